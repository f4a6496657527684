"""Offline compile of the fa2 MLA kernel (sm90 unless --cc says another): registers, spills,
shared memory, programs per SM and the key loop's instructions of each tile config
(no GPU needed).

Compiles ``mla._mla_kernel`` for GPUTarget("cuda", cc, 32) as a launch on contiguous tensors
specializes it (pointers and row strides divisible by 16, column strides 1), then ptxas -v on its
PTX with the ptxas bundled in the Triton wheel, and the SASS of its longest loop (HMMA: mma.sync
tiles, HGMMA: Hopper's warpgroup MMA).

    .venv/bin/python scripts/mla_registers.py                     # the default tiles of 16 and 128 heads
    .venv/bin/python scripts/mla_registers.py --heads 128 --grid '{"block_m": [32, 64], "num_warps": [4, 8]}'
    .venv/bin/python scripts/mla_registers.py --kv e4m3 --cc 89
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shutil
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fd_mla_regs_")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from decode_registers import PTXAS_GPU, SM_LIMITS, SM_REGISTERS, TRITON_TYPES  # noqa: E402
from flashdispatch.backends.fa2.mla import _mla_kernel, mla_tiles  # noqa: E402
from flashdispatch.mla import _mla_problem  # noqa: E402
from offline_compile import compile_like_launch, ptxas_usage, sass_loops  # noqa: E402
from sweep_decode import config_grid  # noqa: E402

MMA = ("HMMA", "HGMMA", "WARPGROUP")
KV = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def compile_tiles(tiles, heads: int, ckv: int, kpe: int, page: int, q_dtype, kv_dtype, cc: int, lse: bool):
    """The CompiledKernel of the MLA kernel with these tiles for sm ``cc``."""
    const = dict(HEADS=heads, CKV=ckv, KPE=kpe, PAGE=page, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                 CAUSAL=False, WRITE_LSE=lse, V_SCALE_T=False, LAZY_RESCALE=tiles.lazy_rescale, stride_qn_d=1,
                 stride_qp_d=1, stride_ckv_d=1, stride_kpe_d=1)
    pointers = {"qn_ptr": TRITON_TYPES[q_dtype], "qp_ptr": TRITON_TYPES[q_dtype], "out_ptr": TRITON_TYPES[q_dtype],
                "ckv_ptr": TRITON_TYPES[kv_dtype], "kpe_ptr": TRITON_TYPES[kv_dtype]}

    def arg_type(name: str) -> str:
        if name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*fp32" if name in ("lse_ptr", "po_ptr", "plse_ptr", "v_scale_ptr") else "*i32"
        return "fp32" if name in ("s_mul", "v_scale") else "i32"
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return compile_like_launch(_mla_kernel, const, arg_type, GPUTarget("cuda", cc, 32), options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,128", help="query head counts, comma list (one query token)")
    ap.add_argument("--ckv", type=int, default=512)
    ap.add_argument("--kpe", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv", default="bf16", choices=sorted(KV))
    ap.add_argument("--grid", default="[{}]", help="JSON MLATiles overrides: a list of dicts or a dict of lists")
    ap.add_argument("--lse", action="store_true", help="the variant that writes lse")
    ap.add_argument("--cc", type=int, default=90, choices=sorted(SM_LIMITS), help="compute capability x 10")
    args = ap.parse_args()
    grid = config_grid(args.grid, False)
    q_dtype = torch.bfloat16
    print(f"sm{args.cc}; {args.kv} KV, ckv {args.ckv}, kpe {args.kpe}, page {args.page_size}")
    print(f"{'heads':>5} {'tiles':24} {'regs':>5} {'spill B':>7} {'shared B':>8} {'programs/SM':>11}  key loop")
    for heads in (int(h) for h in args.heads.split(",")):
        problem = _mla_problem(q_dtype, KV[args.kv], q_dtype, heads, args.ckv, args.kpe, args.page_size, False)
        for overrides in grid:
            tiles = dataclasses.replace(mla_tiles(problem, heads), **overrides)
            name = f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}" + (
                " lazy" if tiles.lazy_rescale else "")
            try:
                k = compile_tiles(tiles, heads, args.ckv, args.kpe, args.page_size, q_dtype, KV[args.kv], args.cc,
                                  args.lse)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a row
                print(f"{heads:5} {name:24} {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            regs, spill = ptxas_usage(k.asm["ptx"], PTXAS_GPU[args.cc])
            threads = 32 * tiles.num_warps
            shared, sm_threads, blocks = SM_LIMITS[args.cc]
            per_sm = min(SM_REGISTERS // (-(-(regs or 255) // 8) * 8 * threads),
                         shared // max(k.metadata.shared + 1024, 1), sm_threads // threads, blocks)
            # the key loop: the shortest loop that issues MMAs (the longest is the work row loop around it)
            loops = [(n, mix) for n, mix in sass_loops(k.asm["cubin"]) if any(op in MMA for op, _ in mix)]
            count, mix = min(loops, key=lambda loop: loop[0], default=(0, []))
            mma = ", ".join(f"{op} {n}" for op, n in mix if op in MMA)
            print(f"{heads:5} {name:24} {regs or '?':>5} {spill or 0:7} {k.metadata.shared:8} {per_sm:11}  "
                  f"{count} instructions ({mma or 'no MMA'})", flush=True)


if __name__ == "__main__":
    main()
