"""fa2 prefill (paged, ragged, single): capabilities, the plan and its launch (tile configs:
prefill_config.py).

plan_prefill() builds the work list once on the host (one item per BLOCK_M query rows of a
request, heaviest first), copies it to the device and fixes the grid; PrefillPlan.run() only
reads strides and launches. Split-KV: when the query tiles x heads are far below what fills the
GPU and the KV is long, or when ``fixed_split_size`` asks for it, a tile's visible KV range is cut
into chunks, one work item per (tile, chunk); the chunks' fp32 partial states go to the float
workspace and fa2's merge kernel (merge.py) combines them per query row. With ``use_cuda_graph``
the list lives at fixed offsets of the wrapper's int workspace and a fixed number of persistent
programs stride over it, so a captured run() replays correctly after a re-plan of a same-shaped
problem; split-KV is off in that mode. The kernel is in prefill_kernels.py; ``PrefillConfig.tma``
(on by default for 16-bit d65-128 on sm90 without a custom mask) loads ragged K/V through TMA
descriptors where that applies (prefill_tma.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton.language as tl

from ...dispatch.caps import Caps
from ...dispatch.problem import FP8_DTYPES, Device, Problem, dtype_name
from ...dispatch.reasons import Reason, Unsupported
from ...environ import env_get
from ..base import AttentionInputs, AttentionParams, PagedKV, RaggedKV
from ..common import TRITON_INTERPRETED, alibi_slopes, kernel_scales, kernel_window, triton_fp8_kv_reasons
from .launch import bind
from . import tuning
from .merge import MERGE_INFO_COLS, DecodeMerge
from .prefill_kernels import RUNS_HEAD, WORK_COLS, fa2_prefill_kernel, qk_parts
from .prefill_mask_tiles import heaviest_first_kernel, mask_tile_classes_kernel, mask_tile_runs_kernel
from .prefill_config import CONFIG_ENV, PrefillConfig, config_from_env, default_config
from .prefill_rope import PrerotatedPrefill, prerotation_applies, without_rope
from .prefill_tma import launch_with_scratch, tma_layout_ok, tma_unused_reason
from .trig import rope_kernel_variant, rope_scalars

_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

PREFILL_CAPS = Caps(
    ops=frozenset({"prefill_paged", "prefill_ragged"}),
    device_types=frozenset({"cuda", "cpu"}) if TRITON_INTERPRETED else frozenset({"cuda"}),
    min_cc=(8, 0),
    q_dtypes=_HALF_DTYPES,
    kv_dtypes=_HALF_DTYPES | frozenset(FP8_DTYPES),
    o_dtypes=_HALF_DTYPES,
    head_dims=frozenset({(64, 64), (128, 128), (256, 256), (192, 128)}),
    page_sizes=frozenset(range(1, 129)),
    layouts=frozenset({"NHD", "HND"}),
    features=frozenset({"causal", "custom_mask", "sliding_window", "soft_cap", "alibi", "rope", "lse",
                        "cuda_graph", "fp8_kv", "sinks"}),
)

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# CUDA-graph mode: item count at byte 0 of the int workspace, the items from byte _GRAPH_ITEMS_AT.
_GRAPH_ITEMS_AT = 256
_ALIGN = 256  # byte alignment of the partial-output region of the float workspace
_LIST_CHUNK = 256  # KV tiles the custom-mask runs kernel reads per step
_ORDER_ROWS, _ORDER_STEP = 32, 512  # heaviest_first_kernel: rows ranked per program, compared per step
# the kernel gets qk_scale as fp32: below this it may round or flush to 0, and -inf * 0 is NaN
_MIN_NORMAL_F32 = 2.0**-126
_MAX_ROW_STRIDE = 2**31  # K/V page and token strides: the kernel forms row offsets with 32x32-bit products


class LaunchVariant(NamedTuple):
    """The per-run constexprs of a prefill launch: q dtype, sinks, lse, per-tensor q/k/v scale
    tensors, TMA loads, V rows at K's row offsets (paged tiles that cross pages, with equal K/V
    page and token strides), and a score scale known to be > 0 (no q/k scale tensors)."""
    dtype: torch.dtype
    sinks: bool
    has_lse: bool
    q_scale_t: bool
    k_scale_t: bool
    v_scale_t: bool
    tma: bool
    shared_rows: bool
    scale_pos: bool


def prefill_extra_checks(problem: Problem, device: Device) -> list[Reason]:
    """Combinations Caps cannot express: KV must be q's dtype or fp8, and an fp8 type this GPU's
    Triton converts."""
    if problem.kv_dtype != problem.q_dtype and problem.kv_dtype not in FP8_DTYPES:
        return [Reason("dtype", f"kv_dtype={dtype_name(problem.kv_dtype)} with q_dtype="
                       f"{dtype_name(problem.q_dtype)}: KV must match q or be fp8")]
    return triton_fp8_kv_reasons(problem.kv_dtype, device.cc)


def tile_ranges(qo_lens, kv_lens, block_m: int, causal: bool, window_left: int) -> np.ndarray:
    """int64 [tiles, 6]: (request, first row, qo_len, kv_len, first visible key, end of visible
    keys) per BLOCK_M query rows, requests in order: the keys any row of the tile can see under
    causal and window bounds (numpy throughout: plan() is host-time bound)."""
    q, k = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    n = -(-q // block_m)
    req = np.arange(len(q)).repeat(n)
    m0 = (np.arange(len(req)) - (n.cumsum() - n).repeat(n)) * block_m
    q, k = q[req], k[req]
    if causal:
        hi = np.maximum(np.minimum(k, np.minimum(m0 + block_m, q) + k - q), 0)
    else:
        hi = k
    lo = np.minimum(np.maximum(0, m0 + k - q - window_left), hi) if window_left >= 0 else np.zeros_like(k)
    return np.stack([req, m0, q, k, lo, hi], 1)


def policy_splits(works: list[int], heads: int, cfg: PrefillConfig, sm_count: int) -> list[int] | None:
    """Chunks per query tile when (tiles x heads) programs leave the GPU idle, else None.

    Each tile gets a share of ``sm_count * ctas_per_sm`` programs proportional to its visible
    KV tokens (rounded), with chunks of at least ``min_chunk_tokens`` and at most ``max_splits``.
    """
    target = sm_count * cfg.ctas_per_sm
    total = sum(works)
    if target == 0 or total == 0 or len(works) * heads >= target:
        return None
    per_token = target / (heads * total)  # programs per visible KV token of one head
    splits = [max(1, min(cfg.max_splits, w // cfg.min_chunk_tokens, round(w * per_token))) for w in works]
    return splits if max(splits) > 1 else None


def balanced_chunks(lo: int, hi: int, n: int, block_n: int) -> list[tuple[int, int]]:
    """[lo, hi) in at most ``n`` chunks of equal length, starting and ending on BLOCK_N
    boundaries (except the first start and the last end), none empty."""
    start = lo // block_n * block_n
    per_chunk = -(-(hi - start) // n)
    size = -(-per_chunk // block_n) * block_n
    return [(max(a, lo), min(a + size, hi)) for a in range(start, hi, size)]


def fixed_chunks(lo: int, hi: int, kv_len: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks [j * chunk, (j + 1) * chunk) that meet [lo, hi): fixed positions, so a request's
    result does not depend on the rest of the batch."""
    if hi <= lo:
        return [(0, kv_len)]
    return [(j * chunk, min((j + 1) * chunk, kv_len)) for j in range(lo // chunk, (hi - 1) // chunk + 1)]


@dataclass
class WorkList:
    """items [n, WORK_COLS] int32 (heaviest first; the tile-list offset column is 0 until
    ``add_tile_lists``); merge [m, MERGE_INFO_COLS] int32, one row per query row whose tile is
    split: (output row, first partial row, chunks, 0)."""

    items: np.ndarray
    merge: np.ndarray
    partial_rows: int


def build_work_list(tiles: np.ndarray, chunks_of, block_m: int, qo_starts: list[int]) -> WorkList:
    """One item per (tile, chunk); ``chunks_of(tile index)`` gives the tile's chunks [(kv_lo, kv_hi)]
    (None: every tile is one chunk, its whole KV). A tile with one chunk is written to out/lse
    directly; query row i of a split tile owns the partial rows base + i * chunks + c. Items are
    ordered by visible keys, most first (stable)."""
    if chunks_of is None:
        items = np.zeros((len(tiles), WORK_COLS), dtype=np.int32)
        t = tiles[np.argsort(tiles[:, 4] - tiles[:, 5], kind="stable")]
        items[:, :4] = t[:, :4]  # request, first row, qo_len, kv_len
        items[:, 5] = t[:, 3]  # kv_hi: the whole KV (kv_lo 0)
        items[:, 6] = -1  # written directly
        items[:, 8] = 1  # one chunk
        return WorkList(items, np.zeros((0, MERGE_INFO_COLS), np.int32), 0)
    items, merge, part_rows = [], [], 0
    for t, (req, m0, q, k, lo, hi) in enumerate(tiles.tolist()):
        chunks = chunks_of(t)
        if len(chunks) <= 1:
            items.append((hi - lo, req, m0, q, k, 0, k, -1, 0, 1, 0))
            continue
        n, rows = len(chunks), np.arange(min(block_m, q - m0))
        for c, (a, z) in enumerate(chunks):
            items.append((min(z, hi) - max(a, lo), req, m0, q, k, a, z, part_rows, c, n, 0))
        merge.append(np.stack([qo_starts[req] + m0 + rows, part_rows + rows * n, np.full_like(rows, n),
                               np.zeros_like(rows)], 1))
        part_rows += len(rows) * n
    items.sort(key=lambda it: -it[0])
    return WorkList(np.array([it[1:] for it in items], dtype=np.int32).reshape(-1, WORK_COLS),
                    np.concatenate(merge).astype(np.int32) if merge else np.zeros((0, MERGE_INFO_COLS), np.int32),
                    part_rows)


def add_tile_lists(items: np.ndarray, block_n: int) -> tuple[int, int]:
    """Give every work item room for its custom-mask tile runs (a head and at most one run of two
    int32 per KV tile meeting its chunk [kv_lo, kv_hi)): writes the offsets into column 9 and
    returns (list length in int32, most KV tiles of one item). The sizes are even, and half an
    item's offset is the first of its bitmap slots (one per KV tile)."""
    if len(items) == 0:
        return RUNS_HEAD, 1
    n_tiles = -(-items[:, 5] // block_n) - items[:, 4] // block_n
    sizes = 2 * n_tiles.astype(np.int64) + RUNS_HEAD
    items[:, 9] = np.cumsum(sizes) - sizes
    return int(sizes.sum()), max(int(n_tiles.max()), 1)


class PrefillPlan:
    """A planned prefill: work list on the device, constexpr features, grid, tile config."""

    def __init__(self, problem: Problem, device: Device, params: AttentionParams, config: PrefillConfig,
                 q_rope: int = 0):
        """``q_rope``: for a problem planned without RoPE whose K the caller rotates first
        (prefill_rope.py), the RoPE kind (`trig.rope_kernel_variant`) the kernel applies to Q."""
        self.problem, self.params, self.config = problem, params, config
        self.paged = problem.op == "prefill_paged"
        self.rope_kind = rope_kernel_variant(problem.pos_encoding_mode, params.rope_scale, params.rope_theta,
                                             problem.head_dim_qk)
        self.q_rope = q_rope
        # page ids clamped into the cache unless plan() checked them before any launch; a CUDA
        # graph replays this kernel after re-plans whose indices may not be checked yet
        self.clamp_pages = self.paged and (problem.use_cuda_graph or not params.indices_checked)
        if problem.mask_mode == "custom" and (params.packed_mask is None or params.mask_indptr is None):
            raise ValueError("fa2 prefill: mask_mode='custom' needs packed_mask and mask_indptr")
        if self.paged and params.kv_indices is None:
            raise ValueError("fa2 prefill: paged KV needs kv_indices")
        dev = params.qo_indptr.device
        tiles = tile_ranges(params.qo_lens_host, params.kv_lens_host, config.block_m,
                            problem.mask_mode == "causal", problem.window_left)
        qo_starts = np.cumsum([0, *params.qo_lens_host]).tolist()
        work = build_work_list(tiles, self._chunking(tiles, device, params), config.block_m, qo_starts)
        self.num_items, self.n_merge, self.partial_rows = len(work.items), len(work.merge), work.partial_rows
        custom = problem.mask_mode == "custom"
        list_len, max_tiles = add_tile_lists(work.items, config.block_n) if custom else (0, 0)
        self.workspace_bytes = self._carve_partials(params.workspace)
        self.tiles = None
        if problem.use_cuda_graph:
            flat = torch.from_numpy(work.items.ravel())
            self.work, self.num_work = self._graph_work_list(params.int_workspace, flat, dev, list_len)
            self.info = None
            self.grid = (max(device.sm_count, 4) * 2,)
        else:
            # pageable source: the copy returns once the driver has staged it (no wait for the GPU)
            meta = torch.from_numpy(np.concatenate([work.items.ravel(), work.merge.ravel()])).to(dev, non_blocking=True)
            self.work = self.num_work = meta[:work.items.size]
            self.info = meta[work.items.size:]
            self.grid = (self.num_items * problem.num_qo_heads,)
            if custom:
                self.tiles = torch.empty(list_len, dtype=torch.int32, device=dev)
        self._merge = (DecodeMerge(self.po, self.plse, self.info, self.n_merge, 1, problem.num_qo_heads,
                                   problem.head_dim_vo) if self.n_merge else None)
        self._mask_classes = self.tile_bits = None
        if custom and self.num_items:
            self._mask_classes = torch.empty((self.num_items, max_tiles), dtype=torch.int8, device=dev)
            self._ordered = torch.empty_like(self.work)
            self._visible = torch.empty(self.num_items, dtype=torch.int32, device=dev)
            self.tile_bits = self._tile_bitmaps(list_len // 2 * config.block_m * config.block_n // 16, dev, params)
            self.refresh_tile_lists()
        elif custom and problem.use_cuda_graph:  # no items: the bitmaps need an address too
            self.tile_bits = self._tile_bitmaps(1, dev, params)
        self.alibi = alibi_slopes(problem.num_qo_heads, dev) if problem.pos_encoding_mode == "ALIBI" else None
        # config.tma where it applies (else ignored, see prefill_tma.py); run() also checks each call's K/V views
        self.tma_reason = ("tma=0" if not config.tma
                           else tma_unused_reason(problem, device, config.num_stages, TRITON_INTERPRETED))
        self.tma = self.tma_reason is None
        self._launchers: dict = {}  # LaunchVariant -> BoundKernel

    def _chunking(self, tiles: np.ndarray, device: Device, params: AttentionParams):
        """chunks_of(tile index) -> [(kv_lo, kv_hi)]: fixed_split_size chunks (KV tokens for ragged,
        pages for paged KV), or the occupancy policy's chunks (needs the SM count and a float
        workspace); None: every tile takes its whole KV (always with disable_split_kv or in
        CUDA-graph mode)."""
        p, cfg = self.problem, self.config
        ws = params.workspace
        if params.disable_split_kv or p.use_cuda_graph:
            return None
        if params.fixed_split_size is not None:
            size = params.fixed_split_size * (p.page_size if self.paged else 1)
            return lambda t: fixed_chunks(int(tiles[t, 4]), int(tiles[t, 5]), int(tiles[t, 3]), size)
        if ws is None or ws.numel() == 0:
            return None
        splits = policy_splits((tiles[:, 5] - tiles[:, 4]).tolist(), p.num_qo_heads, cfg, device.sm_count)
        if splits is None:
            return None
        return lambda t: (balanced_chunks(int(tiles[t, 4]), int(tiles[t, 5]), splits[t], cfg.block_n)
                          if splits[t] > 1 else [(0, int(tiles[t, 3]))])

    def _carve_partials(self, workspace: torch.Tensor | None) -> int:
        """Views of the float workspace for the partial lse [rows, heads] and outputs
        [rows, heads, head_dim_vo] (fp32, at offset 0: run() scratch); returns the bytes used."""
        heads, dim = self.problem.num_qo_heads, self.problem.head_dim_vo
        n = self.partial_rows * heads
        self.po = self.plse = None
        if n == 0:
            return 0
        lse_bytes = -(-n * 4 // _ALIGN) * _ALIGN
        need = lse_bytes + n * dim * 4
        have = 0 if workspace is None else workspace.numel() * workspace.element_size()
        if need > have:
            raise ValueError(f"float_workspace_buffer too small: {have} bytes, this fa2 prefill plan needs {need} "
                             f"bytes for {self.partial_rows} split-KV partial rows x {heads} heads x "
                             f"({dim} + 1) float32; pass a larger float_workspace_buffer, a larger "
                             "fixed_split_size or disable_split_kv=True")
        ws = workspace.view(torch.uint8).reshape(-1)
        self.plse = ws[:n * 4].view(torch.float32)
        self.po = ws[lse_bytes:need].view(torch.float32)
        return need

    def _tile_bitmaps(self, words: int, dev: torch.device, params: AttentionParams) -> torch.Tensor:
        """int16 room for the partial tiles' bitmaps, one slot per two tile-list int32: its own
        buffer, or in CUDA-graph mode the start of the float workspace (fixed across re-plans,
        unused otherwise there: no split-KV partials)."""
        if not self.problem.use_cuda_graph:
            return torch.empty(words, dtype=torch.int16, device=dev)
        ws = params.workspace
        have = 0 if ws is None else ws.numel() * ws.element_size()
        if 2 * words > have:
            raise ValueError(f"float_workspace_buffer too small: {have} bytes, this fa2 prefill plan (CUDA-graph "
                             f"mode, custom mask) needs {2 * words} bytes for the bitmaps of its mask tiles")
        return ws.view(torch.uint8).reshape(-1)[:2 * words].view(torch.int16)

    def refresh_tile_lists(self) -> None:
        """Custom mask: classify each (item, KV tile) from the bits of ``params.packed_mask``,
        writing the partial tiles' bitmaps, write each item's runs of whole and partial tiles, then
        reorder the work rows by their visible tiles, most first (the host saw every item as the
        whole KV range, so a causal-like mask would run its heaviest programs last).
        Stream-ordered, no host sync; at plan() and for each new mask of a kept plan."""
        if self._mask_classes is None:
            return
        prm, cfg, classes = self.params, self.config, self._mask_classes
        max_tiles = classes.shape[1]
        classify = bind(mask_tile_classes_kernel, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        WINDOW=self.problem.window_left >= 0)
        classify((self.num_items * max_tiles,), self.work, prm.packed_mask, prm.mask_indptr, classes, self.tile_bits,
                 max_tiles, kernel_window(self.problem.window_left))
        runs = bind(mask_tile_runs_kernel, BLOCK_N=cfg.block_n, CHUNK=_LIST_CHUNK)
        runs((self.num_items,), self.work, classes, self.tiles, self._visible, max_tiles)
        order = bind(heaviest_first_kernel, BLOCK_I=_ORDER_ROWS, BLOCK_J=_ORDER_STEP)
        order((-(-self.num_items // _ORDER_ROWS),), self.work, self._visible, self._ordered, self.num_items)
        self.work.copy_(self._ordered)

    def _graph_work_list(self, workspace: torch.Tensor | None, flat: torch.Tensor, dev: torch.device,
                         list_len: int):
        """Write the item count and list at fixed offsets of the wrapper's int workspace; a custom
        mask's tile lists (``list_len`` int32) get the second half of it."""
        if workspace is None:
            raise ValueError("fa2 prefill: use_cuda_graph needs the wrapper's int workspace")
        have = workspace.numel() * workspace.element_size()
        lists_at = have // 2 // _ALIGN * _ALIGN if list_len else have
        # one entry at least: an empty view has no address (data_ptr() 0), and a graph captured on
        # a plan of no items would replay that null pointer after a re-plan with items (the
        # wrappers refuse such a capture, its q being empty: this guards the plan itself)
        need = _GRAPH_ITEMS_AT + 4 * max(flat.numel(), 1)
        if need > lists_at or lists_at + 4 * list_len > have:
            raise ValueError(f"fa2 prefill: {self.num_items} work items need {need} int workspace bytes"
                             + (f" and their custom-mask tile lists {4 * list_len} more" if list_len else "")
                             + f", the int workspace has {have}")
        ws = workspace.view(torch.uint8).reshape(-1)
        if list_len:
            self.tiles = ws[lists_at:lists_at + 4 * list_len].view(torch.int32)
        count = ws[:4].view(torch.int32)
        work = ws[_GRAPH_ITEMS_AT:need].view(torch.int32)
        count.copy_(torch.tensor([self.num_items], dtype=torch.int32))
        work[:flat.numel()].copy_(flat)
        return work, count

    def _bind(self, variant: LaunchVariant):
        """The prefill kernel with this plan's constexprs and the per-run ones in ``variant``: a
        BoundKernel, wrapped to provide the descriptors' scratch when TMA is on."""
        p, cfg = self.problem, self.config
        dtype, sinks, has_lse, q_t, k_t, v_t, tma, shared_rows, scale_pos = variant
        head_a, head_b = qk_parts(p.head_dim_qk, self.rope_kind > 0)
        launch = self._launchers[variant] = bind(
            fa2_prefill_kernel,
            NUM_QO_HEADS=p.num_qo_heads, GROUP=p.num_qo_heads // p.num_kv_heads,
            HEAD_QK_A=head_a, HEAD_QK_B=head_b, HEAD_VO=p.head_dim_vo,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=p.page_size if self.paged else 0,
            DTYPE=_TL_DTYPES[dtype], DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
            CAUSAL=p.mask_mode == "causal", CUSTOM_MASK=p.mask_mode == "custom", WINDOW=p.window_left >= 0,
            SOFT_CAP=p.logits_soft_cap > 0, ALIBI=p.pos_encoding_mode == "ALIBI",
            ROPE=self.rope_kind or self.q_rope, K_ROTATED=self.q_rope > 0, SINKS=sinks,
            HAS_LSE=has_lse, Q_SCALE_T=q_t, K_SCALE_T=k_t, V_SCALE_T=v_t, SPLIT=self.n_merge > 0,
            PERSISTENT=p.use_cuda_graph, TMA=tma, SHARED_ROWS=shared_rows, SCALE_POS=scale_pos,
            CLAMP_PAGES=self.clamp_pages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if tma:
            launch = self._launchers[variant] = functools.partial(launch_with_scratch, launch)
        return launch

    def run(self, inputs: AttentionInputs) -> None:
        p, prm = self.problem, self.params
        q, out = inputs.q, inputs.out
        if self.grid[0] == 0:
            return
        if self.n_merge and out.stride(2) != 1:
            raise ValueError(f"fa2 prefill with split-KV needs out with a contiguous head_dim (strides "
                             f"{tuple(out.stride())}); pass a contiguous out or plan with disable_split_kv=True")
        kv = inputs.kv
        if self.paged:
            if not isinstance(kv, PagedKV):
                raise TypeError("fa2 prefill_paged plan run with ragged KV")
            k, v = kv.k, kv.v
            if kv.layout == "NHD":
                sk = (k.stride(0), k.stride(1), k.stride(2), k.stride(3))
                sv = (v.stride(0), v.stride(1), v.stride(2), v.stride(3))
            else:
                sk = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
                sv = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
            kv_indices = prm.kv_indices
        else:
            if not isinstance(kv, RaggedKV):
                raise TypeError("fa2 prefill_ragged plan run with paged KV")
            k, v = kv.k, kv.v
            sk = (k.stride(0), 0, k.stride(1), k.stride(2))
            sv = (v.stride(0), 0, v.stride(1), v.stride(2))
            kv_indices = prm.kv_indptr
        lse = inputs.lse
        q_f, q_ptr, q_t, k_f, k_ptr, k_t, v_f, v_ptr, v_t = kernel_scales(inputs, prm.qo_indptr)
        log2e = 1.0 / math.log(2.0)
        qk_scale = prm.sm_scale * q_f * k_f * log2e
        custom = p.mask_mode == "custom"
        # TMA only where this call's K/V views meet the descriptor rules; else the pointer path, not an error
        tma = self.tma and tma_layout_ok(k, v)
        if max(sk[0], sk[1], sv[0], sv[1]) >= _MAX_ROW_STRIDE:  # the kernel multiplies them in 32-bit
            raise ValueError(f"fa2 prefill: K/V page and token strides must be < 2**31 elements, got "
                             f"k {sk[:2]}, v {sv[:2]}")
        # V rows at K's offsets where tiles cross pages and the page and token strides agree (5-D
        # caches, and tuples of equal strides)
        shared_rows = self.paged and p.page_size % self.config.block_n != 0 and sk[:2] == sv[:2]
        variant = LaunchVariant(q.dtype, inputs.sinks is not None, lse is not None, q_t, k_t, v_t, tma,
                                shared_rows, qk_scale >= _MIN_NORMAL_F32 and not (q_t or k_t))
        launch = self._launchers.get(variant) or self._bind(variant)
        launch(
            self.grid, q, k, v, out, lse if lse is not None else out,
            self.po if self.n_merge else out, self.plse if self.n_merge else out, self.work, self.num_work,
            prm.qo_indptr, prm.kv_indptr, kv_indices,
            self.tile_bits if custom else prm.qo_indptr, self.tiles if custom else prm.qo_indptr,
            inputs.sinks if inputs.sinks is not None else prm.qo_indptr,
            self.alibi if self.alibi is not None else prm.qo_indptr, q_ptr, k_ptr, v_ptr,
            qk_scale, v_f, p.logits_soft_cap * log2e,
            *rope_scalars(prm.rope_scale, prm.rope_theta), kernel_window(p.window_left),
            kv.num_pages if self.paged else 1,
            q.stride(0), q.stride(1), q.stride(2), *sk, *sv, out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0)
        if self._merge is not None:
            self._merge(out, lse)


def plan_prefill(problem: Problem, device: Device, params: AttentionParams,
                 config: PrefillConfig | None = None, autotune: bool | None = None):
    """Plan a paged or ragged prefill. ``config`` (or FLASHDISPATCH_FA2_PREFILL_CONFIG) overrides
    the per-head-dim tile sizes, e.g. for a benchmark sweep. ``autotune`` (None: whether
    FLASHDISPATCH_FA2_AUTOTUNE=1) picks the tile config per shape bucket instead (see
    tuning.py); never with an explicit config or under CUDA graphs, and on a CUDA device only
    unless asked for explicitly. A ragged RoPE prefill with a tile of queries rotates K first and
    plans the kernel without RoPE on K (prefill_rope.py)."""
    reasons = prefill_extra_checks(problem, device)
    if reasons:
        raise Unsupported("fa2 prefill cannot run this problem", {"fa2": reasons})
    if prerotation_applies(problem, params):
        rope_kind = rope_kernel_variant(problem.pos_encoding_mode, params.rope_scale, params.rope_theta,
                                        problem.head_dim_qk)
        inner = _plan_kernel(without_rope(problem), device, params, config, autotune, q_rope=rope_kind)
        return PrerotatedPrefill(inner, problem, params, rope_kind)
    return _plan_kernel(problem, device, params, config, autotune)


def _plan_kernel(problem: Problem, device: Device, params: AttentionParams, config: PrefillConfig | None,
                 autotune: bool | None, q_rope: int = 0) -> "PrefillPlan | tuning.AutotunedPlan":
    base = default_config(problem, device, params.qo_lens_host)
    if config is not None or (env_get(CONFIG_ENV) or "").strip():
        return PrefillPlan(problem, device, params, (config or config_from_env(base)).validate(), q_rope)
    tune = tuning.enabled() and device.is_cuda if autotune is None else autotune
    if tune and not problem.use_cuda_graph:
        return tuning.plan_with_autotune(problem, device, params, base,
                                         lambda cfg: PrefillPlan(problem, device, params, cfg.validate(), q_rope),
                                         kernel_variant=("q_rope", q_rope) if q_rope else ())
    return PrefillPlan(problem, device, params, base.validate(), q_rope)
