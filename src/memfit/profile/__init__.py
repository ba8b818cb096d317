"""Measure the memory a real step uses, independently of the trace engine.

``measure_cpu_peak`` reads the PyTorch profiler's allocator events on CPU; it is the reference the
trace engine's CPU accuracy is tested against.
"""

from memfit.profile.cpu import CpuPeak, live_bytes, measure_cpu_peak

__all__ = ["CpuPeak", "live_bytes", "measure_cpu_peak"]
