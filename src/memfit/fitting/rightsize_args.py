"""The argument checks of :func:`memfit.fitting.rightsize.rightsize_training`: each bad value
a :class:`~memfit.errors.MemfitError` naming the flag, its valid values and the fix."""

from __future__ import annotations

import math

from memfit.errors import MemfitError

__all__ = ["check_training_args"]


def check_training_args(*, train_tokens: float, seq: int, global_batch: int, gpus_max: int,
                        gpus_per_node: int, mode: str, interruption: str | None,
                        mtbf_hours: float | None, write_bandwidth: float,
                        spot_discount: float | None,
                        host_memory: int | None = None) -> tuple[str, float]:
    """Check :func:`memfit.fitting.rightsize.rightsize_training`'s arguments (a
    :class:`MemfitError` naming the flag); return the interruption band and the spot discount,
    the defaults filled in."""
    from memfit.preempt.spot import DEFAULT_BAND, DEFAULT_SPOT_DISCOUNT, INTERRUPTION_BANDS

    if isinstance(train_tokens, bool) or not isinstance(train_tokens, (int, float)) \
            or not (math.isfinite(train_tokens) and train_tokens > 0):
        raise MemfitError(f"--train-tokens must be a positive number of tokens such as 2e9, "
                          f"got {train_tokens!r}")
    for flag, value in (("--seq", seq), ("--global-batch", global_batch),
                        ("--gpus-max", gpus_max), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"{flag} must be an integer >= 1, got {value!r}")
    if mode not in ("train", "lora", "qlora"):
        raise MemfitError(f"--mode must be train, lora or qlora for a training job, got "
                          f"{mode!r}")
    if interruption is not None and mtbf_hours is not None:
        raise MemfitError("give --interruption or --mtbf-hours, not both")
    if mtbf_hours is not None and not (math.isfinite(mtbf_hours) and mtbf_hours > 0):
        raise MemfitError(f"--mtbf-hours must be a positive number, got {mtbf_hours!r}")
    if not (math.isfinite(write_bandwidth) and write_bandwidth > 0):
        raise MemfitError(f"--write-bandwidth must be a positive rate, got {write_bandwidth!r}")
    if host_memory is not None and (isinstance(host_memory, bool)
                                    or not isinstance(host_memory, int) or host_memory < 1):
        raise MemfitError(f"--host-memory must be a positive size such as 1TiB (a node's RAM), "
                          f"got {host_memory!r}")
    band = interruption or DEFAULT_BAND
    if band not in INTERRUPTION_BANDS:
        raise MemfitError(f"unknown interruption band {band!r}; valid: "
                          f"{', '.join(INTERRUPTION_BANDS)}")
    discount = DEFAULT_SPOT_DISCOUNT if spot_discount is None else spot_discount
    if not 0 <= discount < 1:
        raise MemfitError(f"--discount must be in [0, 1), got {discount!r}")
    return band, discount
