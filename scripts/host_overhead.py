"""Host time of the public API layer: plan() and run() of the batch decode and paged prefill
wrappers, and calls of the single-request functions, with the backend's own plan/run replaced by
no-ops, so only our Python above the backends is measured (argument checks, host copies,
Problem, selection, output allocation); with --real the backend's plan/run stay (whole calls).

    .venv/bin/python scripts/host_overhead.py                  # CPU tensors
    python scripts/host_overhead.py --device cuda              # index tensors, q and cache on the GPU
    python scripts/host_overhead.py --device cuda --host-indptr   # indptr/last_page_len on the host
    FLASHDISPATCH_CHECK_INPUTS=0 python scripts/host_overhead.py --device cuda   # no page-index check
    python scripts/host_overhead.py --device cuda --op decode --profile 25   # where plan()'s time goes

Prints one table: op, batch, plan us, run us, each the median over --reps blocks of the mean of
--calls calls (garbage collection off while timing, as timeit does). For ``single_prefill``
(causal) and ``single_decode`` (``--single-len`` tokens, batch 1) "plan us" is a call whose plan
is not kept yet (the kept plans are dropped before each call) and "run us" a repeated call.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import os
import pstats
import statistics
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
OPS = ("decode", "prefill_paged", "single_prefill", "single_decode")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def api(module: str = ""):
    """flashdispatch (or one of its modules), imported after main() has settled TRITON_INTERPRET."""
    return importlib.import_module("flashdispatch" + (f".{module}" if module else ""))


def stub_backend(name: str) -> None:
    """Make backend ``name``'s plan(), replan() and run() no-ops (instance attributes, this process only)."""
    backend = api("dispatch.registry").get_backend(name)
    backend.plan = lambda problem, device, params: None
    backend.replan = lambda plan, problem, device, params: None
    backend.run = lambda plan, inputs: None


def page_table(batch: int, kv_len: int, device: torch.device, small_device: torch.device):
    """indptr, shuffled page indices, last_page_len for ``batch`` requests of ``kv_len`` tokens;
    the indices on ``device``, indptr and last_page_len on ``small_device``."""
    pages = -(-kv_len // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32)
    return (indptr.to(small_device), indices.to(device), last.to(small_device)), batch * pages


def kv_cache(num_pages: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An NHD cache [pages, 2, page, kv_heads, dim] of the right shape; its content is never read."""
    return torch.empty(1, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device).expand(num_pages, -1, -1, -1, -1)


def decode_calls(batch, args, device, small_device, dtype):
    """(plan, run) of BatchDecodeWithPagedKVCacheWrapper, planned once."""
    (indptr, indices, last), num_pages = page_table(batch, args.kv_len, device, small_device)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)  # FlashInfer's recommended size
    w = api().BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=args.backend)

    def plan():
        w.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=dtype, kv_data_type=dtype)

    plan()
    q = torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)
    cache = kv_cache(num_pages, dtype, device)
    return plan, lambda: w.run(q, cache)


def prefill_calls(batch, args, device, small_device, dtype):
    """(plan, run) of BatchPrefillWithPagedKVCacheWrapper (causal, --qo-len new tokens per request)."""
    (indptr, indices, last), num_pages = page_table(batch, args.kv_len, device, small_device)
    qo_indptr = (torch.arange(batch + 1, dtype=torch.int32) * args.qo_len).to(small_device)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)  # FlashInfer's recommended size
    w = api().BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=args.backend)

    def plan():
        w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True,
               q_data_type=dtype, kv_data_type=dtype)

    plan()
    q = torch.empty(batch * args.qo_len, HEADS, HEAD_DIM, dtype=dtype, device=device)
    cache = kv_cache(num_pages, dtype, device)
    return plan, lambda: w.run(q, cache)


def single_calls(call):
    """(a call that plans, a repeated call) of a single-request function call ``call()``."""
    plans = api("planned").single_plans

    def first():
        plans.clear()
        call()

    return first, call


def single_prefill_calls(batch, args, device, small_device, dtype):
    n = args.single_len
    q = torch.empty(n, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.empty(n, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    fn = api().single_prefill_with_kv_cache
    return single_calls(lambda: fn(q, k, v, causal=True, backend=args.backend))


def single_decode_calls(batch, args, device, small_device, dtype):
    q = torch.empty(HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.empty(args.single_len, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    fn = api().single_decode_with_kv_cache
    return single_calls(lambda: fn(q, k, v, backend=args.backend))


CALLS = {"decode": decode_calls, "prefill_paged": prefill_calls, "single_prefill": single_prefill_calls,
         "single_decode": single_decode_calls}


def time_us(fn, calls: int, reps: int, sync, clock) -> float:
    """Median over ``reps`` blocks of the mean host time of one call, in microseconds."""
    for _ in range(3):
        fn()
    sync()
    samples = []
    gc.collect()
    gc.disable()  # its pauses belong to the whole process, not to these calls
    try:
        for _ in range(reps):
            t0 = clock()
            for _ in range(calls):
                fn()
            samples.append((clock() - t0) / calls * 1e6)
            sync()
    finally:
        gc.enable()
    return statistics.median(samples)


def busy_cycles(busy_ms: float) -> int:
    """The ``torch.cuda._sleep`` cycles of a kernel that runs about ``busy_ms`` ms on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 20)
    end.record()
    end.synchronize()
    return int(busy_ms / start.elapsed_time(end) * (1 << 20))


def busy_plan_us(fn, reps: int, busy_ms: float) -> float:
    """Median host time of one call of ``fn`` made while the GPU runs a ``busy_ms`` kernel queued
    just before it: close to the idle figure when the call never waits for the GPU, about
    ``busy_ms`` when something in it synchronises."""
    cycles = busy_cycles(busy_ms)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def profile(name: str, fn, calls: int, top: int, sync) -> None:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time, in us per call of
    ``fn`` (the profiler's own cost inflates every number; compare them with each other)."""
    fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"\n{name}: cProfile over {calls} calls, us per call (own, cumulative), calls per call")
    for (path, line, func), (_, ncalls, own, cum, _) in rows:
        where = f"{os.path.basename(path)}:{line}({func})" if line else func
        print(f"  {own / calls * 1e6:8.2f} {cum / calls * 1e6:8.2f} {ncalls / calls:6.1f}  {where}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (page indices, q and cache live there)")
    ap.add_argument("--host-indptr", action="store_true", help="keep indptr/qo_indptr/last_page_len on the host")
    ap.add_argument("--backend", default="fa2", help="backend whose plan/run are stubbed out (requested explicitly)")
    ap.add_argument("--real", action="store_true", help="keep the backend's own plan/run (the whole call is timed)")
    ap.add_argument("--op", nargs="+", choices=OPS, default=list(OPS), help="what to time (default: all)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="batch sizes of the wrappers")
    ap.add_argument("--kv-len", type=int, default=1024, help="KV tokens per request (wrappers)")
    ap.add_argument("--qo-len", type=int, default=16, help="query tokens per request (paged prefill)")
    ap.add_argument("--single-len", type=int, default=4096, help="qo and kv tokens of single_prefill, kv of "
                                                                 "single_decode")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed block")
    ap.add_argument("--reps", type=int, default=15, help="timed blocks (the median is shown)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall (default) or thread: this thread's CPU time, steadier on a busy machine, but "
                         "blind to time spent waiting for the GPU")
    ap.add_argument("--busy-ms", type=float, default=0.0,
                    help="also time plan() issued while the GPU runs a kernel this long (a wait shows)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also print a cProfile (TOP functions) of each op's plan and run (single ops: repeated "
                         "call) at the last batch size")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # fa2 is selectable on the CPU only under the Triton interpreter (never run here)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    small_device = torch.device("cpu") if args.host_indptr else device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = CLOCKS[args.clock]
    if not args.real:
        stub_backend(args.backend)
    checked = api("checks").page_indices_checked()
    print(f"API host overhead, backend {args.backend!r} plan/run {'real' if args.real else 'stubbed'}, "
          f"device {device} (indptr on "
          f"{small_device}), {str(dtype).replace('torch.', '')}, heads {HEADS}/{KV_HEADS} d {HEAD_DIM} page {PAGE} "
          f"kv_len {args.kv_len}, single {args.single_len}, page-index check {'on' if checked else 'off'}, "
          f"{args.clock} clock, torch {torch.__version__}")
    print(f"{'op':<14} {'batch':>5} {'plan us':>9} {'run us':>8}" + (f" {'busy plan':>10}" if args.busy_ms else ""))
    profiled = []
    for name in args.op:
        batches = args.batches if not name.startswith("single") else [1]
        for batch in batches:
            plan, run = CALLS[name](batch, args, device, small_device, dtype)
            p = time_us(plan, args.calls, args.reps, sync, clock)
            r = time_us(run, args.calls, args.reps, sync, clock)
            busy = f" {busy_plan_us(plan, args.reps, args.busy_ms):>10.1f}" if args.busy_ms else ""
            print(f"{name:<14} {batch:>5} {p:>9.1f} {r:>8.1f}{busy}")
        if name.startswith("single"):
            profiled.append((f"{name} batch {batch}: repeated call", run))
        else:
            profiled += [(f"{name} batch {batch}: plan", plan), (f"{name} batch {batch}: run", run)]
    for title, fn in profiled if args.profile else ():
        profile(title, fn, args.calls, args.profile, sync)


if __name__ == "__main__":
    main()
