"""Measure the memory a real step uses, independently of the trace engine.

``profile()`` records a real run by category, module and tensor (CPU and CUDA);
``measure_cpu_peak`` reads the PyTorch profiler's allocator events on CPU and is the reference
the trace engine's CPU accuracy is tested against.
"""

from memfit.profiling.cpu import CpuPeak, live_bytes, measure_cpu_peak
from memfit.profiling.result import MeasuredPoint, ModuleUsage, ProfileResult, TensorRecord
from memfit.profiling.session import Profiler, profile

__all__ = ["CpuPeak", "MeasuredPoint", "ModuleUsage", "ProfileResult", "Profiler",
           "TensorRecord", "live_bytes", "measure_cpu_peak", "profile"]
