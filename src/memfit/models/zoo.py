"""``memfit validate``'s model zoo: small, scalable versions of seven model families, each a
factory that builds the model, its inputs and its loss on a device (real, or meta to trace).
See :mod:`memfit.validate` for why the zoo ships with the package."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError

__all__ = ["SIZES", "Factory", "LSTMNet", "ResNetBN", "UNetGN", "small_llama", "zoo"]

Factory = Callable[[str], tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]]


# -- the zoo: small, scalable versions of each model family ---------------------------------------

class ResNetBN(nn.Module):
    """A CNN with batch norm and residual blocks (ResNet-style)."""

    def __init__(self, width: int, blocks: int, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                          nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False),
                          nn.BatchNorm2d(width)) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(x.mean((2, 3)))


class UNetGN(nn.Module):
    """A two-level UNet with group norm and a skip connection."""

    def __init__(self, width: int) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                 nn.SiLU())

        self.down1, self.down2 = conv(3, width), conv(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.out = nn.Sequential(conv(2 * width, width), nn.Conv2d(width, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(self.pool(a))
        return self.out(torch.cat([a, self.up(b)], dim=1))


class LSTMNet(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _mse(out: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _ce(out: Any) -> torch.Tensor:
    logits = out.float()
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long,
                                               device=logits.device))


def _transformer(name: str, batch: int, seq: int | None) -> Factory:
    from memfit.models.build import build_model, example_inputs
    from memfit.models.presets import get_preset

    def make(device: str) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
        spec = _SCALED[name]() if name in _SCALED else get_preset(name)
        model = build_model(spec, backend="builtin", device=device)
        inputs = example_inputs(spec, batch=batch, seq=seq, device=device)
        if "input_ids" in inputs:
            inputs["input_ids"].random_(0, spec.vocab_size)
            if "labels" in inputs:
                inputs["labels"].copy_(inputs["input_ids"])
        else:
            inputs["pixel_values"].normal_()
            inputs["labels"].zero_()
        keys = list(inputs)
        return (_KwargsModel(model, keys), tuple(inputs[k] for k in keys),
                lambda out: out if out.dim() == 0 else _mse(out))

    return make


class _KwargsModel(nn.Module):
    """Positional inputs -> keyword inputs, so every zoo model takes a tuple."""

    def __init__(self, model: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.keys, args, strict=True)))


def small_llama(layers: int, hidden: int, experts: int = 0, vocab: int = 32000) -> Any:
    from memfit.models.spec import TransformerSpec

    heads = hidden // 64
    return TransformerSpec(
        name=f"llama-{layers}x{hidden}" + (f"-moe{experts}" if experts else ""),
        family="mixtral" if experts else "llama", arch="decoder", hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=max(heads // 4, 1), head_dim=64,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64, vocab_size=vocab,
        max_position_embeddings=4096, num_experts=experts, experts_per_token=2 if experts else 0)


def _small_gpt2(layers: int, hidden: int, vocab: int = 50257) -> Any:
    from memfit.models.spec import TransformerSpec

    return TransformerSpec(
        name=f"gpt2-{layers}x{hidden}", family="gpt2", arch="decoder", hidden_size=hidden,
        num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64, head_dim=64,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=2048,
        mlp="gelu", norm="layernorm", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        position="learned", tie_embeddings=True)


def _small_vit(layers: int = 2, hidden: int = 128, image: int = 32, patch: int = 8,
               labels: int = 10) -> Any:
    from memfit.models.spec import TransformerSpec

    heads = hidden // 64
    return TransformerSpec(
        name=f"vit-{layers}x{hidden}", family="vit", arch="vision", hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=64,
        intermediate_size=4 * hidden, mlp="gelu", norm="layernorm", qkv_bias=True,
        attn_out_bias=True, mlp_bias=True, position="learned", image_size=image,
        patch_size=patch, num_labels=labels)


_SCALED: dict[str, Callable[[], Any]] = {
    # tiny: two blocks and a 2,048-token vocabulary (the logits of a 50,257-token vocabulary
    # dominated a small CPU config's time)
    "vit-tiny": _small_vit,
    "gpt2-tiny": lambda: _small_gpt2(2, 128, vocab=2048),
    "llama-tiny": lambda: small_llama(2, 128, vocab=2048),
    "moe-tiny": lambda: small_llama(2, 128, experts=4, vocab=2048),
    "vit-small": _small_vit,
    "gpt2-small": lambda: _small_gpt2(4, 256),
    "gpt2-medium": lambda: _small_gpt2(12, 768),
    "vit-medium": lambda: _small_vit(12, 768, image=224, patch=16, labels=1000),  # ViT-B/16
    "llama-small": lambda: small_llama(4, 256),
    "llama-medium": lambda: small_llama(16, 2048),
    "moe-small": lambda: small_llama(2, 256, experts=4),
    "moe-medium": lambda: small_llama(8, 1024, experts=8),
}


SIZES = ("tiny", "small", "medium")


def zoo(size: str) -> dict[str, Callable[[int], Factory]]:
    """Model families by name -> ``batch -> factory``; ``size`` is "tiny" (the CPU default:
    seconds a config), "small" (CPU, tens of seconds) or "medium" (GPU: hundreds of MB to GBs,
    so the runtime constants are a small share)."""
    if size not in SIZES:
        raise MemfitError(f"unknown zoo size {size!r}; valid: {', '.join(SIZES)}")
    small = size != "medium"
    tiny = size == "tiny"
    seq = 64 if tiny else 128 if small else 1024
    img = 16 if tiny else 32 if small else 128
    width = 8 if tiny else 16 if small else 128

    def vision(make: Callable[[], nn.Module], shape: tuple[int, ...],
               loss: Callable[[Any], torch.Tensor]) -> Callable[[int], Factory]:
        def with_batch(batch: int) -> Factory:
            def factory(device: str) -> tuple[nn.Module, tuple[Any, ...],
                                              Callable[[Any], torch.Tensor]]:
                with torch.device(device):
                    return make(), (torch.randn(batch, *shape),), loss
            return factory
        return with_batch

    hidden = 32 if tiny else 64 if small else 1024
    return {
        "gpt2": lambda b: _transformer(f"gpt2-{size}", b, seq),
        "llama": lambda b: _transformer(f"llama-{size}", b, seq),
        "moe": lambda b: _transformer(f"moe-{size}", b, seq),
        "vit": lambda b: _transformer(f"vit-{size}", b, None),
        "resnet-bn": vision(lambda: ResNetBN(width, 2 if small else 6), (3, img, img), _ce),
        "unet-gn": vision(lambda: UNetGN(width), (3, img, img), _mse),
        "lstm": vision(lambda: LSTMNet(hidden, 2), (seq // 2, hidden), _mse),
    }
