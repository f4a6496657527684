"""The Triton split-KV paged decode kernel.

One program = one work item (a request's chunk of tokens) x one KV head x one block of
query rows. The rows are every (q row, query head) pair that reads this KV head
(``q_len_per_req * group`` of them, padded to at least 16 for the tensor cores), so each
KV byte is read once per chunk. Tokens are visited BLOCK_N at a time across pages, with a
page-table lookup per token row; Triton pipelines the gathers (num_stages). K is loaded
either as K^T tiles [HEAD_DIM, BLOCK_N] or, with K_ROWS, as [BLOCK_N, HEAD_DIM] rows transposed
in registers (a different shared-memory path; see DecodeConfig.k_rows).

A work row (int32, `WORK_COLS` wide) holds: request, first page index in kv_indices,
token start, token end, kv_len, output slot (-1: write out/lse directly, else the partial
slot in the workspace) and whether the chunk is the request's first (it carries the sink).
A request index < 0 marks an idle program (CUDA-graph grids are fixed).
"""
from __future__ import annotations

import triton
import triton.language as tl

WORK_COLS = 8


@triton.jit
def _tanh(x):
    # tanh through exp2: saturates to +-1 without inf/inf.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _rope(x1, x2, pos, offs_half, rope_rcp_scale, rope_log2_theta, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE of (x1, x2) = the two halves, [rows, HALF], at positions pos [rows]."""
    inv_freq = tl.exp2(-(offs_half.to(tl.float32) * (2.0 / HEAD_DIM)) * rope_log2_theta)
    angle = (pos.to(tl.float32) * rope_rcp_scale)[:, None] * inv_freq[None, :]
    c = tl.cos(angle)
    s = tl.sin(angle)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
    work_ptr, kv_indices_ptr, slopes_ptr, sinks_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, v_scale, window_left, soft_cap, rope_rcp_scale, rope_log2_theta,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, QLEN: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
    ROPE: tl.constexpr, SINKS: tl.constexpr, WRITE_LSE: tl.constexpr,
    Q_SCALE_T: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, K_ROWS: tl.constexpr,
):
    wrow = work_ptr + tl.program_id(0) * 8  # WORK_COLS
    req = tl.load(wrow)
    if req < 0:
        return
    page_base = tl.load(wrow + 1)
    tok_start = tl.load(wrow + 2)
    tok_end = tl.load(wrow + 3)
    kv_len = tl.load(wrow + 4)
    slot = tl.load(wrow + 5)
    is_first = tl.load(wrow + 6)
    hk = tl.program_id(1) // ROW_BLOCKS
    rb = tl.program_id(1) % ROW_BLOCKS

    # Query rows: g -> (q row qi, query head hq).
    g = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = g < QLEN * GROUP
    qi = g // GROUP
    hq = hk * GROUP + g % GROUP
    q_row = (req * QLEN + qi).to(tl.int64)
    pos = qi + kv_len - QLEN  # query position
    q_off = q_row * stride_qt + hq * stride_qh
    dt = q_ptr.dtype.element_ty

    scale = qk_scale
    if Q_SCALE_T:
        scale = scale * tl.load(q_scale_ptr).to(tl.float32)
    if K_SCALE_T:
        scale = scale * tl.load(k_scale_ptr).to(tl.float32)
    if SOFT_CAP or ALIBI:
        s_mul = scale
    else:
        s_mul = scale * 1.4426950408889634
    if ALIBI:
        slope = tl.load(slopes_ptr + hq, mask=row_ok, other=0.0)

    offs_n = tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = HEAD_DIM // 2
    if ROPE:
        offs_half = tl.arange(0, HALF)
        q1 = tl.load(q_ptr + q_off[:, None] + offs_half[None, :], mask=row_ok[:, None], other=0.0)
        q2 = tl.load(q_ptr + q_off[:, None] + HALF + offs_half[None, :], mask=row_ok[:, None], other=0.0)
        q1r, q2r = _rope(q1.to(tl.float32), q2.to(tl.float32), pos, offs_half,
                         rope_rcp_scale, rope_log2_theta, HEAD_DIM)
        q1 = q1r.to(dt)
        q2 = q2r.to(dt)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    offs_dv = tl.arange(0, HEAD_DIM)

    # Softmax state in base 2; the first chunk starts from the sink logit (no value).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + hq, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        first = (tl.zeros([BLOCK_M], tl.int32) + is_first) != 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first & (sink > float("-inf")), 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_head = k_ptr + hk * stride_kh
    v_head = v_ptr + hk * stride_vh
    for start in range(tok_start, tok_end, BLOCK_N):
        t = start + offs_n
        tc = tl.minimum(t, tok_end - 1)  # clamped: loads stay in bounds, scores masked below
        page = tl.load(kv_indices_ptr + page_base + tc // PAGE).to(tl.int64)
        in_page = tc % PAGE
        k_off = page * stride_kp + in_page * stride_ks
        v_off = page * stride_vp + in_page * stride_vs
        if ROPE:
            k1 = tl.load(k_head + k_off[:, None] + offs_half[None, :]).to(tl.float32)
            k2 = tl.load(k_head + k_off[:, None] + HALF + offs_half[None, :]).to(tl.float32)
            k1r, k2r = _rope(k1, k2, t, offs_half, rope_rcp_scale, rope_log2_theta, HEAD_DIM)
            s = tl.dot(q1, tl.trans(k1r.to(dt))) + tl.dot(q2, tl.trans(k2r.to(dt)))
        elif K_ROWS:
            k = tl.load(k_head + k_off[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k.to(dt)))
        else:
            k = tl.load(k_head + k_off[None, :] + offs_d[:, None])
            s = tl.dot(q, k.to(dt))
        s = s * s_mul
        if ALIBI:
            s += slope[:, None] * (t[None, :] - pos[:, None]).to(tl.float32)
        if SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        if SOFT_CAP or ALIBI:
            s = s * 1.4426950408889634
        keep = (t < tok_end)[None, :]
        if CAUSAL:
            keep = keep & (t[None, :] <= pos[:, None])
        if WINDOW:
            keep = keep & (t[None, :] >= pos[:, None] - window_left)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + v_off[:, None] + offs_dv[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v.to(dt))
        m_i = m_new

    l_safe = tl.where(l_i == 0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if V_SCALE_T:
        o = o * tl.load(v_scale_ptr).to(tl.float32)
    else:
        o = o * v_scale
    lse = tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe))
    if slot < 0:
        o_ptrs = out_ptr + (q_row * stride_ot + hq * stride_oh)[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + q_row * stride_lt + hq * stride_lh, lse, mask=row_ok)
    else:
        prow = (slot * QLEN + qi).to(tl.int64) * NUM_QO_HEADS + hq
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_dv[None, :], o, mask=row_ok[:, None])
        tl.store(plse_ptr + prow, lse, mask=row_ok)
