"""Offline sm90 compile of the fa2 decode kernel over its feature combinations (no GPU needed).

Triton's interpreter (the CPU tests) runs the kernel without the compiler's type checks, so a
combination that fails to compile on a GPU can pass every CPU test (session 12: a name the fused
merge redefined with another type under sinks). This compiles each combination of features
(plain; sinks + window; sinks + window + soft cap; ALiBi; RoPE with two causal query rows) x
work layout (work array with and without the fused merge, direct table, the kernel's own split
with and without the fused merge; fp8 KV: the work array only, as its configs use), at the base
tile and, for the variants that take them (`decode_variant.plain_variant`), each other wave tile, and
where the defaults pack (`DecodeConfig.pack_items`) their packed work array and, where they
take it (`DecodeConfig.wave_pack_line`, no window), the kernel's own packing (fused merge; the
merge kernel's plain only), and a block-table plan's own split (the table read, fused merge;
16-bit KV with the split length from the total), for GPUTarget("cuda", 90, 32); it prints one
line per combination and exits non-zero at the first one that fails. d128 by default; other
head dims as arguments. ``--frontend`` stops each compile at its TTIR (Triton's type checks,
~10x faster: the CPU suite's run of all three head dims; the GPU suite compiles them to cubin,
``--jobs`` on the GPU machine's cores).

    .venv/bin/python scripts/decode_compile_matrix.py [--frontend] [--jobs N] [HEAD_DIM ...]
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_registers as regs  # noqa: E402  (sets up an offline Triton: no interpreter, own cache)
import torch  # noqa: E402

from flashdispatch.backends.fa2 import decode_variant as fvar  # noqa: E402
from flashdispatch.backends.fa2.decode_config import resolve_config  # noqa: E402
from flashdispatch.backends.fa2.decode_variant import line_variant, with_split_block, with_tile  # noqa: E402
from flashdispatch.dispatch.problem import Problem  # noqa: E402

FEATURES = {
    "plain": {},
    "sinks+window": {"sinks": True, "window_left": 100},
    "sinks+window+soft_cap": {"sinks": True, "window_left": 100, "logits_soft_cap": 30.0},
    "alibi": {"pos_encoding_mode": "ALIBI"},
    "rope+q_len2": {"pos_encoding_mode": "ROPE_LLAMA", "q_len_per_req": 2, "mask_mode": "causal"},
}
# (name, fused merge, direct table, direct split)
LAYOUTS = [("work array", False, False, False), ("work array, fused", True, False, False),
           ("direct table", False, True, False), ("direct split", False, True, True),
           ("direct split, fused", True, True, True)]


def combinations(head_dims: list[int]):
    """(line to print, constexprs, kv dtype) of each combination, in the order they print."""
    for d, kv in [(d, kv) for d in head_dims for kv in (torch.bfloat16, torch.float8_e4m3fn)]:
        for feature, changes in FEATURES.items():
            p = Problem("decode", torch.bfloat16, kv, torch.bfloat16, 32, 8, d, d, page_size=16, **changes)
            base = resolve_config(p, None)
            block_m, row_blocks = fvar.row_block(p.q_len_per_req * p.num_qo_heads // p.num_kv_heads, base)
            # the wave tiles run for the plain variant only (decode.py), unsplit or (fp8's wave
            # split) split; bf16's 64 x 2 is also its split block
            waves = base.wave_tiles if fvar.plain_variant(p, block_m) else ()
            tiles = [(base, "")] + [(with_tile(base, bn, st), f", {bn} x {st}") for bn, st, _, _ in waves
                                    if (bn, st) != (base.block_n, base.num_stages)]
            # (label, config, fused merge, direct table, direct split, work rows per program, line,
            # block table, total split)
            variants = [(f"{name}{tile}", cfg, fused, direct, split, 1, False, False, False) for cfg, tile in tiles
                        for name, fused, direct, split in LAYOUTS if not direct or kv == torch.bfloat16]
            # a block-table plan (decode.py's `_place_table`): the direct table whatever the config
            split_cfg = with_split_block(base) if base.split_block_n else base
            variants.append(("block table, split, fused", split_cfg, True, True, True, 1, False, True,
                             base.table_split_slots > 0))
            # a packed plan: the split block's work array, 2 up to pack_items rows a program (as it
            # needs; the most compiled here, the kernel's body repeated that often)
            if base.pack_items > 1:
                packed = with_split_block(base) if base.split_block_n else base
                variants.append((f"packed x{base.pack_items}, fused", packed, True, False, False, base.pack_items,
                                 False, False, False))
                if base.wave_pack_line and p.window_left < 0:  # the merge kernel's line: plain only
                    variants += [(f"line{merge}", line_variant(packed), fused, True, False, 1, True, False, False)
                                 for merge, fused in ((", fused", True), ("", False)) if fused or not changes]
                if base.wave_pack_spread > 0 and p.window_left < 0:  # a block table's line (decode.py)
                    variants.append(("block table, line, fused", line_variant(packed), True, True, False, 1, True,
                                     True, False))
            for label, cfg, fused, direct, split, items, line, table, total in variants:
                consts = fvar.kernel_constants(p, cfg, block_m, row_blocks, fused, direct, split, False, items, line,
                                               table, total)
                consts.update(WRITE_LSE=True, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False,
                              SHARED_KV_ROWS=cfg.shared_kv_rows)
                yield f"d{d:<4}{str(kv).removeprefix('torch.'):14} {feature:22} {label}", consts, kv


def _compile(job: tuple[str, dict, torch.dtype], frontend: bool) -> str:
    line, consts, kv = job
    regs.compile_variant(consts, torch.bfloat16, kv, frontend=frontend)
    return line


def main(head_dims: list[int], frontend: bool = False, jobs: int = 1) -> None:
    work = functools.partial(_compile, frontend=frontend)
    if jobs <= 1:
        lines = map(work, combinations(head_dims))
    else:  # forked workers (no CUDA here), results in order; the first failure raises
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        lines = pool.map(work, list(combinations(head_dims)))
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head_dims", type=int, nargs="*", default=[128])
    ap.add_argument("--frontend", action="store_true", help="stop each compile at its TTIR (type checks only)")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = ap.parse_args()
    main(args.head_dims, args.frontend, args.jobs)
