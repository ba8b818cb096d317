"""Suite-wide: the header of every run names the machine, so that a suite time is never quoted
without the CPU model and instruction set it was measured on (CI machines differ: Intel or AMD,
AVX-512 or AVX2 only)."""

from __future__ import annotations

import gc
import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """``AMD EPYC, 2 cores, ATen AVX512, oneDNN max ISA (unset)``: the CPU, its core count, and
    the instruction set the kernels use (``torch.backends.cpu.get_cpu_capability`` follows
    ``ATEN_CPU_CAPABILITY``)."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "(unset)")
    return (f"{_cpu_model()}, {os.cpu_count()} cores, ATen {isa}, oneDNN max ISA {onednn}, "
            f"torch {torch.__version__}")


def pytest_configure(config):
    """The kernel-scratch cache (``memfit.trace.kernel_cache``) in a directory of this run's own,
    unless the caller chose one: the suite neither reads nor fills the user's
    ``~/.cache/memfit``, and every run measures its kernels afresh, as CI's clean machine does.
    Subprocesses (the CLI tests) inherit it."""
    if "MEMFIT_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-cache-")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # pytest-xdist: the cores shared out between the workers (two workers of two intra-op
        # threads each on two cores oversubscribe OpenMP, whose spinning threads then wait on
        # each other). Before collection: tests that size their cases by the thread count set
        # their own (tests/trace/test_cpu_kernels_reduced.py).
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if not hasattr(config, "workerinput"):  # once, in the controlling process
        _compile_sources()


def _compile_sources() -> None:
    """Byte-compile memfit and the tests before any test runs. Where ``PYTHONDONTWRITEBYTECODE``
    is set (these machines set it), no process writes a ``.pyc``, so each of the suite's
    processes (the gloo ranks spawned with ``-B``, the CLI subprocesses) compiled memfit's
    source again: 23% of the user CPU of ``tests/parallel/test_parallel_ep.py`` (184 s without,
    141 s with, a 2-core Xeon). ``compileall`` writes them whatever the flag; stale ones are
    recompiled by their timestamps."""
    import compileall
    from pathlib import Path

    import memfit

    for folder in (Path(memfit.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(str(folder), quiet=1, workers=0)


def pytest_collection_finish(session):
    """Everything alive once the tests are collected (torch, transformers and the other imported
    modules: a million objects or more) moves to the collector's permanent generation
    (``gc.freeze``). The tests collect garbage before every measured run
    (``memfit.profiling.cpu.measure_cpu_peak``, the batch-size finder's trials, the techniques
    bench's rows), and a full collection walks every tracked object: 0.47 s each with those
    modules imported (the bench's --quick run, cProfile). Frozen objects are alive, so the
    collections free the same garbage, faster; what the tests make is collected as before.
    ``mark_process_frozen`` spares each trace the count of those objects (``frozen_heap``)."""
    from memfit.trace.heap import mark_process_frozen

    gc.collect()
    gc.freeze()
    mark_process_frozen()


def pytest_runtest_setup(item):
    """Before each test (the last test's function fixtures are torn down by then), what is
    alive moves to the permanent generation too, as after the collection. The caches and
    lazily imported modules the tests fill (the trace's templates, transformers' model modules,
    torch's) grew the collector's heap by 200,000 objects and more a test file, and every full
    collection walked them all: 0.16 s a collection after tests/techniques/test_tech_optim.py,
    0.33 s after test_fit.py, 0.59 s on average over the 155 collections of a six-file run
    (``measure_cpu_peak`` and the batch-size finder collect before each measured step: 91 of
    its 360 profiled seconds). Here each collection walks what one test made: test_tech_optim,
    test_batch_size and test_fit took 53 s instead of 74 (one process, a 2-core Xeon). The
    previous test's own garbage is collected first; garbage that frozen objects make later
    (a module fixture's reference cycles, once its module ends) stays until the worker exits."""
    gc.collect()
    gc.freeze()


def pytest_report_header(config):
    return f"machine: {machine_line()}"
