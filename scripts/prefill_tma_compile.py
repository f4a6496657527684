"""Offline compile of the fa2 prefill kernel, pointer loads vs TMA (no GPU needed).

Compiles ``fa2_prefill_kernel`` for GPUTarget("cuda", 90, 32) (``--cc`` for another GPU) the way
a launch on ragged bf16 K/V specializes it (pointers and strides divisible by 16, the unit strides
as constants), with TMA off and on (off only below sm90), and prints per variant: shared memory,
global scratch per program (the descriptors), the PTX's TMA loads (cp.async.bulk.tensor),
cp.async copies, wgmma, and, for sm90 targets, ptxas' registers and spills. Both variants should
fit in shared memory, the TMA one should issue TMA loads and no cp.async for K/V, and neither
should spill.

    .venv/bin/python scripts/prefill_tma_compile.py                       # d128 128x128 w8 s3, three masks
    .venv/bin/python scripts/prefill_tma_compile.py --head-dim 64 --tiles 128,64,4,3 --masks causal
    .venv/bin/python scripts/prefill_tma_compile.py --cc 86 --rope --tiles 128,64,8,2 --no-ptxas  # fits 99 KB?
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fd_tma_compile_")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from flashdispatch.backends.fa2.prefill_kernels import fa2_prefill_kernel, qk_parts  # noqa: E402
from offline_compile import compile_like_launch, ptxas_usage  # noqa: E402  (scripts/, the script's own folder)

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = {"qk_scale", "v_scale", "soft_cap", "rope_inv_scale", "rope_log2_theta"}
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_lh"}  # == 1: constexpr at launch
POINTER_TYPES = {**{n: "*bf16" for n in ("Q", "K", "V", "O")},
                 **{n: "*fp32" for n in ("LSE", "PO", "PLSE", "sinks_ptr", "alibi_ptr", "q_scale_ptr",
                                         "k_scale_ptr", "v_scale_ptr")}, "mask_ptr": "*i16"}
MASKS = {"none": {}, "causal": dict(CAUSAL=True), "custom": dict(CUSTOM_MASK=True),
         "window": dict(CAUSAL=True, WINDOW=True)}


def compile_variant(head: int, tiles: list[int], mask: str, tma: bool, rope: bool = False, target=TARGET):
    """The CompiledKernel of one ragged bf16 variant (32/8 heads, lse on; head 192 is the
    (192, 128) pair, split into K parts of 128 and 64 like a launch)."""
    block_m, block_n, warps, stages = tiles
    head_a, head_b = qk_parts(head, rope)
    head_vo = 128 if head == 192 else head
    const = dict(NUM_QO_HEADS=32, GROUP=4, HEAD_QK_A=head_a, HEAD_QK_B=head_b, HEAD_VO=head_vo,
                 BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=0, DTYPE=tl.bfloat16, DOT_PREC="tf32", CAUSAL=False,
                 CUSTOM_MASK=False, WINDOW=False, SOFT_CAP=False, ALIBI=False, ROPE=rope, K_ROTATED=False, SINKS=False,
                 HAS_LSE=True, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False, SPLIT=False,
                 PERSISTENT=False, TMA=tma, SHARED_ROWS=False, SCALE_POS=True, CLAMP_PAGES=False)
    const.update(MASKS[mask])
    for name in UNIT_STRIDES:
        const[name] = 1

    def arg_type(name: str) -> str:
        return POINTER_TYPES.get(name, "*i32" if name.endswith("_ptr") else "fp32" if name in FLOATS else "i32")
    return compile_like_launch(fa2_prefill_kernel, const, arg_type, target, dict(num_warps=warps, num_stages=stages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tiles", type=lambda t: [int(v) for v in t.split(",")], default=[128, 128, 8, 3],
                    help="block_m,block_n,num_warps,num_stages")
    ap.add_argument("--masks", nargs="+", choices=sorted(MASKS), default=["none", "causal", "custom"])
    ap.add_argument("--no-ptxas", action="store_true", help="skip the register count")
    ap.add_argument("--rope", action="store_true", help="ROPE_LLAMA on (K rotated in the kernel, from its halves)")
    ap.add_argument("--cc", type=int, default=90, help="target compute capability, e.g. 86 (the shared "
                    "memory a launch there needs; TMA variants only from 90 on)")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.cc, 32)
    print(f"triton {triton.__version__}, sm{args.cc}, ragged bf16 d{args.head_dim}, tiles {args.tiles}")
    print(f"{'mask':7} {'tma':5} {'shared B':>9} {'scratch B':>9} {'tma loads':>9} {'cp.async':>8} "
          f"{'wgmma':>6}  ptxas")
    for mask in args.masks:
        for tma in (False, True) if args.cc >= 90 else (False,):
            k = compile_variant(args.head_dim, args.tiles, mask, tma, args.rope, target)
            ptx = k.asm["ptx"]
            ptxas = not args.no_ptxas and args.cc >= 90  # ptxas_usage assembles for sm_90a
            regs, spill = ptxas_usage(ptx) if ptxas else (None, None)
            usage = f"{regs or '?'} regs, {'?' if spill is None else spill} B spill" if ptxas else ""
            print(f"{mask:7} {str(tma):5} {k.metadata.shared:9} {k.metadata.global_scratch_size:9} "
                  f"{ptx.count('cp.async.bulk.tensor'):9} {len(re.findall(r'cp[.]async[.]c[ag]', ptx)):8} "
                  f"{len(re.findall(r'wgmma[.]mma_async', ptx)):6}  {usage}", flush=True)


if __name__ == "__main__":
    main()
