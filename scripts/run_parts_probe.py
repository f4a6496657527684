"""Where a decode run()'s host time goes: parts of our run() timed behind a busy kernel, beside
FlashInfer's run() (a probe for docs/perf-notes.md, not a benchmark).

    source .whl/device_setup.sh && python scripts/run_parts_probe.py --shapes 1x32768,256x1024 --host-indptr

Each part is called --layers times right after a --busy-ms kernel was queued (as a serving step
issues its runs); the figure is the median over --rounds rounds of the mean host time per call.
The two "step" rows are a plan() then --layers - 1 run()s: the plan's time ("first"), the runs'
mean and each run's. Last, the time of selected functions in the 1st, 2nd and 10th run() after
a plan() (`print_run_parts_after_plan`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashdispatch as fd  # noqa: E402
from flashdispatch.backends.base import AttentionInputs  # noqa: E402
from flashdispatch.backends.fa2 import launch as launch_mod  # noqa: E402
from flashdispatch.bench.decode import make_decode_data, parse_decode_shapes, peer_column  # noqa: E402
from flashdispatch.bench.peers import import_flashinfer  # noqa: E402
from flashdispatch import planned as planned_mod  # noqa: E402
from flashdispatch.backends.common import kernel_scales  # noqa: E402
from flashdispatch.backends.fa2.paging import decode_strides  # noqa: E402
from flashdispatch.checks import unpack_paged_kv_cache  # noqa: E402
from host_overhead import busy_cycles  # noqa: E402  (scripts/, the script's own folder)


def per_call_us(fn, layers: int, cycles: int) -> float:
    """Mean host time of ``layers`` calls of ``fn`` (a [first, rest] pair: a step of a first
    call then layers - 1 calls of rest) issued behind a busy kernel."""
    first, rest = fn if isinstance(fn, list) else (fn, fn)
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    first()
    t1 = time.perf_counter()
    marks = [t1]
    for _ in range(layers - 1):
        rest()
        marks.append(time.perf_counter())
    t2 = marks[-1]
    torch.cuda.synchronize()
    if isinstance(fn, list):  # (the first call, the mean of the rest, each of the rest)
        return (t1 - t0) * 1e6, (t2 - t1) / (layers - 1) * 1e6, [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]
    return (t2 - t0) / layers * 1e6


def recorded_launches(backend_run):
    """The (hit, stream, grid, args) of each direct C launch one ``backend_run()`` makes."""
    calls = []
    original = launch_mod.BoundKernel._run

    def record(self, hit, stream, grid, args):
        calls.append((self, hit, stream, grid, args))
        original(self, hit, stream, grid, args)

    launch_mod.BoundKernel._run = record
    try:
        backend_run()
    finally:
        launch_mod.BoundKernel._run = original
    torch.cuda.synchronize()
    return calls


def timed(owner, name: str, totals: dict):
    """Wrap ``owner.name`` so that its calls add their wall time (us) to ``totals[name]``; returns
    the function that puts the original back."""
    original = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            totals[name] = totals.get(name, 0.0) + (time.perf_counter() - t0) * 1e6

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def print_run_parts_after_plan(w, plan, run, cycles: int, layers: int, steps: int = 30) -> None:
    """Where the runs of a step go: the time of selected functions (each wrapped by a timer, which
    adds its own cost) in the 1st, 2nd and 10th run() after plan(), medians over ``steps`` steps."""
    from flashdispatch import checks
    from flashdispatch import decode as api_decode
    from flashdispatch.backends.fa2 import decode as fa2_decode
    from flashdispatch.backends.fa2 import merge as fa2_merge
    totals: dict = {}
    restores = [timed(owner, name, totals) for owner, name in (
        (launch_mod, "spec_key"), (launch_mod.BoundKernel, "_run"), (torch, "empty"), (api_decode, "run_attention"),
        (fa2_decode.DecodePlan, "run"), (fa2_merge.DecodeMerge, "__call__"), (checks, "unpack_paged_kv_cache"),
        (launch_mod.BoundKernel, "launch_addresses"), (fa2_decode, "launch_kept"), (fa2_merge, "launch_kept"),
        (w, "_page_check_at_run"))]
    rows: dict = {1: [], 2: [], 10: []}
    try:
        for _ in range(steps):
            torch.cuda._sleep(cycles)
            plan()
            for i in range(1, layers):
                totals.clear()
                t0 = time.perf_counter()
                run()
                if i in rows:
                    rows[i].append({"whole run()": (time.perf_counter() - t0) * 1e6, **totals})
            torch.cuda.synchronize()
    finally:
        for restore in reversed(restores):
            restore()
    for i, samples in rows.items():
        print(f"run {i} after plan(): " + ", ".join(
            f"{k} {statistics.median(x.get(k, 0.0) for x in samples):.1f}" for k in samples[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,256x1024", help="decode shapes, as the bench's")
    ap.add_argument("--layers", type=int, default=32, help="calls per round (a step's runs)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds (the median is shown)")
    ap.add_argument("--busy-ms", type=float, default=5.0, help="the kernel queued before each round")
    ap.add_argument("--host-indptr", action="store_true", help="indptr and last_page_len on the CPU")
    args = ap.parse_args()
    fi, _ = import_flashinfer()  # (None: our parts only)
    cycles = busy_cycles(args.busy_ms)
    for shape in parse_decode_shapes(args.shapes):
        d = make_decode_data(shape)
        if args.host_indptr:
            d = dataclasses.replace(d, indptr=d.indptr.cpu(), last_page_len=d.last_page_len.cpu())
        s = d.shape
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=d.q.device)
        w = fd.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")

        def our_plan():
            w.plan(d.indptr, d.indices, d.last_page_len, s.qo_heads, s.kv_heads, s.head_dim, s.page_size,
                   q_data_type=s.dtype, kv_data_type=s.kv_dtype)

        our_plan()
        w.run(d.q, d.cache)
        planned = w._variant((1, False))
        plan, backend = planned.plan, planned.backend
        kv = unpack_paged_kv_cache(d.cache, "NHD")
        out = torch.empty(planned.out_shape, dtype=d.q.dtype, device=d.q.device)
        inputs = AttentionInputs(d.q, kv, out, None, None, None, None, None)
        launches = recorded_launches(lambda: backend.run(plan, inputs))
        merge = getattr(plan, "_merge", None)
        dummy = plan.plse
        parts = {
            "wrapper run()": lambda: w.run(d.q, d.cache),
            "backend run()": lambda: backend.run(plan, inputs),
            "C launches only": lambda: [k._run(h, s, g, a) for k, h, s, g, a in launches],
            "torch.empty(out)": lambda: torch.empty(planned.out_shape, dtype=d.q.dtype, device=d.q.device),
            "current_device()": torch.cuda.current_device,
            "direct_allowed": lambda: launch_mod._direct_allowed(launches[0][0].fn),
            "_variant": lambda: w._variant((1, False)),
            "unpack cache": lambda: unpack_paged_kv_cache(d.cache, "NHD"),
            "page_check_at_run": lambda: w._page_check_at_run(planned, kv.num_pages),
            "run_attention": lambda: planned_mod.run_attention(planned, d.q, kv),
            "_check_q": lambda: planned_mod._check_q(planned, d.q),
            "_check_paged": lambda: planned_mod._check_paged(planned, kv),
            "_outputs": lambda: planned_mod._outputs(planned, None, None, False),
            "AttentionInputs()": lambda: AttentionInputs(d.q, kv, out, None, None, None, None, None),
            "q.device == dev": lambda: d.q.device == planned.torch_device,
            "decode_strides": lambda: decode_strides(inputs),
            "kernel_scales": lambda: kernel_scales(inputs, dummy),
            "q.data_ptr()": d.q.data_ptr,
        }
        if merge is not None:
            parts["merge call"] = lambda: merge(out, None)
            parts["merge C launch"] = lambda: launches[-1][0]._run(*launches[-1][1:])
            parts["decode C launch"] = lambda: launches[0][0]._run(*launches[0][1:])
        if fi is not None:
            peer = peer_column(fi, "fa2-tc", False).build(d)
            peer.plan()
            peer.run()
            parts["FlashInfer run()"] = peer.run
            parts["FlashInfer plan()"] = peer.plan
            parts["FlashInfer step"] = [lambda: peer.plan(), peer.run]
        parts["our plan()"] = our_plan
        parts["our step"] = [our_plan, lambda: w.run(d.q, d.cache)]
        torch.cuda.synchronize()
        samples = {k: [] for k in parts}
        for _ in range(args.rounds):
            for k, fn in parts.items():
                samples[k].append(per_call_us(fn, args.layers, cycles))
        print(f"== {shape.label}: {len(launches)} direct launches a backend run(); us per call, median of "
              f"{args.rounds} rounds x {args.layers} calls behind a {args.busy_ms} ms kernel")
        for k, v in samples.items():
            if isinstance(v[0], tuple):
                print(f"{k:<20} first {statistics.median(x[0] for x in v):8.2f}, rest "
                      f"{statistics.median(x[1] for x in v):8.2f}; each: "
                      + " ".join(f"{statistics.median(x[2][i] for x in v):.0f}" for i in range(len(v[0][2]))))
            else:
                print(f"{k:<20} {statistics.median(v):8.2f}   (min {min(v):.2f})")
        print_run_parts_after_plan(w, our_plan, lambda: w.run(d.q, d.cache), cycles, args.layers)


if __name__ == "__main__":
    main()
