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
merge kernel's plain only), for GPUTarget("cuda", 90, 32); it prints one line per combination and exits non-zero at the first
one that fails. d128 by default (the CPU suite runs that); other head dims as arguments.

    .venv/bin/python scripts/decode_compile_matrix.py [HEAD_DIM ...]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_registers as regs  # noqa: E402  (sets up an offline Triton: no interpreter, own cache)
import torch  # noqa: E402

from flashdispatch.backends.fa2 import decode_variant as fvar  # noqa: E402
from flashdispatch.backends.fa2.decode_config import line_variant, resolve_config, with_split_block, with_tile  # noqa: E402
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


def main(head_dims: list[int]) -> None:
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
            # (label, config, fused merge, direct table, direct split, work rows per program, line)
            variants = [(f"{name}{tile}", cfg, fused, direct, split, 1, False) for cfg, tile in tiles
                        for name, fused, direct, split in LAYOUTS if not direct or kv == torch.bfloat16]
            # a packed plan: the split block's work array, 2 up to pack_items rows a program (as it
            # needs; the most compiled here, the kernel's body repeated that often)
            if base.pack_items > 1:
                packed = with_split_block(base) if base.split_block_n else base
                variants.append((f"packed x{base.pack_items}, fused", packed, True, False, False, base.pack_items,
                                 False))
                if base.wave_pack_line and p.window_left < 0:  # the merge kernel's line: plain only
                    variants += [(f"line{merge}", line_variant(packed), fused, True, False, 1, True)
                                 for merge, fused in ((", fused", True), ("", False)) if fused or not changes]
            for label, cfg, fused, direct, split, items, line in variants:
                consts = fvar.kernel_constants(p, cfg, block_m, row_blocks, fused, direct, split, False, items, line)
                consts.update(WRITE_LSE=True, Q_SCALE_T=False, K_SCALE_T=False, V_SCALE_T=False)
                regs.compile_variant(consts, torch.bfloat16, kv)
                print(f"d{d:<4}{str(kv).removeprefix('torch.'):14} {feature:22} {label}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [128])
