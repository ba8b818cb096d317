"""A vision-language model's share of vLLM 0.33.0's startup budget: the vision tower's weights
on each TP rank, and the encoder's part of the profile run.

What vLLM does. 0.33 runs Model Runner V2 for multimodal models
(``vllm/v1/worker/gpu/model_runner.py: GPUModelRunner.profile_run``):

1. ``MultiModalBudget`` (``vllm/multimodal/encoder_budget.py``) asks the model's processing
   info for the largest item of each active modality (``get_mm_max_tokens_per_item``, else the
   embeddings of a dummy item), and ``compute_mm_encoder_budget``
   (``vllm/v1/core/encoder_cache_manager.py``) sets the encoder's compute budget and the
   encoder cache to ``max(max_num_batched_tokens, largest item)`` tokens
   (``SchedulerConfig.max_num_encoder_input_tokens`` and ``encoder_cache_size`` both default to
   ``max_num_batched_tokens``). A modality is active unless ``--limit-mm-per-prompt`` sets it
   to 0 (default 999: ``vllm/config/multimodal.py: MultiModalConfig.get_limit_per_prompt``);
   with every modality of the tower at 0 the tower is not even built
   (``vllm/model_executor/models/interfaces.py: SupportsMultiModal._mark_tower_model``).
2. The profile runs one modality, the one with the most tokens per item
   (``get_modality_with_max_tokens``; a tie goes to the later name, ``video`` over ``image``),
   on ``max_items_per_batch`` copies of its largest item (``MultiModalBudget._get_max_items``:
   ``max(1, min(budget // tokens, max_num_seqs x max(1, min(limit, max_model_len //
   tokens))))``), in one encoder call (``vllm/v1/worker/gpu/mm/encoder_runner.py:
   EncoderRunner.profile_encoder_cache`` → ``execute_mm_encoder``, one batch per modality).
   Its outputs go into the encoder cache and stay there through the decoder's ``_dummy_run``
   and the sampler; ``profile_run`` frees them at its end (``reset_encoder_cache``). So the
   profile's torch peak is ``max(encoder peak, encoder outputs + decoder peak)``.
3. ``EncoderRunner.__init__`` allocates ``inputs_embeds``, ``max_num_batched_tokens x
   text hidden`` in the model dtype, before the profile: persistent memory outside the
   weights' log line, counted here with the encoder.

The encoder's own activation peak is computed from the cited model code (an estimate, not a
trace): the pixel values held in float32 for the whole call (the HF image processors return
float32), the residual stream (two ``patches x hidden`` tensors), and the larger of the
attention and MLP sub-blocks' tensors (see :func:`encoder_peak`). vLLM's encoder attention is
FlashAttention over ``cu_seqlens`` (``MMEncoderAttention``): no ``patches²`` scores.

Families (``model_type``): ``qwen2_vl``, ``qwen2_5_vl`` (dynamic resolution: ``--max-pixels``,
images and videos), ``gemma3`` (SigLIP at a fixed 896 px, 256 tokens per image), ``mistral3``
(Pixtral at a fixed ``image_size``). Torch-free.

Known limitations: the encoder peak is from the code, not traced; the projector's and patch
merger's own temporaries are left out (smaller than a block's at these shapes); the vision
tower is counted in the model dtype under any ``--quant`` (the checkpoints leave it
unquantized); ``mm_encoder_tp_mode="data"`` (replicated towers) and encoder CUDA graphs are not
modelled; Pixtral's rotary tables and Qwen's index buffers (a few MiB) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.vision_tower import Tower, gemma3_tower, mistral3_tower, qwen_tower
from memfit.serving.vision_tower import vision_config_int as _int

__all__ = ["DEFAULT_MM_LIMIT", "DYNAMIC_RESOLUTION", "MULTIMODAL_FAMILIES", "QWEN_MAX_PIXELS",
           "MultimodalBudget", "encoder_peak", "multimodal_budget", "preprocessor_max_pixels",
           "qwen_tokens_per_image", "qwen_video_frames"]

DEFAULT_MM_LIMIT = 999
"""``--limit-mm-per-prompt``'s default count per modality
(``vllm/config/multimodal.py: MultiModalConfig.get_limit_per_prompt``)."""

QWEN_MAX_PIXELS = 12_845_056
"""``max_pixels`` in the published Qwen2-VL and Qwen2.5-VL checkpoints' ``preprocessor_config.json``
(16384 x 28 x 28); vLLM takes the image processor's ``size["longest_edge"]`` from it. Used when
the model folder has no ``preprocessor_config.json`` and no ``--max-pixels`` is given."""

_QWEN_MAX_FRAMES = 14
"""``vllm/model_executor/models/qwen2_vl.py: _MAX_FRAMES_PER_VIDEO``."""
_QWEN_MAX_ASPECT = 200
"""``Qwen2VLProcessingInfo.get_image_size_with_most_features``: factor pairs wider than 200:1
are skipped."""

_BLOCK = 512  # the CUDA caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp)
_PIXEL_BYTES = 4  # float32 pixel values, as the HF image processors return them

_MODELS = "vllm/model_executor/models/"
MULTIMODAL_FAMILIES = {
    "qwen2_vl": _MODELS + "qwen2_vl.py: Qwen2VisionTransformer",
    "qwen2_5_vl": _MODELS + "qwen2_5_vl.py: Qwen2_5_VisionTransformer",
    "gemma3": _MODELS + "gemma3_mm.py (siglip.py: SiglipVisionModel, Gemma3MultiModalProjector)",
    "mistral3": _MODELS + "mistral3.py (pixtral.py: PixtralHFVisionModel, "
                "Mistral3MultiModalProjector)",
}
"""The ``model_type`` values whose vision tower is sized, and the vLLM code each follows."""

DYNAMIC_RESOLUTION = ("qwen2_vl", "qwen2_5_vl")
"""The families whose largest image follows ``max_pixels``; the others resize to one size."""


def _blocks(nbytes: int) -> int:
    return -(-nbytes // _BLOCK) * _BLOCK


@dataclass(frozen=True, kw_only=True)
class MultimodalBudget:
    """A vision-language model's share of vLLM's startup budget on one GPU of the TP group.

    Known limitations: see :mod:`memfit.serving.multimodal`.
    """

    family: str
    modality: str
    """The modality the profile runs (the one with the most tokens per item)."""
    tokens_per_item: int
    """Encoder outputs (LM tokens) of the largest item of ``modality``."""
    patches_per_item: int
    """Rows through the vision transformer's blocks per item (before the patch merger)."""
    items: int
    """``max_items_per_batch``: the largest items the profile encodes at once."""
    encoder_budget_tokens: int
    """``min(encoder compute budget, encoder cache size)``, the figure vLLM logs."""
    weights_parts: dict[str, int]
    """``vision_tower`` and ``projector`` bytes on this rank."""
    encoder_peak_bytes: int
    """The encoder call's highest point above what was allocated before it (pixel values,
    activations and its outputs)."""
    encoder_cache_bytes: int
    """The dummy batch's encoder outputs, held through the decoder's profile."""
    embeds_buffer_bytes: int
    """``EncoderRunner.inputs_embeds``: ``max_num_batched_tokens x text hidden``."""
    max_pixels: int | None
    """The image size bound used (dynamic-resolution families), else None."""
    source: str

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_parts.values())

    def profile_peak(self, decoder_peak_bytes: int) -> int:
        """The profile run's torch peak with the encoder in it:
        ``max(encoder peak, encoder outputs + decoder peak)`` plus the embeddings buffer."""
        return self.embeds_buffer_bytes + max(
            self.encoder_peak_bytes, self.encoder_cache_bytes + decoder_peak_bytes)

    @property
    def log_line(self) -> str:
        """``EncoderRunner.profile_encoder_cache``'s ``logger.info_once``."""
        return (f"Encoder cache will be initialized with a budget of {self.encoder_budget_tokens} "
                f"tokens, and profiled with {self.items} {self.modality} items of the maximum "
                "feature size.")

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "modality": self.modality,
                "tokens_per_item": self.tokens_per_item,
                "patches_per_item": self.patches_per_item, "items": self.items,
                "encoder_budget_tokens": self.encoder_budget_tokens,
                "weights_bytes": self.weights_bytes, "weights_parts": dict(self.weights_parts),
                "encoder_peak_bytes": self.encoder_peak_bytes,
                "encoder_cache_bytes": self.encoder_cache_bytes,
                "embeds_buffer_bytes": self.embeds_buffer_bytes,
                "max_pixels": self.max_pixels, "log_line": self.log_line, "source": self.source}


def qwen_tokens_per_image(max_pixels: int, *, patch_size: int = 14, merge_size: int = 2) -> int:
    """LM tokens of Qwen2-VL's largest image under ``max_pixels``
    (``qwen2_vl.py: Qwen2VLProcessingInfo.get_image_size_with_most_features`` then
    ``_get_vision_info``): the largest ``n <= max_pixels // (patch x merge)²`` whose closest
    factor pair ``h <= w`` has ``w / h <= 200``; the image is ``28h x 28w`` pixels, its grid
    ``2h x 2w`` patches, ``h x w`` tokens after the 2 x 2 merge.

    >>> qwen_tokens_per_image(12_845_056), qwen_tokens_per_image(28 * 28 * 1280)
    (16384, 1280)
    """
    unit = patch_size * merge_size
    most = max_pixels // (unit * unit)
    if most < 1:
        raise MemfitError(f"--max-pixels {max_pixels} is below one merged patch "
                          f"({unit}x{unit} = {unit * unit} pixels); pass at least {unit * unit}")
    for n in range(most, 0, -1):
        h = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
        if (n // h) / h <= _QWEN_MAX_ASPECT:
            return n
    return 1  # n = 1 always qualifies


def qwen_video_frames(tokens_per_frame: int, max_model_len: int, *,
                      temporal_patch_size: int = 2) -> int:
    """Frames of Qwen2-VL's largest dummy video (``get_num_frames_with_most_features`` with one
    video): the most frames whose tokens fit ``max_model_len`` (``_get_max_video_frames``,
    counting up from 1), at most ``_MAX_FRAMES_PER_VIDEO`` = 14.

    >>> qwen_video_frames(16384, 128000), qwen_video_frames(16384, 16000)
    (14, 1)
    """
    def tokens(frames: int) -> int:
        padded = frames + (-frames % temporal_patch_size)
        return max(padded // temporal_patch_size, 1) * tokens_per_frame

    frames = 1
    while tokens(frames + 1) <= max_model_len:
        frames += 1
        if frames >= _QWEN_MAX_FRAMES:
            break
    return max(min(frames, _QWEN_MAX_FRAMES), 1)


def preprocessor_max_pixels(folder: str | Path) -> int | None:
    """The image bound in a checkpoint folder's ``preprocessor_config.json`` (``max_pixels``,
    or ``size["longest_edge"]``, which vLLM treats as the same: ``qwen2_vl.py:
    Qwen2VLProcessingInfo._get_vision_size``), or None."""
    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        return None
    from memfit.errors import read_json_file

    data = read_json_file(path, what="preprocessor config", fix="pass --max-pixels")
    if not isinstance(data, Mapping):
        return None
    size = data.get("size")
    value = data.get("max_pixels") or (size.get("longest_edge") if isinstance(size, Mapping)
                                       else None)
    return value if isinstance(value, int) and value > 0 else None


def encoder_peak(tower: Tower, *, patches: int, out_rows: int, out_hidden: int, tp: int,
                 dtype_bytes: int) -> int:
    """The encoder call's peak on one rank, from the family's vLLM code (see the module
    docstring): pixel values (float32) + the residual stream (2 x ``patches x hidden``) + the
    larger sub-block: attention (normed input, fused QKV / tp, rotary copies of q and k, the
    attention output / tp, the output projection) or the MLP (normed input and its widths / tp
    as the code holds them); at least the outputs ``out_rows x out_hidden`` plus the pixels."""
    b = dtype_bytes
    h, i = tower.hidden, tower.intermediate // tp
    hq = tower.hidden // tp

    def t(width: int) -> int:
        return _blocks(patches * width * b)

    pixels = _blocks(patches * tower.patch_elements * _PIXEL_BYTES)
    stream = 2 * t(h)
    attention = t(h) + t(3 * hq) + (2 * t(hq) if tower.rotary else 0) + t(hq) + t(h)
    if tower.mlp == "held":
        mlp = t(h) + t(2 * i) + t(i) + t(h)
    elif tower.mlp == "gated":
        mlp = t(h) + max(t(2 * i) + t(i), t(i) + t(h))
    else:
        mlp = t(h) + max(2 * t(i), t(i) + t(h))
    outputs = _blocks(out_rows * out_hidden * b)
    return pixels + max(stream + max(attention, mlp), outputs)


def _limit(value: int | None, flag: str) -> int:
    if value is None:
        return DEFAULT_MM_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MemfitError(f"{flag} must be an integer >= 0 (vLLM's --limit-mm-per-prompt "
                          f"count), got {value!r}")
    return value


def _max_items(tokens: int, limit: int, *, budget: int, max_model_len: int,
               max_num_seqs: int) -> int:
    """``MultiModalBudget._get_max_items``'s items per batch (chunked prefill on)."""
    per_prompt = max(1, min(limit, max_model_len // tokens))
    return max(1, min(budget // tokens, max_num_seqs * per_prompt))


def multimodal_budget(config: Mapping[str, Any], *, tp: int = 1, max_images: int | None = None,
                      max_videos: int | None = None, max_pixels: int | None = None,
                      dtype_bytes: int = 2, max_num_batched_tokens: int = 8192,
                      max_num_seqs: int = 1024, max_model_len: int | None = None,
                      ) -> MultimodalBudget | None:
    """The vision tower's weights on one rank of a ``tp`` group and the encoder's part of vLLM
    0.33's profile run, for a transformers ``config`` dict; None for a text-only config (no
    ``vision_config``) or when every modality's limit is 0 (vLLM then builds no tower).

    ``max_images`` / ``max_videos``: ``--limit-mm-per-prompt``'s counts (default 999, as
    vLLM's); ``max_pixels``: the image bound of the dynamic-resolution families (Qwen2-VL,
    Qwen2.5-VL; vLLM's ``--mm-processor-kwargs '{"max_pixels": P}'``), default the
    checkpoints' 12,845,056. Bad input raises MemfitError (one line).

    >>> vc = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
    ...       "out_hidden_size": 96, "patch_size": 14, "spatial_merge_size": 2}
    >>> mm = multimodal_budget({"model_type": "qwen2_5_vl", "vision_config": vc,
    ...                         "hidden_size": 96}, max_pixels=28 * 28 * 64, max_videos=0)
    >>> mm.tokens_per_item, mm.items
    (64, 128)
    """
    vc = config.get("vision_config")
    if not isinstance(vc, Mapping):
        return None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MemfitError(f"--tp must be a positive integer, got {tp!r}")
    images = _limit(max_images, "--max-images")
    videos = _limit(max_videos, "--max-videos")
    family = str(config.get("model_type"))
    if family not in MULTIMODAL_FAMILIES:
        if images == 0:
            return None
        raise MemfitError(
            f"the vision tower of model_type {family!r} is not modelled (serve-plan sizes "
            f"{', '.join(MULTIMODAL_FAMILIES)}); pass --max-images 0 to plan the language "
            "model alone, as vLLM serves it with --limit-mm-per-prompt '{\"image\": 0}'")
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(
            max_pixels, int) or max_pixels < 1):
        raise MemfitError(f"--max-pixels must be a positive integer (pixels per image), got "
                          f"{max_pixels!r}")
    if max_model_len is None:
        from memfit.serving.kv_spec import model_context_length

        max_model_len = model_context_length(config) or max_num_batched_tokens
    modalities: dict[str, tuple[int, int]] = {}  # modality -> (tokens, patches) per item
    if family in DYNAMIC_RESOLUTION:
        tower, parts, merge, out_hidden = qwen_tower(config, vc, tp)
        patch = _int(vc, "patch_size", default=14)
        temporal = _int(vc, "temporal_patch_size", default=2)
        pixels = QWEN_MAX_PIXELS if max_pixels is None else max_pixels
        per_image = qwen_tokens_per_image(pixels, patch_size=patch, merge_size=merge)
        if images:
            modalities["image"] = (per_image, per_image * merge * merge)
        if videos:
            frames = qwen_video_frames(per_image, max_model_len, temporal_patch_size=temporal)
            per_video = max((frames + (-frames % temporal)) // temporal, 1) * per_image
            modalities["video"] = (per_video, per_video * merge * merge)
        limits = {"image": images, "video": videos}
    else:
        if max_pixels is not None:
            size = _int(vc, "image_size", default=896 if family == "gemma3" else 1024)
            raise MemfitError(f"--max-pixels applies to Qwen2-VL and Qwen2.5-VL; {family} "
                              f"resizes every image to {size}x{size} (drop --max-pixels)")
        build = gemma3_tower if family == "gemma3" else mistral3_tower
        tower, parts, patches, per_image, out_hidden = build(config, vc, tp)
        if images:
            modalities["image"] = (per_image, patches)
        limits = {"image": images}
        pixels = None
    if not modalities:
        return None
    modality = max(modalities, key=lambda m: (modalities[m][0], m))
    tokens, patches_per_item = modalities[modality]
    budget = max(max_num_batched_tokens, tokens)
    items = _max_items(tokens, limits[modality], budget=budget, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs)
    cache = _blocks(items * tokens * out_hidden * dtype_bytes)
    peak = encoder_peak(tower, patches=items * patches_per_item, out_rows=items * tokens,
                        out_hidden=out_hidden, tp=tp, dtype_bytes=dtype_bytes)
    return MultimodalBudget(
        family=family, modality=modality, tokens_per_item=tokens,
        patches_per_item=patches_per_item, items=items, encoder_budget_tokens=budget,
        weights_parts={k: v * dtype_bytes for k, v in parts.items()},
        encoder_peak_bytes=peak, encoder_cache_bytes=cache,
        embeds_buffer_bytes=_blocks(max_num_batched_tokens * out_hidden * dtype_bytes),
        max_pixels=pixels, source=MULTIMODAL_FAMILIES[family])
