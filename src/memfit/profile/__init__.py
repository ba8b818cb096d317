"""Measure the memory a real step uses, independently of the trace engine.

``profile()`` records a real run by category, module and tensor (CPU and CUDA);
``measure_cpu_peak`` reads the PyTorch profiler's allocator events on CPU and is the reference
the trace engine's CPU accuracy is tested against.
"""

from memfit.profile.cpu import CpuPeak, live_bytes, measure_cpu_peak
from memfit.profile.result import MeasuredPoint, ModuleUsage, ProfileResult, TensorRecord
from memfit.profile.session import Profiler, profile

__all__ = ["CpuPeak", "MeasuredPoint", "ModuleUsage", "ProfileResult", "Profiler",
           "TensorRecord", "live_bytes", "measure_cpu_peak", "profile"]
