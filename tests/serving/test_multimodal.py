"""A vision-language model's encoder budget in vLLM 0.33's profile run
(``memfit.serving.multimodal``): expected values by hand from the vLLM code each test names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.serving.multimodal import (
    multimodal_budget,
    qwen_tokens_per_image,
    qwen_video_frames,
)

# A small Qwen2.5-VL-like vision tower (qwen2_5_vl.py: Qwen2_5_VisionTransformer).
H, INTER, DEPTH, OUT = 64, 96, 2, 48
QWEN25 = {"model_type": "qwen2_5_vl", "hidden_size": OUT, "max_position_embeddings": 4096,
          "torch_dtype": "bfloat16",
          "vision_config": {"depth": DEPTH, "hidden_size": H, "intermediate_size": INTER,
                            "num_heads": 4, "in_chans": 3, "out_hidden_size": OUT,
                            "patch_size": 14, "spatial_merge_size": 2,
                            "temporal_patch_size": 2}}
PIXELS_224 = 224 * 224  # (224/14)(224/14)/4 = 64 tokens


def test_qwen25_vision_weights_by_hand_tp1_and_tp2() -> None:
    patch_embed = 3 * 2 * 14 * 14 * H  # Conv3d, no bias, replicated
    # per block at tp=1: two RMSNorms, qkv (bias), proj (bias), gate_up (bias), down (bias)
    block1 = (2 * H + (H * 3 * H + 3 * H) + (H * H + H) + (H * 2 * INTER + 2 * INTER)
              + (INTER * H + H))
    # tp=2: column layers halve outputs and biases; row layers halve inputs, keep the bias
    block2 = (2 * H + (H * 3 * H // 2 + 3 * H // 2) + (H // 2 * H + H)
              + (H * INTER + INTER) + (INTER // 2 * H + H))
    wide = 4 * H  # the merger's input: 2 x 2 patches
    merger1 = H + (wide * wide + wide) + (wide * OUT + OUT)
    merger2 = H + (wide * wide // 2 + wide // 2) + (wide // 2 * OUT + OUT)
    for tp, block, merger in ((1, block1, merger1), (2, block2, merger2)):
        mm = multimodal_budget(QWEN25, tp=tp, max_pixels=PIXELS_224)
        assert mm is not None
        assert mm.weights_parts == {"vision_tower": 2 * (patch_embed + DEPTH * block),
                                    "projector": 2 * merger}


def test_qwen_tokens_per_image_by_hand() -> None:
    # patch 14, merge 2: an H x W image is (H/14)(W/14)/4 tokens
    assert qwen_tokens_per_image(PIXELS_224) == (224 // 14) * (224 // 14) // 4 == 64
    # 1,003,520 px = 1280 merged patches: 896 x 1120 px
    assert qwen_tokens_per_image(28 * 28 * 1280) == (896 // 14) * (1120 // 14) // 4 == 1280
    # the published checkpoints' 12,845,056 px: 3584 x 3584
    assert qwen_tokens_per_image(12_845_056) == (3584 // 14) ** 2 // 4 == 16384
    # 401 merged patches is prime: 1 x 401 is wider than 200:1, so 400 = 20 x 20
    assert qwen_tokens_per_image(28 * 28 * 401) == 400
    with pytest.raises(MemfitError, match="below one merged patch"):
        qwen_tokens_per_image(783)


def test_dummy_batch_and_encoder_cache_by_hand() -> None:
    # images only: budget max(8192, 64) = 8192 tokens -> 8192 // 64 = 128 images
    # (max_num_seqs x min(999, 4096 // 64) does not bind); outputs 128 x 64 x 48 x 2 B
    mm = multimodal_budget(QWEN25, max_pixels=PIXELS_224, max_videos=0)
    assert (mm.modality, mm.tokens_per_item, mm.items) == ("image", 64, 128)
    assert mm.encoder_budget_tokens == 8192
    assert mm.encoder_cache_bytes == 128 * 64 * OUT * 2
    assert mm.embeds_buffer_bytes == 8192 * OUT * 2
    assert mm.log_line == ("Encoder cache will be initialized with a budget of 8192 tokens, "
                           "and profiled with 128 image items of the maximum feature size.")
    # the decoder side binds: max_num_seqs 4 x max(1, min(2 images, 100 // 64 = 1)) = 4
    few = multimodal_budget(QWEN25, max_pixels=PIXELS_224, max_videos=0, max_images=2,
                            max_num_seqs=4, max_model_len=100)
    assert few.items == 4 and few.encoder_cache_bytes == 4 * 64 * OUT * 2
    # the profile peak: encoder alone, or its outputs held through the decoder's run
    assert mm.profile_peak(0) == mm.embeds_buffer_bytes + mm.encoder_peak_bytes
    assert mm.profile_peak(10**12) == mm.embeds_buffer_bytes + mm.encoder_cache_bytes + 10**12


def test_video_is_profiled_when_its_items_are_larger() -> None:
    # one video: frames while (padded frames / 2) x 64 <= 4096 tokens, at most 14 -> 14 frames
    assert qwen_video_frames(64, 4096) == 14
    # 2 frames pad to one temporal patch (64 tokens <= 100); 3 pad to 4 frames, 128 tokens
    assert qwen_video_frames(64, 100) == 2
    mm = multimodal_budget(QWEN25, max_pixels=PIXELS_224)
    assert (mm.modality, mm.tokens_per_item) == ("video", 7 * 64)
    assert mm.patches_per_item == 7 * 64 * 4
    # a one-frame video ties an image: the tie goes to "video" (max over (tokens, name))
    tie = multimodal_budget(QWEN25, max_pixels=PIXELS_224, max_model_len=100)
    assert (tie.modality, tie.tokens_per_item) == ("video", 64)


def test_text_only_and_disabled_towers_are_none() -> None:
    assert multimodal_budget({"model_type": "llama", "hidden_size": 64}) is None
    assert multimodal_budget(QWEN25, max_images=0, max_videos=0) is None
    mllama = {"model_type": "mllama", "vision_config": {"hidden_size": 1280}}
    assert multimodal_budget(mllama, max_images=0) is None
    with pytest.raises(MemfitError, match=r"not modelled.*--max-images 0"):
        multimodal_budget(mllama)


def test_mistral_small_32_vision_weights_by_hand() -> None:
    # Mistral-Small-3.2-24B's vision_config (Pixtral, pixtral.py: PixtralHFVisionModel) and
    # its projector (mistral3.py: Mistral3MultiModalProjector, no bias)
    config = {"model_type": "mistral3", "spatial_merge_size": 2,
              "multimodal_projector_bias": False, "torch_dtype": "bfloat16",
              "text_config": {"model_type": "mistral", "hidden_size": 5120},
              "vision_config": {"hidden_size": 1024, "intermediate_size": 4096,
                                "num_hidden_layers": 24, "num_attention_heads": 16,
                                "head_dim": 64, "patch_size": 14, "image_size": 1540}}
    h, i = 1024, 4096
    tower = 3 * 14 * 14 * h + h + 24 * (2 * h + 4 * h * h + 3 * h * i)
    projector = h + 4 * h * h + h * 5120 + 5120 * 5120
    mm = multimodal_budget(config, max_model_len=16000)
    assert mm.weights_bytes == 2 * (tower + projector) == 877_916_160
    # 1540 / 28 = 55: 55 x 55 tokens, from 110 x 110 patches; 8192 // 3025 = 2 images
    assert (mm.tokens_per_item, mm.patches_per_item, mm.items) == (3025, 12100, 2)


def test_gemma3_siglip_by_hand() -> None:
    path = Path(__file__).parents[1] / "data" / "published_configs" / "gemma3-4b-it.json"
    config = json.loads(path.read_text())
    h, i, layers, text = 1152, 4304, 27, config["text_config"]["hidden_size"]
    embeddings = 3 * 14 * 14 * h + h + 64 * 64 * h
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    mm = multimodal_budget(config, max_model_len=131072)
    assert mm.weights_parts == {"vision_tower": 2 * (embeddings + layers * block + 2 * h),
                                "projector": 2 * (h * text + h)}
    # 256 tokens per image: 8192 // 256 = 32 images of 64 x 64 patches
    assert (mm.tokens_per_item, mm.items, mm.patches_per_item) == (256, 32, 4096)
    with pytest.raises(MemfitError, match="resizes every image to 896x896"):
        multimodal_budget(config, max_pixels=10**6)


def test_startup_budget_adds_the_tower_and_the_encoder(monkeypatch) -> None:
    from memfit.gpus import get_gpu
    from memfit.serving import startup

    decoder = 3 * 2**20
    monkeypatch.setattr(startup, "_activation_peak", lambda config, version, **kw: (decoder,
                                                                          "profile_run"))
    config = {**QWEN25, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}
    mm = multimodal_budget(config, max_pixels=PIXELS_224, max_videos=0, max_model_len=4096)
    b = startup.startup_budget(config, config, gpu=get_gpu("h100-sxm-80gb"),
                               max_pixels=PIXELS_224, max_videos=0, max_model_len=4096)
    assert b.weights_parts["vision_tower"] == mm.weights_parts["vision_tower"] > 0
    assert b.activation_peak_bytes == mm.embeds_buffer_bytes + max(
        mm.encoder_peak_bytes, mm.encoder_cache_bytes + decoder)
    assert b.log_lines[0] == mm.log_line


@pytest.mark.parametrize(("argv", "words"), [
    (["--max-images", "-1"], "--max-images must be an integer >= 0"),
    (["--max-videos", "two"], "--max-videos must be an integer >= 0"),
    (["--max-pixels", "0"], "--max-pixels must be a positive integer"),
    (["--max-pixels", "100"], "below one merged patch"),
])
def test_bad_flags_are_one_line_exit_2(capsys, tmp_path, argv: list[str], words: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        **QWEN25, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 1000}))
    code = main(["serve-plan", str(tmp_path), "--gpu", "h100-sxm-80gb", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1
