"""One vocabulary (issue 13): every layer's precision, optimizer and checkpointing names come
from memfit.vocab, in its order, and a name a layer does not take gets one error that says
where it works."""

from __future__ import annotations

from typing import get_args

import pytest

from memfit import vocab
from memfit.errors import MemfitError


def test_each_layer_takes_what_its_code_handles() -> None:
    """The sets are checked against each layer's own code, not against vocab: the trace's dtype
    table, the analytic Literal types, the optimizers the trace and techniques can build."""
    from memfit.analytic import config as plan_config
    from memfit.fitting import config as fit_config
    from memfit.techniques.optim import _TORCH_CLASSES
    from memfit.trace import options
    from memfit.trace.optim import _named

    assert set(vocab.names("precision", "plan")) == set(get_args(plan_config.Precision))
    assert set(vocab.names("optimizer", "plan")) == set(get_args(plan_config.Optimizer))
    assert set(vocab.names("checkpointing", "plan")) == set(get_args(plan_config.Checkpointing))
    # the engine's dtypes per precision (checked by value in tests/test_vocab_precision.py)
    assert set(options.PRECISIONS) == set(vocab.names("precision", "trace"))
    for name in vocab.names("optimizer", "trace"):
        assert callable(_named(name, None))
    apply_optimizers = set(_TORCH_CLASSES) | {"adamw-8bit", "adam-8bit"}
    assert set(vocab.names("optimizer", "apply")) == apply_optimizers
    assert set(vocab.names("optimizer", "fit")) <= (set(vocab.names("optimizer", "trace"))
                                                    & set(apply_optimizers))
    # fit's search and its tie order rely on the order
    assert fit_config.PRECISIONS == ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
    assert fit_config.CHECKPOINTING == ("none", "selective", "torchtitan", "full", "budget")


def test_a_known_name_outside_its_layer_says_where_it_works() -> None:
    from memfit.trace import estimate

    with pytest.raises(MemfitError, match=r"'fp8' is not available here \(trace\); it works in: "
                                          r"plan, apply"):
        estimate(object(), (), precision="fp8")


def test_an_unknown_name_gets_the_closest() -> None:
    with pytest.raises(MemfitError, match=r"unknown precision 'bf16-mixd'.*bf16-mixed"):
        vocab.check("precision", "bf16-mixd", "fit")
