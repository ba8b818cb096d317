"""Silence third-party noise inside memfit's own runs, restoring everything on exit.

Two sources print on every ``memfit validate --device cpu`` / trace on a CPU target with
torch 2.13 (checked on this machine: 12 lines for 2 configs, 159 in the issue's run):

- **Kineto's profiler_start / profiler_stop lines** (``USDT:... SyncActivityProfilerHandler.cpp:52]
  profiler_start``), written by C++ to file descriptor 2 each time a ``torch.profiler.profile``
  starts or stops. Source (pytorch/kineto): ``libkineto/src/SyncActivityProfilerHandler.cpp:
  startTrace / stopTrace`` call ``USDT_EMIT_START_TRACE()`` / ``USDT_EMIT_STOP_TRACE()``
  (``libkineto/src/Logger.h``), logged at severity ``LoggerOutputType::USDT = 5``
  (``libkineto/include/ILoggerObserver.h``), above the ``ERROR = 4`` that
  ``suppressLibkinetoLogMessages`` (``libkineto/src/init.cpp``) sets, so they print even when
  kineto's other messages are suppressed. ``KINETO_LOG_LEVEL=6`` hides them, but kineto reads it
  once, in ``libkineto_init`` (``init.cpp``), when the first profiler starts in the process
  (measured: setting it later has no effect), and it would also hide kineto's real errors for
  the rest of the user's process. So memfit redirects fd 2 to /dev/null only around the
  profiler's ``start()`` and ``stop()`` calls (:func:`quiet_profile`), not around the profiled
  code, and holds its own progress display still meanwhile.
- **Import-time log records of optional dependencies**: ``import torchao`` (0.18) logs
  ``Failed to load ..._C_mxfp8...so`` on logger ``torchao`` (``torchao/__init__.py``, a
  ``logger.warning`` per extension it cannot load) and makes torch log
  ``<enum 'KernelPreference'> is an Enum subclass ...`` on ``torch.utils._pytree``
  (``torch/utils/_pytree.py: register_constant``); bitsandbytes logs ``Failed to load CPU
  gemm_4bit_forward from kernels-community`` on AVX-512-bf16 CPUs
  (``bitsandbytes/backends/cpu/ops.py``). :func:`quiet_import` raises those loggers to ERROR
  and ignores warnings while memfit imports them, then restores the levels and filters.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from memfit.errors import MemfitError

__all__ = ["quiet_fd2", "quiet_import", "quiet_imports", "quiet_loggers", "quiet_profile"]

_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


@contextlib.contextmanager
def quiet_fd2() -> Iterator[None]:
    """File descriptor 2 (C/C++ stderr) goes to /dev/null inside the block, then is restored.

    The progress display is held still meanwhile: a frame drawn into /dev/null would leave the
    terminal out of step with what rich believes it drew."""
    from memfit.progress import paused

    fd = 2  # where C++ writes (std::cerr, stderr), whatever Python's sys.stderr is now
    with paused():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.flush()
        try:
            saved = os.dup(fd)
        except OSError:  # fd 2 closed: nothing to silence
            yield
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(devnull)


@contextlib.contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[Any]:
    """``torch.profiler.profile(**kwargs)`` without kineto's start/stop lines on stderr.

    >>> with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    ...     run()
    """
    from torch.profiler import profile

    prof = profile(**kwargs)
    with quiet_fd2():
        prof.__enter__()
    try:
        yield prof
    except BaseException:
        with quiet_fd2():
            prof.__exit__(*sys.exc_info())
        raise
    else:
        with quiet_fd2():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def quiet_loggers() -> Iterator[None]:
    """The optional dependencies' import-time loggers (torchao, torch.utils._pytree,
    bitsandbytes) at ERROR inside the block, restored after. The CLI runs each command inside
    it: transformers imports torchao when it builds a model (``transformers/quantizers/auto.py``
    imports ``quantizer_torchao``), deep inside memfit's model building."""
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.ERROR))
    hf = logging.getLogger("transformers.modeling_utils")
    hf.addFilter(_drop_default_loss_notice)
    try:
        yield
    finally:
        hf.removeFilter(_drop_default_loss_notice)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _drop_default_loss_notice(record: logging.LogRecord) -> bool:
    """transformers logs "`loss_type=None` was set in the config but it is unrecognized. Using
    the default loss" the first time a model built from a config (``loss_type`` unset) computes
    its loss (``transformers/modeling_utils.py: PreTrainedModel.loss_function``): every model
    memfit builds from a preset. Only that record is dropped; the logger's others pass."""
    return "was set in the config but it is unrecognized" not in record.getMessage()


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """:func:`quiet_loggers`, and warnings ignored: around memfit's imports of optional
    dependencies."""
    with warnings.catch_warnings(), quiet_loggers():
        warnings.simplefilter("ignore")
        yield


def quiet_import(module: str) -> Any:
    """``importlib.import_module(module)`` inside :func:`quiet_imports`."""
    with quiet_imports():
        return importlib.import_module(module)


def require(module: str, extra: str, what: str) -> Any:
    """Import an optional dependency, or say in one line which extra installs it.

    >>> bnb = require("bitsandbytes", "bnb", "optimizer 'adamw-8bit'")
    """
    try:
        return quiet_import(module)  # without torchao's import-time log lines
    except ImportError:
        raise MemfitError(f"{what} needs {module.split('.')[0]}, which is not installed; run "
                          f"pip install 'memfit[{extra}]'") from None
