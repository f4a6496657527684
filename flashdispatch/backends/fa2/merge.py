"""Merging partial attention states by their base-2 lse (Triton).

A state is (v, s): v the softmax-normalized output over some keys, s = log2(sum 2^score)
over them. Merging n states: m = max s_k, w_k = 2^(s_k - m), v = sum w_k v_k / sum w_k,
s = m + log2(sum w_k); states with s = -inf count for nothing; all -inf gives v 0, s -inf.

One kernel body serves two callers:
- `merge_states` (op ``merge``): v [seq, num_states, heads, dim], s [seq, num_states, heads];
- the split-KV decode (`launch_decode_merge`): partials [P, q_len, heads, dim] float32 in the
  workspace, one row of ``info`` per split request (out row base, first partial, count).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dispatch.caps import Caps
from ..base import MergeInputs
from ..common import TRITON_INTERPRETED

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
def _merge_rows(v_ptr, s_ptr, vo_ptr, so_ptr, first, n, offs_h, offs_d, mask_h, mask_d,
                stride_vs, stride_vh, stride_ss, stride_sh, stride_voh, stride_soh,
                WRITE_S: tl.constexpr):
    """Merge states first..first+n-1 for a block of heads; v_ptr/s_ptr/vo_ptr/so_ptr already
    point at this row."""
    m_i = tl.full(offs_h.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(offs_h.shape, tl.float32)
    acc = tl.zeros((offs_h.shape[0], offs_d.shape[0]), tl.float32)
    mask = mask_h[:, None] & mask_d[None, :]
    for k in range(first, first + n):
        s_k = tl.load(s_ptr + k * stride_ss + offs_h * stride_sh, mask=mask_h, other=float("-inf"))
        v_k = tl.load(v_ptr + k * stride_vs + offs_h[:, None] * stride_vh + offs_d[None, :],
                      mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, s_k)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        w = tl.exp2(s_k - m_use)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + tl.where(w[:, None] > 0, w[:, None] * v_k, 0.0)
        m_i = m_new
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(vo_ptr + offs_h[:, None] * stride_voh + offs_d[None, :],
             out.to(vo_ptr.dtype.element_ty), mask=mask)
    if WRITE_S:
        s_out = tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(so_ptr + offs_h * stride_soh, s_out, mask=mask_h)


@triton.jit
def _merge_states_kernel(v_ptr, s_ptr, vo_ptr, so_ptr, num_states, num_heads, head_dim,
                         stride_vt, stride_vs, stride_vh, stride_st, stride_ss, stride_sh,
                         stride_vot, stride_voh, stride_sot, stride_soh,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    _merge_rows(v_ptr + t * stride_vt, s_ptr + t * stride_st, vo_ptr + t * stride_vot, so_ptr + t * stride_sot,
                0, num_states, offs_h, offs_d, offs_h < num_heads, offs_d < head_dim,
                stride_vs, stride_vh, stride_ss, stride_sh, stride_voh, stride_soh, WRITE_S=True)


@triton.jit
def _merge_decode_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, info_ptr,
                         stride_ot, stride_oh, stride_lt, stride_lh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QLEN: tl.constexpr,
                         BLOCK_H: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Program (split request x q row, head block): merge its partials into out/lse.
    Requests with fewer than two partials were written directly by the decode kernel."""
    pid = tl.program_id(0)
    item = pid // QLEN
    qi = pid % QLEN
    row_base = tl.load(info_ptr + item * 4)
    first = tl.load(info_ptr + item * 4 + 1)
    n = tl.load(info_ptr + item * 4 + 2)
    if n > 1:
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        row = (row_base + qi).to(tl.int64)
        _merge_rows(po_ptr + qi * NUM_HEADS * HEAD_DIM, plse_ptr + qi * NUM_HEADS,
                    out_ptr + row * stride_ot, lse_ptr + row * stride_lt,
                    first, n, offs_h, offs_d, offs_h < NUM_HEADS, offs_d < HEAD_DIM,
                    QLEN * NUM_HEADS * HEAD_DIM, HEAD_DIM, QLEN * NUM_HEADS, 1, stride_oh, stride_lh,
                    WRITE_S=WRITE_LSE)


def _heads_block(num_heads: int, head_dim: int) -> int:
    # about 4K elements per program: enough work per program, few registers.
    return max(1, min(triton.next_power_of_2(num_heads), 4096 // max(head_dim, 1)))


def launch_decode_merge(po, plse, out, lse, info, num_items: int, q_len: int) -> None:
    """Merge decode partials (``po`` [P, q_len, H, D] fp32, ``plse`` [P, q_len, H]) into
    ``out`` [rows, H, D] and ``lse`` [rows, H] (may be None) for ``num_items`` rows of ``info``."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    block_h = _heads_block(num_heads, head_dim)
    lse_arg = lse if lse is not None else plse
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    grid = (num_items * q_len, triton.cdiv(num_heads, block_h))
    _merge_decode_kernel[grid](po, plse, out, lse_arg, info, out.stride(0), out.stride(1), *lse_strides,
                               NUM_HEADS=num_heads, HEAD_DIM=head_dim, QLEN=q_len, BLOCK_H=block_h,
                               WRITE_LSE=lse is not None, num_warps=4)


def merge_states(inputs: MergeInputs) -> None:
    """op ``merge``: fill inputs.v_out [seq, H, D] and inputs.s_out [seq, H] (base 2)."""
    v, s, v_out, s_out = inputs.v, inputs.s, inputs.v_out, inputs.s_out
    seq, num_states, num_heads, head_dim = v.shape
    if seq == 0:
        return
    if v.stride(-1) != 1 or v_out.stride(-1) != 1:
        raise ValueError("merge_states: v and v_out need a contiguous last dimension "
                         f"(strides {tuple(v.stride())}, {tuple(v_out.stride())})")
    block_d = triton.next_power_of_2(head_dim)
    block_h = _heads_block(num_heads, block_d)
    grid = (seq, triton.cdiv(num_heads, block_h))
    _merge_states_kernel[grid](v, s, v_out, s_out, num_states, num_heads, head_dim,
                               v.stride(0), v.stride(1), v.stride(2), s.stride(0), s.stride(1), s.stride(2),
                               v_out.stride(0), v_out.stride(1), s_out.stride(0), s_out.stride(1),
                               BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
