"""fa2 MLA: paged multi-head latent attention (DeepSeek, matrix-absorbed) in Triton, split-KV.

Every query head reads the one latent KV head: a program takes BLOCK_M query rows (a request's
(token, head) pairs, token-major) and a range of the request's keys, and computes
s = (q_nope . ckv_j + q_pe . kpe_j) * sm_scale and out = softmax(s) @ ckv on tensor cores, so
each key tile read serves all the rows. Causal masks are bottom-right aligned (query token i of
a request with q_len queries and kv_len keys sees keys j <= kv_len - q_len + i).

plan() cuts the work on the host (its lengths are there): rows into blocks, and, where the
unsplit grid would not fill the GPU, each request's keys into chunks whose partial states
(out, base-2 lse) go to the float workspace and are merged per token by the decode merge kernel
(`merge.DecodeMerge`). Query rows that see no key give 0 and lse -inf.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ...dispatch.caps import Caps
from ...dispatch.problem import FP8_DTYPES, Device, Problem
from ...dispatch.reasons import Reason, Unsupported
from ...environ import env_get
from ..base import MLAInputs, MLAParams
from ..common import TRITON_INTERPRETED, triton_fp8_kv_reasons
from .decode_env import apply_env
from .decode_workspace import carve_partials, int_workspace_ints, partial_bytes, workspace_bytes
from .launch import bind
from .merge import MERGE_INFO_COLS, DecodeMerge, finish_state

_HALF = frozenset({torch.float16, torch.bfloat16})
CKV_DIMS = (64, 128, 256, 512)
KPE_DIMS = (16, 32, 64)

MLA_CAPS = Caps(
    ops=frozenset({"mla"}),
    device_types=frozenset({"cuda", "cpu"}) if TRITON_INTERPRETED else frozenset({"cuda"}),
    min_cc=(8, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF | frozenset(FP8_DTYPES),
    o_dtypes=_HALF,
    head_dims=frozenset((ckv, kpe) for ckv in CKV_DIMS for kpe in KPE_DIMS),
    page_sizes=None,
    features=frozenset({"causal", "lse", "fp8_kv", "cuda_graph"}),
    max_q_len_per_req=1 << 16,
)

LOG2E = 1.0 / math.log(2.0)
WORK_COLS = 8  # request, first row, key range start, end, first partial (-1: none), chunks, chunk, pad
MIN_CHUNK_TOKENS = 256  # a split never cuts a request's keys finer than this
PROGRAMS_PER_SM = 2  # the unsplit grid splits below this many programs per SM
LAZY_BOUND = tl.constexpr(8.0)  # log2 units: with lazy rescaling, probabilities stay below 2**8
MAX_GRAPH_CHUNKS = 16  # chunks per request under a CUDA graph (fixed by the capture, whatever the lengths)
TILES_ENV = "FLASHDISPATCH_FA2_MLA_TILES"  # JSON of MLATiles fields over `mla_tiles`' choice


@triton.jit
def _mla_kernel(qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, count_ptr, work_ptr,
                qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, v_scale_ptr,
                s_mul, v_scale, num_pages,
                stride_qn_t, stride_qn_h, stride_qn_d, stride_qp_t, stride_qp_h, stride_qp_d, stride_ckv_p,
                stride_ckv_s, stride_ckv_d, stride_kpe_p, stride_kpe_s, stride_kpe_d, stride_o_t, stride_o_h,
                stride_l_t, stride_l_h, HEADS: tl.constexpr, CKV: tl.constexpr, KPE: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
                V_SCALE_T: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """Work rows pid, pid + programs, ... of the *count_ptr rows, each BLOCK_M query rows of a
    request against its keys [lo, hi), into out/lse or into the partial of (token, chunk) when the
    request is split (a CUDA graph's grid is fixed; the count is the plan's)."""
    for item in range(tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)):
        _mla_item(qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, work_ptr + item * 8,
                  qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, v_scale_ptr, s_mul, v_scale, num_pages,
                  stride_qn_t, stride_qn_h, stride_qn_d, stride_qp_t, stride_qp_h, stride_qp_d, stride_ckv_p,
                  stride_ckv_s, stride_ckv_d, stride_kpe_p, stride_kpe_s, stride_kpe_d, stride_o_t, stride_o_h,
                  stride_l_t, stride_l_h, HEADS, CKV, KPE, PAGE, BLOCK_M, BLOCK_N, CAUSAL, WRITE_LSE, V_SCALE_T,
                  LAZY_RESCALE)


@triton.jit
def _mla_item(qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, w,
              qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, v_scale_ptr, s_mul, v_scale, num_pages,
              stride_qn_t, stride_qn_h, stride_qn_d, stride_qp_t, stride_qp_h, stride_qp_d, stride_ckv_p,
              stride_ckv_s, stride_ckv_d, stride_kpe_p, stride_kpe_s, stride_kpe_d, stride_o_t, stride_o_h,
              stride_l_t, stride_l_h, HEADS: tl.constexpr, CKV: tl.constexpr, KPE: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
              V_SCALE_T: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """The work row at ``w``: request, first row, keys [lo, hi), first partial, chunks, chunk.
    (Unit column strides are Triton's specialisation of 1: contiguous loads.) ``out``'s columns
    are contiguous (`MLAPlan.run`). LAZY_RESCALE: a row's running max moves only when a tile's
    exceeds it by more than LAZY_BOUND (probabilities then stay below 2**LAZY_BOUND), and the
    accumulator is rescaled only in tiles where some row's max moved."""
    b = tl.load(w)
    m0 = tl.load(w + 1)
    lo = tl.load(w + 2)
    hi = tl.load(w + 3)
    part = tl.load(w + 4)
    n_chunks = tl.load(w + 5)
    chunk = tl.load(w + 6)
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)

    rows = m0 + tl.arange(0, BLOCK_M)
    t_local = rows // HEADS
    h = (rows % HEADS).to(tl.int64)
    row_ok = t_local < q_len
    tok = (q_start + t_local).to(tl.int64)
    offs_c = tl.arange(0, CKV)
    offs_p = tl.arange(0, KPE)
    q_nope = tl.load(qn_ptr + (tok * stride_qn_t + h * stride_qn_h)[:, None] + offs_c[None, :] * stride_qn_d,
                     mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(qp_ptr + (tok * stride_qp_t + h * stride_qp_h)[:, None] + offs_p[None, :] * stride_qp_d,
                   mask=row_ok[:, None], other=0.0)
    if CAUSAL:
        limit = kv_len - q_len + t_local  # the last key each row sees
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len - 1
    limit = tl.where(row_ok, limit, -1)
    end = tl.minimum(hi, tl.max(limit, 0) + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, CKV], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        j = start + offs_n
        j_ok = j < end
        page = tl.load(kv_indices_ptr + page_base + j // PAGE, mask=j_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)  # never read outside the cache
        slot = (j % PAGE).to(tl.int64)
        ckv = tl.load(ckv_ptr + (page * stride_ckv_p + slot * stride_ckv_s)[:, None] + offs_c[None, :] * stride_ckv_d,
                      mask=j_ok[:, None], other=0.0).to(q_nope.dtype)
        kpe = tl.load(kpe_ptr + (page * stride_kpe_p + slot * stride_kpe_s)[:, None] + offs_p[None, :] * stride_kpe_d,
                      mask=j_ok[:, None], other=0.0).to(q_pe.dtype)
        s = tl.dot(q_nope, tl.trans(ckv)) + tl.dot(q_pe, tl.trans(kpe))
        visible = (j[None, :] <= limit[:, None]) & j_ok[None, :]
        s = tl.where(visible, s * s_mul, float("-inf"))
        m_tile = tl.max(s, 1)
        if LAZY_RESCALE:
            m_new = tl.where(m_tile > m_i + LAZY_BOUND, m_tile, m_i)
        else:
            m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if LAZY_RESCALE:
            if tl.max((m_new != m_i).to(tl.int32), 0) > 0:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        acc += tl.dot(p.to(ckv.dtype), ckv)
        m_i = m_new

    o, lse = finish_state(acc, l_i, m_i, v_scale_ptr, v_scale, V_SCALE_T)
    if part < 0:
        tl.store(out_ptr + (tok * stride_o_t + h * stride_o_h)[:, None] + offs_c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + tok * stride_l_t + h * stride_l_h, lse, mask=row_ok)
    else:
        state = (part + t_local * n_chunks + chunk).to(tl.int64) * HEADS + h
        tl.store(po_ptr + (state * CKV)[:, None] + offs_c[None, :], o, mask=row_ok[:, None])
        tl.store(plse_ptr + state, lse, mask=row_ok)


@dataclass(frozen=True)
class MLATiles:
    """Tile shape and launch options of one MLA plan."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    lazy_rescale: bool = False  # rescale the accumulator only where a row's max grew by > LAZY_BOUND


def mla_tiles(problem: Problem, max_rows: int) -> MLATiles:
    """Rows per program: 16 where a request has at most 16 rows (its tokens x heads), else 32 (a
    [32, 512] float32 accumulator over 8 warps is 64 registers a thread). 64 rows over 8 warps ran
    1.24-1.57x faster on an H100 (warpgroup MMAs; docs/perf-notes.md, fa2 MLA, session 77) but have
    not been through the GPU tests yet (FLASHDISPATCH_FA2_MLA_TILES='{"block_m": 64}' on sm90;
    sm86/89 lack the shared memory)."""
    block_m = 16 if max_rows <= 16 else 32
    wide = problem.head_dim_vo >= 256
    return MLATiles(block_m, 32, 8 if wide and block_m > 16 else 4, 2)


def override_tiles(tiles: MLATiles, fields: dict) -> MLATiles:
    """``tiles`` with ``fields`` (MLATiles field names) replaced, each checked: block_m 16-128 and
    block_n 16-128 powers of two, num_warps 1-16 a power of two, num_stages 1-6, lazy_rescale a bool."""
    names = [f.name for f in dataclasses.fields(MLATiles)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"unknown fa2 MLA tile fields {unknown}; known: {names}")
    allowed = {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64, 128), "num_warps": (1, 2, 4, 8, 16),
               "num_stages": (1, 2, 3, 4, 5, 6), "lazy_rescale": (False, True)}
    for name, value in fields.items():
        kind = bool if name == "lazy_rescale" else int
        if type(value) is not kind or value not in allowed[name]:
            raise ValueError(f"{name}={value!r}: expected one of {list(allowed[name])}")
    return dataclasses.replace(tiles, **fields)


def env_tiles(tiles: MLATiles) -> MLATiles:
    """``tiles`` with the fields of FLASHDISPATCH_FA2_MLA_TILES (a JSON object) over it."""
    text = env_get(TILES_ENV)
    example = '\'{"block_n": 64, "lazy_rescale": true}\''
    return apply_env(tiles, text, override_tiles, TILES_ENV, example) if text else tiles


def _cdiv(a, b):
    """ceil(a / b) of ints or int arrays."""
    return -(-a // b)


def _chunk_tokens(row_blocks: np.ndarray, kv_lens: np.ndarray, sm_count: int) -> int:
    """Keys per chunk that give the grid about PROGRAMS_PER_SM programs a SM (0: no split)."""
    target = sm_count * PROGRAMS_PER_SM
    if int(row_blocks.sum()) >= target or not len(kv_lens):
        return 0
    work = int((row_blocks * kv_lens).sum())
    chunk = max(MIN_CHUNK_TOKENS, _cdiv(work, target))
    return chunk if chunk < int(kv_lens.max()) else 0


def _graph_chunks(row_blocks: int, total_q: int, heads: int, ckv: int, sm_count: int, workspace: int) -> int:
    """Chunks of every request's keys under a CUDA graph, from what the graph fixes (the query
    tokens and heads; not the lengths): about PROGRAMS_PER_SM work rows a SM, as many as the
    float workspace holds partials for (1: no split)."""
    chunks = max(1, min(MAX_GRAPH_CHUNKS, _cdiv(sm_count * PROGRAMS_PER_SM, max(row_blocks, 1))))
    while chunks > 1 and partial_bytes(total_q * chunks, heads, ckv) > workspace:
        chunks -= 1
    return chunks


def _work_rows(qo_lens: np.ndarray, kv_lens: np.ndarray, heads: int, tiles: MLATiles, chunk: int,
               chunks: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(work rows [items, WORK_COLS], merge rows [split tokens, MERGE_INFO_COLS], partials) of a
    plan whose requests are cut into chunks of about ``chunk`` keys (0: none cut), evened out over
    each request in whole key tiles; ``chunks`` > 1 instead cuts every request into that many
    (CUDA graphs: the partials and merge rows do not depend on the lengths; chunks may be empty).
    int64 host arrays in, numpy throughout (no loop over requests)."""
    bn = tiles.block_n
    if chunks:
        n = np.full_like(kv_lens, chunks)
    elif chunk:
        n = np.maximum(_cdiv(kv_lens, chunk), 1)
    else:
        n = np.ones_like(kv_lens)
    step = np.maximum(_cdiv(_cdiv(kv_lens, n), bn), 1) * bn  # kv / n keys, in whole key tiles
    if not chunks:
        n = np.where(n > 1, _cdiv(kv_lens, step), 1)
    step = np.where(n > 1, step, kv_lens)
    n = np.where(qo_lens > 0, n, 0)  # a request without queries has no work
    split = n > 1
    parts = np.where(split, qo_lens * n, 0)
    part = np.where(split, np.cumsum(parts) - parts, -1)
    blocks = _cdiv(qo_lens * heads, tiles.block_m)
    per = blocks * n
    req = np.repeat(np.arange(len(kv_lens)), per)
    k = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    n_r, kv_r = n[req], kv_lens[req]
    c = k % np.maximum(n_r, 1)
    lo = np.minimum(kv_r, c * step[req])
    work = np.stack([req, k // np.maximum(n_r, 1) * tiles.block_m, lo, np.minimum(kv_r, lo + step[req]), part[req],
                     n_r, c, np.zeros_like(req)], axis=1)
    tok_req = np.repeat(np.flatnonzero(split), qo_lens[split])
    qo_starts = np.cumsum(qo_lens) - qo_lens
    t = np.arange(len(tok_req)) - np.repeat(np.cumsum(qo_lens[split]) - qo_lens[split], qo_lens[split])
    merge = np.stack([qo_starts[tok_req] + t, part[tok_req] + t * n[tok_req], n[tok_req], np.zeros_like(t)], axis=1)
    return work.astype(np.int32), merge.astype(np.int32).reshape(-1, MERGE_INFO_COLS), int(parts.sum())


class MLAPlan:
    """A planned fa2 MLA call: its tables on the device (one int32 array: the work row count, the
    query offsets, the kv lengths, the merge rows, the work rows), the grid and the merge.

    Under a CUDA graph the tables go to the wrapper's int workspace at offsets fixed by the batch
    size and the query token count, every request is cut into the same number of chunks, and the
    grid is a fixed set of programs that loop over the plan's work rows: a graph captured on one
    plan replays a later plan with other lengths (same batch size and query tokens)."""

    def __init__(self, problem: Problem, device: Device, params: MLAParams, tiles: MLATiles | None = None):
        self.problem, self.params = problem, params
        heads, ckv, graph = problem.num_qo_heads, problem.head_dim_vo, problem.use_cuda_graph
        qo_lens = np.asarray(params.qo_lens_host, dtype=np.int64)
        kv_lens = np.asarray(params.kv_lens_host, dtype=np.int64)
        batch, total_q, sm_count = len(kv_lens), int(qo_lens.sum()), device.sm_count or 8
        rows = heads * (_cdiv(total_q, batch) if graph and batch else int(qo_lens.max(initial=0)))
        self.tiles = tiles or env_tiles(mla_tiles(problem, rows))
        row_blocks = _cdiv(qo_lens * heads, self.tiles.block_m)
        have = workspace_bytes(params)
        chunk, chunks = 0, 0
        if graph:
            chunks = _graph_chunks(_cdiv(total_q * heads, self.tiles.block_m), total_q, heads, ckv, sm_count, have)
        elif params.workspace is not None:
            chunk = _chunk_tokens(row_blocks, kv_lens, sm_count)
            # coarser chunks until their partials fit the float workspace
            while chunk and partial_bytes(int((qo_lens * _cdiv(kv_lens, chunk)).sum()), heads, ckv) > have:
                chunk = chunk * 2 if chunk * 2 < int(kv_lens.max()) else 0
        work, merge, partials = _work_rows(qo_lens, kv_lens, heads, self.tiles, chunk, chunks)
        tables = np.concatenate(([len(work)], np.zeros(7, np.int64), [0], np.cumsum(qo_lens), kv_lens,
                                 merge.reshape(-1), work.reshape(-1))).astype(np.int32)
        host = torch.from_numpy(tables)
        if graph:
            dev_tables = int_workspace_ints(params, tables.size)
            dev_tables.copy_(host, non_blocking=True)
        else:
            dev_tables = host.to(params.kv_indptr.device, non_blocking=True)
        at = np.cumsum([0, 8, batch + 1, batch, merge.size, work.size])
        self.count, self.qo_indptr, self.kv_lens, info, self.work = (dev_tables[at[i]:at[i + 1]] for i in range(5))
        self.grid = (sm_count * PROGRAMS_PER_SM if graph else len(work),)
        self.plse, self.po, _ = carve_partials(params, partials, 1, heads, ckv)
        self._merge = DecodeMerge(self.po, self.plse, info, len(merge), 1, heads, ckv) if partials else None
        self._launchers: dict = {}  # (WRITE_LSE, V_SCALE_T) -> BoundKernel

    def _launcher(self, write_lse: bool, v_t: bool):
        """The bound kernel of this plan's tiles for a run() with or without lse and a tensor v scale."""
        launch = self._launchers.get((write_lse, v_t))
        if launch is None:
            p, t = self.problem, self.tiles
            launch = self._launchers[write_lse, v_t] = bind(
                _mla_kernel, HEADS=p.num_qo_heads, CKV=p.head_dim_vo, KPE=p.head_dim_kpe, PAGE=p.page_size,
                BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=self.params.causal, WRITE_LSE=write_lse, V_SCALE_T=v_t,
                LAZY_RESCALE=t.lazy_rescale, num_warps=t.num_warps, num_stages=t.num_stages)
        return launch

    def run(self, inputs: MLAInputs) -> None:
        """Write inputs.out (and inputs.lse) from the plan's tables and the inputs' tensors (any
        strides; an ``out`` whose columns are not contiguous is written through a copy)."""
        if not self.grid[0]:
            return
        if inputs.out.stride(-1) != 1:
            out = inputs.out.contiguous()
            self.run(dataclasses.replace(inputs, out=out))
            inputs.out.copy_(out)
            return
        prm = self.params
        out, lse = inputs.out, inputs.lse
        v_t = isinstance(inputs.v_scale, torch.Tensor)
        v_scale = 1.0 if v_t or inputs.v_scale is None else float(inputs.v_scale)
        v_ptr = inputs.v_scale.to(torch.float32).reshape(1) if v_t else out
        lse_t = lse if lse is not None else out
        ls = lse.stride() if lse is not None else (0, 0)
        po = self.po if self.po is not None else out
        plse = self.plse if self.plse is not None else out
        qn, qp, ckv, kpe = inputs.q_nope, inputs.q_pe, inputs.ckv_cache, inputs.kpe_cache
        launch = self._launcher(lse is not None, v_t)
        launch(self.grid, qn, qp, ckv, kpe, out, lse_t, po, plse, self.count, self.work, self.qo_indptr,
               prm.kv_indptr, prm.kv_indices, self.kv_lens, v_ptr, float(prm.sm_scale * LOG2E), v_scale, ckv.shape[0],
               *qn.stride(), *qp.stride(), *ckv.stride(), *kpe.stride(), out.stride(0), out.stride(1), ls[0], ls[1])
        if self._merge is not None:
            self._merge(out, lse)


def mla_extra_checks(problem: Problem, device: Device) -> list[Reason]:
    """Combinations Caps cannot express: an fp8 KV type this GPU's Triton converts."""
    return triton_fp8_kv_reasons(problem.kv_dtype, device.cc)


def plan_mla(problem: Problem, device: Device, params: MLAParams, tiles: MLATiles | None = None) -> MLAPlan:
    """Plan fa2 MLA for ``problem`` on ``device`` from the host lengths in ``params``; ``tiles``
    replaces `mla_tiles`' choice and FLASHDISPATCH_FA2_MLA_TILES (sweeps: scripts/sweep_mla.py)."""
    reasons = mla_extra_checks(problem, device)
    if reasons:
        raise Unsupported("fa2 MLA cannot run this problem", {"fa2": reasons})
    return MLAPlan(problem, device, params, tiles)
