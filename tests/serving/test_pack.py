"""memfit pack: MIG profiles by hand, hand-computed packings, the exhaustive optimum against an
independent brute force on seeded random instances, the tenant need by hand, bad input."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.gpus import get_gpu
from memfit.serving.mig import MIG_GPUS, mig_profile, valid_combination
from memfit.serving.pack import (
    HBM_EFFICIENCY,
    PREFILL_MFU,
    Item,
    Tenant,
    device,
    pack,
    pack_items,
    tenant_demand,
)

GiB = 2**30
H100 = get_gpu("h100-sxm-80gb")
FAST = {"activation_peak_bytes": GiB, "cuda_graph_bytes": 0}  # no traced profile run


# -- MIG -------------------------------------------------------------------------------------


def test_mig_profile_memory_is_nvidias_listing() -> None:
    # nvidia-smi mig -lgip, GiB: H100 80GB 9.75 / 19.62 / 19.62 / 39.50 / 39.50 / 79.25
    h = {p.name: p.memory_bytes for p in MIG_GPUS["h100-sxm-80gb"]}
    assert h == {"1g.10gb": 39 * GiB // 4, "1g.20gb": 314 * GiB // 16,
                 "2g.20gb": 314 * GiB // 16, "3g.40gb": 79 * GiB // 2,
                 "4g.40gb": 79 * GiB // 2, "7g.80gb": 317 * GiB // 4}
    a40 = {p.name: p.memory_bytes for p in MIG_GPUS["a100-sxm-40gb"]}
    assert a40["1g.5gb"] == 19 * GiB // 4 and a40["7g.40gb"] == 630 * GiB // 16
    a80 = {p.name: p.memory_bytes for p in MIG_GPUS["a100-sxm-80gb"]}
    assert a80["1g.10gb"] == 19 * GiB // 2 and a80["7g.80gb"] == 79 * GiB


def test_mig_device_gets_its_share_of_bandwidth_and_compute() -> None:
    p = mig_profile("h100-sxm-80gb", "3g.40gb")  # 4 of 8 memory slices, 3 of 7 compute
    d = device(H100, p)
    assert d.memory_bytes == 79 * GiB // 2
    assert d.bandwidth_bytes_per_s == pytest.approx(0.8 * 3350e9 * 4 / 8)
    assert d.flops == pytest.approx(989.4e12 * 3 / 7)


@pytest.mark.parametrize(("names", "ok"), [
    (["4g.40gb", "3g.40gb"], True),
    (["3g.40gb", "3g.40gb"], True),
    (["3g.40gb", "3g.40gb", "1g.10gb"], False),  # 9 memory slices
    (["1g.10gb"] * 7, True),
    (["1g.10gb"] * 8, False),
    (["1g.20gb"] * 4, True),
    (["1g.20gb"] * 5, False),
    (["2g.20gb"] * 3 + ["1g.10gb"], True),
    (["4g.40gb", "4g.40gb"], False),  # one 4g per GPU
    (["4g.40gb", "2g.20gb", "1g.10gb"], True),
    (["7g.80gb", "1g.10gb"], False),
    (["3g.40gb", "2g.20gb", "2g.20gb"], True),  # 3g at 4, 2g at 0 and 2
    (["3g.40gb", "2g.20gb", "2g.20gb", "1g.10gb"], False),
])
def test_mig_valid_combinations(names: list[str], ok: bool) -> None:
    profiles = [mig_profile("h100-sxm-80gb", n) for n in names]
    assert valid_combination(profiles) is ok


def test_mig_profile_on_a_gpu_without_mig_is_refused() -> None:
    with pytest.raises(MemfitError, match="has no MIG"):
        mig_profile("l40s", "1g.10gb")
    with pytest.raises(MemfitError, match=r"valid: 1g\.10gb"):
        mig_profile("h100-sxm-80gb", "2g.10gb")


# -- the packer on hand-made items -----------------------------------------------------------

CAP = device(H100)


def _whole(name: str, mem_tenths: float, bw_tenths: float = 0.0, tp: int = 1) -> Item:
    return Item(name=name, tp=tp, needs={(H100.name, None): (
        int(CAP.memory_bytes * mem_tenths / 10), CAP.bandwidth_bytes_per_s * bw_tenths / 10)})


def test_first_fit_decreasing_misses_and_the_exhaustive_search_does_not() -> None:
    # memory 5, 4, 3, 3, 3, 2 tenths: FFD fills {5,4}, {3,3,3}, {2}; {5,3,2} {4,3,3} is 2 GPUs
    items = [_whole(f"t{i}", s) for i, s in enumerate([5, 4, 3, 3, 3, 2])]
    pool = [H100] * 3
    assert pack_items(items, pool, exact=False).used == 3
    best = pack_items(items, pool)
    assert (best.used, best.unplaced, best.method) == (2, (), "exhaustive")
    for slots in best.gpus:
        assert sum(items[i].needs[(H100.name, None)][0] for i, _ in slots) <= CAP.memory_bytes


def test_bandwidth_constrains_the_packing() -> None:
    pool = [H100] * 2
    # 3 tenths of memory each: one GPU by memory; 6 tenths of bandwidth each: two GPUs
    assert pack_items([_whole("a", 3, 6), _whole("b", 3, 6)], pool).used == 2
    assert pack_items([_whole("a", 3, 3), _whole("b", 3, 3)], pool).used == 1


def test_tp_group_takes_distinct_gpus_and_leftovers_are_unplaced() -> None:
    pool = [H100] * 2
    p = pack_items([_whole("big", 6, tp=2), _whole("s", 3), _whole("x", 4)], pool)
    big = [g for g, slots in enumerate(p.gpus) if any(i == 0 for i, _ in slots)]
    assert big == [0, 1] and p.unplaced == () and p.used == 2
    # 6 + 5 fits no GPU: one tenant must go; leaving out `big` (not `x`) needs 1 GPU, not 2
    p = pack_items([_whole("big", 6, tp=2), _whole("s", 3), _whole("x", 5)], pool)
    assert (p.unplaced, p.used) == ((0,), 1)


def test_mig_items_take_valid_profile_combinations() -> None:
    profs = MIG_GPUS[H100.name]
    # each needs 30 GiB: only 3g.40gb, 4g.40gb, 7g.80gb hold it; two fit per GPU (3g + 4g)
    need = {(H100.name, p.name): (30 * GiB, 1.0) for p in profs if p.memory_bytes >= 30 * GiB}
    items = [Item(name=f"m{i}", needs=need, mig=True) for i in range(3)]
    p = pack_items(items, [H100] * 2)
    assert p.used == 2 and not p.unplaced
    for slots in p.gpus:
        assert valid_combination([mig_profile(H100.name, str(n)) for _, n in slots])


def _brute_force(items: list[Item], pool: list) -> tuple[int, int]:
    """(unplaced, GPUs used) minimum over every assignment, checked by plain sums."""
    n = len(pool)
    cap = {g.name: device(g) for g in pool}
    options = []
    for it in items:
        opts: list = [()]
        if it.mig:
            opts += [((g, prof),) for g in range(n) for (kind, prof) in it.needs
                     if kind == pool[g].name]
        else:
            opts += [tuple((g, None) for g in gs) for gs in itertools.combinations(range(n), it.tp)
                     if all((pool[g].name, None) in it.needs for g in gs)
                     and len({pool[g].name for g in gs}) == 1]  # a TP group: one GPU type
        options.append(opts)
    best = (len(items) + 1, n + 1)
    for choice in itertools.product(*options):
        mem = [0] * n
        bw = [0.0] * n
        profs: list[list] = [[] for _ in range(n)]
        whole = [False] * n
        for it, slots in zip(items, choice, strict=True):
            for g, prof in slots:
                if prof is None:
                    m, b = it.needs[(pool[g].name, None)]
                    mem[g] += m
                    bw[g] += b
                    whole[g] = True
                else:
                    profs[g].append(mig_profile(pool[g].name, prof))
        ok = all(
            not (whole[g] and profs[g])
            and mem[g] <= cap[pool[g].name].memory_bytes
            and bw[g] <= cap[pool[g].name].bandwidth_bytes_per_s * (1 + 1e-12)
            and valid_combination(profs[g]) for g in range(n))
        if ok:
            cost = (sum(1 for c in choice if not c),
                    sum(1 for g in range(n) if whole[g] or profs[g]))
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(24))
def test_packer_meets_the_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    kinds = [H100, get_gpu("a100-sxm-80gb")]
    pool = [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
    items = []
    for i in range(rng.randint(1, 6 if seed % 2 else 4)):
        mig = seed % 2 == 0 and rng.random() < 0.5
        needs: dict = {}
        for g in {g.name: g for g in pool}.values():
            c = device(g)
            m, b = rng.uniform(0.05, 0.7), rng.uniform(0.02, 0.6)
            if mig:
                for p in MIG_GPUS[g.name]:
                    if m * c.memory_bytes <= p.memory_bytes:
                        needs[(g.name, p.name)] = (int(m * c.memory_bytes), 1.0)
            else:
                needs[(g.name, None)] = (int(m * c.memory_bytes), b * c.bandwidth_bytes_per_s)
        tp = 2 if not mig and len(pool) > 1 and rng.random() < 0.2 else 1
        items.append(Item(name=f"t{i}", needs=needs, tp=tp, mig=mig))
    p = pack_items(items, pool)
    assert p.method == "exhaustive"
    assert p.cost == _brute_force(items, pool)


# -- one tenant's need, by hand --------------------------------------------------------------


def test_tenant_kv_and_bandwidth_by_hand() -> None:
    # llama-3-8b: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 131,072 B per token; a
    # 16-token block 2 MiB; 4096 tokens = 256 blocks = 512 MiB per request; 10 requests 5 GiB
    t = Tenant(name="x", model="llama-3-8b", concurrency=10, context=4096, tpot_s=0.05, **FAST)
    d = tenant_demand(t, H100)
    assert d.parts["kv_cache"] == 10 * 512 * 2**20
    assert d.memory_bytes == sum(d.parts.values())
    assert d.parts["activation_peak"] == GiB and d.parts["cuda_graphs"] == 0
    assert d.bandwidth_bytes_per_s == pytest.approx(
        (d.parts["weights"] + 10 * 512 * 2**20) / 0.05)


def test_tenant_littles_law_by_hand() -> None:
    # prefill = 1000 x 2 x 8.03e9 params / (0.5 x 989.4e12) = 32.5 ms; request = 32.5 ms +
    # 300 x 50 ms; C = ceil(2 x 15.032) = 31; KV 31 x ceil(1300 / 16) = 82 blocks x 2 MiB
    t = Tenant(name="x", model="llama-3-8b", qps=2, prompt_tokens=1000, output_tokens=300,
               **FAST)
    d = tenant_demand(t, H100)
    prefill = 1000 * 2 * 8_030_261_248 / (PREFILL_MFU * 989.4e12)
    assert d.prefill_s == pytest.approx(prefill, rel=2e-3)  # + the rope cache, 1M "params"
    assert d.concurrency == math.ceil(2 * (prefill + 300 * 0.05)) == 31
    assert d.parts["kv_cache"] == 31 * 82 * 2 * 2**20
    # mean decode context 1000 + 150 = 1150 tokens = 72 blocks per request read per step
    assert d.bandwidth_bytes_per_s == pytest.approx(
        (d.parts["weights"] + 31 * 72 * 2 * 2**20) / 0.05)
    assert HBM_EFFICIENCY == 0.8


# -- the API and the CLI ---------------------------------------------------------------------


def _file(tmp_path, text: str, name: str = "t.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


TENANTS = """\
defaults: {prompt_tokens: 1000, output_tokens: 300, activation_peak_bytes: 1073741824,
           cuda_graph_bytes: 0}
tenants:
  - {name: chat, model: llama-3-8b, qps: 4}
  - {name: code, model: qwen2.5-7b, qps: 2, mig: 3g.40gb}
  - {name: big, model: llama-3-70b, qps: 1, tp: 2, quant: fp8}
"""


def test_cli_json_stable_keys(tmp_path, capsys) -> None:
    assert main(["pack", _file(tmp_path, TENANTS), "--gpus", "4xh100-sxm-80gb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"gpus_available", "gpus_used", "method", "optimal", "gpus",
                        "tenants", "unplaced", "assumptions"}
    assert (out["gpus_available"], out["method"], out["unplaced"]) == (4, "exhaustive", [])
    rows = {t["name"]: t for t in out["tenants"]}
    assert rows["code"]["mig_profile"] == "3g.40gb"
    assert len(rows["big"]["gpus"]) == 2
    assert out["gpus_used"] == len({g for t in out["tenants"] for g in t["gpus"]})
    for t in out["tenants"]:
        assert t["memory_headroom_bytes"] >= 0 and t["bandwidth_headroom_bytes_per_s"] >= 0


def test_cli_text_and_the_python_export(tmp_path, capsys) -> None:
    import memfit

    assert memfit.pack is pack
    assert main(["pack", _file(tmp_path, TENANTS), "--gpus", "4xh100-sxm-80gb"]) == 0
    out = capsys.readouterr().out
    assert "of 4 GPUs used, optimal" in out and "code (3g.40gb)" in out


@pytest.mark.parametrize(("pool", "line"), [("1xh100-sxm-80gb", "1 of 1 GPU used, optimal"),
                                            ("2xh100-sxm-80gb", "1 of 2 GPUs used, optimal")])
def test_cli_the_gpu_count_line_is_singular_for_one(tmp_path, capsys, pool: str,
                                                    line: str) -> None:
    text = "[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 100, output_tokens: 10}]"
    assert main(["pack", _file(tmp_path, text), "--gpus", pool]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(line)


def test_some_tenants_unplaced_exit_1(tmp_path, capsys) -> None:
    text = TENANTS.replace("  - {name: code, model: qwen2.5-7b, qps: 2, mig: 3g.40gb}\n", "")
    assert main(["pack", _file(tmp_path, text), "--gpus", "1xh100-sxm-80gb"]) == 1
    assert "NOT PLACED: big" in capsys.readouterr().out


@pytest.mark.parametrize(("text", "gpus", "message"), [
    ("[{name: a, model: llama-3-8b, qps: 0, prompt_tokens: 10, output_tokens: 10}]",
     "1xh100-sxm-80gb", "qps must be a number > 0"),
    ("[{name: a, model: llama-3-8b, qps: -1, prompt_tokens: 10, output_tokens: 10}]",
     "1xh100-sxm-80gb", "qps must be a number > 0"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10}]",
     "2xh100-nope", "unknown GPU"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10}",
     "1xh100-sxm-80gb", "not valid YAML"),
    ("!!python/object/apply:os.system ['echo hi']", "1xh100-sxm-80gb", "not valid YAML"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10, mig: 1g.10gb}]",
     "2xl40s", "no GPU of the pool (l40s) has MIG"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10, mig: auto}]",
     "1xh200", "no MIG profiles for h200-141gb yet"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10, qsp: 1}]",
     "1xh100-sxm-80gb", "unknown key 'qsp'"),
    ("[{name: a, model: llama-3-70b, qps: 1, prompt_tokens: 10, output_tokens: 10, "
     "activation_peak_bytes: 0, cuda_graph_bytes: 0}]", "1xh100-sxm-80gb", "short by"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10}]",
     "0xh100-sxm-80gb", "COUNTxGPU"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10, "
     "max_model_len: 16}]", "1xh100-sxm-80gb", "max_model_len 16 is below the 20 tokens"),
    ("[{name: a, model: llama-3-8b, concurrency: 4, context: 100, ttft_ms: 10}]",
     "1xh100-sxm-80gb", "go with qps"),
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10}, "
     "{name: a, model: gpt2, qps: 1, prompt_tokens: 10, output_tokens: 10}]",
     "1xh100-sxm-80gb", "repeated: a"),
    ("tenants: {name: a}", "1xh100-sxm-80gb", "non-empty list of tenants"),
    # bool("false") is True: a quoted flag would have dropped the CUDA graphs
    ("[{name: a, model: llama-3-8b, qps: 1, prompt_tokens: 10, output_tokens: 10, "
     "enforce_eager: 'false'}]", "1xh100-sxm-80gb", "enforce_eager must be true or false"),
    # YAML 1.1 reads 1e3 (no dot) as a string
    ("[{name: a, model: llama-3-8b, qps: 1e3, prompt_tokens: 10, output_tokens: 10}]",
     "1xh100-sxm-80gb", "write 1.0e+9 or 1000000000"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, text: str, gpus: str,
                                   message: str) -> None:
    assert main(["pack", _file(tmp_path, text), "--gpus", gpus]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_json_tenants_file(tmp_path, capsys) -> None:
    data = [{"name": "a", "model": "llama-3-8b", "qps": 1, "prompt_tokens": 100,
             "output_tokens": 10, **FAST}]
    path = _file(tmp_path, json.dumps(data), "t.json")
    assert main(["pack", path, "--gpus", "h100-sxm-80gb", "--mig", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["tenants"][0]
    assert row["mig_profile"] == "1g.20gb"  # 16.1 GB of weights: not 1g.10gb
    # vLLM's defaults for a device under 70 GiB (EngineArgs.get_batch_defaults): 256, 2048
    assert (row["max_num_seqs"], row["max_num_batched_tokens"]) == (256, 2048)
    assert row["memory_capacity_bytes"] == 314 * GiB // 16
