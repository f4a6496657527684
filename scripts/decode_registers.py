"""Offline compile of the fa2 decode kernel (sm90 unless --cc says another): registers, spills,
shared memory and programs per SM of the variants a plan would launch (no GPU needed).

Compiles ``decode_kernel`` for GPUTarget("cuda", 90, 32) (or --cc) with the constexprs
``decode_variant.kernel_constants`` gives the problem's default config plus run()'s (float scales;
lse with --lse), pointers and strides divisible by 16 as a launch of contiguous tensors
specializes them: the work array and the direct table on the config's block, the direct split and
(wave_pack_line) the kernel's own packing (direct line) on the split block, each at its register
cap (`decode_variant.register_cap`) where it has one and uncapped; then ptxas -v on the PTX.
This is how session 6 explained a slower direct table: 79 registers against the work array's 64,
6 programs per SM instead of 8 (128x2048 read 3.38 TB/s against 4.24); and session 25 the line
kernel's first version (168 registers, 3 per SM).

    .venv/bin/python scripts/decode_registers.py                          # bf16, 32/8 heads, d128
    .venv/bin/python scripts/decode_registers.py --heads 64,4 --kv e4m3 --q-len 4
    .venv/bin/python scripts/decode_registers.py --kv e5m2 --cc 80       # an A100's compile
    .venv/bin/python scripts/decode_registers.py --kv e4m3 --sass        # + each token loop's SASS mix
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fd_decode_regs_")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from flashdispatch.backends.fa2 import decode_variant as fvar  # noqa: E402
from flashdispatch.backends.fa2 import decode_config  # noqa: E402
from flashdispatch.backends.fa2.decode_kernel import decode_kernel  # noqa: E402
from flashdispatch.dispatch.problem import Problem  # noqa: E402
from offline_compile import (compile_like_launch, frontend_like_launch,  # noqa: E402
                             ptxas_usage, sass_loop_mix)  # (scripts/, the script's own folder)

KV = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
                torch.float8_e5m2: "*fp8e5"}
FLOATS = {"qk_scale", "v_scale", "soft_cap", "rope_rcp_scale", "rope_log2_theta"}
# per SM by compute capability: registers, shared memory (H100/H200 228 KB, A100 164 KB, sm86/89
# 100 KB; a block may take 1 KB less, which the driver reserves per block), threads
SM_REGISTERS = 65536
# (shared memory, threads, resident blocks)
SM_LIMITS = {80: (167936, 2048, 32), 86: (102400, 1536, 16), 89: (102400, 1536, 24), 90: (233472, 2048, 32)}
PTXAS_GPU = {80: "sm_80", 86: "sm_86", 89: "sm_89", 90: "sm_90a"}


def compile_variant(consts: dict, q_dtype, kv_dtype, cc: int = 90, frontend: bool = False):
    """The CompiledKernel of ``decode_kernel`` with these constexprs and launch options, for sm
    ``cc``; with ``frontend`` its TTIR only (`offline_compile.frontend_like_launch`)."""
    options = {k: consts[k] for k in ("num_warps", "num_stages", "maxnreg") if k in consts}
    const = {k: v for k, v in consts.items() if k not in options}
    const["stride_lh"] = 1  # lse rows are contiguous: a launch makes the unit stride a constexpr
    pointers = {"q_ptr": TRITON_TYPES[q_dtype], "out_ptr": TRITON_TYPES[q_dtype], "k_ptr": TRITON_TYPES[kv_dtype],
                "v_ptr": TRITON_TYPES[kv_dtype]}

    def arg_type(name: str) -> str:
        return pointers.get(name, "*i32" if name in ("work_ptr", "last_ptr", "kv_indices_ptr", "merge_info_ptr",
                                                     "counters_ptr")
                            else "*fp32" if name.endswith("_ptr") else "fp32" if name in FLOATS else "i32")
    compile_fn = frontend_like_launch if frontend else compile_like_launch
    return compile_fn(decode_kernel, const, arg_type, GPUTarget("cuda", cc, 32), options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32,8", help="QO_HEADS,KV_HEADS")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv", default="bf16", choices=sorted(KV))
    ap.add_argument("--q-len", type=int, default=1, help="q_len_per_req (speculative rows)")
    ap.add_argument("--config", default="{}", help="JSON DecodeConfig overrides, as FLASHDISPATCH_FA2_DECODE_CONFIG")
    ap.add_argument("--lse", action="store_true", help="the run variant that writes lse")
    ap.add_argument("--fused", action="store_true", help="the variants with the fused merge (split plans)")
    ap.add_argument("--rope", action="store_true", help="ROPE_LLAMA (its tile and cap: DecodeConfig.rope_block_n)")
    ap.add_argument("--cc", type=int, default=90, choices=sorted(SM_LIMITS), help="compute capability x 10")
    ap.add_argument("--sass", action="store_true",
                    help="after each variant, the instructions of its token loop (the longest loop of its SASS)")
    args = ap.parse_args()
    hq, hk = (int(h) for h in args.heads.split(","))
    q_dtype = torch.bfloat16
    p = Problem("decode", q_dtype, KV[args.kv], q_dtype, hq, hk, args.head_dim, args.head_dim,
                page_size=args.page_size, q_len_per_req=args.q_len,
                pos_encoding_mode="ROPE_LLAMA" if args.rope else "NONE")
    # the defaults of a GPU with this shared memory per block (per SM less the 1 KB a block reserves)
    cfg = decode_config.resolve_config(p, json.loads(args.config), SM_LIMITS[args.cc][0] - 1024)
    block_m, row_blocks = fvar.row_block(args.q_len * (hq // hk), cfg)
    cfg = fvar.rope_config(cfg) if fvar.rope_variant(p, block_m) else cfg
    split_cfg = fvar.with_split_block(cfg) if cfg.split_block_n else cfg
    print(f"triton {triton.__version__}, sm{args.cc}; {args.kv} KV, {hq}/{hk} heads, d{args.head_dim}, page "
          f"{args.page_size}, q_len {args.q_len}; config {cfg}")
    print(f"{'variant':24} {'regs':>5} {'spill B':>7} {'shared B':>8} {'programs/SM':>11}")
    # the work array and the direct table on the config's block, the direct split and, where the
    # config takes it, the kernel's own packing (LINE, DecodeConfig.wave_pack_line) on the split
    # block (DecodePlan: split_block_n), as the plans that use them run; each at its register cap
    # (`register_cap`) where it has one, and uncapped
    variants = [(False, False, False), (True, False, False), (True, True, False)]
    variants += [(True, False, True)] if cfg.wave_pack_line else []
    for direct, split, line in variants:
        base = fvar.line_variant(split_cfg) if line else split_cfg if split else cfg
        cap = fvar.register_cap(p, base, block_m, args.fused)
        for capped in (True, False) if cap else (False,):
            variant_cfg = base if capped else dataclasses.replace(base, max_registers=0)
            consts = dict(fvar.kernel_constants(p, variant_cfg, block_m, row_blocks, args.fused, direct, split,
                                                False, line=line))  # a copy: the cached dict is only read
            # run()'s own constexprs (DecodePlan._bind): float scales, lse as asked
            consts.update(WRITE_LSE=args.lse, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False,
                          SHARED_KV_ROWS=cfg.shared_kv_rows)  # a 5-D cache's
            k = compile_variant(consts, q_dtype, KV[args.kv], args.cc)
            regs, spill = ptxas_usage(k.asm["ptx"], PTXAS_GPU[args.cc])
            if regs is None:
                raise RuntimeError(f"ptxas gave no register count for {direct=}, {split=}, {capped=}")
            spill = spill or 0
            threads = 32 * consts["num_warps"]
            shared, sm_threads, blocks = SM_LIMITS[args.cc]
            per_sm = min(SM_REGISTERS // (-(-regs // 8) * 8 * threads), shared // max(k.metadata.shared + 1024, 1),
                         sm_threads // threads, blocks)
            kind = "direct line" if line else "direct split" if split else "direct table" if direct else "work array"
            name = kind + (f", cap {cap}" if capped else "") + (", fused" if args.fused else "")
            print(f"{name:24} {regs:5} {spill:7} {k.metadata.shared:8} {per_sm:11}", flush=True)
            if args.sass:
                count, mix = sass_loop_mix(k.asm["cubin"])
                print(f"  loop: {count} instructions: " + ", ".join(f"{op} {n}" for op, n in mix), flush=True)


if __name__ == "__main__":
    main()
