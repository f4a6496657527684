"""Offline sm90 compile of the fa2 RoPE kernels (no GPU needed): registers, spills and each loop's
instruction mix (MUFU, FFMA, ...) of the decode kernel (bf16, 32/8 heads, d128, page 16, the
default config's work-array variant, ROPE 1), the ragged prefill kernel's pointer path (128x64
w8 s3, causal, ROPE 1: what paged RoPE prefill runs) and the K rotation kernel
(`fa2/prefill_rope.py`), for the source tree given (default: this checkout). Session 57 compared
trees with it before the first GPU run of its MUFU sin/cos (perf-notes).

    .venv/bin/python scripts/rope_compile.py                 # this checkout
    .venv/bin/python scripts/rope_compile.py out/before      # another tree (e.g. a `git archive`)
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

TREE = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fd_rope_compile_")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
sys.path[:0] = [TREE, os.path.join(TREE, "scripts")]

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from decode_registers import compile_variant as decode_compile  # noqa: E402
from flashdispatch.backends.fa2 import decode_config, decode_variant  # noqa: E402
from flashdispatch.dispatch.problem import Problem  # noqa: E402
from offline_compile import compile_like_launch, ptxas_usage, sass_loops  # noqa: E402
from prefill_tma_compile import compile_variant as prefill_compile  # noqa: E402

OPCODES = ("MUFU", "FFMA", "FMUL", "FADD", "FRND", "F2I", "LOP3", "FSETP", "FSEL", "HMMA", "LDG", "LDGSTS", "STG")


def show(name: str, kernel) -> None:
    regs, spill = ptxas_usage(kernel.asm["ptx"])
    print(f"{name}: {regs} registers, {spill or 0} spill bytes", flush=True)
    for count, mix in sass_loops(kernel.asm["cubin"]):
        ops = dict(mix)
        print(f"  loop of {count}: " + ", ".join(f"{op} {ops[op]}" for op in OPCODES if ops.get(op)), flush=True)


def main() -> None:
    p = Problem("decode", torch.bfloat16, torch.bfloat16, torch.bfloat16, 32, 8, 128, 128, page_size=16,
                pos_encoding_mode="ROPE_LLAMA")
    cfg = decode_config.resolve_config(p, {}, 233472 - 1024)
    block_m, row_blocks = decode_variant.row_block(4, cfg)
    consts = decode_variant.kernel_constants(p, cfg, block_m, row_blocks, False, False, False, False)
    consts.pop("maxnreg", None)
    consts.update(WRITE_LSE=False, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False,
                  SHARED_KV_ROWS=cfg.shared_kv_rows)
    print(f"tree {TREE}")
    show(f"decode {consts['BLOCK_N']} keys a step, {consts['num_warps']} warps",
         decode_compile(consts, torch.bfloat16, torch.bfloat16))
    show("prefill pointer path 128x64 w8 s3", prefill_compile(128, [128, 64, 8, 3], "causal", False, 1))
    try:
        from flashdispatch.backends.fa2.prefill_rope import rotate_rows_kernel
    except ImportError:  # a tree before session 57
        return

    def arg_type(name: str) -> str:
        return ("*bf16" if name in ("X", "Y") else "*i32" if name.endswith("_ptr")
                else "fp32" if name.startswith("rope") else "i32")
    const = dict(HEADS=8, HEAD_DIM=128, BLOCK_R=32, BLOCK_H=2, ROPE=1, stride_xd=1)
    show("K rotation, 8 heads", compile_like_launch(rotate_rows_kernel, const, arg_type, GPUTarget("cuda", 90, 32),
                                                    dict(num_warps=4)))


if __name__ == "__main__":
    main()
