"""A Hugging Face ``Trainer`` callback logging memory by category every N steps.

>>> from memfit.integrations import MemfitTrainerCallback
>>> trainer.add_callback(MemfitTrainerCallback(every_n_steps=50))  # doctest: +SKIP

Each record (weights, gradients, optimizer states by storage; on CUDA also allocated, reserved
and ``other`` = activations and temporaries) is kept in ``callback.history``, logged on the
``memfit`` logger, and added as ``memfit/<name>_bytes`` to the next logs that ``Trainer.log``
hands to callbacks: the console printer and callbacks added after this one see them; reporting
integrations set by ``report_to`` run before user callbacks and do not (read ``history``).
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the message says how to get it
    raise ImportError("MemfitTrainerCallback needs transformers: `pip install 'memfit[hf]'`"
                      ) from exc

from memfit.integrations._common import check_every, record


class MemfitTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Log memory by category every ``every_n_steps`` optimizer steps.

    Known limitations: activations and temporaries are only visible on CUDA (as ``other``), and
    only between steps: the peak inside a step needs ``memfit profile``.
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = check_every(every_n_steps)
        self.history: list[dict[str, int]] = []
        self._pending: dict[str, int] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    optimizer: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps == 0:
            entry = record(state.global_step, model, optimizer)
            self.history.append(entry)
            self._pending = entry

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if logs is not None and self._pending is not None:
            for k, v in self._pending.items():
                if k != "step":
                    logs[f"memfit/{k}_bytes"] = v
            self._pending = None
