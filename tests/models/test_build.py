"""Building real modules from TransformerSpecs (memfit.models.build).

Expected parameter counts come from the spec's formula (an independent count: the modules are
built layer by layer, the formula multiplies shapes) and, for the full-size Llama-3-8B, from the
published count in shared/facts.md. Numerical parity is checked against Hugging Face transformers
with the same weights (skipped when transformers is not installed).
"""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import ParamCountSpec, TransformerSpec

# Full-size architectures (the models' config.json on the Hugging Face Hub).
FULL = {
    "gpt2": TransformerSpec(
        name="gpt2", family="gpt2", arch="decoder", hidden_size=768, num_layers=12, num_heads=12,
        num_kv_heads=12, head_dim=64, intermediate_size=3072, vocab_size=50257,
        max_position_embeddings=1024, mlp="gelu", norm="layernorm", qkv_bias=True,
        attn_out_bias=True, mlp_bias=True, position="learned", tie_embeddings=True),
    "llama": TransformerSpec(
        name="llama-3-8b", family="llama", arch="decoder", hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=8192),
    "mistral": TransformerSpec(
        name="mistral-7b", family="mistral", arch="decoder", hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
        max_position_embeddings=32768),
    "mixtral": TransformerSpec(
        name="mixtral-8x7b", family="mixtral", arch="decoder", hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
        max_position_embeddings=32768, num_experts=8, experts_per_token=2),
    "qwen2": TransformerSpec(
        name="qwen2.5-7b", family="qwen2", arch="decoder", hidden_size=3584, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
        max_position_embeddings=32768, qkv_bias=True),
    "gemma2": TransformerSpec(
        name="gemma-2-9b", family="gemma2", arch="decoder", hidden_size=3584, num_layers=42,
        num_heads=16, num_kv_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000,
        max_position_embeddings=8192, mlp="geglu", norms_per_layer=4, tie_embeddings=True),
    "phi3": TransformerSpec(
        name="phi-3-mini", family="phi3", arch="decoder", hidden_size=3072, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=96, intermediate_size=8192, vocab_size=32064,
        max_position_embeddings=4096),
    "qwen3": TransformerSpec(
        name="qwen3-8b", family="qwen3", arch="decoder", hidden_size=4096, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
        max_position_embeddings=40960, qk_norm="head"),
    "qwen3_moe": TransformerSpec(
        name="qwen3-30b-a3b", family="qwen3_moe", arch="decoder", hidden_size=2048,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=768,
        vocab_size=151936, max_position_embeddings=40960, qk_norm="head", num_experts=128,
        experts_per_token=8),
    "olmo2": TransformerSpec(
        name="olmo-2-7b", family="olmo2", arch="decoder", hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008, vocab_size=100352,
        max_position_embeddings=4096, qk_norm="proj"),
    "gemma3_text": TransformerSpec(
        name="gemma-3-1b", family="gemma3_text", arch="decoder", hidden_size=1152,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, intermediate_size=6912,
        vocab_size=262144, max_position_embeddings=32768, mlp="geglu", norms_per_layer=4,
        qk_norm="head", tie_embeddings=True),
    "bert": TransformerSpec(
        name="bert-base", family="bert", arch="encoder", hidden_size=768, num_layers=12,
        num_heads=12, num_kv_heads=12, head_dim=64, intermediate_size=3072, vocab_size=30522,
        max_position_embeddings=512, mlp="gelu", norm="layernorm", qkv_bias=True,
        attn_out_bias=True, mlp_bias=True, position="learned", type_vocab_size=2, pooler=True),
    "vit": TransformerSpec(
        name="vit-b-16", family="vit", arch="vision", hidden_size=768, num_layers=12,
        num_heads=12, num_kv_heads=12, head_dim=64, intermediate_size=3072, mlp="gelu",
        norm="layernorm", qkv_bias=True, attn_out_bias=True, mlp_bias=True, position="learned",
        image_size=224, patch_size=16, num_labels=1000),
}


def tiny(family: str) -> TransformerSpec:
    """The family's architecture shrunk: 2 layers, hidden 64, vocab 128, 32x32 images."""
    full = FULL[family]
    kv_heads = 4 if full.num_kv_heads == full.num_heads else 2
    head_dim = 32 if family.startswith("gemma") else 16  # gemma: q_dim (128) != hidden (64)
    return dataclasses.replace(
        full, name=f"{family}-tiny", hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=96,
        vocab_size=0 if family == "vit" else 128,
        max_position_embeddings=0 if family == "vit" else 64,
        num_experts=4 if full.is_moe else 0, experts_per_token=2 if full.is_moe else 0,
        image_size=32, patch_size=8,
        num_labels=10 if full.num_labels else 0)


FAMILIES = list(FULL)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def needs_transformers() -> None:
    pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------- param counts
@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_param_count_equals_spec(family: str) -> None:
    spec = tiny(family)
    assert n_params(build_model(spec, backend="builtin")) == spec.param_count()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_param_count_equals_spec(family: str) -> None:
    needs_transformers()
    spec = tiny(family)
    model = build_model(spec, backend="transformers")
    assert type(model).__module__.startswith("transformers.")
    assert n_params(model) == spec.param_count()


@pytest.mark.parametrize(("family", "published"), [
    ("gpt2", 124_439_808), ("llama", 8_030_261_248), ("mistral", 7_241_732_096),
    ("mixtral", 46_702_792_704)])
def test_full_size_counts_match_published(family: str, published: int) -> None:
    # shared/facts.md: GPT-2 124,439,808 (tied head), Llama-3-8B 8,030,261,248, Mistral-7B
    # 7,241,732,096, Mixtral-8x7B 46,702,792,704. Built on meta: no memory.
    assert n_params(build_model(FULL[family], backend="builtin")) == published
    if _has_transformers():
        assert n_params(build_model(FULL[family], backend="transformers")) == published


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_tied_embeddings_share_one_tensor(family: str) -> None:
    model = build_model(tiny(family), backend="builtin")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_head_is_separate() -> None:
    model = build_model(tiny("llama"), backend="builtin")
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_every_preset_builds_on_meta_with_its_exact_count() -> None:
    from memfit.models.presets import list_presets

    backends = ["builtin", "transformers"] if _has_transformers() else ["builtin"]
    for spec in list_presets():
        for backend in backends:
            model = build_model(spec, backend=backend, dtype=torch.bfloat16)
            assert n_params(model) == spec.param_count(), (spec.name, backend)


# ------------------------------------------------------------------------------ meta and dtypes
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_8b_builtin_on_meta_allocates_nothing() -> None:
    # (How long the build takes, a target, is timed in bench/speed_targets.py.)
    spec = FULL["llama"]  # 8.03e9 parameters = 32 GB in fp32 if anything were real
    rss_before = _rss_bytes()
    model = build_model(spec, backend="builtin", device="meta", dtype=torch.bfloat16)
    rss_growth = _rss_bytes() - rss_before
    assert rss_growth < 50 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_meta_forward_of_every_builtin_family() -> None:
    """Shapes only: the forward (MoE dispatch included) has no data-dependent shape."""
    for family in FAMILIES:
        spec = tiny(family)
        model = build_model(spec, backend="builtin")
        seq = None if spec.arch == "vision" else 16
        out = model(**example_inputs(spec, batch=2, seq=seq))
        assert out.is_meta
        if spec.arch == "encoder":
            assert out.shape == (2, 16, spec.hidden_size)
        else:
            assert out.shape == ()  # a loss


def test_pure_bf16_vit_takes_fp32_images() -> None:
    spec = tiny("vit")
    model = build_model(spec, backend="builtin", device="cpu", dtype=torch.bfloat16)
    loss = model(**example_inputs(spec, batch=2, device="cpu"))  # fp32 pixel_values
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_dtype_and_device_are_honoured() -> None:
    spec = tiny("llama")
    model = build_model(spec, backend="builtin", device="cpu", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}
    assert torch.get_default_dtype() == torch.float32  # restored


def test_transformers_model_on_meta_in_bf16() -> None:
    needs_transformers()
    model = build_model(tiny("mistral"), backend="transformers", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert torch.get_default_dtype() == torch.float32


# --------------------------------------------------------------------------- real CPU training
@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_cpu_forward_backward(family: str) -> None:
    torch.manual_seed(0)
    spec = tiny(family)
    # Capacity that never drops, so every expert sees tokens and gets a gradient.
    model = build_model(spec, backend="builtin", device="cpu", moe_capacity_factor=None)
    inputs = example_inputs(spec, batch=2, seq=None if spec.arch == "vision" else 16,
                            device="cpu")
    out = model(**inputs)
    if spec.arch == "encoder":
        assert out.shape == (2, 16, spec.hidden_size)
        loss = out.pow(2).mean() + model.pool(out).sum()
    else:
        loss = out
        # Random init (std 0.02) predicts nearly uniformly: loss ~ ln(classes).
        classes = spec.num_labels if spec.arch == "vision" else spec.vocab_size
        assert abs(loss.item() - torch.log(torch.tensor(float(classes))).item()) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_builtin_training_reduces_loss() -> None:
    torch.manual_seed(0)
    spec = tiny("llama")
    model = build_model(spec, backend="builtin", device="cpu")
    inputs = example_inputs(spec, batch=4, seq=16, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = model(**inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # memorising one batch


def _saved_activation_bytes(spec: TransformerSpec, batch: int, seq: int, attn: str) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (not params)."""
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu", dtype=torch.bfloat16,
                        attn_implementation=attn)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**example_inputs(spec, batch, seq, device="cpu"))
    return sum(saved.values())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_builtin_gpt2_layer_activations_match_korthikanti(attn: str) -> None:
    """Korthikanti et al. 2022 (arXiv 2205.05198), 16-bit activations: sbh(34 + 5as/h) bytes per
    layer. Without dropout the two sbh masks (1 byte each) are gone and the softmax output is
    also the input of the V matmul, so eager attention keeps 2as^2b: sbh(32 + 2as/h) (plus the
    s^2 bool causal mask); SDPA (CPU flash kernel) keeps no s^2 term: 32sbh. The rest (LayerNorm
    statistics, logsumexp) is under 1%; tolerance 2%. One layer = difference of 2- and 1-layer
    models, so embeddings and the loss cancel."""
    b, s, h, a = 2, 128, 256, 4
    spec = dataclasses.replace(FULL["gpt2"], hidden_size=h, num_heads=a, num_kv_heads=a,
                               head_dim=h // a, intermediate_size=4 * h, vocab_size=128,
                               max_position_embeddings=s)
    per_layer = (_saved_activation_bytes(dataclasses.replace(spec, num_layers=2), b, s, attn)
                 - _saved_activation_bytes(dataclasses.replace(spec, num_layers=1), b, s, attn))
    expected = 32 * s * b * h + (2 * a * s * s * b + s * s if attn == "eager" else 0)
    assert per_layer == pytest.approx(expected, rel=0.02)


def test_eager_and_sdpa_attention_agree() -> None:
    torch.manual_seed(0)
    spec = tiny("llama")
    sdpa = build_model(spec, backend="builtin", device="cpu")
    eager = build_model(spec, backend="builtin", device="cpu", attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    ids = example_inputs(spec, batch=2, seq=16, device="cpu")["input_ids"]
    torch.testing.assert_close(eager(ids), sdpa(ids), rtol=1e-5, atol=1e-5)


def test_moe_capacity_drops_only_overflow() -> None:
    """Capacity 1.0 equals dropless routing wherever no expert overflows: compare per token."""
    torch.manual_seed(0)
    spec = tiny("mixtral")
    dropless = build_model(spec, backend="builtin", device="cpu", moe_capacity_factor=None)
    balanced = build_model(spec, backend="builtin", device="cpu", moe_capacity_factor=1.0)
    balanced.load_state_dict(dropless.state_dict())
    moe_a, moe_b = dropless.model.layers[0].mlp, balanced.model.layers[0].mlp
    x = torch.randn(1, 32, spec.hidden_size)
    assert moe_b.capacity(32) == 16  # ceil(32 tokens * 2 / 4 experts)
    full, capped = moe_a(x)[0], moe_b(x)[0]
    # Which assignments overflow, computed independently from the router's choices.
    _, chosen = torch.topk(moe_a.router(x[0]), spec.experts_per_token, dim=-1)
    seen = torch.zeros(spec.num_experts, dtype=torch.long)
    dropped = torch.zeros(32, dtype=torch.bool)
    for t in range(32):
        for e in chosen[t].tolist():
            seen[e] += 1
            dropped[t] |= bool(seen[e] > 16)
    torch.testing.assert_close(capped[~dropped], full[~dropped])
    if dropped.any():
        assert not torch.allclose(capped[dropped], full[dropped])


# ---------------------------------------------------------------- parity with Hugging Face
def _remap(hf_state: dict[str, torch.Tensor],
           rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in hf_state.items():
        for pattern, replacement in rules:
            if re.fullmatch(pattern, key):
                out[re.sub(pattern, replacement, key)] = value
                break
        else:
            raise AssertionError(f"no mapping for {key}")
    return out


def _gpt2_state(hf: nn.Module, spec: TransformerSpec) -> dict[str, torch.Tensor]:
    """HF GPT-2 -> builtin: Conv1D weights are [in, out] (transpose), c_attn fuses q, k, v."""
    out: dict[str, torch.Tensor] = {}
    h = spec.hidden_size
    for key, value in hf.state_dict().items():
        key = key.removeprefix("transformer.")
        if m := re.fullmatch(r"h\.(\d+)\.(.+)", key):
            layer, rest = f"model.layers.{m[1]}.", m[2]
            if rest.startswith("attn.c_attn."):
                kind = rest.rsplit(".", 1)[1]
                parts = (value.t() if kind == "weight" else value).split(h, dim=0)
                for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    out[f"{layer}self_attn.{name}.{kind}"] = part
                continue
            names = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
                     "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj",
                     "mlp.c_proj": "mlp.down_proj"}
            module, kind = rest.rsplit(".", 1)
            transpose = kind == "weight" and module not in ("ln_1", "ln_2")
            out[f"{layer}{names[module]}.{kind}"] = value.t() if transpose else value
        else:
            names = {"wte.weight": "model.embed_tokens.weight",
                     "wpe.weight": "model.embed_positions.weight",
                     "ln_f.weight": "model.norm.weight", "ln_f.bias": "model.norm.bias",
                     "lm_head.weight": "lm_head.weight"}
            out[names[key]] = value
    return out


def _pair(family: str, **spec_changes: object) -> tuple[TransformerSpec, nn.Module, nn.Module]:
    needs_transformers()
    torch.manual_seed(0)
    spec = dataclasses.replace(tiny(family), **spec_changes)
    hf = build_model(spec, backend="transformers", device="cpu").eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so that details show in outputs
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    builtin = build_model(spec, backend="builtin", device="cpu", moe_capacity_factor=None).eval()
    return spec, hf, builtin


def test_gpt2_builtin_matches_transformers_loss() -> None:
    spec, hf, builtin = _pair("gpt2")
    builtin.load_state_dict(_gpt2_state(hf, spec), strict=True)
    inputs = example_inputs(spec, batch=2, seq=16, device="cpu")
    expected = hf(**inputs)
    torch.testing.assert_close(builtin(**inputs), expected.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(builtin(inputs["input_ids"]), expected.logits,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "olmo2"])
def test_llama_style_builtin_loads_hf_state_dict_as_is(family: str) -> None:
    # Same parameter names as Hugging Face Llama: no key map (RoPE, GQA, q/k/v biases, SwiGLU;
    # Qwen3's per-head and OLMo-2's whole-projection q/k RMSNorms; OLMo-2's norms after the
    # sub-layers instead of before).
    spec, hf, builtin = _pair(family)
    builtin.load_state_dict(hf.state_dict(), strict=True)
    inputs = example_inputs(spec, batch=2, seq=16, device="cpu")
    torch.testing.assert_close(builtin(**inputs), hf(**inputs).loss, rtol=1e-5, atol=1e-5)


def test_phi3_builtin_matches_transformers() -> None:
    # Phi-3 fuses q/k/v and gate/up into one projection each: split them.
    spec, hf, builtin = _pair("phi3")
    state = {}
    for key, value in hf.state_dict().items():
        if key.endswith("self_attn.qkv_proj.weight"):
            parts = value.split([spec.q_dim, spec.kv_dim, spec.kv_dim])
            for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                state[key.replace("qkv_proj", name)] = part
        elif key.endswith("mlp.gate_up_proj.weight"):
            gate, up = value.chunk(2)
            state[key.replace("gate_up_proj", "gate_proj")] = gate
            state[key.replace("gate_up_proj", "up_proj")] = up
        else:
            state[key] = value
    builtin.load_state_dict(state, strict=True)
    inputs = example_inputs(spec, batch=2, seq=16, device="cpu")
    torch.testing.assert_close(builtin(**inputs), hf(**inputs).loss, rtol=1e-5, atol=1e-5)


def test_mixtral_dropless_builtin_matches_transformers() -> None:
    spec, hf, builtin = _pair("mixtral")
    f = spec.intermediate_size
    state = {}
    for key, value in hf.state_dict().items():
        if m := re.fullmatch(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.(.+)", key):
            prefix, rest = f"{m[1]}.mlp.", m[2]
            if rest == "gate.weight":
                state[prefix + "router.weight"] = value
            elif rest == "experts.gate_up_proj":  # transformers 5: [E, 2f, h]
                state[prefix + "gate_proj"], state[prefix + "up_proj"] = value.split(f, dim=1)
            elif rest == "experts.down_proj":
                state[prefix + "down_proj"] = value
            elif em := re.fullmatch(r"experts\.(\d+)\.(w[123])\.weight", rest):  # transformers 4
                name = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[em[2]]
                state.setdefault(prefix + name, [None] * spec.num_experts)[int(em[1])] = value
            else:
                raise AssertionError(key)
        else:
            state[key] = value
    state = {k: torch.stack(v) if isinstance(v, list) else v for k, v in state.items()}
    builtin.load_state_dict(state, strict=True)
    inputs = example_inputs(spec, batch=2, seq=16, device="cpu")
    torch.testing.assert_close(builtin(**inputs), hf(**inputs).loss, rtol=1e-5, atol=1e-5)


def test_bert_builtin_matches_transformers() -> None:
    spec, hf, builtin = _pair("bert")
    layer = r"encoder\.layer\.(\d+)\."
    rules = [
        (r"embeddings\.(word|position|token_type)_embeddings\.(\w+)", r"\1_embeddings.\2"),
        (r"embeddings\.LayerNorm\.(\w+)", r"embed_norm.\1"),
        (layer + r"attention\.self\.query\.(\w+)", r"layers.\1.attention.q_proj.\2"),
        (layer + r"attention\.self\.key\.(\w+)", r"layers.\1.attention.k_proj.\2"),
        (layer + r"attention\.self\.value\.(\w+)", r"layers.\1.attention.v_proj.\2"),
        (layer + r"attention\.output\.dense\.(\w+)", r"layers.\1.attention.o_proj.\2"),
        (layer + r"attention\.output\.LayerNorm\.(\w+)", r"layers.\1.attention_norm.\2"),
        (layer + r"intermediate\.dense\.(\w+)", r"layers.\1.mlp.up_proj.\2"),
        (layer + r"output\.dense\.(\w+)", r"layers.\1.mlp.down_proj.\2"),
        (layer + r"output\.LayerNorm\.(\w+)", r"layers.\1.mlp_norm.\2"),
        (r"pooler\.dense\.(\w+)", r"pooler.\1"),
    ]
    state = _remap(hf.state_dict(), rules)
    builtin.load_state_dict(state, strict=True)
    ids = example_inputs(spec, batch=2, seq=16, device="cpu")["input_ids"]
    expected = hf(input_ids=ids)
    hidden = builtin(ids)
    torch.testing.assert_close(hidden, expected.last_hidden_state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(builtin.pool(hidden), expected.pooler_output, rtol=1e-4, atol=1e-5)


def test_vit_builtin_matches_transformers() -> None:
    spec, hf, builtin = _pair("vit")
    # transformers 4 names (vit.encoder.layer.N.attention.attention.query ...) and 5 names
    # (vit.layers.N.attention.q_proj ...).
    layer = r"vit\.(?:encoder\.layer|layers)\.(\d+)\."
    attn = layer + r"attention\."
    rules = [
        (r"vit\.embeddings\.cls_token", "cls_token"),
        (r"vit\.embeddings\.position_embeddings", "position_embeddings"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.(\w+)", r"patch_embed.\1"),
        (layer + r"layernorm_before\.(\w+)", r"layers.\1.input_layernorm.\2"),
        (layer + r"layernorm_after\.(\w+)", r"layers.\1.post_attention_layernorm.\2"),
        (attn + r"(?:attention\.query|q_proj)\.(\w+)", r"layers.\1.self_attn.q_proj.\2"),
        (attn + r"(?:attention\.key|k_proj)\.(\w+)", r"layers.\1.self_attn.k_proj.\2"),
        (attn + r"(?:attention\.value|v_proj)\.(\w+)", r"layers.\1.self_attn.v_proj.\2"),
        (attn + r"(?:output\.dense|o_proj)\.(\w+)", r"layers.\1.self_attn.o_proj.\2"),
        (layer + r"(?:intermediate\.dense|mlp\.fc1)\.(\w+)", r"layers.\1.mlp.up_proj.\2"),
        (layer + r"(?:output\.dense|mlp\.fc2)\.(\w+)", r"layers.\1.mlp.down_proj.\2"),
        (r"vit\.layernorm\.(\w+)", r"norm.\1"),
        (r"classifier\.(\w+)", r"classifier.\1"),
    ]
    builtin.load_state_dict(_remap(hf.state_dict(), rules), strict=True)
    inputs = example_inputs(spec, batch=2, device="cpu")
    torch.testing.assert_close(builtin(**inputs), hf(**inputs).loss, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ backends
def test_auto_backend_follows_transformers_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tiny("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    model = build_model(spec, backend="auto")
    assert type(model).__module__ == "memfit.models.build"
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[hf\]'"):
        build_model(spec, backend="transformers")


def test_auto_backend_uses_transformers_when_installed() -> None:
    needs_transformers()
    model = build_model(tiny("llama"), backend="auto")
    assert type(model).__module__.startswith("transformers.")


def test_gemma2_transformers_defaults_to_eager_when_no_sdpa() -> None:
    needs_transformers()
    model = build_model(tiny("gemma2"), backend="transformers")
    supports_sdpa = type(model)._supports_sdpa
    assert model.config._attn_implementation == ("sdpa" if supports_sdpa else "eager")
    if not supports_sdpa:
        with pytest.raises(MemfitError, match="attn_implementation='eager'"):
            build_model(tiny("gemma2"), backend="transformers", attn_implementation="sdpa")


# ----------------------------------------------------------------------------------- bad input
def test_bad_backend_name() -> None:
    with pytest.raises(MemfitError, match=r"unknown backend 'bultin' \(did you mean 'builtin'"):
        build_model(tiny("llama"), backend="bultin")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"attn_implementation": "flash"}, "unknown attn_implementation 'flash'"),
    ({"dtype": torch.int64}, "dtype must be a floating"),
    ({"device": "gpu"}, "bad device 'gpu'"),
    ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be positive"),
])
def test_bad_build_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MemfitError, match=re.escape(message)):
        build_model(tiny("llama"), backend="builtin", **kwargs)  # type: ignore[arg-type]


def test_param_count_only_model_cannot_be_built() -> None:
    with pytest.raises(MemfitError, match="only a parameter count"):
        build_model(ParamCountSpec(name="7b", params=7_000_000_000))  # type: ignore[arg-type]


def test_unknown_family_for_transformers() -> None:
    needs_transformers()
    spec = dataclasses.replace(tiny("llama"), family="lama")
    with pytest.raises(MemfitError, match=r"family 'lama'.*did you mean 'llama'"):
        build_model(spec, backend="transformers")


@pytest.mark.parametrize("family", ["gpt_neox", "phi", "falcon"])
def test_parallel_block_families_build_with_transformers_only(family: str) -> None:
    spec = dataclasses.replace(tiny("gpt2"), family=family, position="rope",
                               tie_embeddings=family == "falcon", head_bias=family == "phi",
                               norms_per_layer=1 if family == "phi" else 2)
    with pytest.raises(MemfitError, match="backend='transformers'"):
        build_model(spec, backend="builtin")
    if _has_transformers():
        assert n_params(build_model(spec, backend="transformers")) == spec.param_count()


def test_spec_transformers_cannot_express() -> None:
    needs_transformers()
    spec = dataclasses.replace(tiny("mistral"), qkv_bias=True)  # Mistral has no bias option
    with pytest.raises(MemfitError, match="cannot express"):
        build_model(spec, backend="transformers")
    assert n_params(build_model(spec, backend="builtin")) == spec.param_count()


def test_example_inputs_shapes_and_errors() -> None:
    gpt2, vit, bert = tiny("gpt2"), tiny("vit"), tiny("bert")
    inputs = example_inputs(gpt2, batch=3, seq=8)
    assert inputs["input_ids"].shape == inputs["labels"].shape == (3, 8)
    assert inputs["input_ids"].dtype == torch.long
    assert example_inputs(gpt2, batch=1)["input_ids"].shape == (1, 64)  # default: context
    assert set(example_inputs(bert, batch=2, seq=8)) == {"input_ids"}
    vit_inputs = example_inputs(vit, batch=2, dtype=torch.bfloat16)
    assert vit_inputs["pixel_values"].shape == (2, 3, 32, 32)
    assert vit_inputs["pixel_values"].dtype == torch.bfloat16
    assert vit_inputs["labels"].shape == (2,)
    with pytest.raises(MemfitError, match="seq 65 is longer"):
        example_inputs(gpt2, batch=1, seq=65)
    with pytest.raises(MemfitError, match="17 tokens per image"):
        example_inputs(vit, batch=1, seq=16)
    with pytest.raises(MemfitError, match="batch must be a positive integer"):
        example_inputs(gpt2, batch=0)
