"""Host time of one paged decode run(): fa2 with Triton's plain launch (`kernel[grid](...)`) against
fa2 with the bound launcher (flashdispatch/backends/fa2/launch.py), and FlashInfer's
BatchDecodeWithPagedKVCacheWrapper.run() on the same problem when `import flashinfer` works.

    python scripts/launch_overhead.py                              # batch 256 x 1024 tokens
    python scripts/launch_overhead.py --shapes 256x1024 16x8192    # the second one splits (+ merge launch)
    source .whl/device_setup.sh && python scripts/launch_overhead.py --fi tc cc

32/8 heads, head_dim 128, page 16, bf16, NHD. Each number is the median over --reps blocks of the
mean host time of --calls back-to-back run() calls (no sync inside a block: the launches queue
up; the device is drained between blocks, so the queue never fills; gc off while timing, as
scripts/host_overhead.py does). The "normal" column counts the decode launches that went through
Triton's JITFunction.run during the timed bound calls (0: every one was direct). "check" compares
each output with the plain fa2 launch's (bitwise for fa2, relative error for FlashInfer).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
WORKSPACE_BYTES = 128 << 20


def time_us(fn, calls: int, reps: int) -> float:
    """Median over ``reps`` blocks of the mean host time of one of ``calls`` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    finally:
        gc.enable()
    return statistics.median(samples)


def decode_data(batch: int, kv_len: int, seed: int = 0):
    """(indptr, indices, last_page_len, q, NHD cache) on the GPU, random pages and values."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-kv_len // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    indices = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    cache = torch.randn(batch * pages, 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    return indptr, indices, last, q, cache


def planned_wrapper(mod, data, **kwargs):
    indptr, indices, last, _, _ = data
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    w = mod.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kwargs)
    w.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    return w


class NormalPathCounter:
    """Counts the launches of a JITFunction that go through its run() (Triton's normal path)."""

    def __init__(self, fn):
        self.fn, self.calls, self._run = fn, 0, fn.run

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._run(*args, **kwargs)
        self.fn.run = counting
        return self

    def __exit__(self, *exc):
        del self.fn.run  # back to the class method


def fa2_rows(data, args) -> tuple[list, torch.Tensor]:
    import flashdispatch
    from flashdispatch.backends.fa2 import launch
    from flashdispatch.backends.fa2.decode_kernel import decode_kernel
    q, cache = data[3], data[4]
    w = planned_wrapper(flashdispatch, data, backend="fa2")
    rows = []
    launch.DIRECT_LAUNCH = False
    plain_us = time_us(lambda: w.run(q, cache), args.calls, args.reps)
    ref = w.run(q, cache).clone()
    rows.append(("fa2 plain launch", plain_us, "-", "-"))
    launch.DIRECT_LAUNCH = True
    w.run(q, cache)  # the bound launcher's first call of this plan: the normal path
    with NormalPathCounter(decode_kernel) as counter:
        bound_us = time_us(lambda: w.run(q, cache), args.calls, args.reps)
    out = w.run(q, cache)
    rows.append(("fa2 bound launcher", bound_us, str(counter.calls), "bitwise" if torch.equal(out, ref) else
                 f"DIFFERS {(out.float() - ref.float()).norm() / ref.float().norm():.1e}"))
    return rows, ref


def flashinfer_rows(data, ref, args) -> list:
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means: no FlashInfer rows
        print(f"flashinfer: not importable ({type(e).__name__}: {e}); no FlashInfer rows")
        return []
    rows = []
    q, cache = data[3], data[4]
    for variant in args.fi:
        w = planned_wrapper(flashinfer, data, use_tensor_cores=variant == "tc")
        us = time_us(lambda: w.run(q, cache), args.calls, args.reps)
        out = w.run(q, cache)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        rows.append((f"flashinfer fa2-{variant}", us, "-", f"rel err {err:.1e}"))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["256x1024"], help="BATCHxKV_LEN, e.g. 256x1024 16x8192")
    ap.add_argument("--fi", nargs="*", default=["tc"], choices=["tc", "cc"],
                    help="FlashInfer decode variants: tc (tensor cores), cc (CUDA cores); none: skip")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed block")
    ap.add_argument("--reps", type=int, default=50, help="timed blocks (the median is shown)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead.py needs a CUDA GPU")
    import triton
    from flashdispatch.backends.fa2 import launch
    print(f"decode run() host time, {HEADS}/{KV_HEADS} heads d{HEAD_DIM} page {PAGE} bf16 NHD, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__} "
          f"(bound launches direct: {launch._version_verified()}), median of {args.reps} x {args.calls} calls")
    print(f"{'shape':<10} {'run':<20} {'host us':>8} {'normal':>7}  check")
    for shape in args.shapes:
        batch, kv_len = (int(x) for x in shape.lower().split("x"))
        data = decode_data(batch, kv_len)
        rows, ref = fa2_rows(data, args)
        rows += flashinfer_rows(data, ref, args)
        for name, us, normal, check in rows:
            print(f"{shape:<10} {name:<20} {us:>8.1f} {normal:>7}  {check}")
        del data, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
