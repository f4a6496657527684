"""Timing on the GPU: CUDA events around one call, L2 flushed before each, median of many.

A `Job` is one benchmark cell ready to run: ``plan()`` (None for APIs without one) and
``run()`` (one launch, returns the output). `measure()` gives its first-call time
(compile/JIT included), device time, and the host time of ``plan()`` and ``run()``.
The ceilings (`copy_rate_tbs`, `matmul_tflops`) are measured the same way, in the same
process, so every ratio compares numbers from one machine at one moment.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024
# GPU cycles spun after each flush so the timed launch is queued before its start event
# fires: the measured time is the device's, not the Python wrapper's launch latency.
SPIN_CYCLES = 1_000_000
WARMUP_CALLS = 3
HOST_REPS_MAX = 20


@dataclass
class Job:
    """One cell: ``plan`` re-plans (host-timed; None when the API has none), ``run`` launches
    one call and returns its output (None: nothing to check against the other columns).
    ``plan`` must be called once before ``run``."""

    run: Callable[[], torch.Tensor | None]
    plan: Callable[[], object] | None = None
    info: Callable[[], str] | None = None  # after a run: e.g. which backend "auto" selected


def graphed(job: Job) -> Job:
    """``job`` with each run() a replay of a CUDA graph of its run(), captured at the first call
    (after two eager calls on a side stream, which compile and warm up); plan() unchanged (a
    CUDA-graph wrapper's later plan() rewrites the buffers the graph reads). The first call's time
    includes the capture."""
    graph, output = None, None

    def run():
        nonlocal graph, output
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    job.run()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                output = job.run()
            graph = captured  # kept only once captured: a failed capture is tried again, not replayed
        graph.replay()
        return output

    return Job(run=run, plan=job.plan, info=job.info)


@dataclass
class Timing:
    """Result of `measure` (times in ms, host times in us, first call in s)."""

    ms: float
    ms_all: list[float]
    first_s: float
    plan_us: float | None
    run_us: float
    output: torch.Tensor | None


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


FLUSH_MODES = ("write", "read")


class L2Flusher:
    """Evicts the L2 before each timed call, then spins the GPU.

    ``mode`` "write" (the default, ANCHORS.md's method) zeroes a 256 MB buffer: about an L2's
    worth of dirty lines stays behind, and the timed call pays for writing them back while it
    reads (H200, fa2 decode 1x32768, 134 MB of KV: 51 us against 43 with "read"). "read" sums the
    buffer instead, leaving clean lines: a cold L2 without that write-back."""

    def __init__(self, device: torch.device, nbytes: int = L2_FLUSH_BYTES, spin_cycles: int = SPIN_CYCLES,
                 mode: str = "write"):
        if mode not in FLUSH_MODES:
            raise ValueError(f"L2 flush mode {mode!r}: valid: {', '.join(FLUSH_MODES)}")
        if nbytes <= 0 or nbytes % 8:
            raise ValueError(f"L2 flush nbytes={nbytes}: must be a positive multiple of 8 (read sums int64 words)")
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.spin_cycles = spin_cycles
        self.mode = mode

    def __call__(self) -> None:
        if self.mode == "write":
            self.buffer.zero_()
        else:
            self.buffer.view(torch.int64).sum()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)


def device_times_ms(fn: Callable[[], object], reps: int, flush: L2Flusher | None) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``, one event pair around each call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_time_us(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of the Python call itself (no sync inside the timed region; the
    device is drained between calls so the launch queue never fills)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return median(times)


def measure(job: Job, reps: int, flush: L2Flusher | None) -> Timing:
    """First call (plan + run, synchronized), warm-up, then device and host timings."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if job.plan is not None:
        job.plan()
    out = job.run()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(WARMUP_CALLS):
        job.run()
    torch.cuda.synchronize()
    ms_all = device_times_ms(job.run, reps, flush)
    host_reps = min(reps, HOST_REPS_MAX)
    plan_us = host_time_us(job.plan, host_reps) if job.plan is not None else None
    run_us = host_time_us(job.run, host_reps)
    return Timing(median(ms_all), ms_all, first_s, plan_us, run_us, out)


def copy_rate_tbs(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = median(device_times_ms(lambda: dst.copy_(src), reps, None))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """bf16 n x n x n matmul rate through PyTorch, in TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    ms = median(device_times_ms(lambda: torch.matmul(a, b, out=c), reps, None))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 (inf when out has NaN/inf or the shapes differ)."""
    if out.shape != ref.shape:
        return float("inf")
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
