"""One decode call of one column inside a profiler window, for Nsight Compute.

The column is built and warmed up (compiles, plans) outside the window; then ``--calls`` calls
run between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that
``ncu --profile-from-start off`` measures only their kernels. Columns as the bench's
(``fd:auto``, ``fd:fa2``, ``fi:fa2-tc``, ``fi:xqa-fn``, ...). The last call's output is compared
with our reference backend's on the same data (the line printed at the end), so a profile is
of a call that computed the right thing. ``--device cpu`` runs it without a profiler window
(fa2 under TRITON_INTERPRET=1, ``--dtype fp16``: the CPU test of this script).

    ncu --profile-from-start off --clock-control none --section WarpStateStats \\
        python3 scripts/ncu_decode.py --shape 48x4096:fp8 --column fd:auto
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashdispatch as fd  # noqa: E402
from flashdispatch.bench.decode import (make_decode_data, our_column, parse_decode_shapes, parse_heads,  # noqa: E402
                                        peer_column)
from flashdispatch.bench.peers import import_flashinfer  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, help="one decode shape, as the bench's (e.g. 48x4096:fp8)")
    ap.add_argument("--column", required=True, help="fd:NAME (ours) or fi:NAME (FlashInfer's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", default="32/8", help="QO/KV heads")
    ap.add_argument("--calls", type=int, default=1, help="calls inside the profiler window")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (no profiler window)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"),
                    help="q, output and 16-bit KV dtype (the interpreter computes bf16 wrongly: fp16 on the CPU)")
    args = ap.parse_args(argv)
    side, _, name = args.column.partition(":")
    if side not in ("fd", "fi") or not name:
        ap.error(f"--column {args.column!r}: expected fd:NAME or fi:NAME (e.g. fd:auto, fi:xqa-fn)")
    if args.calls < 1:
        ap.error(f"--calls {args.calls}: at least 1")
    qo, kv = parse_heads(args.heads)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    shape = parse_decode_shapes(args.shape, dtype, heads=(qo, kv), head_dim=args.head_dim)[0]
    if side == "fd":
        column = our_column(fd, name)
    else:
        fi, why = import_flashinfer()
        if fi is None:
            raise SystemExit(why)
        column = peer_column(fi, name)
    data = make_decode_data(shape, device=args.device)
    job = column.build(data)
    if job.plan is not None:
        job.plan()
    for _ in range(3):
        job.run()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for _ in range(args.calls):
        out = job.run()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    check = "no output to compare"
    if out is not None:
        reference = our_column(fd, "reference").build(data)
        reference.plan()
        check = f"max |out - reference| {(out.float() - reference.run().float()).abs().max().item():.3g}"
    print(f"{args.column} {shape.label} d{args.head_dim}: {args.calls} call(s) profiled"
          + (f"; {job.info()}" if job.info else "") + f"; {check}")


if __name__ == "__main__":
    main()
