"""Any ``model_type`` the installed transformers knows, for the trace.

memfit's formulas (:mod:`memfit.models.hf_config`) cover the families they know exactly. Every
other ``config.json`` whose ``model_type`` is in transformers' ``CONFIG_MAPPING`` loads as an
:class:`HFModelSpec`: the config as written, the task head its ``architectures`` names, and the
exact parameter count of that model built on the meta device (no memory, nothing downloaded).
The trace (``memfit plan --method trace``, chosen automatically for these) builds the same model
and runs one step on inputs of the right kinds (:meth:`HFModelSpec.example_inputs`).

Nothing from the Hub is executed: ``auto_map`` (``trust_remote_code``) entries are ignored, and a
model type transformers does not ship is refused.

Known limitations: the analytic planner sees only the parameter count of these models (model
states, no activations), so LoRA/QLoRA on them is traced only (one GPU). A config's
``quantization_config`` and ``torch_dtype`` are dropped: the model is planned at the precision
``--precision`` says. An image-text model (Gemma-3) gets text inputs only: its vision tower
holds its weights but, running in no step, no gradients or optimizer states.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.models.spec import ParamCountSpec

__all__ = ["TASKS", "HFModelSpec", "hf_model_spec", "known_model_types"]

# task -> (transformers.models.auto.modeling_auto mapping, Auto class). The order is the
# preference when ``architectures`` does not say (encoder-decoder configs try seq2seq first).
TASKS: dict[str, tuple[str, str]] = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "seq2seq-lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "speech-seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "image-classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                             "AutoModelForImageClassification"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    "audio-classification": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
                             "AutoModelForAudioClassification"),
    "base": ("MODEL_MAPPING_NAMES", "AutoModel"),
}
_SEQ2SEQ_FIRST = ("seq2seq-lm", "speech-seq2seq")
# Keys that describe how the checkpoint was stored or run, not the architecture.
_DROPPED_KEYS = ("model_type", "auto_map", "quantization_config", "transformers_version")
# The dtype the checkpoint was saved in (Note: [the trace's parameter dtype]).
_DTYPE_KEYS = ("torch_dtype", "dtype")
_MAX_DEFAULT_SEQ = 2048
_AUDIO_SAMPLES = 16_000  # one second at 16 kHz for waveform models (wav2vec2, HuBERT)


def _transformers(what: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise MemfitError(f"{what} needs transformers, which is not installed; run "
                          "pip install 'memfit[hf]'") from None


def known_model_types() -> frozenset[str]:
    """``model_type`` values the installed transformers can build (empty without it)."""
    try:
        hf = importlib.import_module("transformers")
    except ImportError:
        return frozenset()
    return frozenset(hf.CONFIG_MAPPING.keys())


def _mapping(task: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, TASKS[task][0], {}))


def _class_names(names: Any) -> tuple[str, ...]:
    return tuple(names) if isinstance(names, list | tuple) else (names,)


def _pick_task(model_type: str, architectures: list[str], encoder_decoder: bool) -> str:
    """The task whose mapping holds a class ``architectures`` names, else the first task (in
    :data:`TASKS` order, seq2seq first for encoder-decoder configs) that has the model type."""
    order = [t for t in TASKS if t in _SEQ2SEQ_FIRST] if encoder_decoder else []
    order += [t for t in TASKS if t not in order]
    for task in order:
        names = _mapping(task).get(model_type)
        if names is not None and set(_class_names(names)) & set(architectures):
            return task
    for task in order:
        if model_type in _mapping(task):
            return task
    raise MemfitError(f"transformers has no model class for model_type {model_type!r}; pass "
                      "--params N to plan model states only")


def _without_dtype(values: dict[str, Any]) -> dict[str, Any]:
    """The config's values (and those of every config nested in it: ``text_config``,
    ``vision_config``, ``encoder``...) without the dtype the checkpoint was saved in.

    Note: [the trace's parameter dtype] transformers 5's ``from_config`` builds the model in
    the config's ``torch_dtype`` (``dtype``), and a published config.json always names one
    (usually bfloat16): kept, a bf16-mixed plan would trace bf16 parameters and optimizer
    states, half the fp32 ones autocast training keeps. The run's precision decides instead:
    the model is built in fp32 (:meth:`HFModelSpec.build`) and the trace casts it for a pure
    16-bit run, as for every other model."""
    out = {k: v for k, v in values.items() if k not in _DTYPE_KEYS}
    for key, value in out.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _without_dtype(value)
    return out


def _no_cache(config: Any) -> None:
    """``use_cache=False`` (a training step keeps no KV cache) on ``config`` and on every
    sub-config, as written in the file or filled in by transformers: a nested text config
    left with its cache re-appends the KV cache in checkpointing's recompute, and Gemma-3's
    sliding-window mask then no longer matches the keys."""
    config.use_cache = False
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _no_cache(sub)


def _config_object(model_type: str, data: dict[str, Any], where: str) -> Any:
    hf = _transformers(f"model_type {model_type!r}")
    values = _without_dtype({k: v for k, v in data.items() if k not in _DROPPED_KEYS})
    try:
        config = hf.AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MemfitError(f"{where}: transformers cannot read this {model_type} config "
                          f"({first}); fix the config") from None
    _no_cache(config)
    return config


@dataclass(frozen=True, kw_only=True)
class HFModelSpec(ParamCountSpec):
    """A Hugging Face config that memfit's formulas do not cover, for the trace.

    ``params`` is the exact count of the task model built on meta (tied weights once). The
    analytic planner treats it as a parameter count (model states only); the trace builds the
    real module. ``config`` is the config.json as read (minus ``auto_map`` and
    ``quantization_config``).
    """

    model_type: str
    task: str
    """One of :data:`TASKS`: which Auto class builds it (from ``architectures``)."""
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    source: str | None = None

    # ------------------------------------------------ what `memfit models` shows
    def _first_int(self, *keys: str) -> int:
        config = self._text_config()
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    @property
    def family(self) -> str:
        return self.model_type

    @property
    def num_layers(self) -> int:
        return self._first_int("num_hidden_layers", "num_layers", "n_layer", "n_layers")

    @property
    def hidden_size(self) -> int:
        return self._first_int("hidden_size", "d_model", "n_embd", "dim")

    @property
    def num_heads(self) -> int:
        return self._first_int("num_attention_heads", "num_heads", "n_head", "n_heads")

    @property
    def num_kv_heads(self) -> int:
        return self._first_int("num_key_value_heads") or self.num_heads

    @property
    def num_experts(self) -> int:
        return self._first_int("n_routed_experts", "num_local_experts", "num_experts")

    @property
    def experts_per_token(self) -> int:
        return self._first_int("num_experts_per_tok") if self.num_experts else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ------------------------------------------------------------------- building
    def hf_config(self) -> Any:
        """The transformers config object (``AutoConfig.for_model``), with ``use_cache`` off:
        a training step keeps no KV cache."""
        return _config_object(self.model_type, self.config, self.source or self.name)

    def model_class(self) -> Any:
        hf = _transformers(f"model_type {self.model_type!r}")
        # The class the Auto class builds for this config (the mapping's first name).
        return getattr(hf, _class_names(_mapping(self.task)[self.model_type])[0])

    def build(self, *, device: Any = "meta", dtype: Any = None,
              attn_implementation: str | None = None) -> Any:
        """The task model on ``device`` (meta: no memory), parameters in ``dtype`` (default
        fp32, whatever ``torch_dtype`` the config names: Note: [the trace's parameter dtype]).
        ``attn_implementation`` unset means SDPA where the class has it, else eager.

        >>> spec = hf_model_spec({"model_type": "t5", "d_model": 64, ...})  # doctest: +SKIP
        >>> model = spec.build()  # T5ForConditionalGeneration on meta
        """
        import torch

        cls = self.model_class()
        if attn_implementation is None:
            attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
        elif attn_implementation == "sdpa" and not getattr(cls, "_supports_sdpa", False):
            raise MemfitError(f"{cls.__name__} has no SDPA attention in this transformers; use "
                              "attn_implementation='eager' (or leave it unset)")
        hf = _transformers(f"model_type {self.model_type!r}")
        auto = getattr(hf, TASKS[self.task][1])
        config = self.hf_config()
        from memfit.models.build import _default_dtype

        with torch.device(device), _default_dtype(dtype or torch.float32):
            try:
                return auto.from_config(config, attn_implementation=attn_implementation)
            except (ValueError, TypeError, RuntimeError) as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise MemfitError(f"{self.source or self.name}: transformers cannot build "
                                  f"{cls.__name__} from this config ({first}); fix the config "
                                  "or pass --params N") from None

    # --------------------------------------------------------------------- inputs
    @property
    def default_seq_len(self) -> int:
        """The context length (``max_position_embeddings`` / ``n_positions``), capped at 2048."""
        cfg = self._text_config()
        for key in ("max_position_embeddings", "n_positions", "max_target_positions"):
            value = cfg.get(key)
            if isinstance(value, int) and value > 0 and not isinstance(value, bool):
                return min(value, _MAX_DEFAULT_SEQ)
        return _MAX_DEFAULT_SEQ

    def sequence_length(self, seq: int | None) -> int | None:
        """Tokens per row of :meth:`example_inputs`: ``seq`` (default :attr:`default_seq_len`)
        for text models, capped at ``max_target_positions`` for the labels of speech models;
        None for image and audio models, whose inputs have no sequence length to choose."""
        if self.task in ("image-classification", "ctc", "audio-classification"):
            return None
        seq = seq or self.default_seq_len
        if self.task == "speech-seq2seq":
            target = self._text_config().get("max_target_positions", seq)
            return min(seq, int(target))
        return seq

    def _text_config(self) -> dict[str, Any]:
        text = self.config.get("text_config")
        if isinstance(text, dict) and "vocab_size" not in self.config:
            return {**self.config, **text}
        return self.config

    def _text_default(self, key: str) -> Any:
        """``key`` of the text config as transformers fills it in when the file leaves it out
        (a published Gemma-3 config.json has no vocab_size anywhere)."""
        config = self.hf_config()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, key, None)

    def example_inputs(self, batch: int, seq: int | None = None, device: Any = "meta", *,
                       training: bool = True) -> dict[str, Any]:
        """Keyword inputs for one training step of :meth:`build`'s model: token ids and labels
        (T5/BART shift the labels right into ``decoder_input_ids`` themselves), pixels and class
        labels, log-mel features and transcript labels (Whisper), or waveforms.

        ``training=False``: no labels; encoder-decoders get ``decoder_input_ids`` of the
        labels' shape instead (a forward pass needs decoder inputs)."""
        inputs = self._training_inputs(batch, seq, device)
        if training:
            return inputs
        labels = inputs.pop("labels", None)
        if self.task in _SEQ2SEQ_FIRST and labels is not None:
            inputs["decoder_input_ids"] = labels
        return inputs

    def _training_inputs(self, batch: int, seq: int | None, device: Any) -> dict[str, Any]:
        import torch

        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise MemfitError(f"batch must be a positive integer, got {batch!r}")
        config = self._text_config()
        seq = self.sequence_length(seq) or self.default_seq_len
        vocab = config.get("vocab_size")
        if vocab is None:  # transformers' default: Gemma-3's text config says 262,208
            vocab = self._text_default("vocab_size")
        if self.task in ("causal-lm", "seq2seq-lm", "masked-lm", "base"):
            if not isinstance(vocab, int) or vocab <= 0:
                raise MemfitError(f"{self.source or self.name}: no vocab_size in the config; "
                                  "add it")
            ids = torch.randint(0, vocab, (batch, seq), device=device)
            if self.task == "base":
                return {"input_ids": ids}
            return {"input_ids": ids, "labels": ids.clone()}
        if self.task == "image-classification":
            size = config.get("image_size", 224)
            size = int(size[0] if isinstance(size, list | tuple) else size)
            channels = int(config.get("num_channels", 3))
            labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
            return {"pixel_values": torch.randn(batch, channels, size, size, device=device),
                    "labels": torch.randint(0, labels, (batch,), device=device)}
        if self.task == "speech-seq2seq":
            mels = int(config.get("num_mel_bins", 80))
            frames = 2 * int(config.get("max_source_positions", 1500))
            return {"input_features": torch.randn(batch, mels, frames, device=device),
                    "labels": torch.randint(0, int(vocab or 2), (batch, seq), device=device)}
        wave = torch.randn(batch, _AUDIO_SAMPLES, device=device)
        if self.task == "ctc":
            labels = torch.randint(1, int(vocab or 2), (batch, 16), device=device)
        else:  # audio-classification
            num = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
            labels = torch.randint(0, num, (batch,), device=device)
        return {"input_values": wave, "labels": labels}


def hf_model_spec(data: dict[str, Any], *, name: str, source: str | None = None) -> HFModelSpec:
    """An :class:`HFModelSpec` for a parsed config.json whose ``model_type`` transformers knows,
    with its exact parameter count (the task model built on meta, tied weights once).

    Raises MemfitError without transformers (with the install hint) and for model types it does
    not know.
    """
    model_type = data.get("model_type")
    where = source or name
    hf = _transformers(f"{where}: model_type {model_type!r} (not covered by memfit's formulas)")
    if model_type not in hf.CONFIG_MAPPING:
        raise MemfitError(f"{where}: transformers {hf.__version__} does not know model_type "
                          f"{model_type!r}; upgrade transformers or pass --params N to plan "
                          "model states only")
    archs = data.get("architectures") or []
    if not isinstance(archs, list):
        raise MemfitError(f"{where}: 'architectures' must be a list of class names; fix the "
                          "config")
    config = _config_object(model_type, data, where)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    task = _pick_task(model_type, archs, encoder_decoder)
    spec = HFModelSpec(name=name, params=1, model_type=model_type, task=task, config=data,
                       source=source)
    params = sum(p.numel() for p in spec.build(device="meta").parameters())
    return HFModelSpec(name=name, params=params, model_type=model_type, task=task, config=data,
                       source=source)

