"""Host time of the public API layer: plan() and run() of the batch decode and paged prefill
wrappers with the backend's own plan/run replaced by no-ops, so only our Python above the
backends is measured (argument checks, host copies, Problem, selection, output allocation).

    .venv/bin/python scripts/host_overhead.py                  # CPU tensors
    python scripts/host_overhead.py --device cuda              # index tensors, q and cache on the GPU
    python scripts/host_overhead.py --device cuda --host-indptr   # indptr/last_page_len on the host

Prints one table: op, batch, plan() us, run() us, each the median over --reps blocks of the
mean of --calls calls (garbage collection off while timing, as timeit does).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def api():
    """flashdispatch, imported after main() has settled TRITON_INTERPRET."""
    return importlib.import_module("flashdispatch")


def stub_backend(name: str) -> None:
    """Make backend ``name``'s plan() and run() no-ops (instance attributes, this process only)."""
    backend = importlib.import_module("flashdispatch.dispatch.registry").get_backend(name)
    backend.plan = lambda problem, device, params: None
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


def time_us(fn, calls: int, reps: int, sync) -> float:
    """Median over ``reps`` blocks of the mean host time of one call, in microseconds."""
    for _ in range(3):
        fn()
    sync()
    samples = []
    gc.collect()
    gc.disable()  # its pauses belong to the whole process, not to these calls
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
            sync()
    finally:
        gc.enable()
    return statistics.median(samples)


def bench_decode(batch, args, device, small_device, dtype, sync):
    (indptr, indices, last), num_pages = page_table(batch, args.kv_len, device, small_device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = api().BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=args.backend)

    def plan():
        w.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=dtype, kv_data_type=dtype)

    plan()
    q = torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)
    cache = kv_cache(num_pages, dtype, device)
    return (time_us(plan, args.calls, args.reps, sync),
            time_us(lambda: w.run(q, cache), args.calls, args.reps, sync))


def bench_prefill(batch, args, device, small_device, dtype, sync):
    (indptr, indices, last), num_pages = page_table(batch, args.kv_len, device, small_device)
    qo_indptr = (torch.arange(batch + 1, dtype=torch.int32) * args.qo_len).to(small_device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = api().BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=args.backend)

    def plan():
        w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True,
               q_data_type=dtype, kv_data_type=dtype)

    plan()
    q = torch.empty(batch * args.qo_len, HEADS, HEAD_DIM, dtype=dtype, device=device)
    cache = kv_cache(num_pages, dtype, device)
    return (time_us(plan, args.calls, args.reps, sync),
            time_us(lambda: w.run(q, cache), args.calls, args.reps, sync))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (page indices, q and cache live there)")
    ap.add_argument("--host-indptr", action="store_true", help="keep indptr/qo_indptr/last_page_len on the host")
    ap.add_argument("--backend", default="fa2", help="backend whose plan/run are stubbed out (requested explicitly)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--kv-len", type=int, default=1024, help="KV tokens per request")
    ap.add_argument("--qo-len", type=int, default=16, help="query tokens per request (paged prefill)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed block")
    ap.add_argument("--reps", type=int, default=15, help="timed blocks (the median is shown)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # fa2 is selectable on the CPU only under the Triton interpreter (never run here)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    small_device = torch.device("cpu") if args.host_indptr else device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stub_backend(args.backend)
    print(f"API host overhead, backend {args.backend!r} plan/run stubbed, device {device} (indptr on "
          f"{small_device}), {str(dtype).replace('torch.', '')}, heads {HEADS}/{KV_HEADS} d {HEAD_DIM} page {PAGE} "
          f"kv_len {args.kv_len}, torch {torch.__version__}")
    print(f"{'op':<14} {'batch':>5} {'plan us':>9} {'run us':>8}")
    for name, bench in (("decode", bench_decode), ("prefill_paged", bench_prefill)):
        for batch in args.batches:
            p, r = bench(batch, args, device, small_device, dtype, sync)
            print(f"{name:<14} {batch:>5} {p:>9.1f} {r:>8.1f}")


if __name__ == "__main__":
    main()
