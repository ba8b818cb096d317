"""The torch and transformers internals memfit relies on (memfit/_compat): each still behaves as
memfit assumes, and no private torch name is used outside the adapters' register.

Each assertion names the internal and what changed, so that a torch or transformers upgrade that
breaks one fails here, loudly, rather than as a wrong prediction elsewhere. Sources: the
docstrings in memfit/_compat/torch_internals.py (torch/autograd/graph.py:
_engine_run_backward; torch/utils/checkpoint.py: CheckpointFunction.forward and
_checkpoint_without_reentrant_generator; torch/_subclasses/fake_impls.py:
op_implementations_checks; torch/csrc/autograd/input_buffer.cpp: can_accumulate_inplace) and
memfit/_compat/transformers_internals.py (transformers/utils/import_utils.py: is_fake_tensor,
is_tracing).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit._compat import torch_dtensor, torch_fsdp, torch_pipelining
from memfit._compat import torch_internals as ti
from memfit._compat import transformers_internals as tfi

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"
HERE = Path(__file__).name
aten = torch.ops.aten


# -- the register ------------------------------------------------------------------------------


def test_every_registered_private_torch_name_exists() -> None:
    missing = []
    for module, names in ti.PRIVATE_NAMES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"module {module} ({exc})")
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    assert not missing, (f"torch {torch.__version__} no longer has {', '.join(missing)}, which "
                         "memfit uses (memfit/_compat/torch_internals.py: PRIVATE_NAMES): find "
                         "what replaced it and update the adapter")


def test_an_allocator_settings_setter_exists() -> None:
    setter = ti.allocator_settings_setter()
    assert callable(setter), (
        f"torch {torch.__version__} has neither torch._C._accelerator_setAllocatorSettings nor "
        "torch._C._cuda_cudaCachingAllocator_set_allocator_settings: configure_allocator cannot "
        "change the caching allocator at run time; see torch.cuda.memory._set_allocator_settings")


def test_cublas_workspaces_can_be_cleared_on_cuda_builds() -> None:
    if torch.version.cuda is None:
        ti.clear_cublas_workspaces()  # a no-op on builds without CUDA: must not raise
        pytest.skip("torch._C._cuda_clearCublasWorkspaces exists only on CUDA builds")
    assert hasattr(torch._C, "_cuda_clearCublasWorkspaces"), (
        f"torch {torch.__version__} (CUDA build) has no torch._C._cuda_clearCublasWorkspaces: "
        "validate's reset between configurations would keep cuBLAS workspaces")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _private(chain: str) -> bool:
    parts = chain.split(".")
    return (parts[0] in ("torch", "nn") and parts[:2] != ["torch", "ops"]
            and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]))


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    uses: list[tuple[int, str]] = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            uses += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
            if chain:
                uses.append((node.lineno, chain))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base = _dotted(node.args[0])
            if base:
                uses.append((node.lineno, f"{base}.{node.args[1].value}"))
    return [(line, chain) for line, chain in uses if _private(chain)]


def _registered(chain: str) -> bool:
    chain = chain.replace("nn.modules.", "torch.nn.modules.", 1) if chain.startswith("nn.") \
        else chain
    known = {f"{m}.{n}" for m, names in ti.PRIVATE_NAMES.items() for n in names}
    known |= set(ti.OPTIONAL_NAMES)
    parts = chain.split(".")
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    # a registered name, something reached through one, or a registered module itself
    return bool(prefixes & known) or chain in ti.PRIVATE_NAMES or chain in {
        m.rsplit(".", 1)[0] for m in known}


def test_no_private_torch_name_is_used_outside_the_register() -> None:
    unregistered = []
    for path in sorted(SRC.rglob("*.py")):
        if "_compat" in path.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        unregistered += [f"{path.relative_to(SRC.parent)}:{line}: {chain}"
                         for line, chain in _private_uses(tree) if not _registered(chain)]
    assert not unregistered, (
        "private torch names used outside memfit/_compat and missing from its register:\n  "
        + "\n  ".join(unregistered) + "\nwrap each in memfit/_compat/torch_internals.py (a "
        "docstring naming the internal, the torch versions checked and the source it mirrors) "
        "or add it to PRIVATE_NAMES, with a test here")


def test_the_scan_sees_private_names() -> None:
    # the scan itself must be able to fail
    tree = ast.parse("import torch\nx = torch._C._made_up(1)\nfrom torch._foo import bar\n"
                     "y = getattr(torch._C, '_other', None)\nz = torch.ops.aten._softmax\n")
    chains = {chain for _, chain in _private_uses(tree)}
    assert chains == {"torch._C._made_up", "torch._foo.bar", "torch._C._other", "torch._C"}
    assert not any(_registered(c) for c in ("torch._C._made_up", "torch._foo.bar",
                                            "torch._C._other"))


# -- the frame walk ------------------------------------------------------------------------------

# User code lives in its own "file", so that the walk (which skips this test file's dispatch
# code) stops at it, as it stops at a user's model in a real trace.
_USER = compile('''
class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.mul(2)  # an op called by Python code inside a backward


def step(x):
    y = x * 3 + x.sin()    # x feeds two ops: the engine sums their gradients (aten.add)
    Twice.apply(y).sum().backward()
''', "user_step.py", "exec")


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append((func, ti.called_by_autograd_engine((HERE,))))
        return func(*args, **(kwargs or {}))


class _FakeSeen(FakeTensorMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append((func, ti.called_by_autograd_engine((HERE,))))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("mode", [_Seen, _FakeSeen])
def test_the_frame_walk_finds_the_autograd_engine(mode: type) -> None:
    user: dict[str, Any] = {"torch": torch}
    exec(_USER, user)
    x0 = torch.randn(4)
    with mode() as m:
        x = x0.clone().requires_grad_() if mode is _Seen else \
            m.from_tensor(x0).requires_grad_()  # type: ignore[attr-defined]
        user["step"](x)
    seen = m.seen
    by_engine = {f for f, e in seen if e}
    by_python = {f for f, e in seen if not e}
    assert aten.add.Tensor in by_engine, (
        f"torch {torch.__version__}: the autograd engine's gradient accumulation (aten.add) was "
        f"not recognised as called by the engine: the Python frame above the engine is no longer "
        f"{ti.ENGINE_FRAME} (torch/autograd/graph.py) or new dispatch frames sit between; "
        f"frames seen: {seen}")
    assert aten.cos.default in by_engine, "sin's backward (a C++ autograd node) not recognised"
    forward_ops = {aten.mul.Tensor, aten.sin.default}
    assert forward_ops <= by_python, f"forward ops taken for the engine's: {seen}"
    python_backward = [f for f, e in seen if f is aten.mul.Tensor and not e]
    assert len(python_backward) >= 3, (
        f"g.mul(2) in a Python backward must count as Python code, not the engine's: {seen}")


# -- patches ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_reports_its_cpu_rng_state(use_reentrant: bool) -> None:
    original = torch.get_rng_state
    states: list[torch.Tensor] = []
    x = torch.randn(3, requires_grad=True)
    with ti.reporting_get_rng_state(states.append):
        y = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=use_reentrant)
    y.sum().backward()
    assert torch.get_rng_state is original, "torch.get_rng_state not restored after the context"
    assert len(states) == 1 and states[0].dtype == torch.uint8, (
        f"torch {torch.__version__}: torch.utils.checkpoint (use_reentrant={use_reentrant}) no "
        f"longer saves the CPU RNG state through torch.get_rng_state() (saw {len(states)} "
        "calls); memfit would miss the saved state's bytes (trace/fake_rules.py: "
        "_count_cpu_rng_states)")


def test_get_rng_state_is_restored_after_an_error() -> None:
    original = torch.get_rng_state
    with pytest.raises(ValueError), ti.reporting_get_rng_state(lambda s: None):
        assert torch.get_rng_state is not original
        raise ValueError
    assert torch.get_rng_state is original


class _Sentinel(Exception):
    pass


def test_a_fake_op_rule_runs_first_and_is_removed() -> None:
    def rule(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Sentinel

    op = aten._grouped_mm.default
    a, b = torch.randn(4, 16), torch.randn(2, 16, 8)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    from torch._subclasses import fake_impls

    before = list(fake_impls.op_implementations_checks)
    with ti.fake_op_rule({op}, rule), FakeTensorMode() as mode, pytest.raises(_Sentinel):
        torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offs))
    assert fake_impls.op_implementations_checks == before, (
        "fake_op_rule left its entry in torch._subclasses.fake_impls.op_implementations_checks")


def test_fake_op_rules_are_consulted_by_fake_tensor_dispatch() -> None:
    # FakeTensorMode must still scan op_implementations_checks (fake_tensor.py: _dispatch_impl)
    def rule(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Sentinel

    op = aten.special_modified_bessel_k0.default
    x = torch.randn(3)
    try:
        with ti.fake_op_rule({op}, rule), FakeTensorMode() as mode:
            torch.special.modified_bessel_k0(mode.from_tensor(x))
    except _Sentinel:
        return
    pytest.fail(f"torch {torch.__version__}: FakeTensorMode no longer consults "
                "torch._subclasses.fake_impls.op_implementations_checks; memfit's fake rule for "
                "aten._grouped_mm (trace/fake_rules.py: grouped_mm_rule) would be ignored")


# -- calls -----------------------------------------------------------------------------------------


def test_storage_use_count_counts_views() -> None:
    x = torch.empty(4)
    fresh = ti.storage_use_count(x)
    assert fresh == 2, (
        f"torch {torch.__version__}: a fresh tensor's storage use count is {fresh}, not 2 (the "
        "tensor plus its Python storage object); trace/grad_accumulation.py: _accumulates_in_place "
        "assumes 2 means 'only one tensor'")
    view = x[1:]
    assert ti.storage_use_count(x) == fresh + 1, "a view must add one reference to the storage"
    del view
    assert ti.storage_use_count(x) == fresh


def test_disable_torch_function_hides_modes() -> None:
    calls: list[Any] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.add(torch.ones(1), 1)
        seen = len(calls)
        with ti.DisableTorchFunction():
            torch.add(torch.ones(1), 1)
    assert seen > 0 and len(calls) == seen, (
        "torch._C.DisableTorchFunction() no longer hides torch-function modes")


def test_flatten_and_unflatten_dense_tensors_round_trip() -> None:
    ts = [torch.arange(3.0), torch.arange(4.0).view(2, 2)]
    flat = ti.flatten_dense_tensors(ts)
    assert flat.tolist() == [0, 1, 2, 0, 1, 2, 3]
    back = ti.unflatten_dense_tensors(flat, ts)
    assert all(torch.equal(a, b) for a, b in zip(back, ts, strict=True))


def test_norm_layers() -> None:
    assert ti.is_norm_layer(nn.BatchNorm1d(3)) and ti.is_norm_layer(nn.InstanceNorm2d(3))
    assert not ti.is_norm_layer(nn.LayerNorm(3))
    assert {"running_mean", "running_var", "num_batches_tracked"} <= dict(
        nn.BatchNorm1d(3).named_buffers()).keys()


def test_current_graph_task_id_tells_backward() -> None:
    task_id = ti.current_graph_task_id()
    assert task_id is not None, "torch._C._current_graph_task_id is gone (profiling/session.py)"
    inside: list[int] = []
    x = torch.randn(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(task_id()))
    y.sum().backward()
    assert task_id() == -1 and inside and inside[0] != -1, (
        "torch._C._current_graph_task_id no longer returns -1 outside a backward and a task id "
        "inside one")


def test_sdp_priority_order_follows_sdpa_kernel() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = ti.sdp_priority_order()
    assert order is not None, "torch._C._get_sdp_priority_order is gone (trace/sdpa.py)"
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        changed = ti.sdp_priority_order()
    assert changed is not None and changed[:2] == [int(SDPBackend.MATH.value),
                                                   int(SDPBackend.FLASH_ATTENTION.value)], (
        f"torch._C._get_sdp_priority_order() gave {changed} after sdpa_kernel([MATH, FLASH], "
        "set_priority=True); trace/sdpa.py: priority_order reads it as SDPBackend values")
    assert ti.sdp_priority_order() == order


# -- transformers ----------------------------------------------------------------------------------


def test_transformers_treats_fake_tensors_as_eager_inside_the_context() -> None:
    import_utils = pytest.importorskip(tfi.IMPORT_UTILS)
    masking_utils = importlib.import_module("transformers.masking_utils")
    assert hasattr(import_utils, "is_fake_tensor"), (
        f"{tfi.IMPORT_UTILS}.is_fake_tensor is gone: see how transformers now detects fake "
        "tensors (is_tracing) and update memfit/_compat/transformers_internals.py")
    assert masking_utils.is_tracing is import_utils.is_tracing, (
        "transformers.masking_utils no longer uses import_utils.is_tracing")
    original = import_utils.is_fake_tensor
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2, 3))
    assert import_utils.is_tracing(fake), (
        "transformers no longer treats a FakeTensor as tracing: the patch may be unneeded")
    with tfi.fake_tensors_look_eager():
        assert not import_utils.is_tracing(fake), (
            f"patching {tfi.IMPORT_UTILS}.is_fake_tensor no longer reaches is_tracing "
            "(does it bind is_fake_tensor another way now?)")
    assert import_utils.is_fake_tensor is original, "is_fake_tensor not restored"
    with pytest.raises(ValueError), tfi.fake_tensors_look_eager():
        raise ValueError
    assert import_utils.is_fake_tensor is original, "is_fake_tensor not restored after an error"


def test_has_dispatch_kernel_reads_the_dispatcher() -> None:
    """``has_dispatch_kernel`` answers from the dispatcher: ``aten::mm`` has a CPU kernel and an
    AutocastCUDA one (``autocast_mode.cpp``, lower_precision_fp, every build registers it),
    ``aten::add.Tensor`` has no AutocastCUDA kernel, and an op that does not exist is False."""
    assert ti.has_dispatch_kernel("aten::mm", "CPU")
    assert ti.has_dispatch_kernel("aten::mm", "AutocastCUDA")
    assert not ti.has_dispatch_kernel("aten::add.Tensor", "AutocastCUDA")
    assert not ti.has_dispatch_kernel("aten::no_such_op_memfit", "AutocastCUDA")


# -- the patches of a rank traced over a fake process group (memfit/parallel) -----------------

def test_storage_resizes_are_reported_and_the_method_restored() -> None:
    original = torch.UntypedStorage.resize_
    st = torch.empty(4).untyped_storage()
    seen: list[tuple[int, int]] = []
    with torch_fsdp.storage_resizes_reported(lambda s, size: seen.append((s.nbytes(), size))):
        st.resize_(0)
        st.resize_(32)
    assert seen == [(0, 0), (32, 32)], (
        "torch.UntypedStorage.resize_ no longer goes through the Python attribute memfit "
        "replaces: FSDP2's all-gather frees would be invisible to the parallel trace")
    assert torch.UntypedStorage.resize_ is original


@pytest.fixture
def fake_world_of_two():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("fake", store=ti.fake_store(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_device_meshes_made_real_inside_a_fake_mode(fake_world_of_two) -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    with FakeTensorMode(), torch_dtensor.device_meshes_made_real():
        mesh = DeviceMesh("cpu", [0, 1])
    assert not isinstance(mesh.mesh, FakeTensor), (
        "DeviceMesh.__init__ made its rank map inside the fake mode: "
        "device_meshes_made_real no longer reaches the mesh's constructor")
    assert list(mesh.get_coordinate() or ()) == [0]
    assert DeviceMesh.__init__ is original


def test_p2p_works_hold_their_tensors(fake_world_of_two) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p
    t = torch.ones(3)
    with torch_pipelining.p2p_works_hold_their_tensors():
        works = schedules._batch_p2p([dist.P2POp(dist.isend, t, 1)])
    assert works and all(any(x is t for x in w._tensors) for w in works), (
        "torch.distributed.pipelining.schedules._batch_p2p's works no longer carry the sent "
        "tensor: a schedule's send would free its activations early in the trace")
    for w in works:
        w.wait()
    assert schedules._batch_p2p is original


def test_autograd_backward_keeps_function_modes() -> None:
    """A torch-function mode sees ``torch.autograd.backward`` itself (and runs it with the mode
    popped); inside the context the call enters the engine with the mode still on top."""
    seen: list[Any] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    original = torch.autograd.backward
    w = torch.ones(2, requires_grad=True)
    with Record():
        torch.autograd.backward((w * 2).sum())
    assert torch.autograd.backward in seen  # the premise: the mode intercepts the call
    seen.clear()
    w.grad = None
    with Record(), torch_pipelining.autograd_backward_keeps_function_modes():
        torch.autograd.backward((w * 3).sum())
    assert torch.autograd.backward not in seen and torch.equal(w.grad, torch.full((2,), 3.0))
    assert torch.autograd.backward is original


def test_the_schedule_patches_are_restored() -> None:
    """``stage_chunks_within`` runs each stage's chunks inside the contexts given and
    ``warmup_vote_static`` answers the vote; both leave the stage and the schedule as they were
    (their own methods, from the class) on exit, also after an error."""
    import contextlib

    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining._utils import InferenceMode

    class Stage:
        def forward_one_chunk(self, x: int) -> tuple[str, int]:
            return "forward", x

        def backward_one_chunk(self, x: int) -> tuple[str, int]:
            return "backward", x

    class Schedule:
        def __init__(self) -> None:
            self._stage = Stage()

        def _warmup_p2p(self, stages: Any, has_backward: bool, p2p_done: bool) -> None:
            raise AssertionError("the real vote ran")

    seen: list[str] = []

    def inside(name: str) -> Any:
        @contextlib.contextmanager
        def context() -> Any:
            seen.append(f"{name} in")
            yield
            seen.append(f"{name} out")
        return context

    schedule = Schedule()
    stage = schedule._stage
    with torch_pipelining.stage_chunks_within(schedule, inside("fwd"), inside("bwd")):
        assert stage.forward_one_chunk(1) == ("forward", 1)
        assert stage.backward_one_chunk(2) == ("backward", 2)
    assert seen == ["fwd in", "fwd out", "bwd in", "bwd out"]
    assert "forward_one_chunk" not in vars(stage) and "backward_one_chunk" not in vars(stage)
    with pytest.raises(ValueError), torch_pipelining.warmup_vote_static(schedule):
        schedule._warmup_p2p([stage], True, False)
        assert stage._inference_mode == InferenceMode.STATIC  # type: ignore[attr-defined]
        raise ValueError
    assert "_warmup_p2p" not in vars(schedule)
