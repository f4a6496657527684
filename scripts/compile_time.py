"""Offline compile time of the fa2 Triton kernels for sm90 (no GPU needed).

Compiles ``fa2_prefill_kernel`` or ``decode_kernel`` with ``triton.compile`` for
GPUTarget("cuda", 90, 32), with the tile sizes the backend picks on an H100/H200
(``default_config``), through a fresh Triton cache so nothing is reused, and prints the seconds
and shared memory of each variant. This is the first-call cost of a new configuration on the
GPU minus the launch, so it is what issue "first call <= 5 s" is about.

    .venv/bin/python scripts/compile_time.py                                # every variant
    .venv/bin/python scripts/compile_time.py --kernel prefill --head-dims 256 --rope on
    .venv/bin/python scripts/compile_time.py --kernel decode --head-dims 128 256 --rope both
    .venv/bin/python scripts/compile_time.py --kernel prefill --head-dims 256 --tiles 64,32,4,2

Prefill variants: fp16, 32/8 heads, ragged KV, no mask, lse on; --split on sets SPLIT (split-KV
partials). Decode variants: fp16, 32/8 heads, page 16, one query row per request, lse on; the
decode kernel has both output paths in every variant (the fused merge off), so --split does not
apply. --tiles replaces the
default tiles: block_m,block_n,num_warps,num_stages (prefill) or block_n,num_warps,num_stages (decode).
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fd_compile_time_")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashdispatch.backends.fa2 import decode_config as fa2_decode_config  # noqa: E402
from flashdispatch.backends.fa2 import decode_variant as fa2_decode_variant  # noqa: E402
from flashdispatch.backends.fa2.prefill_config import default_config  # noqa: E402
from flashdispatch.backends.fa2.decode_kernel import decode_kernel  # noqa: E402
from flashdispatch.backends.fa2.prefill_kernels import fa2_prefill_kernel, qk_parts  # noqa: E402
from flashdispatch.dispatch.problem import Device, Problem  # noqa: E402

QO_HEADS, KV_HEADS, PAGE = 32, 8, 16
H200 = Device(type="cuda", index=0, cc=(9, 0), name="H200 (offline)", sm_count=132)
TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"qk_scale", "v_scale", "soft_cap", "rope_inv_scale", "rope_rcp_scale", "rope_log2_theta"}


def _problem(op: str, head: int, rope: bool) -> Problem:
    return Problem(op=op, q_dtype=torch.float16, kv_dtype=torch.float16, o_dtype=torch.float16,
                   num_qo_heads=QO_HEADS, num_kv_heads=KV_HEADS, head_dim_qk=head, head_dim_vo=head,
                   page_size=PAGE if op == "decode" else 0,
                   pos_encoding_mode="ROPE_LLAMA" if rope else "NONE")


def _signature(kernel, const: dict, pointers: dict) -> dict:
    """constexpr for ``const``, the given pointer types, fp32 scalars, *i32 for other pointers, i32 else."""
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def prefill_variant(head: int, rope: bool, split: bool, tiles: list[int] | None):
    """(kernel, signature, constexprs, options, config text) of one prefill variant."""
    cfg = default_config(_problem("prefill_ragged", head, rope), H200)
    if tiles:
        cfg = dataclasses.replace(cfg, **dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tiles)))
    head_a, head_b = qk_parts(head, rope)
    const = dict(NUM_QO_HEADS=QO_HEADS, GROUP=QO_HEADS // KV_HEADS, HEAD_QK_A=head_a, HEAD_QK_B=head_b,
                 HEAD_VO=head, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=0, DTYPE=tl.float16,
                 DOT_PREC="tf32", CAUSAL=False, CUSTOM_MASK=False, WINDOW=False, SOFT_CAP=False, ALIBI=False,
                 ROPE=rope, K_ROTATED=False, SINKS=False, HAS_LSE=True, Q_SCALE_T=False, K_SCALE_T=False,
                 V_SCALE_T=False, SPLIT=split, PERSISTENT=False, TMA=False, SHARED_ROWS=True, SCALE_POS=True,
                 CLAMP_PAGES=False)
    fp16 = {name: "*fp16" for name in ("Q", "K", "V", "O")}
    f32 = {name: "*fp32" for name in ("LSE", "PO", "PLSE", "sinks_ptr", "alibi_ptr", "q_scale_ptr",
                                      "k_scale_ptr", "v_scale_ptr")}
    sig = _signature(fa2_prefill_kernel, const, {**fp16, **f32, "mask_ptr": "*i16"})
    text = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
    return fa2_prefill_kernel, sig, const, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), text


def decode_variant(head: int, rope: bool, split: bool, tiles: list[int] | None):
    """(kernel, signature, constexprs, options, config text) of one decode variant (``split``
    unused): the work-array kernel of the default config, its constexprs as a plan gives them
    (`decode_variant.kernel_constants`) plus run()'s (float scales, lse, a 5-D cache's rows)."""
    del split
    p = _problem("decode", head, rope)
    cfg = fa2_decode_config.default_config(p)
    if tiles:
        cfg = dataclasses.replace(cfg, **dict(zip(("block_n", "num_warps", "num_stages"), tiles)), max_registers=0)
    block_m, row_blocks = fa2_decode_variant.row_block(QO_HEADS // KV_HEADS, cfg)
    const = dict(fa2_decode_variant.kernel_constants(p, cfg, block_m, row_blocks, False, False, False, False))
    options = {k: const.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in const}
    const.update(WRITE_LSE=True, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False, SHARED_KV_ROWS=cfg.shared_kv_rows)
    fp16 = {name: "*fp16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    f32 = {name: "*fp32" for name in ("lse_ptr", "po_ptr", "plse_ptr", "slopes_ptr", "sinks_ptr",
                                      "q_scale_ptr", "k_scale_ptr", "v_scale_ptr")}
    sig = _signature(decode_kernel, const, {**fp16, **f32})
    text = f"{block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
    return decode_kernel, sig, const, options, text


VARIANTS = {"prefill": prefill_variant, "decode": decode_variant}


def _switch(value: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [False, True]}[value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("prefill", "decode", "both"), default="both")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rope", choices=("on", "off", "both"), default="both")
    ap.add_argument("--split", choices=("on", "off", "both"), default="both",
                    help="prefill SPLIT constexpr (decode has one variant)")
    ap.add_argument("--tiles", type=lambda text: [int(v) for v in text.split(",")],
                    help="prefill: block_m,block_n,num_warps,num_stages; decode: block_n,num_warps,num_stages")
    args = ap.parse_args()
    kernels = ["prefill", "decode"] if args.kernel == "both" else [args.kernel]
    print(f"triton {triton.__version__}, target sm90, fresh cache")
    print(f"{'kernel':8} {'head':>4} {'rope':>5} {'split':>5}  {'tiles':18} {'seconds':>8} {'shared B':>9}")
    for kernel in kernels:
        for head in args.head_dims:
            for rope in _switch(args.rope):
                for split in _switch(args.split) if kernel == "prefill" else [False]:
                    fn, sig, const, opts, text = VARIANTS[kernel](head, rope, split, args.tiles)
                    start = time.perf_counter()
                    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                              target=TARGET, options=opts)
                    seconds = time.perf_counter() - start
                    split_text = str(split) if kernel == "prefill" else "-"
                    print(f"{kernel:8} {head:4} {str(rope):>5} {split_text:>5}  {text:18} {seconds:8.1f} "
                          f"{compiled.metadata.shared:9}", flush=True)


if __name__ == "__main__":
    main()
