"""Measure each rank's peak of a real data-parallel step: one process per rank over gloo (CPU).

The truth that :mod:`memfit.parallel.trace` is checked against. Every rank builds the model, applies
the layout with the same functions (``memfit.parallel.apply``) and runs the same step (the default
loss, ``backward``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``), all under the PyTorch
profiler with ``profile_memory=True`` from before the model is built, so that every byte the rank
holds is an allocator event of the session (DDP's buckets and FSDP2's sharded parameters are made
in C++ and Python constructors, out of reach of a count of live tensors). The peak is the highest
running sum of those events inside the steps (``memfit.profiling.cpu``: the same event reading as
``measure_cpu_peak``).

>>> from memfit.models import TransformerSpec
>>> case = Case(spec=tiny_spec(), batch=2, seq=32,
...             recipe=Recipe(parallel=Parallel(gpus=2, fsdp=2)))
>>> peaks = measure([case], world=2)        # doctest: +SKIP
>>> peaks[0]                                  # one peak per rank  # doctest: +SKIP
[1234567, 1234567]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _EventType

from memfit.parallel.config import Parallel
from memfit.parallel.gloo import spawn
from memfit.recipe import Recipe

STEP_MARKER = "memfit::parallel_step"
"""The profiler range around each measured step."""
PHASE_MARKER = "memfit::phase::"
"""The profiler ranges around each phase of a step: ``memfit::phase::<step>:<phase>``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One recipe on one model to measure (picklable: it travels to the rank processes): the
    :class:`memfit.Recipe` (its layout, optimizer and model-side techniques, which :func:`build`
    applies in the trace and the real ranks alike) plus what only a measurement has (the model,
    its inputs' sizes, the steps, the builder).

    Known limitations: the ranks run the recipe's model-side techniques, its optimizer and its
    layout in fp32, one micro-batch per step; a recipe that names more (mixed precision,
    offloaded states or parameters, accumulation) is refused, not measured without it."""

    spec: Any
    """A :class:`memfit.models.TransformerSpec` (built by ``backend``) or a
    :class:`memfit.models.hf_auto.HFModelSpec` (transformers builds it, e.g. DeepSeek-V3)."""
    batch: int
    """Samples per step on each rank (a pipeline layout splits them into its micro-batches)."""
    seq: int
    recipe: Recipe
    """The step: ``recipe.parallel`` is the layout (required), ``recipe.optimizer`` the
    optimizer, ``recipe.checkpointing`` (``"full"``, ``"selective"``) the checkpointing applied
    to the model's blocks (``memfit.techniques.recipe.apply_techniques``)."""
    steps: int = 2
    backend: str = "builtin"
    """The builder of :func:`memfit.models.build.build_model`: ``"builtin"`` or
    ``"transformers"`` (Hugging Face's module of the same spec)."""
    make: Callable[[], tuple[torch.nn.Module, Any]] | None = None
    """A model of your own in place of ``spec``'s: a module-level function (it travels to the
    ranks by name) returning the model (real, CPU) and its inputs; called after
    ``torch.manual_seed(0)``. ``batch`` and ``seq`` are then only labels."""

    def __post_init__(self) -> None:
        r = self.recipe
        if not isinstance(r, Recipe) or r.parallel is None:
            raise ValueError("Case(recipe=...) takes a memfit.Recipe with a layout, e.g. "
                             "Recipe(parallel=Parallel(gpus=2, fsdp=2))")
        unmeasured = [name for name, off in (
            ("precision", r.precision != "fp32"), ("accumulation", r.accumulation != 1),
            ("offload_states", r.offload_states), ("offload_params", r.offload_params),
            ("offload_gradients", r.offload_gradients)) if off]
        if unmeasured:
            raise ValueError(f"the gloo ranks do not run the recipe's {', '.join(unmeasured)}; "
                             "measure an fp32 step of one micro-batch without offload")

    @property
    def parallel(self) -> Parallel:
        """The layout: ``recipe.parallel``."""
        assert self.recipe.parallel is not None  # __post_init__
        return self.recipe.parallel


def tiny_spec(layers: int = 2) -> Any:
    """A tiny Llama-like decoder (hidden 64, 4 heads, vocab 256): a few MB per step."""
    from memfit.models import TransformerSpec

    return TransformerSpec(
        name="tiny-llama", family="llama", arch="decoder", hidden_size=64, num_layers=layers,
        num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=256,
        max_position_embeddings=512)


def tiny_moe_spec(layers: int = 2, experts: int = 4, top_k: int = 2) -> Any:
    """:func:`tiny_spec` with memfit's builtin MoE layers (``experts`` SwiGLU experts, top
    ``top_k``, capacity factor 1.0) in place of the MLPs: the case expert parallelism runs."""
    return dataclasses.replace(tiny_spec(layers), name="tiny-moe", family="mixtral",
                               num_experts=experts, experts_per_token=top_k)


def build(case: Case) -> tuple[torch.nn.Module, Any]:
    """The case's model (real, CPU, seeded) and inputs."""
    from memfit.models.build import build_model, example_inputs
    from memfit.models.hf_auto import HFModelSpec

    torch.manual_seed(0)
    if case.make is not None:
        model, inputs = case.make()
    elif isinstance(case.spec, HFModelSpec):  # a config the formulas do not cover
        model = case.spec.build(device="cpu")
        inputs = case.spec.example_inputs(case.batch, case.seq, device="cpu")
    else:
        model = build_model(case.spec, backend=case.backend, device="cpu")
        inputs = example_inputs(case.spec, batch=case.batch, seq=case.seq, device="cpu")
    from memfit.techniques.recipe import apply_techniques

    apply_techniques(model, case.recipe)
    return model, inputs


def _measure_case(case: Case) -> dict[str, int]:
    """This rank's peak bytes over the case's steps (see the module and :func:`_step_peaks`)."""
    import gc

    if case.parallel.pp > 1:
        return _measure_pipeline_case(case)

    from memfit._loss import model_loss
    from memfit._noise import quiet_profile
    from memfit.parallel.apply import apply_model, apply_optimizer, loss_context
    from memfit.trace.optim import make_optimizer

    gc.collect()
    gc.disable()
    try:
        with _gloo_lets_go(), loss_context(case.parallel), quiet_profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model, inputs = build(case)
            model = apply_model(model, case.parallel, "cpu")
            params = [p for p in model.parameters() if p.requires_grad]
            opt = apply_optimizer(make_optimizer(case.recipe.optimizer, params, cuda_target=False),
                                  case.parallel)
            for step in range(case.steps):
                with torch.profiler.record_function(STEP_MARKER):
                    with torch.profiler.record_function(f"{PHASE_MARKER}{step}:forward"):
                        loss = model_loss(model, inputs)
                    with torch.profiler.record_function(f"{PHASE_MARKER}{step}:backward"):
                        loss.backward()
                    del loss
                    with torch.profiler.record_function(f"{PHASE_MARKER}{step}:optimizer"):
                        opt.step()
                    opt.zero_grad(set_to_none=True)
            del model, opt, inputs, params
    finally:
        gc.enable()
    return _step_peaks(prof)


def _measure_pipeline_case(case: Case) -> dict[str, int]:
    """This rank's peak bytes over the case's steps of a pipeline layout: the rank's stages of
    the model (``memfit.parallel.pipeline.stage_modules``, the same split as the trace; the
    rest of the model is freed before the first step) run by the layout's schedule
    (``build_pipeline``), then the optimizer over the stages' parameters. The schedule's
    forwards and backwards interleave, so a step has two phases: ``pipeline`` and
    ``optimizer``."""
    import gc

    import torch.distributed as dist

    from memfit._noise import quiet_profile
    from memfit.parallel.apply import apply_optimizer, loss_context
    from memfit.parallel.pipeline import build_pipeline, stage_modules
    from memfit.parallel.pipeline_parallelize import apply_dp_stages, pipeline_mesh
    from memfit.trace.optim import make_optimizer

    rank = dist.get_rank()
    gc.collect()
    gc.disable()
    try:
        with _gloo_lets_go(), loss_context(case.parallel), quiet_profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model, inputs = build(case)
            modules = stage_modules(model, case.parallel, rank)
            del model
            gc.collect()  # the other stages' blocks, embedding or head: not this rank's
            group = dp_group = submods = None
            if case.parallel.tp > 1:  # TP on each stage, then FSDP2 over dp (torchtitan's order)
                from memfit.parallel.pipeline_parallelize import apply_tp_stages

                mesh = pipeline_mesh(case.parallel)
                apply_tp_stages(modules, case.parallel, mesh)
                group = mesh["pp"].get_group()
            elif case.parallel.dp > 1:  # FSDP2 / HSDP / DDP on each stage over the dp ranks
                mesh = pipeline_mesh(case.parallel)
                submods = apply_dp_stages(modules, case.parallel, mesh)
                group = mesh["pp"].get_group()
                if "dp" in (mesh.mesh_dim_names or ()):
                    dp_group = mesh["dp"].get_group()
            pipeline = build_pipeline(modules, case.parallel, case.batch, case.seq, group=group,
                                      submods=submods)
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
            opt = apply_optimizer(make_optimizer(case.recipe.optimizer, params, cuda_target=False),
                                  case.parallel, process_group=dp_group)
            for step in range(case.steps):
                with torch.profiler.record_function(STEP_MARKER):
                    with torch.profiler.record_function(f"{PHASE_MARKER}{step}:pipeline"):
                        pipeline.step(inputs)
                    with torch.profiler.record_function(f"{PHASE_MARKER}{step}:optimizer"):
                        opt.step()
                    opt.zero_grad(set_to_none=True)
            del pipeline, modules, submods, opt, inputs, params
    finally:
        gc.enable()
    return _step_peaks(prof)


GLOO_RELEASE_S = 0.002
"""How long a rank's thread waits after a functional collective's ``wait_tensor``, for gloo's
worker to let go of the work (Note: [gloo's worker lets go])."""


@contextlib.contextmanager
def _gloo_lets_go() -> Iterator[None]:
    """Inside the block, ``torch.distributed._functional_collectives.wait_tensor`` (what
    DTensor's collectives, tensor parallelism's, wait with) sleeps :data:`GLOO_RELEASE_S` once
    the collective finished, and so does ``Work.wait``; ``all_to_all_single_autograd`` (expert
    parallelism's exchange) is the module's ``all_to_all_single``, whose backward waits with
    that ``wait_tensor`` (Note: [the all-to-all's C++ wait]); restored after.

    Note: [gloo's worker lets go] The profiler records allocator events only on the threads it
    profiles, so a block freed on gloo's worker thread is never seen freed: it stays in the
    running sum for the rest of the session. A gloo work holds its tensors until its worker lets
    go of the work, after the work completed (``ProcessGroupGloo::runLoop``: the collective
    runs, the waiter wakes, and only then ``workInProgress_[workerIndex].reset()``), so a
    rank's thread that drops a collective's output before that makes the worker's release the
    free. Measured on tp2 (2 ranks on this 2-core machine): 0 to 4 blocks of 16 or 32 KiB per
    run held that way, up to 6% of the optimizer phase's high point, different each run; one
    CI run held one in all nine runs. In 4 of 18 waits the worker still held the output
    (``Tensor._use_count()`` 7, then 3) and let go within 0.2 ms of sleep. NCCL keeps no
    reference to the tensors once the collective is enqueued, which is what the trace
    models.

    Note: [the all-to-all's C++ wait] In torch 2.11 and 2.12, ``all_to_all_single_autograd``
    calls ``_c10d_functional_autograd::all_to_all_single``, a C++ autograd node
    (``torch/csrc/distributed/c10d/Functional.cpp: AllToAllSingle``) whose backward waits for
    the reverse exchange with the dispatcher's ``_c10d_functional::wait_tensor``, which the
    patch above cannot reach; torch 2.13 (pytorch#172792, "Remove custom
    _c10d_functional_autograd implementations, use redirects") made it ``all_to_all_single``,
    whose backward is Python (``_functional_collectives.py: all_to_all_single_backward``) and
    waits with the module's ``wait_tensor``. Read in the 2.11.0, 2.12.0 and 2.13.0 wheels. So
    on 2.11 each backward exchange of an expert layer could leave its input or output (each a
    ``[experts * capacity, hidden]`` buffer: 65,536 bytes in the tests' tiny MoE) to be freed
    on gloo's worker, unseen: the gloo check of pp 2 x DDP 2 x ep 2 measured 2-7% above the
    trace on 2.11, a different amount each run, and within 64 bytes on 2.13. The measurement
    runs 2.13's function on every version: on 2.11 and 2.12 ``all_to_all_single`` has the same
    Python backward (pytorch#168140, in both releases) and the same forward, and the
    exchange's blocks are the same (the gradient made contiguous, the output from
    ``new_empty``). bench/gloo_alltoall_wait.py runs 2.11's shape on the installed torch: 10
    runs on 4 ranks (torch 2.13, loaded 2-core machine) left unseen 64 KiB blocks in 16 of 40
    rank-runs without this, 3 of 40 with it (2.13's own path: 5 of 40, the 2 ms wait's rest,
    which the lowest of a role's ranks and runs removes)."""
    from torch.distributed import Work
    from torch.distributed import _functional_collectives as funcol

    wait_tensor, wait_work = funcol.wait_tensor, Work.wait
    all_to_all = funcol.all_to_all_single_autograd

    def tensor_then_let_go(tensor: torch.Tensor) -> torch.Tensor:
        out = wait_tensor(tensor)
        time.sleep(GLOO_RELEASE_S)
        return out

    def work_then_let_go(work: Any, *args: Any, **kwargs: Any) -> Any:
        out = wait_work(work, *args, **kwargs)
        time.sleep(GLOO_RELEASE_S)
        return out

    funcol.wait_tensor, Work.wait = tensor_then_let_go, work_then_let_go
    funcol.all_to_all_single_autograd = funcol.all_to_all_single
    try:
        yield
    finally:
        funcol.wait_tensor, Work.wait = wait_tensor, wait_work
        funcol.all_to_all_single_autograd = all_to_all


def _in_collective(event: Any) -> bool:
    """Whether an allocator event happened inside a ``c10d::`` op (the backend's own code)."""
    parent = event.parent
    while parent is not None:
        if parent.name.startswith("c10d::"):
            return True
        parent = parent.parent
    return False


def _step_peaks(prof: Any) -> dict[str, int]:
    """Peaks of the running sum of this session's allocator events inside the steps: of the
    blocks the step allocated itself (``peak``: the main thread, outside the process group's
    ops), of all blocks (``peak_all_threads``) and of the backend's (``backend``: allocated by
    gloo's worker threads or inside a ``c10d::`` op); ``phases``: the step's own peak inside
    each ``"<step>:forward|backward|optimizer"`` (at its allocations, as the trace's
    ``Estimate.phase_peaks``).

    Note: [gloo's own buffers] ProcessGroupGloo allocates scratch that NCCL does not:
    ``reduce_scatter_tensor`` clones its input on the calling thread and all-reduces the clone,
    which lives as long as the returned work (``torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp: ProcessGroupGloo::reduce_scatter_tensor_coalesced``; measured: an
    input-sized block inside ``c10d::_reduce_scatter_base_``); ``all_gather_into_tensor``
    gathers into a flat temporary on its worker thread (``AsyncAllgatherWork``; measured: two
    output-sized blocks). FSDP2 runs its collectives asynchronously, so whether that scratch
    overlaps the step's peak depends on thread timing: in one 4-rank run, 3 ranks of 4 held a
    reduce-scatter clone of one block at the peak and one did not. The trace models the
    collectives as NCCL runs them (into FSDP's and DDP's own buffers, no scratch), so the truth
    it is checked against is ``peak``; ``backend`` is reported beside it."""
    events: list[tuple[int, int, int, bool]] = []
    main_tid = None
    start = end = None
    allocations: list[Any] = []
    windows: dict[str, tuple[int, int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu" and fields.alloc_size != 0:
                allocations.append(event)
            continue
        if event.name.startswith(PHASE_MARKER):
            windows[event.name[len(PHASE_MARKER):]] = (event.start_time_ns, event.end_time_ns)
        if event.name == STEP_MARKER:
            main_tid = event.start_tid
            start = event.start_time_ns if start is None else min(start, event.start_time_ns)
            end = event.end_time_ns if end is None else max(end, event.end_time_ns)
        stack.extend(event.children)
    for event in allocations:
        fields = event.extra_fields
        own = event.start_tid == main_tid and not _in_collective(event)
        events.append((event.start_time_ns, fields.ptr, fields.alloc_size, own))
    events.sort(key=lambda e: e[0])
    owner: dict[int, bool] = {}  # live block address -> allocated by the step itself
    running = {True: 0, False: 0}
    peaks = {True: 0, False: 0}
    peak_all = 0
    phases: dict[str, int] = {}  # "<step>:<phase>" -> the step's own peak inside it
    for time_ns, ptr, nbytes, own in events:
        if nbytes > 0:
            owner[ptr] = own
        else:
            allocated_own = owner.pop(ptr, None)
            if allocated_own is None:
                continue  # allocated before this session
            own = allocated_own
        running[own] += nbytes
        if start <= time_ns <= end:  # type: ignore[operator]
            peaks[own] = max(peaks[own], running[own])
            peak_all = max(peak_all, running[True] + running[False])
            if own and nbytes > 0:
                for name, (lo, hi) in windows.items():
                    if lo <= time_ns <= hi:
                        phases[name] = max(phases.get(name, 0), running[True])
    return {"peak": peaks[True], "peak_all_threads": peak_all, "backend": peaks[False],
            "phases": phases}  # type: ignore[dict-item]


def _repeated(case: Case, repeats: int) -> dict[str, int]:
    """The case measured ``repeats`` times from scratch: ``peak`` is the lowest (see Note:
    [gloo's timing]), ``peak_highest`` the highest; ``backend`` and ``peak_all_threads`` the
    highest.

    Note: [gloo's timing] A gloo work object keeps views of the tensors it was given until its
    worker thread lets go of it, so a block FSDP2 has already dropped (a flat all-gather
    output) can outlive its last use by however long that thread is descheduled. On this
    shared 2-core machine, in one 4-rank run, one rank of four held the root's all-gather output
    (131,328 bytes, 5% of its peak) into the backward's peak and the other three did not; the
    Python code FSDP2 runs is the same on every rank. Running the case again and taking the
    lowest peak removes that delay, which a real rank can show (NCCL does not: it keeps no
    reference to FSDP's buffers once the collective is enqueued)."""
    runs = [_measure_case(case) for _ in range(repeats)]
    phases = {name: min(r["phases"].get(name, 0) for r in runs)  # type: ignore[union-attr]
              for name in runs[0]["phases"]}  # type: ignore[union-attr]
    return {"peak": min(r["peak"] for r in runs), "phases": phases,  # type: ignore[dict-item]
            "peak_highest": max(r["peak"] for r in runs),
            "peak_all_threads": max(r["peak_all_threads"] for r in runs),
            "backend": max(r["backend"] for r in runs)}


def lowest(a: Any, b: Any) -> Any:
    """Elementwise lowest of two measurements of the same case (dicts and lists of bytes,
    nested): what a re-measured case keeps (Note: [gloo's timing])."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: lowest(a[k], b[k]) if k in b else a[k] for k in a}
    if isinstance(a, list) and isinstance(b, list):
        return [lowest(x, y) for x, y in zip(a, b, strict=True)]
    return min(a, b)


def rank_peaks(cases: list[Case], repeats: int = 1) -> list[dict[str, int]]:
    """This rank's peaks of each case (:func:`_repeated`), inside a rank of a gloo group
    already started (:func:`memfit.parallel.gloo.spawn`): for a test's own worker that
    measures the cases and runs more in the same ranks. Its ranks' results, as
    ``[[rank0, rank1, ...] for each case]``, are :func:`measure_until`'s ``first``."""
    return [_repeated(case, repeats) for case in cases]


def _worker(rank: int, world: int, cases: list[Case], out: str, repeats: int) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(rank_peaks(cases, repeats)))


def measure(cases: list[Case], world: int, repeats: int = 3) -> list[list[dict[str, int]]]:
    """Run ``cases`` in ``world`` gloo processes (:func:`memfit.parallel.gloo.spawn`); return, per
    case, each rank's peaks over ``repeats`` runs (``peak``: the lowest of the step's own
    blocks, the truth for the trace; ``peak_highest``; ``peak_all_threads``; ``backend``:
    gloo's scratch; see :func:`_step_peaks` and :func:`_repeated`). Every case's layout must
    have ``gpus == world``."""
    for case in cases:
        if case.parallel.gpus != world:
            raise ValueError(f"case {case.parallel.describe()} needs {case.parallel.gpus} ranks, "
                             f"not {world}")
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, world, cases, out, repeats)
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def measure_until(cases: list[Case], world: int, off: Callable[[Case, list[dict[str, Any]]], bool],
                  tries: int = 3, first: list[list[dict[str, Any]]] | None = None,
                  ) -> list[list[dict[str, Any]]]:
    """:func:`measure` once, then the cases that ``off(case, measured)`` still finds off again,
    up to ``tries`` runs in all, keeping each rank's :func:`lowest` (Note: [gloo's timing]: a
    free on gloo's thread that the profiler does not see only ever adds bytes, so a lower run is
    the truer one; the tests' tolerance never loosens). ``first``: the first run's results,
    already measured (:func:`rank_peaks` in ranks that also did other work), instead of
    :func:`measure`'s."""
    results = list(first) if first is not None else measure(cases, world, repeats=1)
    for _ in range(tries - 1):
        bad = [i for i, (case, got) in enumerate(zip(cases, results, strict=True))
               if off(case, got)]
        if not bad:
            break
        again = measure([cases[i] for i in bad], world, repeats=1)
        for i, got in zip(bad, again, strict=True):
            results[i] = lowest(results[i], got)
    return results
