"""Which fa2 decode kernel a plan compiles: the row blocks of a program's query rows, the fused
merge's tile, the register cap, and the kernel's constexprs and launch options (decode.py plans,
decode_kernel.py is the kernel)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ...dispatch.problem import FP8_DTYPES, Problem
from ..common import TRITON_INTERPRETED
from .decode_config import DecodeConfig

LINE_BLOCK = 256  # kv_indptr entries a line program counts at a time (decode_kernel.py's LINE)


def merge_tile(rows: int, head_dim: int, values: int) -> tuple[int, int]:
    """(rows, partials) per load round of the fused merge for ``rows`` query rows per program: a
    [rows, partials, head_dim] float32 tile of ``values`` (DecodeConfig.fused_merge_values), all
    rows at once where that leaves >= 2 partials per round (sm90, d128, 4K values: 4 warps keep
    72 registers, 1 warp does not spill: the merge runs after the token loop, whose registers
    are free by then)."""
    pairs = max(4, values // head_dim)
    block_r = min(1 << (rows - 1).bit_length(), pairs // 2)
    return block_r, pairs // block_r


def row_block(rows: int, cfg: DecodeConfig) -> tuple[int, int]:
    """(block_m, row blocks) for a program's ``rows`` query rows (q_len_per_req x group): the next
    power of two, at least the mma's side the rows are on (M 16, or N 8 with ``cfg.swap_ab``), at
    most ``cfg.max_block_m``."""
    block_m = max(8 if cfg.swap_ab else 16, min(1 << (rows - 1).bit_length(), cfg.max_block_m))
    return block_m, -(-rows // block_m)


def _one_row_block(p: Problem, block_m: int) -> bool:
    """One query row per request in one 16-row block, no soft cap."""
    return p.q_len_per_req == 1 and block_m <= 16 and p.logits_soft_cap <= 0


def plain_variant(p: Problem, block_m: int) -> bool:
    """Whether the kernel is the variant the configs' register cap and programs-per-SM figures
    were measured on: one query row per request in one 16-row block, no RoPE/ALiBi/soft cap."""
    return p.pos_encoding_mode == "NONE" and _one_row_block(p, block_m)


def rope_variant(p: Problem, block_m: int) -> bool:
    """Whether the kernel is the plain variant with RoPE (`DecodeConfig.rope_block_n`)."""
    return p.pos_encoding_mode == "ROPE_LLAMA" and _one_row_block(p, block_m)


@functools.lru_cache(maxsize=64)
def without_waves(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` without its programs-per-SM figures (wave_tiles, wave_slots): for kernel
    variants other than the one they were measured on."""
    return dataclasses.replace(cfg, wave_tiles=(), wave_slots=0)


@functools.lru_cache(maxsize=64)
def rope_config(cfg: DecodeConfig) -> DecodeConfig:
    """The config a `rope_variant` plan runs: ``cfg.rope_block_n`` capped at
    ``cfg.rope_max_registers``, and ``cfg.rope_split_block_n`` capped at
    ``cfg.rope_split_max_registers`` for its split block (a block 0: the config's own; a cap 0: none)."""
    return dataclasses.replace(cfg, block_n=cfg.rope_block_n or cfg.block_n, max_registers=cfg.rope_max_registers,
                               split_block_n=cfg.rope_split_block_n or cfg.split_block_n,
                               split_max_registers=cfg.rope_split_max_registers)


@functools.lru_cache(maxsize=64)
def for_cuda_graph(cfg: DecodeConfig) -> DecodeConfig:
    """The config of a CUDA-graph plan off the line: without the eager plans' few-programs split
    (`DecodeConfig.split_ctas_per_sm` and the split block it runs), else ``cfg`` itself."""
    if not cfg.split_ctas_per_sm:
        return cfg
    return dataclasses.replace(cfg, split_ctas_per_sm=0, split_block_n=None)


@functools.lru_cache(maxsize=64)
def with_split_block(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with block_n = split_block_n, capped at split_max_registers (cached: plan() is
    host-time bound)."""
    return dataclasses.replace(cfg, block_n=cfg.split_block_n, max_registers=cfg.split_max_registers)


@functools.lru_cache(maxsize=64)
def line_variant(cfg: DecodeConfig) -> DecodeConfig:
    """The config a line plan runs (`DecodeConfig.wave_pack_line`), from its packed plans' one:
    page_prefetch on where line_page_prefetch says."""
    return dataclasses.replace(cfg, page_prefetch=True) if cfg.line_page_prefetch and not cfg.page_prefetch else cfg


@functools.lru_cache(maxsize=64)
def with_tile(cfg: DecodeConfig, block_n: int, num_stages: int) -> DecodeConfig:
    """``cfg`` with this block_n x num_stages, uncapped (cached like the split block); ``cfg``
    itself, register cap included, where that is its own tile."""
    if (block_n, num_stages) == (cfg.block_n, cfg.num_stages):
        return cfg
    return dataclasses.replace(cfg, block_n=block_n, num_stages=num_stages, max_registers=0)


def register_cap(p: Problem, cfg: DecodeConfig, block_m: int, fused_merge: bool) -> int:
    """The register cap handed to ptxas: ``cfg.max_registers`` for the variants it was measured on
    (`plain_variant`; `rope_variant`, whose `rope_config` sets it), without fused merge; else 0:
    the offline sm90 compiles of the others spill under a cap of 64 (the fused merge of group 8/16
    up to 256 bytes) or, at 64 rows, do not compile."""
    if fused_merge:
        return 0
    return cfg.max_registers if plain_variant(p, block_m) or rope_variant(p, block_m) else 0


@functools.lru_cache(maxsize=256)
def kernel_constants(p: Problem, cfg: DecodeConfig, block_m: int, row_blocks: int, fused_merge: bool,
                     direct: bool, direct_split: bool, pdl: bool, items: int = 1, line: bool = False,
                     table: bool = False, total_split: bool = False, rope: int | None = None) -> dict:
    """The decode kernel's constexprs and launch options of a plan (cached: plan() is host-time
    bound; the dict is only read, as ``bind(decode_kernel, **consts, ...)``); ``rope``: the
    kernel's ROPE (`trig.rope_kernel_variant` of the plan's rope_scale and rope_theta; None: of
    FlashInfer's defaults, 1 and 1e4)."""
    q_len, group = p.q_len_per_req, p.num_qo_heads // p.num_kv_heads
    fp16_dots = p.kv_dtype in FP8_DTYPES and (cfg.fp8_dot_dtype == "fp16" or p.q_dtype == torch.float16)
    merge_r, merge_s = merge_tile(min(block_m, q_len * group), p.head_dim_vo, cfg.fused_merge_values)
    cap = register_cap(p, cfg, block_m, fused_merge)
    return dict(
        NUM_QO_HEADS=p.num_qo_heads, GROUP=group, QLEN=q_len, ROW_BLOCKS=row_blocks,
        PAGE=p.page_size, HEAD_DIM=p.head_dim_qk, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        CAUSAL=p.mask_mode == "causal" and q_len > 1, WINDOW=p.window_left >= 0,
        SOFT_CAP=p.logits_soft_cap > 0, ALIBI=p.pos_encoding_mode == "ALIBI",
        ROPE=int(p.pos_encoding_mode == "ROPE_LLAMA") if rope is None else rope, SINKS=p.sinks, K_ROWS=cfg.k_rows,
        FP16_DOTS=cfg.fp8_dot_dtype == "fp16" and p.kv_dtype in FP8_DTYPES,
        HEADS_FASTEST=cfg.heads_fastest, PAGE_PREFETCH=cfg.page_prefetch,
        V_STAGED=cfg.fp8_v_convert == "staged" and fp16_dots and not TRITON_INTERPRETED,
        FUSED_MERGE=fused_merge, MERGE_BLOCK_R=merge_r, MERGE_BLOCK_S=merge_s, DIRECT=direct,
        DIRECT_SPLIT=direct_split, PDL_TRIGGER=pdl, SWAP_AB=cfg.swap_ab, ITEMS=items,
        LINE=line, LINE_BLOCK=LINE_BLOCK, TABLE=table, TOTAL_SPLIT=total_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cap} if cap and not TRITON_INTERPRETED else {}))
