"""GPU timing for the suite: CUDA-graph replays timed with CUDA events, L2 flushed
between replays, and the device-copy bandwidth measured the same way in the same run.

Replaying a captured graph removes Python and launch overhead from the figure,
which is what a serving engine (vLLM, HF static cache) sees; flushing L2 keeps a
50 MB L2 from holding a whole n=1,301 operator between repetitions.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

FLUSH_BYTES = 256 * 2**20  # larger than any current L2 (H100: 50 MB, H200: 60 MB)
COPY_BYTES = 2 * 2**30  # 2 GiB: far past L2, long enough for a steady rate


class GraphTimer:
    """Times callables on CUDA as graph replays; one flush buffer and stream for the run."""

    def __init__(self, flush: bool = True):
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None

    def capture(self, fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
        """Run ``fn`` eagerly (compiles and tunes kernels outside the capture), then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph

    def replay_us(self, graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
        """Device time of each of ``reps`` replays in microseconds (L2 flushed before each)."""
        out = []
        for _ in range(reps):
            if self.flush is not None:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return out

    def median_us(self, fn: Callable[[], object], reps: int = 40) -> float:
        """Median device time of ``fn`` as a graph replay, in microseconds."""
        graph = self.capture(fn)
        try:
            return statistics.median(self.replay_us(graph, reps))
        finally:
            del graph

    def copy_bandwidth_gbps(self, nbytes: int = COPY_BYTES, reps: int = 20) -> float:
        """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
        a = torch.empty(nbytes, dtype=torch.int8, device="cuda")
        b = torch.empty_like(a)
        us = self.median_us(lambda: b.copy_(a), reps)
        return 2 * nbytes / (us * 1e3)  # the 4 GiB go back to the caching allocator on return


def time_eager_us(fn: Callable[[], object], reps: int = 5) -> float:
    """Median wall time of ``fn`` in microseconds, synchronising CUDA when present (the CPU smoke path)."""
    import time

    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
