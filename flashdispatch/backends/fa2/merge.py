"""Merging partial attention states by their base-2 lse (Triton).

A state is (v, s): v the softmax-normalized output over some keys, s = log2(sum 2^score)
over them. Merging n states: m = max s_k, w_k = 2^(s_k - m), v = sum w_k v_k / sum w_k,
s = m + log2(sum w_k); states with s = -inf count for nothing; all -inf gives v 0, s -inf.

One merge step (`_merge_step`) serves three callers:
- `merge_states` (op ``merge``): v [seq, num_states, heads, dim], s [seq, num_states, heads];
- the split-KV decode and prefill (`DecodeMerge`): partials [P, q_len, heads, dim] float32 in the
  workspace, one row of ``info`` per split request (decode) or split query row (prefill): out row
  base, first partial, count;
- the decode kernel's fused merge (decode_kernel.py, DecodeConfig.fused_merge_max_chunks), through
  `_merge_row_block`: the rows of one KV head and row block at a time.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ...dispatch.caps import Caps
from ..base import MergeInputs
from ..common import TRITON_INTERPRETED
from .launch import BoundKernel, SpecKeys, bind, launch_kept

MERGE_CAPS = Caps(
    ops=frozenset({"merge"}),
    device_types=frozenset({"cuda", "cpu"}) if TRITON_INTERPRETED else frozenset({"cuda"}),
    min_cc=(8, 0),
    q_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    kv_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    o_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
)

# Row of the decode merge info array: [out_row_base, first_partial, num_partials, pad].
MERGE_INFO_COLS = 4


@triton.jit
def _merge_step(m_i, l_i, acc, s_k, v_k, AXIS: tl.constexpr):
    """One round of the online merge: the states (s_k, v_k) along AXIS (masked ones s = -inf)
    joined into the running (max, sum of weights, weighted sum of v)."""
    m_new = tl.maximum(m_i, tl.max(s_k, AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    w = tl.exp2(s_k - tl.expand_dims(m_use, AXIS))
    l_i = l_i * alpha + tl.sum(w, AXIS)
    w_v = tl.expand_dims(w, AXIS + 1)
    acc = acc * tl.expand_dims(alpha, AXIS) + tl.sum(tl.where(w_v > 0, w_v * v_k, 0.0), AXIS)
    return m_new, l_i, acc


@triton.jit
def finish_state(acc, l_i, m_i, v_scale_ptr, v_scale, V_SCALE_T: tl.constexpr):
    """(out, lse) of rows' online-softmax state: acc / l (0 where no key was seen) times the v
    scale (a float, or the float32 at v_scale_ptr with V_SCALE_T), lse = m + log2(l) (-inf)."""
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if V_SCALE_T:
        o = o * tl.load(v_scale_ptr).to(tl.float32)
    else:
        o = o * v_scale
    return o, tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe))


@triton.jit
def _merge_rows(v_ptr, s_ptr, vo_ptr, so_ptr, first, n, stride_vs, stride_ss, stride_vd, stride_vod, head_dim,
                write_s, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_S: tl.constexpr):
    """Merge states first..first+n-1 of one (row, head) over columns [0, head_dim) of v_ptr (column
    strides stride_vd in v, stride_vod in the output); the pointers already point at it. States are
    read BLOCK_S at a time, so a few dozen splits cost one or two load rounds. The merged s is stored
    where WRITE_S and ``write_s``."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = offs_d.to(tl.int64)
    m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        ok = s0 + offs_s < n
        k = (first + s0 + offs_s).to(tl.int64)
        s_k = tl.load(s_ptr + k * stride_ss, mask=ok, other=float("-inf"))
        v_k = tl.load(v_ptr + k[:, None] * stride_vs + cols[None, :] * stride_vd, mask=ok[:, None] & mask_d[None, :],
                      other=0.0).to(tl.float32)
        m_i, l_i, acc = _merge_step(m_i, l_i, acc, s_k, v_k, 0)
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    tl.store(vo_ptr + cols * stride_vod, (acc / l_safe).to(vo_ptr.dtype.element_ty), mask=mask_d)
    if WRITE_S:
        tl.store(so_ptr, tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe)), mask=write_s)


@triton.jit
def _merge_row_block(v_rows, s_rows, vo_rows, so_rows, row_ok, first, n, stride_vs, stride_ss,
                     BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_S: tl.constexpr):
    """`_merge_rows` for BLOCK_R (row, head) pairs at once, [BLOCK_R, BLOCK_S, HEAD_DIM] tiles:
    v_rows, s_rows, vo_rows, so_rows are [BLOCK_R] pointers (state 0 of each pair, its outputs);
    rows where row_ok is False are left alone. The loads are L2-only (.cg): the fused decode merge
    reads states that other CTAs of the same launch just wrote (L1 is not coherent across SMs)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        ok = row_ok[:, None] & (s0 + offs_s < n)[None, :]
        k = (first + s0 + offs_s).to(tl.int64)
        s_k = tl.load(s_rows[:, None] + k[None, :] * stride_ss, mask=ok, other=float("-inf"), cache_modifier=".cg")
        v_k = tl.load(v_rows[:, None, None] + (k[None, :] * stride_vs)[:, :, None] + offs_d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_i, l_i, acc = _merge_step(m_i, l_i, acc, s_k, v_k, 1)
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    tl.store(vo_rows[:, None] + offs_d[None, :], (acc / l_safe[:, None]).to(vo_rows.dtype.element_ty),
             mask=row_ok[:, None])
    if WRITE_S:
        tl.store(so_rows, tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe)), mask=row_ok)


@triton.jit
def _merge_states_kernel(v_ptr, s_ptr, vo_ptr, so_ptr, num_states, head_dim,
                         stride_vt, stride_vs, stride_vh, stride_vd, stride_st, stride_ss, stride_sh,
                         stride_vot, stride_voh, stride_vod, stride_sot, stride_soh,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    _merge_rows(v_ptr + t * stride_vt + h * stride_vh, s_ptr + t * stride_st + h * stride_sh,
                vo_ptr + t * stride_vot + h * stride_voh, so_ptr + t * stride_sot + h * stride_soh,
                0, num_states, stride_vs, stride_ss, stride_vd, stride_vod, head_dim, True, BLOCK_S, BLOCK_D,
                WRITE_S=True)


@triton.jit
def _merge_decode_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, info_ptr,
                         stride_ot, stride_oh, stride_lt, stride_lh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QLEN: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (split request x q row, head, column block): merge its partials' BLOCK_D columns
    into out (column block 0 also writes lse). Requests with fewer than two partials were written
    directly by the decode kernel. PDL: launched as a programmatic dependent of the kernel that
    wrote the partials; wait for that grid to finish (its stores visible) before reading them."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.program_id(2) * BLOCK_D
    item = pid // QLEN
    qi = pid % QLEN
    row_base = tl.load(info_ptr + item * 4)
    first = tl.load(info_ptr + item * 4 + 1)
    n = tl.load(info_ptr + item * 4 + 2)
    if n > 1:
        row = (row_base + qi).to(tl.int64)
        _merge_rows(po_ptr + (qi * NUM_HEADS + h) * HEAD_DIM + col, plse_ptr + qi * NUM_HEADS + h,
                    out_ptr + row * stride_ot + h * stride_oh + col, lse_ptr + row * stride_lt + h * stride_lh,
                    first, n, QLEN * NUM_HEADS * HEAD_DIM, QLEN * NUM_HEADS, 1, 1, BLOCK_D, col == 0,
                    BLOCK_S, BLOCK_D, WRITE_S=WRITE_LSE)


def _states_block(head_dim: int) -> int:
    # a [BLOCK_S, head_dim] float32 tile of about 4K elements per load round
    return max(2, min(32, 4096 // head_dim))


# head-dim columns per decode-merge program: a few programs per (row, head), so a batch-1 merge of
# 32 heads runs on more than 32 SMs and reads all of a few dozen partials in one load round
_MERGE_COLS = 32
_MERGE_STATES = 64


def _merge_columns(head_dim: int) -> int:
    """Columns per decode-merge program: _MERGE_COLS where they divide head_dim, else all."""
    return _MERGE_COLS if head_dim % _MERGE_COLS == 0 else head_dim


@functools.lru_cache(maxsize=None)
def _decode_merge_launcher(num_heads: int, head_dim: int, q_len: int, write_lse: bool, pdl: bool) -> BoundKernel:
    cols = _merge_columns(head_dim)
    return bind(_merge_decode_kernel, NUM_HEADS=num_heads, HEAD_DIM=head_dim, QLEN=q_len,
                BLOCK_S=_MERGE_STATES if cols == _MERGE_COLS else _states_block(head_dim), BLOCK_D=cols,
                WRITE_LSE=write_lse, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))


class DecodeMerge:
    """The split-KV merge launch of one plan: partials ``po`` [P, q_len, H, D] fp32 and ``plse``
    [P, q_len, H] into ``out`` [rows, H, D] and ``lse`` [rows, H] (may be None) for ``num_items``
    rows of ``info``. The grid, launchers and the plan's own arguments are fixed here, and the
    Triton specialisation key of a call is kept per kind of call (strides, lse or not), so a
    repeated run() does no argument analysis. ``pdl`` (sm90+ only): launch as a programmatic
    dependent of the kernel before it on the stream (which then should call
    griddepcontrol.launch_dependents early; see DecodeConfig.pdl)."""

    def __init__(self, po, plse, info, num_items: int, q_len: int, num_heads: int, head_dim: int,
                 pdl: bool = False):
        self.po, self.plse, self.info, self.pdl = po, plse, info, pdl
        self.grid = (num_items * q_len, num_heads, head_dim // _merge_columns(head_dim))
        self._launchers = {write_lse: _decode_merge_launcher(num_heads, head_dim, q_len, write_lse, pdl)
                           for write_lse in (False, True)}
        self._specs = SpecKeys()
        self._po_at, self._plse_at, self._info_at = po.data_ptr(), plse.data_ptr(), info.data_ptr()
        self._cuda_index = po.device.index if po.is_cuda else None

    def __call__(self, out, lse) -> None:
        write_lse = lse is not None
        os_ = out.stride()
        ls = lse.stride() if write_lse else (0, 0)
        lse_t = lse if write_lse else self.plse
        out_at, lse_at = out.data_ptr(), lse_t.data_ptr()
        aligned = (self._po_at | self._plse_at | out_at | lse_at | self._info_at) & 15 == 0
        launch_kept(self._launchers[write_lse], self._specs,
                    (write_lse, out.dtype, lse_t.dtype, os_, ls) if aligned else None, self._cuda_index, self.grid,
                    (self._po_at, self._plse_at, out_at, lse_at, self._info_at, os_[0], os_[1], *ls),
                    lambda: (self.po, self.plse, out, lse_t, self.info, os_[0], os_[1], *ls))


@functools.lru_cache(maxsize=None)
def _merge_states_launcher(head_dim: int) -> BoundKernel:
    block_d = triton.next_power_of_2(head_dim)
    return bind(_merge_states_kernel, BLOCK_S=_states_block(block_d), BLOCK_D=block_d, num_warps=4)


def merge_states(inputs: MergeInputs) -> None:
    """op ``merge``: fill inputs.v_out [seq, H, D] and inputs.s_out [seq, H] (base 2); any strides
    (a unit column stride, the usual case, is Triton's specialisation of 1: contiguous loads)."""
    v, s, v_out, s_out = inputs.v, inputs.s, inputs.v_out, inputs.s_out
    seq, num_states, num_heads, head_dim = v.shape
    if seq == 0:
        return
    _merge_states_launcher(head_dim)(
        (seq, num_heads), v, s, v_out, s_out, num_states, head_dim, *v.stride(), *s.stride(), *v_out.stride(),
        *s_out.stride())
