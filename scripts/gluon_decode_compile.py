"""Offline (no GPU): the Gluon fp8 decode kernel (decode_gluon_kernel.py) compiled for sm90 as a
launch specializes it: registers, spills, shared memory and each token loop's SASS mix.

    python scripts/gluon_decode_compile.py                  # e4m3, 2-4 stages, lse written
    python scripts/gluon_decode_compile.py --e5m2 --stages 3 --group 8 --no-shared-kv
    python scripts/gluon_decode_compile.py --split --stages 4   # the split-KV variant
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # Gluon has no interpreter: the kernel must be defined for compiling
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from flashdispatch.backends.fa2.decode_gluon_kernel import fp8_decode_gluon_kernel  # noqa: E402
from offline_compile import compile_like_launch, ptxas_usage, sass_loops  # noqa: E402  (scripts/, this folder)

_FLOAT_ARGS = ("qk_scale", "v_scale")


def compile_kernel(stages: int, group: int, e5m2: bool, shared_kv: bool, write_lse: bool, split: bool):
    """The CompiledKernel of one variant (bf16 q and out, 8 KV heads) as a launch on contiguous
    tensors specializes it (`offline_compile.compile_like_launch`)."""
    const = dict(NUM_KV_HEADS=8, GROUP=group, STAGES=stages, E5M2=e5m2, SHARED_KV=shared_kv, WRITE_LSE=write_lse,
                 Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False, SPLIT=split)
    kv = "*fp8e5" if e5m2 else "*fp8e4nv"
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32"}

    def arg_type(name: str) -> str:
        if name.endswith("_ptr"):
            return types.get(name, "*fp32" if "scale" in name else "*i32")
        return "fp32" if name in _FLOAT_ARGS else "i32"
    return compile_like_launch(fp8_decode_gluon_kernel, const, arg_type, GPUTarget("cuda", 90, 32), {"num_warps": 1},
                               source=GluonASTSource)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="cp.async stages (>= 2)")
    ap.add_argument("--group", type=int, default=4, help="query heads a KV head (2-8)")
    ap.add_argument("--e5m2", action="store_true", help="e5m2 KV (default e4m3)")
    ap.add_argument("--no-shared-kv", action="store_true", help="V with its own strides (a (k, v) pair)")
    ap.add_argument("--no-lse", action="store_true")
    ap.add_argument("--split", action="store_true", help="the split-KV variant (fp32 partials, lse written)")
    args = ap.parse_args(argv)
    if min(args.stages) < 2:
        ap.error(f"--stages {min(args.stages)}: at least 2")
    if not 2 <= args.group <= 8:
        ap.error(f"--group {args.group}: 2 to 8")
    for stages in args.stages:
        k = compile_kernel(stages, args.group, args.e5m2, not args.no_shared_kv, args.split or not args.no_lse,
                           args.split)
        regs, spill = ptxas_usage(k.asm["ptx"])
        print(f"sm90, {stages} stages: {regs} registers, {spill} B spilled, {k.metadata.shared} B shared")
        for count, mix in sass_loops(k.asm["cubin"]):
            print(f"  loop of {count} instructions:", ", ".join(f"{op} {n}" for op, n in mix[:12]))


if __name__ == "__main__":
    main()
