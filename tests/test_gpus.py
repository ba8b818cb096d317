"""The GPU catalog: shipped figures against published ones, lookup, and user files.

Expected numbers come from ../shared/facts.md (its GPU table and its nvidia-smi capacities) and
from first principles (PCIe lane arithmetic, NVLink bidirectional/2), never from the code.
"""

from __future__ import annotations

import json
import math
import re
from datetime import date
from importlib import resources
from pathlib import Path

import pytest

from memfit.errors import MemfitError
from memfit.gpus import GpuSpec, get_gpu, list_gpus, load_catalog

MiB = 2**20


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the developer's own ~/.config/memfit/gpus.json and $MEMFIT_GPU_FILE out of tests."""
    monkeypatch.delenv("MEMFIT_GPU_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-empty"))
    monkeypatch.setenv("HOME", str(tmp_path / "home-empty"))


def _raw_entries() -> list[dict]:
    """The packaged data file read directly, independent of the loader."""
    text = resources.files("memfit").joinpath("data/gpus.json").read_text(encoding="utf-8")
    return json.loads(text)["gpus"]


def _write(tmp_path: Path, data: object, name: str = "gpus.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# The shipped catalog

REQUIRED = {  # the list -> the canonical entry a user's spelling must reach
    "v100-16gb": "v100-sxm2-16gb",
    "v100-32gb": "v100-sxm2-32gb",
    "t4": "t4",
    "a10g": "a10g",
    "l4": "l4",
    "l40s": "l40s",
    "a100-40gb": "a100-sxm-40gb",
    "a100-80gb": "a100-sxm-80gb",
    "a100-pcie-80gb": "a100-pcie-80gb",
    "h100-sxm-80gb": "h100-sxm-80gb",
    "h100-pcie-80gb": "h100-pcie-80gb",
    "h100-nvl": "h100-nvl-94gb",
    "h200": "h200-141gb",
    "b200": "b200",
    "mi300x": "mi300x",
    "rtx-3090": "rtx-3090",
    "rtx-4090": "rtx-4090",
    "rtx-5090": "rtx-5090",
}


@pytest.mark.parametrize(("query", "canonical"), sorted(REQUIRED.items()))
def test_required_gpus_present(query: str, canonical: str) -> None:
    assert get_gpu(query).name == canonical


def test_catalog_has_at_least_16_entries_in_file_order() -> None:
    names = [g.name for g in list_gpus()]
    assert len(names) >= 16
    assert names == [e["name"] for e in _raw_entries()]


# facts.md "GPU catalog (dense, no sparsity)": (capacity GB on the label, bandwidth GB/s, bf16).
# None for bf16 means "—" (unsupported). A100 80 GB: 2.0 TB/s SXM, 1.94 TB/s PCIe.
FACTS = {
    "v100-sxm2-16gb": (16, 900, None),
    "v100-sxm2-32gb": (32, 900, None),
    "t4": (16, 320, None),
    "a10g": (24, 600, 70),
    "l4": (24, 300, 121),
    "l40s": (48, 864, 362),
    "a100-sxm-40gb": (40, 1555, 312),
    "a100-sxm-80gb": (80, 2000, 312),
    "a100-pcie-80gb": (80, 1940, 312),
    "h100-sxm-80gb": (80, 3350, 989),
    "h100-pcie-80gb": (80, 2000, 756),
    "h200-141gb": (141, 4800, 989),
    "b200": (180, 8000, 2250),
    "mi300x": (192, 5300, 1307),
    "rtx-4090": (24, 1008, 165),
}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_figures_match_facts(name: str) -> None:
    capacity_gb, bandwidth, bf16 = FACTS[name]
    gpu = get_gpu(name)
    assert re.match(rf"{capacity_gb} GB\b", gpu.memory_label), gpu.memory_label
    # the driver's total is near the label: within -7% (ECC/reserve) .. +7% (GiB-sized stacks)
    assert 0.93 <= gpu.memory_bytes / (capacity_gb * 1e9) <= 1.075
    assert gpu.bandwidth_gbps == pytest.approx(bandwidth, rel=0.035)  # facts rounds 2039 to 2.0
    if bf16 is None:
        assert gpu.tflops["bf16"] is None
        assert not gpu.bf16 and not gpu.supports("bf16")
    else:
        assert gpu.tflops["bf16"] == pytest.approx(bf16, rel=0.01)
        assert gpu.bf16 and gpu.supports("bf16-mixed")


def test_no_bf16_on_v100_and_t4_but_fp16() -> None:
    # facts.md: V100 fp16 125, T4 fp16 65; no bf16 below compute capability 8.0
    for name, fp16 in (("v100-16gb", 125), ("v100-32gb", 125), ("t4", 65)):
        gpu = get_gpu(name)
        assert gpu.tflops["fp16"] == fp16
        assert gpu.bf16 is False and gpu.supports("bf16") is False
        assert gpu.supports("fp16-mixed") and gpu.supports("fp32")


def test_driver_reported_capacities_from_facts() -> None:
    # facts.md: nvidia-smi shows 81,559 MiB on an H100 80GB HBM3 and 143,771 MiB on an H200
    assert get_gpu("h100-sxm-80gb").memory_bytes == 81559 * MiB
    assert get_gpu("h100-80gb").memory_bytes == 81559 * MiB
    assert get_gpu("h200").memory_bytes == 143771 * MiB
    assert get_gpu("h100-sxm-80gb").memory_basis == "driver"


def test_usable_never_exceeds_total() -> None:
    for gpu in list_gpus():
        assert 0 < gpu.usable_bytes <= gpu.memory_bytes, gpu.name


def test_precision_flags_follow_compute_capability() -> None:
    """bf16 tensor cores arrived with compute capability 8.0 (Ampere), fp8 with 8.9 (Ada)."""
    for gpu in list_gpus():
        assert gpu.bf16 == (gpu.tflops["bf16"] is not None), gpu.name
        assert gpu.fp8 == (gpu.tflops["fp8"] is not None), gpu.name
        assert set(gpu.tflops) == {"fp32", "tf32", "fp16", "bf16", "fp8"}
        if gpu.vendor == "nvidia":
            assert gpu.compute_capability is not None
            cc = tuple(int(p) for p in gpu.compute_capability.split("."))
            assert gpu.bf16 == (cc >= (8, 0)), gpu.name
            assert gpu.fp8 == (cc >= (8, 9)), gpu.name
    assert get_gpu("a100-sxm-80gb").supports("fp8") is False
    assert get_gpu("h100-sxm-80gb").supports("fp8") is True


def test_dense_not_sparse_tflops() -> None:
    """Datasheets print sparse tensor figures; the catalog stores dense = sparse / 2."""
    h100 = get_gpu("h100-sxm-80gb")
    assert h100.tflops["fp8"] == pytest.approx(3958 / 2, rel=0.001)  # 3,958 sparse
    assert get_gpu("l40s").tflops["fp8"] == pytest.approx(1466 / 2, rel=0.001)  # 1,466 sparse
    assert get_gpu("l4").tflops["bf16"] == pytest.approx(242 / 2, rel=0.001)  # 242 sparse
    for gpu in list_gpus():  # tensor bf16 is never below fp32 on any of these parts
        if gpu.tflops["bf16"] is not None:
            assert gpu.tflops["bf16"] >= gpu.tflops["fp32"], gpu.name


def test_pcie_per_direction_from_lane_arithmetic() -> None:
    # per lane at 8/16/32 GT/s with 128b/130b encoding; facts.md: Gen5 x16 ~63 GB/s per direction
    per_lane = {g: rate * 128 / 130 / 8 for g, rate in ((3, 8), (4, 16), (5, 32))}
    assert 16 * per_lane[5] == pytest.approx(63, rel=0.01)
    for gpu in list_gpus():
        link = gpu.host_link
        if gpu.unified_memory:  # no host link: the GPU reads the same DRAM as the CPU
            assert link.kind.startswith("unified memory") and link.generation is None, gpu.name
            assert link.gbps == gpu.bandwidth_gbps, gpu.name
            continue
        assert link.generation in per_lane, gpu.name
        match = re.fullmatch(rf"PCIe {link.generation}\.0 x(8|16)", link.kind)
        assert match, (gpu.name, link.kind)  # x8: RTX 4060 and 4060 Ti
        expected = int(match.group(1)) * per_lane[link.generation]
        assert link.gbps == pytest.approx(expected, rel=0.001), gpu.name


def test_gpu_links_per_direction() -> None:
    # published bidirectional totals / 2: NVLink 2 300, NVLink 3 600, NVLink 4 900, NVLink 5
    # 1.8 TB/s; MI300X: 7 Infinity Fabric links x 128 GB/s bidirectional.
    expected = {"v100-16gb": 150, "a100-80gb": 300, "h100-sxm-80gb": 450, "h200": 450, "b200": 900,
                "mi300x": 7 * 128 / 2, "rtx-3090": 112.5 / 2}
    for name, gbps in expected.items():
        link = get_gpu(name).gpu_link
        assert link is not None and link.gbps == pytest.approx(gbps), name
    for name in ("t4", "l4", "l40s", "a10g", "rtx-4090", "rtx-5090"):
        assert get_gpu(name).gpu_link is None, name


# ---------------------------------------------------------------------------------------------
# The data file itself


def test_names_and_aliases_unique_and_kebab() -> None:
    seen: dict[str, str] = {}
    for entry in _raw_entries():
        for key in (entry["name"], *entry["aliases"]):
            assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9.]+)*", key), key
            assert key not in seen, f"{key!r} used by {seen.get(key)} and {entry['name']}"
            seen[key] = entry["name"]


def test_every_entry_has_price_source_and_date_or_explicit_null() -> None:
    for entry in _raw_entries():
        name = entry["name"]
        for key in ("price_per_hour", "price_source", "price_date"):
            assert key in entry, (name, key)  # explicit, even when null
        if entry["price_per_hour"] is None:
            assert entry["price_source"] is None and entry["price_date"] is None, name
            assert "Price null:" in entry["notes"], name  # the reason is written down
        else:
            assert 0 < entry["price_per_hour"] < 100, name
            assert entry["price_source"], name
            assert date.fromisoformat(entry["price_date"]) <= date.today(), name


def test_every_entry_cites_sources_and_flags_fallback_capacities() -> None:
    for entry in _raw_entries():
        assert entry["sources"], entry["name"]
        assert entry["memory_basis"] in ("driver", "driver-sister-board", "marketing",
                                         "label-gib")
        if entry["memory_basis"] == "marketing":  # the fallback is said out loud
            assert "marketing" in entry["notes"], entry["name"]
            gb = float(entry["memory_label"].split()[0])
            assert entry["memory_bytes"] == gb * 1e9
        if entry["memory_basis"] == "label-gib":  # Apple sells unified memory in GiB
            assert entry["vendor"] == "apple" and "label-gib" in entry["notes"], entry["name"]
            assert entry["memory_bytes"] == int(entry["memory_label"].split()[0]) * 2**30
        if entry["memory_basis"] == "driver" and entry["vendor"] == "nvidia":
            assert entry["memory_bytes"] % MiB == 0, entry["name"]  # nvidia-smi counts MiB


def test_top_level_describes_units() -> None:
    text = resources.files("memfit").joinpath("data/gpus.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    assert doc["version"] == 1
    assert {"memory_bytes", "bandwidth_gbps", "tflops", "price_per_hour"} <= set(doc["notes"])


# ---------------------------------------------------------------------------------------------
# Lookup


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("rtx-4090", "rtx-4090"), ("4090", "rtx-4090"), ("RTX_4090", "rtx-4090"),
    ("rtx 4090", "rtx-4090"), ("h100-80gb", "h100-sxm-80gb"), ("H100-SXM", "h100-sxm-80gb"),
    ("h100-sxm", "h100-sxm-80gb"), ("a100-40gb", "a100-sxm-40gb"), ("A100-80GB", "a100-sxm-80gb"),
    ("h200", "h200-141gb"), ("  L40S ", "l40s"), ("MI300X", "mi300x"),
])
def test_aliases_resolve(spelling: str, canonical: str) -> None:
    assert get_gpu(spelling).name == canonical


def test_unknown_gpu_suggests_closest_and_how_to_fix() -> None:
    with pytest.raises(MemfitError) as err:
        get_gpu("h10")
    message = str(err.value)
    assert "'h100-sxm-80gb'" in message  # found through an alias, named as `memfit gpus` does
    assert "memfit gpus" in message and "--gpu-file" in message
    assert "\n" not in message
    with pytest.raises(MemfitError, match="'rtx-4090'"):
        get_gpu("rtx-4080")


def _memory_gb(label: str) -> float:
    """The size in a memory label: "80 GB HBM3" -> 80."""
    return float(label.split()[0])


@pytest.mark.parametrize(("name", "family"), [
    ("a100", "a100-"), ("A100", "a100-"), ("h100", "h100-"), ("v100", "v100-"),
    ("a100-sxm", "a100-sxm-"), ("Tesla V100", "v100-"),
])
def test_a_name_that_fits_several_gpus_is_refused_with_the_candidates(name: str,
                                                                        family: str) -> None:
    """``a100`` once meant the 80 GB SXM board although a 40 GB one is in the catalog: a
    silent 2x in capacity. Every catalog board of the family is a candidate, in one line."""
    boards = [g.name for g in list_gpus() if g.name.startswith(family)]
    assert len(boards) >= 2
    with pytest.raises(MemfitError) as err:
        get_gpu(name)
    message = str(err.value)
    assert "\n" not in message and f"GPU {name!r} fits {len(boards)} catalog GPUs" in message
    for board in boards:
        assert board in message


def test_every_alias_names_one_memory_size() -> None:
    """An alias may leave out the form factor of boards with the same memory (h100-80gb: SXM
    or PCIe, both 80 GB), never the memory size: each alias's words fit no board of another
    size."""
    entries = _raw_entries()

    def words(entry: dict) -> set[str]:
        return {w for key in (entry["name"], *entry["aliases"], entry["label"])
                for w in re.split(r"[^a-z0-9.]+", key.lower()) if w}

    for entry in entries:
        for alias in entry["aliases"]:
            fits = [e for e in entries if set(alias.split("-")) <= words(e)]
            sizes = {_memory_gb(e["memory_label"]) for e in fits}
            assert sizes == {_memory_gb(entry["memory_label"])}, (alias, [e["name"] for e in fits])


def test_the_label_plan_prints_is_accepted() -> None:
    """``memfit plan`` prints the label ("NVIDIA GeForce RTX 4090"); it is a valid --gpu,
    in any case."""
    for gpu in list_gpus():
        assert get_gpu(gpu.label) == gpu
        assert get_gpu(gpu.label.upper()) == gpu and get_gpu(gpu.label.lower()) == gpu


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4080", "geforce 4090", "h10", "h1000",
                                  "a100-40gb-pcie", "rtx4080"])
def test_suggestions_are_names_memfit_gpus_lists(name: str) -> None:
    """A suggestion is copied into --gpu; `memfit gpus` lists canonical names only."""
    listed = {g.name for g in list_gpus()}
    with pytest.raises(MemfitError) as err:
        get_gpu(name)
    suggested = re.findall(r"'([^']+)'", str(err.value).split(";")[0])[1:]
    assert suggested and set(suggested) <= listed, suggested


def test_supports_rejects_unknown_precision() -> None:
    with pytest.raises(MemfitError, match="valid: fp32, tf32, fp16, bf16, fp8"):
        get_gpu("h100-80gb").supports("int3")


# ---------------------------------------------------------------------------------------------
# User files

NEW_GPU = {
    "name": "My_GPU 48GB",
    "aliases": ["mygpu"],
    "memory_bytes": 48 * 10**9,
    "bandwidth_gbps": 1000,
    "tflops": {"fp32": 50, "bf16": 200},
    "bf16": True,
    "fp8": False,
    "host_link": {"kind": "PCIe 4.0 x16", "gbps": 31.5, "generation": 4},
}


def test_user_file_adds_a_gpu(tmp_path: Path) -> None:
    path = _write(tmp_path, {"gpus": [NEW_GPU]})
    gpu = get_gpu("my-gpu-48gb", extra_file=path)
    assert gpu == get_gpu("MYGPU", extra_file=str(path))
    assert gpu.memory_bytes == gpu.usable_bytes == 48 * 10**9
    assert gpu.tflops == {"fp32": 50.0, "tf32": None, "fp16": None, "bf16": 200.0, "fp8": None}
    assert gpu.memory_basis == "user" and gpu.gpu_link is None and gpu.price_per_hour is None
    names = [g.name for g in list_gpus(extra_file=path)]
    assert names[-1] == "my-gpu-48gb" and len(names) == len(_raw_entries()) + 1
    assert "my-gpu-48gb" not in load_catalog()  # the cached built-in part is untouched


def test_user_file_partial_override(tmp_path: Path) -> None:
    path = _write(tmp_path, {"gpus": [
        {"name": "h100-80gb", "price_per_hour": 1.25, "tflops": {"bf16": 800},
         "gpu_link": {"gbps": 1}},
        {"name": "a100-sxm-80gb", "memory_bytes": 80 * 2**30},
    ]})
    h100 = get_gpu("h100-sxm-80gb", extra_file=path)
    assert h100.price_per_hour == 1.25
    assert str(path) in (h100.price_source or "") and h100.price_date is None
    assert h100.tflops["bf16"] == 800
    assert h100.tflops["fp8"] == pytest.approx(3958 / 2, rel=0.001)  # untouched field kept
    assert h100.memory_bytes == 81559 * MiB  # untouched field kept
    assert h100.gpu_link is not None and h100.gpu_link.gbps == 1 and "NVLink" in h100.gpu_link.kind
    a100 = get_gpu("a100-80gb", extra_file=path)
    assert a100.memory_bytes == a100.usable_bytes == 80 * 2**30
    assert a100.memory_basis == "user"
    assert get_gpu("h100-80gb").price_per_hour != 1.25  # built-in cache not mutated


def test_user_file_from_env_and_default_location(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    env_file = _write(tmp_path, {"gpus": [NEW_GPU]}, "env.json")
    monkeypatch.setenv("MEMFIT_GPU_FILE", str(env_file))
    assert "my-gpu-48gb" in load_catalog()
    other = _write(tmp_path, {"gpus": [dict(NEW_GPU, name="explicit", aliases=[])]}, "x.json")
    catalog = load_catalog(other)  # an explicit file wins over the environment
    assert "explicit" in catalog and "my-gpu-48gb" not in catalog
    monkeypatch.delenv("MEMFIT_GPU_FILE")
    config = tmp_path / "xdg" / "memfit"
    config.mkdir(parents=True)
    _write(config, {"gpus": [{"name": "t4", "price_per_hour": 0.1}]})
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert get_gpu("t4").price_per_hour == 0.1


def test_malformed_json_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"gpus": [{"name": "x",}]}', "broken.json")
    with pytest.raises(MemfitError) as err:
        load_catalog(path)
    message = str(err.value)
    assert str(path) in message and "not valid JSON" in message and "line 1" in message
    assert "\n" not in message


def test_python_expressions_are_not_evaluated(tmp_path: Path) -> None:
    # json.loads only: an expression a Python eval would accept is a syntax error here
    path = _write(tmp_path, '{"gpus": [{"name": "x", "memory_bytes": 2**30}]}')
    with pytest.raises(MemfitError, match="not valid JSON"):
        load_catalog(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MemfitError, match=r"does not exist.*--gpu-file"):
        load_catalog(tmp_path / "nope.json")


BAD = [  # (entry or whole document, text the one-line message must contain)
    (dict(NEW_GPU, memory_bytes=-5), "'memory_bytes' must be a positive whole number"),
    (dict(NEW_GPU, memory_bytes="80GB"), "'memory_bytes' must be a positive whole number"),
    (dict(NEW_GPU, memory_bytes=True), "'memory_bytes' must be a positive whole number"),
    (dict(NEW_GPU, memory_bytes=1.5), "'memory_bytes' must be a positive whole number"),
    (dict(NEW_GPU, bandwidth_gbps="fast"), "'bandwidth_gbps' must be a positive number"),
    (dict(NEW_GPU, bandwidth_gbps=0), "'bandwidth_gbps' must be a positive number"),
    (dict(NEW_GPU, tflops={"bf16": -1}), "tflops.bf16 must be a non-negative number"),
    (dict(NEW_GPU, tflops={"bf61": 1}), "unknown key 'bf61' (did you mean 'bf16'"),
    (dict(NEW_GPU, memory_byte=1), "unknown field 'memory_byte' (did you mean 'memory_bytes'"),
    ({k: v for k, v in NEW_GPU.items() if k != "bandwidth_gbps"},
     "missing required field(s) bandwidth_gbps"),
    (dict(NEW_GPU, usable_bytes=49 * 10**9), "usable_bytes (49000000000) exceeds memory_bytes"),
    (dict(NEW_GPU, price_per_hour=-1), "'price_per_hour' must be a non-negative number"),
    (dict(NEW_GPU, price_date="May 2026"), "'price_date' must be a date written YYYY-MM-DD"),
    (dict(NEW_GPU, bf16="yes"), "'bf16' must be true or false"),
    (dict(NEW_GPU, host_link={"kind": "PCIe", "gbps": -3}), "host_link.gbps must be a positive"),
    (dict(NEW_GPU, host_link=None), "'host_link' must be an object"),
    (dict(NEW_GPU, aliases=["h100-80gb"]), "'h100-80gb' is used by both"),
    ({"name": "h100", "memory_bytes": 1}, "not a catalog name; to override some fields use one of "
     "h100-sxm-80gb, h100-pcie-80gb, h100-nvl-94gb"),
    ({"name": "h100-80gb", "memory_bytes": -1}, "'memory_bytes' must be a positive whole number"),
    ({"name": "t4", "gpu_link": {"gbps": 10}}, "gpu_link is missing 'kind'"),  # T4 has none
    ({"gpus": []}, "non-empty \"gpus\" list"),
    ({"gpus": [NEW_GPU], "gpu": []}, "unknown top-level keys ['gpu']"),
    ({"gpus": [NEW_GPU, NEW_GPU]}, "appears twice"),
    ({"gpus": [{"memory_bytes": 1}]}, "has no \"name\" string"),
    ({"gpus": ["h100"]}, "is str, not an object"),
]


@pytest.mark.parametrize(("data", "expected"), BAD)
def test_bad_user_values(tmp_path: Path, data: dict, expected: str) -> None:
    document = data if "gpus" in data else {"gpus": [data]}
    path = _write(tmp_path, document, "user-gpus.json")
    with pytest.raises(MemfitError) as err:
        get_gpu("t4", extra_file=path)
    message = str(err.value)
    assert expected in message
    assert str(path) in message and "\n" not in message


def test_gpuspec_is_frozen() -> None:
    gpu = get_gpu("l4")
    assert isinstance(gpu, GpuSpec)
    with pytest.raises(AttributeError):
        gpu.memory_bytes = 1  # type: ignore[misc]
    assert math.isfinite(gpu.bandwidth_gbps)
