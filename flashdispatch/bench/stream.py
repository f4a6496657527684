"""``hw:stream`` (``bench decode --stream``): a plain streaming read of each row's own KV cache.

What would a kernel that only reads the row's bytes take, timed the same way (same L2 flush,
same events)? A Triton kernel sums the cache as int32 words, each program one contiguous slice,
with or without an L2 eviction hint on its loads, whichever is faster (picked per row by a short
calibration under the run's flush); ``x stream`` in the detail table is each cell's rate over it.

It is a reference point, not an upper bound. Its loads are plain (``ld.global``), which can
carry an L2 ``evict_first`` hint: under the write flush that hint keeps the flush's dirty lines
in L2 and their write-back out of the timed call (H200, 1x32768: 37 us of kernel with it, 49
without). The decode kernels load through cp.async pipelines, which cannot carry the hint in
Triton 3.6 and read large rows faster than this stream does (H200: 4.39 TB/s against 4.18 at
256x4096). See docs/perf-notes.md, session 13.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .matrix import Column
from .timing import Job, L2Flusher, device_times_ms, median

STREAM_COLUMN = "hw:stream"
_BLOCK = 2048  # int32 words per load (8 KB)
_UNROLL = 4  # loads in flight per program and step
_PROGRAMS_PER_SM = 4
CALIBRATION_REPS = 10


@triton.jit
def stream_sum_kernel(x_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                      EVICT: tl.constexpr):
    """Program p: the int32 (wrapping) sum of ``x[p * per_program:][:per_program]`` (within n)
    into ``out[p]``."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    end = tl.minimum(start + per_program, n)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(start, end, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = i + u * BLOCK + offs
            acc += tl.load(x_ptr + o, mask=o < end, other=0, eviction_policy=EVICT)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


# The L2 eviction hint of the loads ("" none); the hint-free loop is the same code at any
# num_stages (no cp.async for a loop without a dot), so the hint is the only style to choose.
STYLES = ("evict_first", "")


def style_label(evict: str) -> str:
    return f"{evict or 'no'} L2 hint"


def stream_words(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as a flat int32 view (ValueError unless contiguous and 4-byte sized)."""
    if not cache.is_contiguous():
        raise ValueError("stream read: the cache must be contiguous")
    flat = cache.view(-1).view(torch.uint8)
    if flat.numel() % 4:
        raise ValueError(f"stream read: {flat.numel()} bytes is not a whole number of int32 words")
    return flat.view(torch.int32)


def stream_launch(words: torch.Tensor, programs: int, evict: str):
    """A function that launches one streaming read of ``words`` on ``programs`` programs, loads
    with the L2 eviction hint ``evict``, and returns the per-program sums (``int32 [programs]``,
    reused between calls)."""
    if programs <= 0:
        raise ValueError(f"stream read: programs={programs} must be positive")
    n = words.numel()
    step = _BLOCK * _UNROLL
    per_program = step * max(1, -(-n // (programs * step)))  # whole steps, every word covered
    out = torch.zeros(programs, dtype=torch.int32, device=words.device)

    def launch():
        stream_sum_kernel[(programs,)](words, out, n, per_program, BLOCK=_BLOCK, UNROLL=_UNROLL,
                                       EVICT=evict, num_warps=4, num_stages=1)
        return out

    return launch


def stream_column(flush_mode: str) -> Column:
    """The ``hw:stream`` column: the fastest of `STYLES` on the row's cache,
    picked by `CALIBRATION_REPS` timed calls each under ``flush_mode``. Its job returns None
    (no attention output to check)."""

    def build(data) -> Job:
        words = stream_words(data.cache)
        device = words.device
        programs = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        flush = L2Flusher(device, mode=flush_mode)
        timed = []
        for evict in STYLES:
            launch = stream_launch(words, programs, evict)
            launch()
            timed.append((median(device_times_ms(launch, CALIBRATION_REPS, flush)), evict, launch))
        del flush
        _, evict, launch = min(timed, key=lambda t: t[0])

        def run():
            launch()

        return Job(run=run, info=lambda: f"{style_label(evict)}, {programs} programs")

    return Column(STREAM_COLUMN, build)
