"""Price a training job on spot (preemptible) instances: the checkpoint interval, the work lost
to preemptions, the restarts, and the expected time and cost against on-demand.

The model (first order, as Young's and Daly's): the job computes for ``work_s`` seconds and
writes a checkpoint of ``C = checkpoint_bytes / write_bandwidth`` seconds every ``τ`` seconds of
work. Preemptions of the whole job arrive at random (a Poisson process) with a mean time between
them ``M`` (``mtbf_s``). A preemption loses the work since the last checkpoint, on average half
a segment ``(τ + C) / 2``, and costs a restart ``R`` (``restart_s``: the new instance's
provisioning, which you give, plus reading the checkpoint back, ``checkpoint_bytes /
read_bandwidth``). With a preemption notice long enough to finish the step and write a
checkpoint (:func:`memfit.preemptible` on SIGTERM), nothing but the restart is lost.

- Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  ``τ = √(2·C·M)``.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3): ``τ = √(2CM)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C`` for ``C < 2M``, else ``τ = M``.
- Wall time ``W`` solves ``W = work·(1 + C/τ) + (W/M)·(lost + R)``; expected preemptions
  ``W/M``; cost ``W/3600 · price_per_hour · (1 − spot_discount)``.

Preemption rates (per instance; a synchronous job of ``n`` instances stops when any one is
preempted, so its ``M`` is the instance's over ``n``):

- AWS publishes no rate, only the Spot Instance Advisor's "frequency of interruption" band of
  each instance type and region over the trailing month: <5%, 5-10%, 10-15%, 15-20%, >20%
  (https://aws.amazon.com/ec2/spot/instance-advisor/). Read as the share of instances
  interrupted in a month (730 h, AWS's billing month), a band's upper edge ``p`` gives
  ``M = 730 h / −ln(1 − p)``; ">20%" is a lower bound on the rate (its ``M`` is an upper bound).
  The notice is two minutes (AWS EC2 user guide, "Spot Instance interruption notices").
- Google Cloud's preemptible VMs always stop after 24 hours, so at least one preemption per
  24 h of an instance (``M`` at most 24 h; Spot VMs have no maximum runtime, and no published
  rate); the notice is 30 s (https://cloud.google.com/compute/docs/instances/preemptible).
- Discounts: AWS "up to 90%" off on-demand
  (https://aws.amazon.com/ec2/spot/pricing/); Google Cloud 60-91% for preemptible and Spot
  VMs (the page above). The default, 0.60, is the low end of Google's published range.

>>> p = spot_plan(checkpoint_bytes=100e9, write_bandwidth=1e9, mtbf_s=20_000, work_s=36_000)
>>> round(p.interval_s)
2000
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from memfit.errors import MemfitError

HOURS_PER_MONTH = 730.0
"""AWS's billing month (365 × 24 / 12 hours)."""

AWS_NOTICE_S = 120.0
GCP_NOTICE_S = 30.0

INTERRUPTION_BANDS: dict[str, tuple[float, float, str]] = {
    # name: (per-instance MTBF in hours, notice in seconds, what it is)
    "aws-lt5": (HOURS_PER_MONTH / -math.log(1 - 0.05), AWS_NOTICE_S,
                "AWS Spot Instance Advisor band <5% a month (upper edge 5%)"),
    "aws-5-10": (HOURS_PER_MONTH / -math.log(1 - 0.10), AWS_NOTICE_S,
                 "AWS Spot Instance Advisor band 5-10% a month (upper edge 10%)"),
    "aws-10-15": (HOURS_PER_MONTH / -math.log(1 - 0.15), AWS_NOTICE_S,
                  "AWS Spot Instance Advisor band 10-15% a month (upper edge 15%)"),
    "aws-15-20": (HOURS_PER_MONTH / -math.log(1 - 0.20), AWS_NOTICE_S,
                  "AWS Spot Instance Advisor band 15-20% a month (upper edge 20%)"),
    "aws-gt20": (HOURS_PER_MONTH / -math.log(1 - 0.20), AWS_NOTICE_S,
                 "AWS Spot Instance Advisor band >20% a month (at least 20%: MTBF at most this)"),
    "gcp-preemptible": (24.0, GCP_NOTICE_S,
                        "Google Cloud preemptible VM: stopped after 24 h at the latest"),
}
"""Named preemption rates with their sources (see the module docstring)."""

DEFAULT_BAND = "gcp-preemptible"
"""The default rate: Google Cloud's 24-hour limit, the one published bound that holds for every
instance of its kind (a preemptible VM never runs longer). The AWS bands, read as above, give
far longer MTBFs (the ">20%" band: 3,271 h), averages over a month of a whole capacity pool,
not a bound. Name yours (``--interruption``) or, better, give the MTBF you measured
(``--mtbf-hours``)."""

DEFAULT_SPOT_DISCOUNT = 0.60


@dataclass(frozen=True, kw_only=True)
class SpotPlan:
    """A job on preemptible instances: its checkpoint interval, expected time and cost."""

    checkpoint_bytes: int
    checkpoint_s: float
    """``C``: seconds to write one checkpoint."""
    mtbf_s: float
    """``M``: mean seconds between preemptions of the whole job."""
    interval_s: float
    """Young's optimum: seconds of work between checkpoints, ``√(2·C·M)``."""
    interval_daly_s: float
    """Daly's higher-order optimum (close to Young's while ``C ≪ M``)."""
    lost_per_preemption_s: float
    """Work lost per preemption: ``(τ + C)/2``, or 0 when a checkpoint on notice fits."""
    restart_s: float
    saved_on_notice: bool
    """Whether the last step and a checkpoint fit in the preemption notice."""
    work_s: float
    wall_s: float
    """Expected wall time on spot: work, checkpoints, lost work and restarts."""
    expected_preemptions: float
    on_demand_cost: float | None
    spot_cost: float | None
    """Expected cost on spot (``None`` without a price)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum checkpoint interval."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return (math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9)
            - checkpoint_s)


def band_mtbf_s(band: str, instances: int = 1) -> float:
    """The job's mean time between preemptions for a named band and ``instances`` instances."""
    if band not in INTERRUPTION_BANDS:
        raise MemfitError(f"unknown interruption band {band!r}; valid: "
                          f"{', '.join(INTERRUPTION_BANDS)} (or give the MTBF in hours)")
    _positive("instances", instances)
    return INTERRUPTION_BANDS[band][0] * 3600.0 / instances


def _positive(name: str, value: float | None) -> None:
    if value is None or isinstance(value, bool) or not (value > 0 and math.isfinite(value)):
        raise MemfitError(f"{name} must be a positive number, got {value!r}")


def spot_plan(*, checkpoint_bytes: float, write_bandwidth: float, mtbf_s: float, work_s: float,
              read_bandwidth: float | None = None, provision_s: float = 0.0,
              price_per_hour: float | None = None,
              spot_discount: float = DEFAULT_SPOT_DISCOUNT, notice_s: float | None = None,
              step_s: float | None = None) -> SpotPlan:
    """Plan a job of ``work_s`` seconds of computing on spot instances.

    ``checkpoint_bytes`` (all ranks' shards together: :func:`checkpoint_bytes`) is written at
    ``write_bandwidth`` bytes/s (the storage's aggregate rate) and read back at
    ``read_bandwidth`` (default: the write rate) after ``provision_s`` seconds of getting a new
    instance. ``mtbf_s``: mean seconds between preemptions of the job (:func:`band_mtbf_s`).
    ``price_per_hour`` (on-demand, the whole job's instances) and ``spot_discount`` (0-1) give
    the costs. With ``notice_s`` and ``step_s``, a preemption whose notice leaves time for the
    step in progress and a checkpoint loses no work.
    """
    for name, value in (("checkpoint_bytes", checkpoint_bytes),
                        ("write_bandwidth", write_bandwidth), ("mtbf_s", mtbf_s),
                        ("work_s", work_s)):
        _positive(name, value)
    if read_bandwidth is not None:
        _positive("read_bandwidth", read_bandwidth)
    if provision_s < 0:
        raise MemfitError(f"provision_s must be >= 0, got {provision_s!r}")
    if not 0 <= spot_discount < 1:
        raise MemfitError(f"spot_discount must be in [0, 1), a fraction off on-demand (0.6 = "
                          f"60% off), got {spot_discount!r}")
    if price_per_hour is not None and price_per_hour < 0:
        raise MemfitError(f"price_per_hour must be >= 0, got {price_per_hour!r}")
    checkpoint_s = checkpoint_bytes / write_bandwidth
    interval_s = math.sqrt(2 * checkpoint_s * mtbf_s)  # Young (1974)
    saved_on_notice = (notice_s is not None and step_s is not None
                       and step_s + checkpoint_s <= notice_s)
    lost = 0.0 if saved_on_notice else (interval_s + checkpoint_s) / 2
    restart_s = provision_s + checkpoint_bytes / (read_bandwidth or write_bandwidth)
    # W = work·(1 + C/τ) + (W/M)·(lost + R)
    progress = 1 - (lost + restart_s) / mtbf_s
    if progress <= 0:
        raise MemfitError(
            f"preempted every {mtbf_s:.0f} s on average, and each preemption costs "
            f"{lost + restart_s:.0f} s (lost work and restart): the job never finishes; use "
            f"faster storage, a smaller checkpoint, or instances preempted less often")
    wall_s = work_s * (1 + checkpoint_s / interval_s) / progress
    on_demand = None if price_per_hour is None else work_s / 3600 * price_per_hour
    spot = (None if price_per_hour is None
            else wall_s / 3600 * price_per_hour * (1 - spot_discount))
    return SpotPlan(checkpoint_bytes=int(checkpoint_bytes), checkpoint_s=checkpoint_s,
                    mtbf_s=mtbf_s, interval_s=interval_s,
                    interval_daly_s=daly_interval(checkpoint_s, mtbf_s),
                    lost_per_preemption_s=lost, restart_s=restart_s,
                    saved_on_notice=saved_on_notice, work_s=work_s, wall_s=wall_s,
                    expected_preemptions=wall_s / mtbf_s, on_demand_cost=on_demand,
                    spot_cost=spot)


def checkpoint_bytes(model: Any, run: Any) -> int:
    """Bytes of a resumable checkpoint of ``model`` trained as ``run`` says (a
    :class:`memfit.RunConfig`): the weights and the optimizer states (fp32 masters included)
    of one whole replica, as :func:`memfit.plan` counts them on one GPU. Gradients and
    activations are not saved."""
    import dataclasses

    from memfit.analytic.model_states import model_states
    from memfit.parallel.config import Parallel

    whole = dataclasses.replace(run, parallel=Parallel(gpus=1), offload_optimizer=False,
                                offload_params=False)
    states = model_states(model, whole)
    return states.weights + states.optimizer_states
