"""A Lightning callback logging memory by category every N training batches.

>>> from memfit.integrations import MemfitLightningCallback
>>> trainer = L.Trainer(callbacks=[MemfitLightningCallback(every_n_steps=50)])  # doctest: +SKIP

Records go to ``callback.history``, the ``memfit`` logger and ``pl_module.log`` as
``memfit/<name>_bytes``.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError("MemfitLightningCallback needs Lightning: `pip install lightning`"
                          ) from exc

from memfit.integrations._common import check_every, record


class MemfitLightningCallback(Callback):  # type: ignore[misc]
    """Log memory by category every ``every_n_steps`` global steps.

    Known limitations: as for :class:`~memfit.integrations.huggingface.MemfitTrainerCallback`;
    with several optimizers only the first one's states are counted.
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        super().__init__()
        self.every_n_steps = check_every(every_n_steps)
        self.history: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step == 0 or step % self.every_n_steps:
            return
        if self.history and self.history[-1]["step"] == step:
            return  # gradient accumulation: several batches end on the same optimizer step
        optimizers = trainer.optimizers
        entry = record(step, pl_module, optimizers[0] if optimizers else None)
        self.history.append(entry)
        for k, v in entry.items():
            if k != "step":
                pl_module.log(f"memfit/{k}_bytes", float(v), on_step=True, on_epoch=False)
