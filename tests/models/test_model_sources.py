"""Model sources beyond the presets: any transformers model type (traced), the local Hugging Face
hub cache, safetensors headers.

Expected parameter counts are worked out by hand from the modules' shapes (each test says how).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models import HFModelSpec, load_hf_config, resolve_model

# A tiny T5 (t5-small's layout: relu FF, tied head, 32 relative-position buckets).
TINY_T5: dict[str, Any] = {
    "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64,
    "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2, "vocab_size": 512,
    "n_positions": 512, "feed_forward_proj": "relu", "is_encoder_decoder": True,
    "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": True, "relative_attention_num_buckets": 32}


def _t5_params(d: int, ff: int, heads: int, d_kv: int, layers: int, vocab: int,
               buckets: int = 32) -> int:
    """T5ForConditionalGeneration, tied head: shared embedding; per encoder layer q,k,v,o + FF
    (wi, wo, no biases) + two RMSNorm-style weights; per decoder layer self- and cross-attention
    + FF + three norms; each stack's first layer holds the relative-position bias
    (buckets x heads) and each stack ends with a norm."""
    inner = heads * d_kv
    attn = 4 * d * inner
    encoder = layers * (attn + 2 * d * ff + 2 * d) + buckets * heads + d
    decoder = layers * (2 * attn + 2 * d * ff + 3 * d) + buckets * heads + d
    return vocab * d + encoder + decoder


def _write(folder: Path, data: dict[str, Any], name: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------- any model type transformers knows
def test_t5_small_count_from_first_principles() -> None:
    # t5-small (d_model 512, d_ff 2048, 8 heads of 64, 6 layers, 32128 tokens): 60,506,624, the
    # count usually quoted for it ("60M").
    assert _t5_params(512, 2048, 8, 64, 6, 32128) == 60_506_624


def test_t5_config_loads_as_a_traceable_spec(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    spec = load_hf_config(_write(tmp_path / "tiny-t5", TINY_T5))
    assert isinstance(spec, HFModelSpec)
    assert (spec.model_type, spec.task, spec.name) == ("t5", "seq2seq-lm", "tiny-t5")
    assert spec.param_count() == _t5_params(64, 128, 4, 16, 2, 512)
    model = spec.build()
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert all(p.is_meta for p in model.parameters())
    inputs = spec.example_inputs(batch=2, seq=24)
    assert inputs["input_ids"].shape == inputs["labels"].shape == (2, 24)
    out = model(**inputs)  # labels are shifted right into the decoder inputs by T5 itself
    assert out.loss.shape == () and out.logits.shape == (2, 24, 512)


def test_architectures_pick_the_task_head(tmp_path: Path) -> None:
    """BART's config lists BartForConditionalGeneration (seq2seq), though transformers also maps
    model_type bart to BartForCausalLM; a config without architectures that is an encoder-decoder
    gets the seq2seq head too. BLOOM (no formula) defaults to its causal LM."""
    pytest.importorskip("transformers")
    bart = {"model_type": "bart", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
            "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "vocab_size": 100, "max_position_embeddings": 64}
    with_arch = load_hf_config(_write(tmp_path, dict(
        bart, architectures=["BartForConditionalGeneration"]), "a.json"))
    without = load_hf_config(_write(tmp_path, bart, "b.json"))
    causal = load_hf_config(_write(tmp_path, dict(bart, architectures=["BartForCausalLM"]),
                                   "c.json"))
    assert (with_arch.task, without.task, causal.task) == ("seq2seq-lm", "seq2seq-lm",
                                                           "causal-lm")
    bloom = {"model_type": "bloom", "hidden_size": 32, "n_layer": 1, "n_head": 2,
             "vocab_size": 100}
    spec = load_hf_config(_write(tmp_path, bloom, "f.json"))
    assert isinstance(spec, HFModelSpec) and spec.task == "causal-lm"


def test_whisper_inputs_are_log_mel_features(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    whisper = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
               "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2,
               "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 100,
               "num_mel_bins": 16, "max_source_positions": 20, "max_target_positions": 30,
               "decoder_start_token_id": 1, "pad_token_id": 0}
    spec = load_hf_config(_write(tmp_path, whisper))
    assert spec.task == "speech-seq2seq"
    inputs = spec.example_inputs(batch=2, seq=100)
    # The encoder's two convolutions (stride 1, then 2) turn 2 * max_source_positions frames
    # into its positions; labels are capped at the decoder's positions.
    assert inputs["input_features"].shape == (2, 16, 40)
    assert inputs["labels"].shape == (2, 30)
    from memfit.trace import estimate

    # Plain meta tensors cannot run Whisper's data-dependent mask code; the trace's fake tensors
    # can: one traced training step on these inputs.
    est = estimate(spec.build(), inputs, device="cpu", steps=1)
    assert est.peak_bytes > 4 * 4 * spec.param_count()  # fp32 weights, grads, two Adam states


def test_plan_traces_a_config_the_formulas_do_not_cover(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    pytest.importorskip("transformers")
    path = _write(tmp_path, TINY_T5)
    code, out, err = _cli(capsys, "plan", str(path), "--gpu", "h100-80gb", "--seq", "32")
    assert code == 0, err
    first = out.splitlines()[0]
    assert "t5" in first and "not covered by the analytic formulas" in first
    assert "trac" in first and "traced on meta tensors" in out
    code, out, err = _cli(capsys, "plan", str(path), "--json", "--seq", "32")
    assert code == 0, err
    result = json.loads(out)  # nothing but the JSON object on stdout
    assert result["method"] == "trace"
    assert result["model"]["params"] == _t5_params(64, 128, 4, 16, 2, 512)


def test_plan_of_an_uncovered_type_shows_the_trace_alone(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The formulas know only T5's parameter count, so no analytic column (it would show model
    states alone) and no suggestions taken from it."""
    pytest.importorskip("transformers")
    path = _write(tmp_path, TINY_T5)
    code, out, err = _cli(capsys, "plan", str(path), "--gpu", "t4", "--seq", "32")
    assert code == 0, err
    assert "Memory per GPU (trace)" in out and "analytic" not in out.split("(trace)", 1)[1]
    code, out, err = _cli(capsys, "plan", str(path), "--json", "--seq", "32")
    assert json.loads(out)["analytic_total_bytes"] is None


def test_a_config_the_model_code_rejects_is_one_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """T5 without decoder_start_token_id fails inside transformers' own _shift_right: the
    config's fault, said in one line with exit 2, no traceback."""
    pytest.importorskip("transformers")
    broken = {k: v for k, v in TINY_T5.items() if k != "decoder_start_token_id"}
    path = _write(tmp_path, broken)
    code, _out, err = _cli(capsys, "plan", str(path), "--seq", "32")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "decoder_start_token_id" in err and "MEMFIT_DEBUG" in err


@pytest.mark.parametrize("extra", [["--mode", "inference"], ["--checkpointing", "full"]])
def test_plan_traces_t5_inference_and_checkpointing(tmp_path: Path, extra: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Inference feeds T5 decoder_input_ids (a forward pass without labels needs them);
    checkpointing wraps its blocks. Both trace to a plan holding at least the weights."""
    pytest.importorskip("transformers")
    path = _write(tmp_path, TINY_T5)
    code, out, err = _cli(capsys, "plan", str(path), "--seq", "32", "--json", *extra)
    assert code == 0, err
    result = json.loads(out)
    weights = result["per_gpu"]["breakdown"]["weights"]
    assert weights >= 2 * _t5_params(64, 128, 4, 16, 2, 512)  # at least 16-bit weights
    spec = load_hf_config(path)
    inputs = spec.example_inputs(batch=2, seq=8, training=False)
    assert set(inputs) == {"input_ids", "decoder_input_ids"}
    assert spec.build()(**inputs).logits.shape == (2, 8, 512)


def test_plan_method_analytic_on_such_a_config_says_use_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    path = _write(tmp_path, TINY_T5)
    code, _, err = _cli(capsys, "plan", str(path), "--method", "analytic")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--method trace" in lines[0]
    # LoRA on it is traced too, on peft's default targets for t5 (q and v; issue 25 §4).
    code, out, err = _cli(capsys, "plan", str(path), "--mode", "lora", "--seq", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["lora"]["targets"] == ["q", "v"]


def test_without_transformers_the_error_names_the_extra(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(MemfitError) as err:
        load_hf_config(_write(tmp_path, TINY_T5))
    message = str(err.value)
    assert "pip install 'memfit[hf]'" in message and "'t5'" in message and "\n" not in message
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    assert "\nhf = [" in pyproject.read_text()  # the extra the hint names exists


def test_unknown_model_type_says_neither_knows_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(MemfitError, match="nor the installed transformers"):
        load_hf_config(_write(tmp_path, {"model_type": "surely-not-a-model"}))


def test_remote_code_is_never_used(tmp_path: Path) -> None:
    """An ``auto_map`` pointing at Hub code is dropped: the model is transformers' own class."""
    pytest.importorskip("transformers")
    data = dict(TINY_T5, auto_map={"AutoModelForSeq2SeqLM": "evil.EvilModel"})
    spec = load_hf_config(_write(tmp_path, data))
    assert type(spec.build()).__module__.startswith("transformers.models.t5")
    assert resolve_model(str(tmp_path)).param_count() == _t5_params(64, 128, 4, 16, 2, 512)


# --------------------------------------------------------------------- the local hub cache
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000,
    "max_position_embeddings": 256, "tie_word_embeddings": False}
# embeddings + untied head 2 * 1000 * 64; per layer q, o 64x64, k, v 64x32, gate/up/down
# 64x128, two RMSNorms; the final norm.
TINY_LLAMA_PARAMS = 2 * 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64


def _cache_repo(cache: Path, repo_id: str, config: dict[str, Any], commit: str = "a" * 40,
                main: str | None = None) -> Path:
    """The huggingface_hub cache layout (https://huggingface.co/docs/hub/local-cache)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    _write(snapshot, config)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(main or commit)  # no newline, as huggingface_hub writes
    return snapshot


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("with_huggingface_hub", [True, False])
@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "HF_HOME", "default"])
def test_hub_id_resolves_from_the_cache(hub_env: Path, monkeypatch: pytest.MonkeyPatch,
                                        where: str, with_huggingface_hub: bool) -> None:
    if with_huggingface_hub:
        pytest.importorskip("huggingface_hub")
    else:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    if where == "HF_HUB_CACHE":
        cache = hub_env / "hubcache"
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    elif where == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(hub_env / "hfhome"))
        cache = hub_env / "hfhome" / "hub"
    else:
        cache = hub_env / "home" / ".cache" / "huggingface" / "hub"
    _cache_repo(cache, "acme/tiny-llama", TINY_LLAMA)
    spec = resolve_model("acme/tiny-llama")
    assert spec.name == "acme/tiny-llama"
    assert spec.param_count() == TINY_LLAMA_PARAMS


@pytest.mark.parametrize("with_huggingface_hub", [True, False])
def test_hub_cache_follows_refs_main(hub_env: Path, monkeypatch: pytest.MonkeyPatch,
                                     with_huggingface_hub: bool) -> None:
    """Two snapshots: refs/main names the newer one (4 layers), which is the one read."""
    if not with_huggingface_hub:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    cache = hub_env / "c"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    _cache_repo(cache, "acme/m", TINY_LLAMA, commit="1" * 40)
    _cache_repo(cache, "acme/m", dict(TINY_LLAMA, num_hidden_layers=4), commit="2" * 40)
    assert resolve_model("acme/m").num_layers == 4
    (cache / "models--acme--m" / "refs" / "main").write_text("1" * 40)
    assert resolve_model("acme/m").num_layers == 2


@pytest.mark.parametrize("with_huggingface_hub", [True, False])
def test_hub_id_not_cached_says_how_to_get_it(hub_env: Path, monkeypatch: pytest.MonkeyPatch,
                                              with_huggingface_hub: bool) -> None:
    if not with_huggingface_hub:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "empty"))
    # A snapshot without refs/main is not what "main" means: not found either.
    (hub_env / "empty" / "models--acme--nope" / "snapshots" / ("3" * 40)).mkdir(parents=True)
    for repo_id in ("acme/not-here", "acme/nope"):
        with pytest.raises(MemfitError) as err:
            resolve_model(repo_id)
        message = str(err.value)
        assert "not in the local Hugging Face cache" in message and "\n" not in message
        assert f"huggingface-cli download {repo_id} config.json" in message
        assert str(hub_env / "empty") in message


def test_presets_keep_their_alias_names_over_the_cache(hub_env: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = hub_env / "c"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    _cache_repo(cache, "meta-llama/Meta-Llama-3-8B", TINY_LLAMA)
    assert resolve_model("meta-llama/Meta-Llama-3-8B").name == "llama-3-8b"


def test_hub_id_never_touches_the_network(hub_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("network access")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "c"))
    with pytest.raises(MemfitError, match="not in the local Hugging Face cache"):
        resolve_model("acme/absent")
    _cache_repo(hub_env / "c", "acme/present", TINY_LLAMA)
    assert resolve_model("acme/present").param_count() == TINY_LLAMA_PARAMS


def test_plan_cli_with_a_cached_hub_id(hub_env: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "c"))
    _cache_repo(hub_env / "c", "acme/tiny-llama", TINY_LLAMA)
    code, out, err = _cli(capsys, "plan", "acme/tiny-llama", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["params"] == TINY_LLAMA_PARAMS
    code, _, err = _cli(capsys, "plan", "acme/absent")
    assert code == 2 and "huggingface-cli download acme/absent" in err


# ------------------------------------------------------------------------ safetensors headers
def _safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], *,
                       metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file written by hand from the format spec
    (https://huggingface.co/docs/safetensors/index): u64 little-endian header length, JSON
    header, then the data buffer (zeros here)."""
    bits = {"F32": 32, "F16": 16, "BF16": 16, "I64": 64, "F8_E4M3": 8}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        size = numel * bits[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)


def test_safetensors_counts_and_dtypes_from_the_header(tmp_path: Path) -> None:
    from memfit.models.checkpoint import read_safetensors

    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors_bytes({
        "embed.weight": ("BF16", [100, 8]), "norm.weight": ("F32", [8]),
        "step": ("I64", []), "q.weight": ("F8_E4M3", [8, 8])}, metadata={"format": "pt"}))
    info = read_safetensors(path)
    assert info.params == 800 + 8 + 1 + 64 and info.tensors == 4
    assert info.params_by_dtype == {"BF16": 800, "F32": 8, "I64": 1, "F8_E4M3": 64}
    assert info.bytes_by_dtype == {"BF16": 1600, "F32": 32, "I64": 8, "F8_E4M3": 64}
    assert info.main_dtype == "BF16" and info.total_bytes == 1704


def test_safetensors_written_by_the_library_reads_the_same(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    from memfit.models.checkpoint import read_safetensors

    tensors = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7),
               "c": torch.zeros(2, 2, 2, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    info = read_safetensors(tmp_path / "model.safetensors")
    assert info.params == 15 + 7 + 8
    assert info.bytes_by_dtype == {"BF16": 30, "F32": 28, "F16": 16}


def test_sharded_index_counts_every_shard_once(tmp_path: Path) -> None:
    from memfit.models.checkpoint import read_safetensors

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(
        _safetensors_bytes({"a": ("BF16", [10, 10]), "b": ("BF16", [10])}))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(
        _safetensors_bytes({"c": ("F32", [4, 4])}))
    index = {"metadata": {"total_size": 200 + 20 + 64},
             "weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00001-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}
    path = _write(tmp_path, index, "model.safetensors.index.json")
    info = read_safetensors(path)
    assert (info.params, info.tensors, len(info.files)) == (126, 3, 2)
    assert info.bytes_by_dtype == {"BF16": 220, "F32": 64}
    # A shard missing from the folder, or a tensor no shard holds: one line each.
    index["weight_map"]["d"] = "model-00003-of-00003.safetensors"
    _write(tmp_path, index, "model.safetensors.index.json")
    with pytest.raises(MemfitError, match=r"shard 'model-00003-of-00003\.safetensors' is missing"):
        read_safetensors(path)
    index["weight_map"]["d"] = "model-00002-of-00002.safetensors"
    _write(tmp_path, index, "model.safetensors.index.json")
    with pytest.raises(MemfitError, match="1 tensors of the weight_map are in no shard"):
        read_safetensors(path)


def _valid_header() -> bytes:
    return _safetensors_bytes({"w": ("F32", [2, 2])})


@pytest.mark.parametrize("blob, expected", [
    (b"\x01\x02", "shorter than the 8-byte header length"),
    ((10**9).to_bytes(8, "little") + b"{}", "exceeds the format's limit"),
    ((500).to_bytes(8, "little") + b"{}", "runs past the end"),
    ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not UTF-8 JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ((2).to_bytes(8, "little") + b"{]", "not UTF-8 JSON"),
    (_valid_header().replace(b'"F32"', b'"F99"'), "unknown dtype 'F99'"),
    (_valid_header().replace(b"[2, 2]", b"[2,-2]"), "bad shape"),
    (_valid_header().replace(b"[0, 16]", b"[0, 99]"), "bad data_offsets"),
    (_valid_header().replace(b"[0, 16]", b"[0, 12]"), "12 bytes for 4 F32 elements"),
])
def test_malformed_safetensors_is_one_line(tmp_path: Path, blob: bytes, expected: str) -> None:
    from memfit.models.checkpoint import read_safetensors

    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(MemfitError) as err:
        read_safetensors(path)
    message = str(err.value)
    assert expected in message and str(path) in message and "\n" not in message


def test_reading_a_header_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    import pickle

    from memfit.models.checkpoint import read_safetensors

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("unpickling")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    path = tmp_path / "model.safetensors"
    path.write_bytes(_valid_header())
    assert read_safetensors(path).params == 4


def _tiny_llama_checkpoint(folder: Path) -> None:
    """TINY_LLAMA's tensors (bf16, the names transformers saves), one file."""
    h, kv, f, v = 64, 32, 128, 1000
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [v, h]),
                                                 "model.norm.weight": ("BF16", [h])}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": ("BF16", [h, h]),
            p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
            p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
            p + "self_attn.o_proj.weight": ("BF16", [h, h]),
            p + "mlp.gate_proj.weight": ("BF16", [f, h]),
            p + "mlp.up_proj.weight": ("BF16", [f, h]),
            p + "mlp.down_proj.weight": ("BF16", [h, f]),
            p + "input_layernorm.weight": ("BF16", [h]),
            p + "post_attention_layernorm.weight": ("BF16", [h])})
    tensors["lm_head.weight"] = ("BF16", [v, h])
    (folder / "model.safetensors").write_bytes(_safetensors_bytes(tensors))


def test_plan_reports_the_checkpoints_count_and_dtype(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny"
    _write(folder, TINY_LLAMA)
    _tiny_llama_checkpoint(folder)
    code, out, err = _cli(capsys, "plan", str(folder))
    assert code == 0, err
    line = out.splitlines()[0]
    assert f"{TINY_LLAMA_PARAMS:,} parameters stored as bf16" in line
    assert "matches the config's count" in line
    code, out, _ = _cli(capsys, "plan", str(folder), "--json")
    checkpoint = json.loads(out)["checkpoint"]
    assert checkpoint["params"] == checkpoint["config_params"] == TINY_LLAMA_PARAMS
    assert checkpoint["bytes_by_dtype"] == {"bf16": 2 * TINY_LLAMA_PARAMS}
    if importlib.util.find_spec("transformers") is not None:
        code, out, err = _cli(capsys, "plan", str(folder), "--json", "--method", "trace",
                              "--seq", "16")
        assert code == 0, err
        assert json.loads(out)["checkpoint"]["params"] == TINY_LLAMA_PARAMS
    # The config.json file alone: no checkpoint read (the way around a broken checkpoint).
    (folder / "model.safetensors").write_bytes(b"\x00")
    code, out, err = _cli(capsys, "plan", str(folder))
    assert code == 2 and "config.json file instead of the folder" in err
    code, out, _ = _cli(capsys, "plan", str(folder / "config.json"))
    assert code == 0 and "checkpoint (" not in out
    _tiny_llama_checkpoint(folder)
    # The config says tied, the checkpoint stores the head anyway: the difference is named.
    _write(folder, dict(TINY_LLAMA, tie_word_embeddings=True))
    code, out, _ = _cli(capsys, "plan", str(folder))
    line = out.splitlines()[0]
    assert f"({1000 * 64:+,})" in line and "apart from the tied embeddings" in line


def test_variants_the_formulas_cannot_express_go_to_the_trace(tmp_path: Path) -> None:
    """Qwen3-MoE with a dense layer (mlp_only_layers) is not one TransformerSpec: it loads as
    an HFModelSpec. Its count by hand: layer 0 dense (3 x 64 x 96 MLP), layer 1 MoE (4 experts
    of 3 x 64 x 32 and a 4 x 64 router); both with q, o 64 x 64, k, v 64 x 32, q/k norms of 16
    and two norms of 64; embeddings and untied head 2 x 100 x 64; the final norm."""
    pytest.importorskip("transformers")
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "vocab_size": 100, "mlp_only_layers": [0]}
    spec = load_hf_config(_write(tmp_path, config))
    assert isinstance(spec, HFModelSpec)
    attention = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 2 * 64
    expected = (2 * 100 * 64 + attention + 3 * 64 * 96 + attention + 4 * 3 * 64 * 32 + 4 * 64
                + 64)
    assert spec.param_count() == expected
    dense_everywhere = load_hf_config(_write(tmp_path, dict(config, mlp_only_layers=[]), "b.json"))
    assert not isinstance(dense_everywhere, HFModelSpec)


def test_qk_norm_activations_are_counted() -> None:
    """Qwen3's q/k RMSNorms (transformers' Qwen3RMSNorm: ``hidden_states.to(float32)``, pow,
    rsqrt, ``weight * hidden.to(input_dtype)``) keep, per q and k element, the fp32 upcast of
    their input (4 bytes, saved by pow/mul) and the normalised tensor in the input's dtype
    (2 bytes in bf16, saved for the weight's gradient): 6 bytes x s x b x (q_dim + kv_dim)."""
    import dataclasses

    from memfit.analytic.block_activations import layer_terms
    from memfit.models import get_preset

    spec = get_preset("qwen3-8b")
    plain = dataclasses.replace(spec, qk_norm="none")
    s, b = 512, 2
    with_norms = layer_terms(spec, seq=s, batch=b, act_bytes=2, attention="sdpa")
    without = layer_terms(plain, seq=s, batch=b, act_bytes=2, attention="sdpa")
    assert with_norms.split - without.split == 6 * s * b * (32 * 128 + 8 * 128)
    assert with_norms.replicated == without.replicated
