"""Model specs: presets shipped as data, Hugging Face config.json files, or a parameter count."""

from memfit.models.spec import LinearShape, ModelSpec, ParamCountSpec, TransformerSpec

__all__ = ["LinearShape", "ModelSpec", "ParamCountSpec", "TransformerSpec"]
