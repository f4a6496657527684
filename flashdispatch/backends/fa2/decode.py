"""fa2 paged batch decode: split-KV planning and the launcher (kernel in decode_kernel.py).

plan() does all index work on the host with numpy: it clips each request's tokens to the
window, cuts them into chunks so that (chunks x KV heads) fills the GPU, and copies one
int32 array (work rows + merge rows) to the device. A request with one chunk is written to
out/lse by the decode kernel; the partials of a split request go to the workspace and the
merge kernel (merge.py) combines them. run() only launches.

Fused merge (DecodeConfig.fused_merge_max_chunks): when no request has more chunks than that,
the decode kernel merges in place of the merge kernel, one launch in all. Work column 7 holds
each split item's merge row; the last program to arrive at a (merge row, KV head, row block)
int32 counter merges those rows and zeroes the counter (decode_kernel.py). The counters, n_merge
x kv_heads x row_blocks, follow the plan arrays in the same int32 copy (at the next 256-byte
boundary), zeros from the host, so the plan's one stream-ordered copy zeroes them (no memset, no
host sync). Without CUDA graphs that copy is a tensor the plan owns. With them it is the
wrapper's int workspace: the counters' offset is the plan arrays' size, batch x graph-splits
work rows + batch merge rows, fixed by the batch size as the grid a captured graph replays is,
so every re-plan zeroes them at the same address.

CUDA graphs: the grid is fixed by the batch size (batch x max_splits programs, idle ones
exit) and the plan arrays live at fixed offsets of the wrapper's int workspace, updated in place,
so a graph captured once replays correctly after a later plan() of the same batch size.

Tuning: `DecodeConfig` fields can be overridden per plan (``plan_decode(..., config={...})``)
or through FLASHDISPATCH_FA2_DECODE_CONFIG='{"block_n": 64, "num_stages": 3, ...}'.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ...dispatch.caps import Caps
from ...dispatch.problem import FP8_DTYPES, Device, Problem
from ...dispatch.reasons import Reason, Unsupported
from ..base import AttentionInputs, AttentionParams
from ..common import TRITON_INTERPRETED, alibi_slopes, kernel_scale, kernel_window, triton_fp8_kv_reasons
from .decode_kernel import WORK_COLS, decode_kernel
from .launch import BoundKernel, SpecKeys, bind
from .merge import MERGE_INFO_COLS, DecodeMerge

_HALF = frozenset({torch.float16, torch.bfloat16})

DECODE_CAPS = Caps(
    ops=frozenset({"decode"}),
    device_types=frozenset({"cuda", "cpu"}) if TRITON_INTERPRETED else frozenset({"cuda"}),
    min_cc=(8, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF | frozenset(FP8_DTYPES),
    o_dtypes=_HALF | {torch.float32},
    head_dims=frozenset({(64, 64), (128, 128), (256, 256)}),
    page_sizes=None,
    layouts=frozenset({"NHD", "HND"}),
    features=frozenset({"causal", "sliding_window", "soft_cap", "alibi", "rope", "lse", "cuda_graph",
                        "fp8_kv", "sinks", "q_len_per_req"}),
    max_q_len_per_req=64,
)

CONFIG_ENV = "FLASHDISPATCH_FA2_DECODE_CONFIG"
_ALIGN = 256  # byte alignment of the workspace regions


@dataclass(frozen=True)
class DecodeConfig:
    """Kernel and split-policy knobs.

    block_n: tokens per inner step; num_warps / num_stages: Triton launch options;
    max_registers: per-thread register cap handed to ptxas (Triton's ``maxnreg``); 0: ptxas
    chooses. It sets how many programs fit on an SM, which bounds the KV reads in flight (sm90
    d128, 4 warps, block_n 32: ptxas gave group 4's direct-table variant and group 16's 79-80
    registers, 6 programs per SM, where 64 fits 8; see docs/perf-notes.md). Only the variant it
    was measured on takes it (`_register_cap`: one query row per request, one 16-row block, no
    RoPE/ALiBi/soft cap, no fused merge); the others, and plans that switch to ``split_block_n``
    or the busy tiles or override block_n, run uncapped (under 64 they spill, or do not compile
    at 64 rows).
    max_block_m: most query rows per program (more rows use several row blocks);
    ctas_per_sm: programs per SM the split policy aims for; min_chunk_tokens: shortest chunk
    worth a split; max_splits: most chunks of one request (CUDA-graph grids use it);
    k_rows: load K as token rows and transpose in registers instead of loading K^T tiles;
    split_block_n: block_n for plans that split requests by the default policy (few requests,
    long contexts: fewer, longer steps pay off there); None: block_n.
    fp8_dot_dtype (fp8 KV only): "q" runs both dots in q's dtype (fp8 -> bf16 is a slow
    conversion on sm90), "fp16" runs them in fp16 with q row-scaled by powers of two (see
    decode_kernel.py for the ranges).
    heads_fastest: program order of the 1-D grid: all (kv head, row block) units of a work item
    next to each other (whole pages read together), or one unit of every item at a time.
    page_prefetch: load the next tile's page numbers one step ahead, so that K/V get
    num_stages - 1 buffers (else one buffer below num_stages 5: no copy in flight during compute).
    fp8_v_convert (fp8 KV with fp16 dots): "operand" converts V inside the dot operand layout
    (one ld.shared.b8 per value), "staged" converts it in registers and stages it as fp16 in
    shared memory (more shared memory, far fewer instructions); the interpreter and GPUs before
    sm89 (whose ptxas has no fp8x2 cvt) run "operand".
    fused_merge_max_chunks: plans whose requests have at most this many chunks merge the partials
    inside the decode kernel (the last program of each split request to finish merges, through an
    arrival counter) instead of in a second kernel launch; 0: never. That last program merges
    alone, so many chunks favour the merge kernel (H200 sweeps, TB/s unfused -> fused: 32x4096 with
    2 chunks 3.70-3.75 -> 3.82-3.92, 16x8192 with 4 3.74-3.85 -> 3.82-3.92, 1x32768 with 64
    2.58-2.60 -> 2.47-2.50).
    direct_table: a plan that splits no request (and is not a CUDA-graph grid) gives the kernel
    the API's kv_indptr and last_page_len instead of a work array: one program per (request, KV
    head, row block) reads its pages and length from them, so plan() builds and uploads nothing
    (H200 bf16 GQA d128 with max_registers 64, TB/s work array -> direct: 256x1024 4.15 -> 4.15,
    128x2048 4.15 -> 4.15, 256x4096 4.39 -> 4.38; batch-256 plan() ~60-100 us less host time).
    default_config turns it on for 16-bit GQA KV up to d128, where it was measured; fp8 KV and
    MHA measured slower with it, d256 is not measured.
    busy_programs: plans of at least this many programs (request x KV head x row block) run
    ``busy_block_n`` tokens per step in ``busy_stages`` stages; 0: never. The fp8 GQA default
    takes 1536 -> 32 x 4 (H200 fp8 e4m3, 32/8 heads, TB/s, 64 x 3 -> 32 x 4: 192x4096 3.68 ->
    3.70, 256x1024 3.24 -> 3.34, 256x2048 3.54 -> 3.62, 256x4096 3.71 -> 3.77, 384x2048 3.63 ->
    3.68, 512x4096 3.80 -> 3.83; fewer programs lose: 128x4096 3.62 -> 3.28, 64x4096 3.45 ->
    3.22). A config that sets block_n or num_stages turns them off.
    pdl: on sm90+, a plan with a merge kernel launches it with programmatic dependent launch:
    every decode program signals at its start (griddepcontrol.launch_dependents), so the merge
    grid is launched while the decode grid runs, and each merge program waits
    (griddepcontrol.wait) until the decode grid has finished and its stores are visible. The
    second launch's latency leaves the critical path (H200 bf16 32/8 heads, TB/s off -> on:
    1x32768 2.66 -> 2.76, 2x16384 2.68 -> 2.75).
    """

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    max_block_m: int = 64
    ctas_per_sm: int = 4
    min_chunk_tokens: int = 256
    max_splits: int = 64
    k_rows: bool = False
    split_block_n: int | None = None
    fp8_dot_dtype: str = "q"
    heads_fastest: bool = True
    page_prefetch: bool = False
    fp8_v_convert: str = "operand"
    fused_merge_max_chunks: int = 16
    direct_table: bool = False
    max_registers: int = 0
    busy_programs: int = 0
    busy_block_n: int = 32
    busy_stages: int = 4
    pdl: bool = True

    def __post_init__(self):
        if self.fp8_dot_dtype not in ("q", "fp16"):
            raise ValueError(f"fp8_dot_dtype must be 'q' or 'fp16', got {self.fp8_dot_dtype!r}")
        if self.fp8_v_convert not in ("operand", "staged"):
            raise ValueError(f"fp8_v_convert must be 'operand' or 'staged', got {self.fp8_v_convert!r}")
        for name in ("k_rows", "heads_fastest", "page_prefetch", "direct_table", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fa2 decode config {name} must be true or false, got {getattr(self, name)!r}")
        for name, low in (("fused_merge_max_chunks", 0), ("busy_programs", 0), ("busy_block_n", 1),
                          ("busy_stages", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"fa2 decode config {name} must be an int >= {low}, got {v!r}")
        if not isinstance(self.max_registers, int) or isinstance(self.max_registers, bool) \
                or not (self.max_registers == 0 or 24 <= self.max_registers <= 255):
            raise ValueError(f"fa2 decode config max_registers must be 0 (ptxas chooses) or an int in "
                             f"[24, 255], got {self.max_registers!r}")


def default_config(problem: Problem) -> DecodeConfig:
    """Defaults by head dim and KV dtype (tuned on an H200, see docs/perf-notes.md)."""
    d = problem.head_dim_qk
    # direct_table where the H200 sweep (session 6, TB/s work array / direct) found parity:
    # 16-bit GQA (group 4 and 16, page 16 and 1, d64 and d128); fp8 256x4096 3.69 / 3.66, MHA
    # 64x4096 4.39 / 4.20 (twice) measured slower, d256 not measured
    gqa = problem.num_qo_heads != problem.num_kv_heads
    if problem.kv_dtype in FP8_DTYPES:
        if d <= 128:
            return DecodeConfig(block_n=64, num_warps=1, k_rows=True, fp8_dot_dtype="fp16", num_stages=3,
                                page_prefetch=True, fp8_v_convert="staged", busy_programs=1536 if gqa else 0)
        return DecodeConfig(block_n=64, fp8_dot_dtype="fp16", num_stages=3)
    if problem.page_size == 1 and d <= 128:
        return DecodeConfig(block_n=128, direct_table=gqa)
    if not gqa and d <= 128:
        return DecodeConfig(block_n=64, num_stages=3)
    if d <= 64:
        return DecodeConfig(block_n=64, direct_table=True)
    if d <= 128:
        return DecodeConfig(block_n=32, split_block_n=64, max_registers=64, direct_table=True)
    return DecodeConfig(block_n=32)


def _apply(cfg: DecodeConfig, source: dict) -> DecodeConfig:
    unknown = set(source) - {f.name for f in dataclasses.fields(DecodeConfig)}
    if unknown:
        raise ValueError(f"unknown fa2 decode config keys {sorted(unknown)}; "
                         f"known: {[f.name for f in dataclasses.fields(DecodeConfig)]}")
    if "block_n" in source:  # the split block and the register cap were chosen for the default block_n
        source = {"split_block_n": None, "max_registers": 0, **source}
    if "block_n" in source or "num_stages" in source:  # the busy tiles would replace both
        source = {"busy_programs": 0, **source}
    return dataclasses.replace(cfg, **source)


@functools.lru_cache(maxsize=256)
def _base_config(head_dim: int, kv_dtype: torch.dtype, page_size: int, group: int,
                 env: str | None) -> DecodeConfig:
    cfg = default_config(Problem("decode", torch.float16, kv_dtype, torch.float16, group, 1, head_dim, head_dim,
                                 page_size=page_size))
    return _apply(cfg, json.loads(env)) if env else cfg


def resolve_config(problem: Problem, overrides: dict | None = None) -> DecodeConfig:
    """Defaults, then FLASHDISPATCH_FA2_DECODE_CONFIG (JSON), then ``overrides``."""
    cfg = _base_config(problem.head_dim_qk, problem.kv_dtype, problem.page_size,
                       problem.num_qo_heads // problem.num_kv_heads, os.environ.get(CONFIG_ENV))
    return _apply(cfg, overrides) if overrides else cfg


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _merge_tile(rows: int, head_dim: int) -> tuple[int, int]:
    """(rows, partials) per load round of the fused merge for ``rows`` query rows per program: a
    [rows, partials, head_dim] float32 tile of 4K values, as merge.py's, all rows at once where
    that leaves >= 2 partials per round (sm90, d128: 4 warps keep 72 registers, 1 warp does not
    spill: the merge runs after the token loop, whose registers are free by then)."""
    pairs = max(4, 4096 // head_dim)
    block_r = min(1 << (rows - 1).bit_length(), pairs // 2)
    return block_r, pairs // block_r


@functools.lru_cache(maxsize=64)
def _with_split_block(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with block_n = split_block_n (cached: plan() is host-time bound)."""
    return dataclasses.replace(cfg, block_n=cfg.split_block_n, max_registers=0)


@functools.lru_cache(maxsize=64)
def _with_busy_tiles(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with block_n / num_stages = busy_block_n / busy_stages (cached like the split block)."""
    return dataclasses.replace(cfg, block_n=cfg.busy_block_n, num_stages=cfg.busy_stages, max_registers=0)


def _balanced_chunks(eff: np.ndarray, n: np.ndarray, block_n: int) -> np.ndarray:
    """Chunk length per request for ``n`` chunks each: equal shares, rounded up to whole blocks."""
    per = -(-eff // np.maximum(n, 1))
    return np.maximum(block_n, -(-per // block_n) * block_n)


def _never_split(batch: int, params: AttentionParams, cfg: DecodeConfig, units: int, sm_count: int) -> bool:
    """Whether `_chunk_tokens` splits no request whatever the lengths: split-KV off, no request,
    or (the policy's split) work items enough to fill the GPU unsplit."""
    if params.disable_split_kv or batch == 0:
        return True
    return params.fixed_split_size is None and batch * units >= max(sm_count, 1) * cfg.ctas_per_sm


def _chunk_tokens(eff: np.ndarray, problem: Problem, params: AttentionParams, cfg: DecodeConfig,
                  units: int, sm_count: int) -> np.ndarray | None:
    """Chunk length in tokens per request, or None: no request is split."""
    if _never_split(len(eff), params, cfg, units, sm_count):
        return None
    if params.fixed_split_size is not None:
        return np.full_like(eff, max(1, params.fixed_split_size) * problem.page_size)
    target = max(sm_count, 1) * cfg.ctas_per_sm
    # Chunks per request rounded down: the grid stays within the target (one more chunk each
    # would start a second, mostly idle wave: 32 x 4096 ran at 3.06 TB/s with 3 chunks, 3.73 with 2).
    chunk = max(cfg.min_chunk_tokens, -(-int(eff.sum()) * units // target))
    n = np.minimum(np.maximum(eff // chunk, 1), cfg.max_splits)
    return _balanced_chunks(eff, n, cfg.block_n) if n.max() > 1 else None


def _register_cap(p: Problem, cfg: DecodeConfig, block_m: int, fused_merge: bool) -> int:
    """``cfg.max_registers`` for the variant it was measured on (one query row per request in
    one 16-row block, no RoPE/ALiBi/soft cap, no fused merge), else 0: the offline sm90 compiles
    of the others spill under a cap of 64 (RoPE 76-112 bytes, the fused merge of group 8/16 up
    to 256) or, at 64 rows, do not compile."""
    plain = (p.q_len_per_req == 1 and block_m <= 16 and not fused_merge and p.pos_encoding_mode == "NONE"
             and p.logits_soft_cap <= 0)
    return cfg.max_registers if plain else 0


@functools.lru_cache(maxsize=256)
def _kernel_constants(p: Problem, cfg: DecodeConfig, block_m: int, row_blocks: int, fused_merge: bool,
                      direct: bool, pdl: bool) -> dict:
    """The decode kernel's constexprs and launch options of a plan (cached: plan() is host-time
    bound; the dict is only read, as ``bind(decode_kernel, **consts, ...)``)."""
    q_len, group = p.q_len_per_req, p.num_qo_heads // p.num_kv_heads
    fp16_dots = p.kv_dtype in FP8_DTYPES and (cfg.fp8_dot_dtype == "fp16" or p.q_dtype == torch.float16)
    merge_r, merge_s = _merge_tile(min(block_m, q_len * group), p.head_dim_vo)
    cap = _register_cap(p, cfg, block_m, fused_merge)
    return dict(
        NUM_QO_HEADS=p.num_qo_heads, GROUP=group, QLEN=q_len, ROW_BLOCKS=row_blocks,
        PAGE=p.page_size, HEAD_DIM=p.head_dim_qk, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        CAUSAL=p.mask_mode == "causal" and q_len > 1, WINDOW=p.window_left >= 0,
        SOFT_CAP=p.logits_soft_cap > 0, ALIBI=p.pos_encoding_mode == "ALIBI",
        ROPE=p.pos_encoding_mode == "ROPE_LLAMA", SINKS=p.sinks, K_ROWS=cfg.k_rows,
        FP16_DOTS=cfg.fp8_dot_dtype == "fp16" and p.kv_dtype in FP8_DTYPES,
        HEADS_FASTEST=cfg.heads_fastest, PAGE_PREFETCH=cfg.page_prefetch,
        V_STAGED=cfg.fp8_v_convert == "staged" and fp16_dots and not TRITON_INTERPRETED,
        FUSED_MERGE=fused_merge, MERGE_BLOCK_R=merge_r, MERGE_BLOCK_S=merge_s, DIRECT=direct, PDL_TRIGGER=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cap} if cap and not TRITON_INTERPRETED else {}))


class DecodePlan:
    """A planned decode: the work array on the device, the grid, and the launch options."""

    def __init__(self, problem: Problem, device: Device, params: AttentionParams, config: dict | None = None):
        cfg, p = resolve_config(problem, config), problem
        if cfg.fp8_v_convert == "staged" and device.cc is not None and device.cc < (8, 9):
            # staged V converts with cvt.*.e4m3x2/e5m2x2, which ptxas takes from sm_89 on only
            cfg = dataclasses.replace(cfg, fp8_v_convert="operand")
        self.q_len = p.q_len_per_req
        self.group = p.num_qo_heads // p.num_kv_heads
        rows = self.q_len * self.group
        self.block_m = max(16, min(1 << (rows - 1).bit_length(), cfg.max_block_m))
        self.row_blocks = -(-rows // self.block_m)
        policy_splits = not params.disable_split_kv and params.fixed_split_size is None
        target = (device.sm_count or 8) * cfg.ctas_per_sm
        programs = params.batch_size * p.num_kv_heads * self.row_blocks
        if cfg.split_block_n and policy_splits and programs < target:
            cfg = _with_split_block(cfg)
        elif cfg.busy_programs and programs >= cfg.busy_programs:
            cfg = _with_busy_tiles(cfg)
        self.problem, self.config = problem, cfg
        # griddepcontrol is sm90+ PTX; the interpreter has no launch to overlap
        self.pdl_capable = cfg.pdl and not TRITON_INTERPRETED and device.cc is not None and device.cc >= (9, 0)
        self.sm_scale = params.sm_scale
        self.rope = (1.0 / params.rope_scale, math.log2(params.rope_theta))
        self.kv_indices = params.kv_indices
        run_device = params.kv_indices.device
        self.slopes = alibi_slopes(p.num_qo_heads, run_device) if p.pos_encoding_mode == "ALIBI" else None
        self.units = p.num_kv_heads * self.row_blocks  # programs per work item
        self._build(device, params, run_device)

    def refreshed(self, device: Device, params: AttentionParams) -> DecodePlan | None:
        """This plan for the new lengths and index tensors of ``params`` (same problem, device,
        batch size and scalars): when the kernel reads the page table directly and still no request
        is split, only the tables change (a copy of the plan with the new ones, its config too:
        FLASHDISPATCH_FA2_DECODE_CONFIG is read when a plan is made afresh); None otherwise, to
        plan afresh."""
        if not self.direct or params.batch_size != self.n_work:
            return None
        if not _never_split(self.n_work, params, self.config, self.units, device.sm_count or 8):
            _, _, splits, chunk = self._partition(device, params)
            if chunk is not None or splits > 1:
                return None
        plan = object.__new__(DecodePlan)  # a shallow copy (copy.copy takes the slower __reduce_ex__ path)
        plan.__dict__.update(self.__dict__)
        plan.kv_indices = params.kv_indices
        plan.work, plan.last = params.kv_indptr, params.kv_last_page_len
        plan.plse = plan.po = plan.work
        plan._set_tables()
        return plan

    # --- planning --------------------------------------------------------------------------
    def _partition(self, device: Device, params: AttentionParams):
        """(kv lengths, window starts, graph splits, chunk tokens per request or None) of
        ``params``' requests: the split-KV partition (see `_chunk_tokens`, `_graph_splits`)."""
        p, cfg, ql = self.problem, self.config, self.q_len
        lens = np.array(params.kv_lens_host, dtype=np.int64)
        batch = len(lens)
        lo = np.maximum(lens - ql - p.window_left, 0) if p.window_left >= 0 else np.zeros(batch, np.int64)
        eff = lens - lo
        sm_count = device.sm_count or 8
        splits = self._graph_splits(batch, self.units, sm_count, params) if p.use_cuda_graph else 0
        if splits > 1 and params.fixed_split_size is None:
            chunk = _balanced_chunks(eff, np.minimum(-(-eff // cfg.min_chunk_tokens), splits), cfg.block_n)
        else:
            chunk = _chunk_tokens(eff, p, params, cfg, self.units, sm_count)
        return lens, lo, splits, chunk

    def _build(self, device: Device, params: AttentionParams, run_device: torch.device) -> None:
        p, cfg, ql = self.problem, self.config, self.q_len
        lens, lo, splits, chunk = self._partition(device, params)
        batch = len(lens)
        eff = lens - lo
        unsplit = chunk is None and splits <= 1  # one work item per request, nothing to merge
        if unsplit:
            self.n_work, self.n_merge, self.max_chunks = batch, 0, 1
            if cfg.direct_table and not p.use_cuda_graph:
                self._place_direct(params)
                return
        pages = -(-lens // p.page_size)
        page_base = pages.cumsum() - pages
        if unsplit:
            meta = np.zeros((batch, WORK_COLS), dtype=np.int32)
            meta[:, 0] = np.arange(batch)
            meta[:, 1] = page_base
            meta[:, 2] = lo
            meta[:, 3] = lens
            meta[:, 4] = lens
            meta[:, 5] = -1
            meta[:, 6] = 1
            self._place(meta.ravel(), batch, 0, params, run_device)
            return

        nsplit = np.maximum(1, -(-eff // chunk)) if chunk is not None else np.ones_like(eff)
        req = np.arange(batch).repeat(nsplit)
        if splits:  # CUDA graph: request b owns work items and partial slots b*splits .. +splits-1
            if nsplit.max() > splits:
                raise ValueError(f"use_cuda_graph: a request needs {int(nsplit.max())} chunks of "
                                 f"fixed_split_size={params.fixed_split_size} pages, the graph grid holds "
                                 f"{splits}; raise fixed_split_size")
            n_work, n_partial = batch * splits, (batch * splits if splits > 1 else 0)
            items = np.arange(len(req)) - (nsplit.cumsum() - nsplit).repeat(nsplit) + req * splits
            sidx = items - req * splits
            slot_of = np.where(nsplit[req] > 1, items, -1)
            merge_rows = np.arange(batch if splits > 1 else 0)
            merge_row_of = np.where(nsplit[req] > 1, req, -1)
            merge_first = merge_rows * splits
        else:  # items in order (a slice below, not an index array: plan() is host-time bound)
            n_work = len(req)
            items = slice(None)
            first_item = nsplit.cumsum() - nsplit
            sidx = np.arange(n_work) - first_item[req]
            merge_rows = np.flatnonzero(nsplit > 1)
            if merge_rows.size == batch:  # every request split (the usual case): every item a partial
                slot_of, merge_row_of, n_partial, merge_first = np.arange(n_work), req, n_work, first_item
            else:
                split_item = nsplit[req] > 1
                slot_of = np.where(split_item, split_item.cumsum() - 1, -1)
                merge_row_of = np.where(split_item, ((nsplit > 1).cumsum() - 1)[req], -1)
                n_partial = int(split_item.sum())
                merge_first = nsplit[merge_rows].cumsum() - nsplit[merge_rows]
        n_merge = len(merge_rows)
        meta = np.zeros(n_work * WORK_COLS + n_merge * MERGE_INFO_COLS, dtype=np.int32)
        work = meta[:n_work * WORK_COLS].reshape(n_work, WORK_COLS)
        info = meta[n_work * WORK_COLS:].reshape(n_merge, MERGE_INFO_COLS)
        if splits:  # the graph grid's idle items
            work[:, 0] = -1
            work[:, 7] = -1
        req_chunk = chunk[req] if chunk is not None else 0
        start = lo[req] + sidx * req_chunk
        lens_req = lens[req]
        work[items, 0] = req
        work[items, 1] = page_base[req]
        work[items, 2] = start
        work[items, 3] = np.minimum(start + req_chunk, lens_req) if chunk is not None else lens_req
        work[items, 4] = lens_req
        work[items, 5] = slot_of
        work[items, 6] = sidx == 0
        work[items, 7] = merge_row_of
        info[:, 0] = merge_rows * ql
        info[:, 1] = merge_first
        info[:, 2] = nsplit[merge_rows]
        self.n_work, self.n_merge = n_work, n_merge
        # CUDA graphs: the most chunks a request can get (fixed by the batch size, as the kernel
        # variant a captured graph replays must be)
        self.max_chunks = splits if splits else int(nsplit.max())
        self._place(meta, n_work, n_partial, params, run_device)

    def _graph_splits(self, batch: int, units: int, sm_count: int, params: AttentionParams) -> int:
        """Chunks per request in a CUDA-graph grid: a function of the batch size alone."""
        if params.disable_split_kv:
            return 1
        target = sm_count * self.config.ctas_per_sm
        return max(1, min(self.config.max_splits, target // max(batch * units, 1)))

    def _place_direct(self, params: AttentionParams) -> None:
        """`DecodeConfig.direct_table`: the kernel reads kv_indptr / last_page_len (on the run
        device: a host one is uploaded here, with the API's other host arrays) for its request."""
        self.direct = True
        self.fused_merge = False
        self.work, self.last = params.kv_indptr, params.kv_last_page_len
        self.info = self.counters = None
        self.plse = self.po = self.work  # never written: no request is split
        self.workspace_bytes = 0
        self._launch_constants()

    def _place(self, meta: np.ndarray, n_work: int, n_partial: int, params: AttentionParams,
               run_device: torch.device) -> None:
        """Copy the plan arrays (and the fused merge's zeroed counters after them) to the device
        and carve the partials out of the workspace."""
        p, ql = self.problem, self.q_len
        heads, d = p.num_qo_heads, p.head_dim_vo
        graph = p.use_cuda_graph
        self.direct, self.last = False, None
        self.fused_merge = self.n_merge > 0 and self.max_chunks <= self.config.fused_merge_max_chunks
        n_meta = meta.size
        if self.fused_merge:
            counters_at = _align(meta.nbytes) // 4
            meta = np.concatenate([meta, np.zeros(counters_at - n_meta + self.n_merge * self.units, np.int32)])
        lse_bytes = _align(n_partial * ql * heads * 4)
        need = lse_bytes + n_partial * ql * heads * d * 4 if n_partial else 0
        ws = params.workspace
        have = 0 if ws is None else ws.numel() * ws.element_size()
        if need > have:
            raise ValueError(f"float_workspace_buffer too small: {have} bytes, this decode plan needs {need} "
                             f"bytes ({n_partial} split-KV partials of {ql}x{heads}x{d} float32)")
        host = torch.from_numpy(meta)  # pageable: a copy returns once the driver has staged it
        if graph:
            # the wrapper's own int workspace: same addresses at every re-plan, never shared
            iws = params.int_workspace
            if iws is None or iws.numel() * iws.element_size() < meta.nbytes:
                raise ValueError(f"fa2 decode with use_cuda_graph needs {meta.nbytes} bytes of int workspace, "
                                 f"got {0 if iws is None else iws.numel() * iws.element_size()}")
            dst = iws.view(torch.uint8).reshape(-1)[:meta.nbytes].view(torch.int32)
            dst.copy_(host, non_blocking=True)
        else:
            dst = host.to(run_device, non_blocking=True)
        self.work = dst[:n_work * WORK_COLS]
        self.info = dst[n_work * WORK_COLS:n_meta]
        self.counters = dst[counters_at:] if self.fused_merge else None
        if need:  # partials: scratch of run(), at fixed offsets of the (possibly shared) float workspace
            self.plse = ws[:n_partial * ql * heads * 4].view(torch.float32)
            self.po = ws[lse_bytes:lse_bytes + n_partial * ql * heads * d * 4].view(torch.float32)
        else:
            self.plse = self.po = self.work  # never written: no request is split
        self.workspace_bytes = need
        self._launch_constants()

    # --- running ----------------------------------------------------------------------------
    def _launch_constants(self) -> None:
        """Everything of the decode launch that run() does not learn from the inputs."""
        p = self.problem
        self._grid = (self.n_work * p.num_kv_heads * self.row_blocks,)
        self._plan_scalars = (max(kernel_window(p.window_left), 0), p.logits_soft_cap or 1.0, *self.rope)
        merge_kernel = self.n_merge > 0 and not self.fused_merge
        self.pdl = self.pdl_capable and merge_kernel
        self._merge = (DecodeMerge(self.po, self.plse, self.info, self.n_merge, self.q_len, p.num_qo_heads,
                                   p.head_dim_vo, self.pdl) if merge_kernel else None)
        self._consts = _kernel_constants(p, self.config, self.block_m, self.row_blocks, self.fused_merge,
                                         self.direct, self.pdl)
        self._launchers: dict = {}  # (WRITE_LSE, Q/K/V_SCALE_T) -> BoundKernel
        self._set_tables()

    def _set_tables(self) -> None:
        """The plan's tensors in the launch's order, and the specialisation keys of launches with
        them (what a `refreshed` plan changes)."""
        dummy = self.plse
        self._tables = (self.po, self.plse, self.info if self.fused_merge else dummy,
                        self.counters if self.fused_merge else dummy, self.work,
                        self.last if self.direct else dummy, self.kv_indices,
                        self.slopes if self.slopes is not None else dummy)
        self._specs = SpecKeys()  # a run's call kind -> spec_key of its arguments (see run())

    def _bind(self, variant: tuple[bool, bool, bool, bool]) -> BoundKernel:
        write_lse, q_t, k_t, v_t = variant
        launch = self._launchers[variant] = bind(decode_kernel, **self._consts, WRITE_LSE=write_lse, Q_SCALE_T=q_t,
                                                 K_SCALE_T=k_t, V_SCALE_T=v_t)
        return launch

    def run(self, inputs: AttentionInputs) -> None:
        """Launch decode (and merge when some request is split, unless the kernel fuses the merge)
        into inputs.out / inputs.lse."""
        if self.n_work == 0:
            return
        q, kv, out, lse = inputs.q, inputs.kv, inputs.out, inputs.lse
        k, v = kv.k, kv.v
        ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), out.stride()  # one call each: run() is host-bound
        if ks[3] != 1 or vs[3] != 1 or qs[2] != 1 or os_[2] != 1:
            raise ValueError("fa2 decode needs q, out and the k/v cache with a contiguous head_dim")
        if kv.layout == "HND":
            ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
        dummy = self.plse
        q_f, q_t, q_in = kernel_scale(inputs.q_scale, "q_scale", dummy)
        k_f, k_t, k_in = kernel_scale(inputs.k_scale, "k_scale", dummy)
        v_scale, v_t, v_in = kernel_scale(inputs.v_scale, "v_scale", dummy)
        qk_scale = self.sm_scale * q_f * k_f
        sinks = inputs.sinks
        if sinks is None:
            if self.problem.sinks:
                raise ValueError("the plan has sinks: run() needs inputs.sinks")
            sinks = dummy
        write_lse = lse is not None
        po, plse, merge_info, counters, work, last, kv_indices, slopes = self._tables
        variant = (write_lse, q_in, k_in, v_in)
        launch = self._launchers.get(variant) or self._bind(variant)
        ls = lse.stride() if write_lse else (0, 0)
        args = (q, k, v, out, lse if write_lse else dummy, po, plse, merge_info, counters, work, last, kv_indices,
                slopes,
                sinks, q_t, k_t, v_t, qk_scale, v_scale, *self._plan_scalars, qs[0], qs[1], os_[0], os_[1], *ls,
                ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
        # Triton's specialisation of these arguments, kept per call kind: the plan's own tensors
        # are fixed, the scalars' types too; what varies is keyed here (all pointers 16-byte
        # aligned, as nearly always; otherwise spec_key works it out for each call)
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | args[4].data_ptr()
                   | sinks.data_ptr() | q_t.data_ptr() | k_t.data_ptr() | v_t.data_ptr()) & 15 == 0
        spec = None
        if aligned:
            spec = self._specs.get((variant, qs, os_, ls, ks, vs, q.dtype, k.dtype, out.dtype, args[4].dtype,
                                    sinks.dtype, q_t.dtype, k_t.dtype, v_t.dtype), args)
        launch.launch_with_spec(spec, self._grid, args)
        if self._merge is not None:
            self._merge(out, lse)


def decode_extra_checks(problem: Problem, device: Device) -> list[Reason]:
    """Combinations Caps cannot express: an fp8 KV type this GPU's Triton converts."""
    return triton_fp8_kv_reasons(problem.kv_dtype, device.cc)


def plan_decode(problem: Problem, device: Device, params: AttentionParams, config: dict | None = None) -> DecodePlan:
    """Plan a paged batch decode (see the module docstring); ``config`` overrides `DecodeConfig`."""
    reasons = decode_extra_checks(problem, device)
    if reasons:
        raise Unsupported("fa2 decode cannot run this problem", {"fa2": reasons})
    return DecodePlan(problem, device, params, config)
