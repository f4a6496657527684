"""Triton FlashAttention-2 style prefill kernel (paged or ragged KV), read top to bottom.

One program computes one (work item, query head) pair: a tile of BLOCK_M query rows of one
request against one chunk [kv_lo, kv_hi) of that request's KV (the whole KV unless split),
walked in BLOCK_N tiles with an online softmax in base 2 (log2(e) is folded into the score
scale, so only exp2 is used). A work item is `WORK_COLS` int32 that plan() builds on the host:
(request, first query row of the tile inside the request, qo_len, kv_len, kv_lo, kv_hi,
partial base, chunk, chunks, tile-list offset). Partial base -1: the program writes out/lse.
Otherwise (split-KV) query row i of the tile writes its fp32 output and base-2 lse to partial row
base + i * chunks + chunk of the workspace, the merge kernel (merge.py) combines them, and only
chunk 0 carries the sink. The KV range of a tile is three loops: masked tiles left of the fully
visible band (sliding window, chunk start), the unmasked band, masked tiles on the right (causal
diagonal, chunk end, KV end). With a custom mask, plan() first classifies every (item, KV tile)
from the mask bits (prefill_mask_tiles.py: no visible key / all visible / partial) and writes
each item's runs of consecutive whole and partial tiles (at the tile-list offset); the attention
kernel walks each whole run as a plain tile range without masks, then each partial run with the
bitmaps the classifier wrote (`_tile_bits`), and never visits a tile without a visible key. A
causal-like mask gives one or two runs per item, so the tile loops pipeline as the causal ones do.
Every feature is a tl.constexpr, so a feature that is off costs nothing on the hot path. TMA
(ragged KV, sm90+): K and V tiles come through device-side tensor descriptors made per (request,
KV head) instead of pointer loads (prefill_tma.py). RoPE: Q tiles are rotated once per program;
a K tile of a power-of-two head is rotated from its two halves (`qk_parts`, `_load_k_halves`: two
score dots of half width), of the 192/128 pair with a second, permuted load per part
(`_load_k_part`). Ragged prefills with long queries rotate K before this kernel instead
(prefill_rope.py, ``K_ROTATED``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .paging import page_of, slot_in_page
from .prefill_tma import kv_descriptor
from .trig import rope_halves, rope_sincos, tanh

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
WORK_COLS = 10  # int32 per work item, see the module docstring
_WORK_COLS = tl.constexpr(WORK_COLS)
RUNS_HEAD = 4  # int32 before an item's custom-mask tile runs, see prefill_mask_tiles.mask_tile_runs_kernel
_RUNS_HEAD = tl.constexpr(RUNS_HEAD)


def qk_parts(head_dim_qk: int, rope: bool) -> tuple[int, int]:
    """The kernel's (HEAD_QK_A, HEAD_QK_B): the Q/K columns of its two score dots. 192 splits as
    128 + 64 (power-of-two tiles); with RoPE a power-of-two head splits into its halves, so a K
    tile is rotated from its two halves with one sine and cosine per pair (`_load_k_halves`)."""
    if head_dim_qk == 192:
        return 128, 64
    return (head_dim_qk // 2, head_dim_qk // 2) if rope else (head_dim_qk, 0)


@triton.jit
def _page_ids(kv_indices_ptr, kv_start, start_n, kv_len, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page id of each token of the KV tile at ``start_n`` (int32 [BLOCK_N]; 0 past kv_len).
    One load per tile when a tile never crosses a page; zeros for ragged KV."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGE_SIZE == 0:
        return tl.zeros([BLOCK_N], tl.int32)
    elif PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(kv_indices_ptr + kv_start + start_n // PAGE_SIZE, mask=start_n < kv_len, other=0)
        return tl.zeros([BLOCK_N], tl.int32) + page
    else:
        return tl.load(kv_indices_ptr + kv_start + page_of(offs_n, PAGE_SIZE), mask=offs_n < kv_len, other=0)


@triton.jit
def _row_offsets(page, slot, stride_page, stride_slot):
    """int64 element offsets page * stride_page + slot * stride_slot of KV rows. Page ids, ragged
    row indices (int32 kv_start + offset: indptr is int32), slots and strides (run() refuses
    >= 2**31) are >= 0 and < 2**31, so both products are unsigned 32x32 -> 64-bit multiplies (one
    IMAD.WIDE.U32 each on sm90), not signed 64x64-bit ones. tl.cast: a stride of 1 arrives as a
    constexpr int."""
    wide = page.to(tl.uint32).to(tl.uint64) * tl.cast(stride_page, tl.uint32).to(tl.uint64)
    return (wide + slot.to(tl.uint32).to(tl.uint64) * tl.cast(stride_slot, tl.uint32).to(tl.uint64)).to(tl.int64)


@triton.jit
def _rope(x, x_partner, pos, offs_d, HALF: tl.constexpr, HEAD_QK: tl.constexpr,
          rope_inv_scale, rope_log2_theta, ROPE: tl.constexpr):
    """Rotate-half RoPE of rows ``x`` (float32, columns ``offs_d``) at positions ``pos``;
    ``x_partner`` holds column (c + HALF) % HEAD_QK of each column c."""
    t = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    sin_a, cos_a = rope_sincos(pos, t, rope_inv_scale, rope_log2_theta, HEAD_QK, ROPE)
    return x * cos_a + (sign[None, :] * x_partner) * sin_a


@triton.jit
def _load_k_part(k_base, row_off, kv_len, offs_n, offs_d, stride_kd, pos_n, rope_inv_scale, rope_log2_theta,
                 DTYPE: tl.constexpr, MASKED: tl.constexpr, ROPE: tl.constexpr,
                 HALF: tl.constexpr, HEAD_QK: tl.constexpr):
    """One column part of a K tile [BLOCK_N, len(offs_d)] in the compute dtype (RoPE applied)."""
    ptrs = k_base + row_off[:, None] + offs_d[None, :] * stride_kd
    if MASKED:
        k = tl.load(ptrs, mask=(offs_n < kv_len)[:, None], other=0.0)
    else:
        k = tl.load(ptrs)
    if ROPE:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        pptrs = k_base + row_off[:, None] + partner[None, :] * stride_kd
        if MASKED:
            kp = tl.load(pptrs, mask=(offs_n < kv_len)[:, None], other=0.0)
        else:
            kp = tl.load(pptrs)
        k = _rope(k.to(tl.float32), kp.to(tl.float32), pos_n, offs_d, HALF, HEAD_QK,
                  rope_inv_scale, rope_log2_theta, ROPE)
    return k.to(DTYPE)


@triton.jit
def _load_k_halves(k_base, row_off, kv_len, offs_n, stride_kd, rope_inv_scale, rope_log2_theta,
                   DTYPE: tl.constexpr, MASKED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    """The two halves of a K tile [BLOCK_N, HALF] each, rotated (RoPE at positions ``offs_n``) with
    one sine and cosine per column pair, in the compute dtype."""
    offs_h = tl.arange(0, HALF)
    ptrs = k_base + row_off[:, None] + offs_h[None, :] * stride_kd
    if MASKED:
        k1 = tl.load(ptrs, mask=(offs_n < kv_len)[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(ptrs + HALF * stride_kd, mask=(offs_n < kv_len)[:, None], other=0.0).to(tl.float32)
    else:
        k1 = tl.load(ptrs).to(tl.float32)
        k2 = tl.load(ptrs + HALF * stride_kd).to(tl.float32)
    sin_a, cos_a = rope_sincos(offs_n, offs_h, rope_inv_scale, rope_log2_theta, 2 * HALF, ROPE)
    k1, k2 = rope_halves(k1, k2, sin_a, cos_a)
    return k1.to(DTYPE), k2.to(DTYPE)


@triton.jit
def _tile_bits(bits_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The visible pairs [BLOCK_M, BLOCK_N] of one partial KV tile from its bitmap, written by
    mask_tile_classes_kernel: row-major [BLOCK_M, BLOCK_N // 16] int16, bit b of word w = key
    16 * w + b of the tile (one coalesced load instead of a byte gather per pair)."""
    WORDS: tl.constexpr = BLOCK_N // 16
    words = tl.load(bits_ptr + tl.arange(0, BLOCK_M)[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    bits = (words.to(tl.int32)[:, :, None] >> tl.arange(0, 16)[None, None, :]) & 1
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) != 0


@triton.jit
def _attn_tiles(acc, l_i, m_i, q_a, q_b, lo, hi,
                K, V, kv_indices_ptr, last_page, mask_ptr, kv_start, kv_len, kv_lo, kv_hi, kvh, mask_off,
                offs_m, pos_m, qo_len, stride_kp, stride_ks, stride_kh, stride_kd,
                stride_vp, stride_vs, stride_vh, stride_vd,
                qk_scale, alibi_log2, soft_cap, window_left, rope_inv_scale, rope_log2_theta,
                DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HEAD_QK_A: tl.constexpr, HEAD_QK_B: tl.constexpr, HEAD_VO: tl.constexpr,
                CAUSAL: tl.constexpr, CUSTOM_MASK: tl.constexpr, WINDOW: tl.constexpr,
                SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, ROPE: tl.constexpr, SPLIT: tl.constexpr,
                TMA: tl.constexpr, SHARED_ROWS: tl.constexpr, SCALE_POS: tl.constexpr, CLAMP_PAGES: tl.constexpr):
    """Online-softmax update over the KV tiles starting in [lo, hi). MASKED tiles apply every
    mask (a custom mask's from its tile bitmaps), the chunk bounds [kv_lo, kv_hi) included; the
    others none. K and V are base pointers or, TMA, the descriptors of the request's rows of this
    KV head (rows past kv_len load as zeros, so no load mask). SHARED_ROWS (paged tiles that cross
    pages): V's page and slot strides are K's, so V rows are read at K's row offsets (no second
    address computation; within one page the compiler derives V's addresses more cheaply itself).
    SCALE_POS: qk_scale > 0, so without soft cap and ALiBi the row max is taken over the raw scores
    and the scale folds into the exponent's FMA (one instruction per score instead of two).
    CLAMP_PAGES: page ids are clamped to [0, last_page] where used (compared as unsigned: a
    negative one clamps too), so ids the API has not checked yet never read outside the cache."""
    HALF: tl.constexpr = (HEAD_QK_A + HEAD_QK_B) // 2
    HALVES: tl.constexpr = ROPE > 0 and HEAD_QK_A == HALF  # K rotated from its halves (`qk_parts`)
    FOLD: tl.constexpr = SCALE_POS and not SOFT_CAP and not ALIBI
    offs_da = tl.arange(0, HEAD_QK_A)
    offs_dv = tl.arange(0, HEAD_VO)
    if TMA:  # K and V are already the descriptors of this KV head's rows
        k_base = K
        v_base = V
    else:
        k_base = K + kvh.to(tl.int64) * stride_kh
        v_base = V + kvh.to(tl.int64) * stride_vh
    # page ids are fetched one tile ahead, so the K/V addresses never wait on them
    page_ids = _page_ids(kv_indices_ptr, kv_start, lo, kv_len, PAGE_SIZE, BLOCK_N)
    # a custom mask's partial tiles at BLOCK_N 128 are not pipelined: their bitmap buffers would
    # not fit in shared memory beside the K/V stages (sm90, 128x128, 3 stages: 233472 > 232448 B)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if CUSTOM_MASK and MASKED and BLOCK_N >= 128 else None):
        next_n = start_n + BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if PAGE_SIZE == 0:
            page = kv_start + offs_n
            slot = tl.zeros([BLOCK_N], tl.int32)
        else:
            page = page_ids
            if CLAMP_PAGES:  # here, not at the load a tile ahead: that waited for the load (H200: 5-13 %)
                page = tl.minimum(page.to(tl.uint32), last_page)
            slot = slot_in_page(offs_n, PAGE_SIZE)
            page_ids = _page_ids(kv_indices_ptr, kv_start, next_n, kv_len, PAGE_SIZE, BLOCK_N)
        k_rows = _row_offsets(page, slot, stride_kp, stride_ks)
        if TMA:
            k = K.load([start_n, 0])
        elif HALVES:
            k, kb = _load_k_halves(k_base, k_rows, kv_len, offs_n, stride_kd, rope_inv_scale, rope_log2_theta,
                                   DTYPE, MASKED, ROPE, HALF)
        else:
            k = _load_k_part(k_base, k_rows, kv_len, offs_n, offs_da, stride_kd, offs_n,
                             rope_inv_scale, rope_log2_theta, DTYPE, MASKED, ROPE, HALF, HEAD_QK_A + HEAD_QK_B)
        qk = tl.dot(q_a, tl.trans(k), input_precision=DOT_PREC)
        if HEAD_QK_B > 0:
            if not HALVES:
                offs_db = HEAD_QK_A + tl.arange(0, HEAD_QK_B)
                kb = _load_k_part(k_base, k_rows, kv_len, offs_n, offs_db, stride_kd, offs_n,
                                  rope_inv_scale, rope_log2_theta, DTYPE, MASKED, ROPE, HALF, HEAD_QK_A + HEAD_QK_B)
            qk = tl.dot(q_b, tl.trans(kb), qk, input_precision=DOT_PREC)
        # scores in log2 units (FOLD: raw, scaled in the exponent below)
        if FOLD:
            s = qk
        elif SOFT_CAP:
            s = qk * qk_scale
            if ALIBI:
                s += alibi_log2 * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
            # cap * tanh(s / cap), with s and cap both in log2 units (the same ratio as in natural ones)
            s = soft_cap * tanh(s * (1.0 / soft_cap))
        else:
            s = qk * qk_scale
            if ALIBI:
                s += alibi_log2 * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
        if MASKED:
            keep = (offs_n < kv_hi)[None, :]
            if SPLIT:
                keep = keep & (offs_n >= kv_lo)[None, :]
            if CUSTOM_MASK:  # the bitmap holds the window and the chunk and row bounds too
                BM: tl.constexpr = offs_m.shape[0]
                keep = _tile_bits(mask_ptr + (mask_off + start_n // BLOCK_N) * (BM * (BLOCK_N // 16)), BM, BLOCK_N)
            elif CAUSAL:
                keep = keep & (offs_n[None, :] <= pos_m[:, None])
            if WINDOW:
                keep = keep & (offs_n[None, :] >= pos_m[:, None] - window_left)
            s = tl.where(keep, s, float("-inf"))
        if FOLD:  # max(qk) * scale == max(qk * scale) for scale > 0; -inf stays -inf
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = V.load([start_n, 0])
        else:
            v_rows = k_rows if SHARED_ROWS else _row_offsets(page, slot, stride_vp, stride_vs)
            v_ptrs = v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=(offs_n < kv_len)[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(p.to(DTYPE), v.to(DTYPE), acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_q_part(Q, q_row_off, offs_m, qo_len, offs_d, stride_qd, pos_m, rope_inv_scale, rope_log2_theta,
                 DTYPE: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, HEAD_QK: tl.constexpr):
    """One column part of the Q tile [BLOCK_M, len(offs_d)] in the compute dtype (RoPE applied)."""
    row_ok = (offs_m < qo_len)[:, None]
    q = tl.load(Q + q_row_off[:, None] + offs_d[None, :] * stride_qd, mask=row_ok, other=0.0)
    if ROPE:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        qp = tl.load(Q + q_row_off[:, None] + partner[None, :] * stride_qd, mask=row_ok, other=0.0)
        q = _rope(q.to(tl.float32), qp.to(tl.float32), pos_m, offs_d, HALF, HEAD_QK,
                  rope_inv_scale, rope_log2_theta, ROPE)
    return q.to(DTYPE)


@triton.jit
def _prefill_one(pid, Q, K, V, O, LSE, PO, PLSE, work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                 mask_ptr, tiles_ptr, sinks_ptr, alibi_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                 qk_scale, v_scale, soft_cap, rope_inv_scale, rope_log2_theta, window_left, last_page,
                 stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                 stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                 stride_lt, stride_lh,
                 NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_QK_A: tl.constexpr, HEAD_QK_B: tl.constexpr, HEAD_VO: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                 CAUSAL: tl.constexpr, CUSTOM_MASK: tl.constexpr, WINDOW: tl.constexpr,
                 SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, ROPE: tl.constexpr, K_ROTATED: tl.constexpr,
                 SINKS: tl.constexpr, HAS_LSE: tl.constexpr, Q_SCALE_T: tl.constexpr, K_SCALE_T: tl.constexpr,
                 V_SCALE_T: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
                 SHARED_ROWS: tl.constexpr, SCALE_POS: tl.constexpr, CLAMP_PAGES: tl.constexpr):
    """The tile of one (work item, query head): pid = item * NUM_QO_HEADS + head. TMA (ragged KV
    only, HEAD_QK_B == 0): K/V tiles through descriptors of the request's rows of this KV head.
    K_ROTATED: K arrives rotated (prefill_rope.py), so ROPE applies to Q only."""
    K_ROPE: tl.constexpr = 0 if K_ROTATED else ROPE  # the RoPE kind of the K tiles
    head = pid % NUM_QO_HEADS
    item = pid // NUM_QO_HEADS
    row = work_ptr + item * _WORK_COLS
    req = tl.load(row)
    m0 = tl.load(row + 1)
    qo_len = tl.load(row + 2)
    kv_len = tl.load(row + 3)
    kv_lo = 0
    kv_hi = kv_len
    chunk = 0
    if SPLIT:
        kv_lo = tl.load(row + 4)
        kv_hi = tl.load(row + 5)
        part_base = tl.load(row + 6)
        chunk = tl.load(row + 7)
        num_chunks = tl.load(row + 8)
    q_start = tl.load(qo_indptr_ptr + req)
    kv_start = tl.load(kv_indptr_ptr + req)
    mask_off = 0
    if CUSTOM_MASK:  # bitmap slot of KV tile 0: tile t's is half the item's list offset + t - its first tile
        mask_off = (tl.load(row + 9) // 2 - kv_lo // BLOCK_N).to(tl.int64)
    kvh = head // GROUP
    HALF: tl.constexpr = (HEAD_QK_A + HEAD_QK_B) // 2
    if TMA:
        tl.static_assert(PAGE_SIZE == 0 and HEAD_QK_B == 0, "TMA loads are for ragged KV with one K part")
        k_src = kv_descriptor(K, kv_start, kvh, kv_len, stride_kp, stride_kh, BLOCK_N, HEAD_QK_A)
        v_src = kv_descriptor(V, kv_start, kvh, kv_len, stride_vp, stride_vh, BLOCK_N, HEAD_VO)
    else:
        k_src = K
        v_src = V

    offs_m = m0 + tl.arange(0, BLOCK_M)
    delta = kv_len - qo_len
    pos_m = offs_m + delta
    q_row_off = (q_start + offs_m).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_a = _load_q_part(Q, q_row_off, offs_m, qo_len, tl.arange(0, HEAD_QK_A), stride_qd, pos_m,
                       rope_inv_scale, rope_log2_theta, DTYPE, ROPE, HALF, HEAD_QK_A + HEAD_QK_B)
    if HEAD_QK_B > 0:
        q_b = _load_q_part(Q, q_row_off, offs_m, qo_len, HEAD_QK_A + tl.arange(0, HEAD_QK_B), stride_qd,
                           pos_m, rope_inv_scale, rope_log2_theta, DTYPE, ROPE, HALF, HEAD_QK_A + HEAD_QK_B)
    else:
        q_b = q_a

    scale = qk_scale
    if Q_SCALE_T:
        scale = scale * tl.load(q_scale_ptr).to(tl.float32)
    if K_SCALE_T:
        scale = scale * tl.load(k_scale_ptr).to(tl.float32)
    alibi_log2 = 0.0
    if ALIBI:
        alibi_log2 = tl.load(alibi_ptr + head) * LOG2E

    # KV tile ranges inside the chunk [kv_lo, kv_hi): masked [lo, b), unmasked [b, c), masked [c, hi)
    p_min = m0 + delta
    p_max = tl.minimum(m0 + BLOCK_M, qo_len) - 1 + delta
    hi = kv_hi
    if CAUSAL:
        hi = tl.minimum(hi, p_max + 1)
    first_key = kv_lo
    full_lo = kv_lo
    if WINDOW:
        first_key = tl.maximum(first_key, p_min - window_left)
        full_lo = tl.maximum(full_lo, p_max - window_left)
    lo = (tl.maximum(first_key, 0) // BLOCK_N) * BLOCK_N
    full_lo = ((tl.maximum(full_lo, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = kv_hi
    if CAUSAL:
        full_hi = tl.minimum(full_hi, p_min + 1)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    b = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    c = tl.minimum(tl.maximum(full_hi, b), tl.maximum(hi, b))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # the sink joins the softmax of chunk 0 only, so the merge counts it once
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        carry = (tl.zeros([BLOCK_M], tl.int32) + chunk) == 0
        m_i = tl.where(carry, sink, m_i)
        l_i = tl.where(carry, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_VO], tl.float32)

    if CUSTOM_MASK:  # runs of whole KV tiles without masks, then runs of partial ones (mask_tile_runs_kernel)
        runs = tiles_ptr + tl.load(row + 9)
        n_whole = tl.load(runs)
        n_runs = n_whole + tl.load(runs + 1)
        for partial in tl.static_range(2):  # the whole runs without masks, then the partial ones with them
            for r in range(n_whole if partial else 0, n_runs if partial else n_whole):
                acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_a, q_b, tl.load(runs + _RUNS_HEAD + 2 * r) * BLOCK_N,
                                            tl.load(runs + _RUNS_HEAD + 2 * r + 1) * BLOCK_N, k_src, v_src,
                                            kv_indices_ptr, last_page, mask_ptr, kv_start, kv_len, kv_lo, kv_hi, kvh,
                                            mask_off, offs_m, pos_m, qo_len, stride_kp, stride_ks, stride_kh, stride_kd,
                                            stride_vp, stride_vs, stride_vh, stride_vd, scale, alibi_log2, soft_cap,
                                            window_left, rope_inv_scale, rope_log2_theta, DTYPE, DOT_PREC,
                                            partial == 1, BLOCK_N, PAGE_SIZE, HEAD_QK_A, HEAD_QK_B, HEAD_VO, CAUSAL,
                                            CUSTOM_MASK, WINDOW, SOFT_CAP, ALIBI, K_ROPE, SPLIT, TMA, SHARED_ROWS,
                                            SCALE_POS, CLAMP_PAGES)
    else:
        # masked [lo, b), unmasked [b, c), masked [c, hi)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_a, q_b, lo, b, k_src, v_src, kv_indices_ptr, last_page, mask_ptr,
                                    kv_start, kv_len, kv_lo, kv_hi, kvh, mask_off, offs_m, pos_m, qo_len, stride_kp,
                                    stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, scale,
                                    alibi_log2, soft_cap, window_left, rope_inv_scale, rope_log2_theta, DTYPE, DOT_PREC,
                                    True, BLOCK_N, PAGE_SIZE, HEAD_QK_A, HEAD_QK_B, HEAD_VO, CAUSAL, CUSTOM_MASK,
                                    WINDOW, SOFT_CAP, ALIBI, K_ROPE, SPLIT, TMA, SHARED_ROWS, SCALE_POS, CLAMP_PAGES)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_a, q_b, b, c, k_src, v_src, kv_indices_ptr, last_page, mask_ptr,
                                    kv_start, kv_len, kv_lo, kv_hi, kvh, mask_off, offs_m, pos_m, qo_len, stride_kp,
                                    stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, scale,
                                    alibi_log2, soft_cap, window_left, rope_inv_scale, rope_log2_theta, DTYPE, DOT_PREC,
                                    False, BLOCK_N, PAGE_SIZE, HEAD_QK_A, HEAD_QK_B, HEAD_VO, CAUSAL, CUSTOM_MASK,
                                    WINDOW, SOFT_CAP, ALIBI, K_ROPE, SPLIT, TMA, SHARED_ROWS, SCALE_POS, CLAMP_PAGES)
        # keys from c on are inside every stored row's window (c >= b, the first such tile, or the
        # range is empty): no window test
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_a, q_b, c, hi, k_src, v_src, kv_indices_ptr, last_page, mask_ptr,
                                    kv_start, kv_len, kv_lo, kv_hi, kvh, mask_off, offs_m, pos_m, qo_len, stride_kp,
                                    stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, scale,
                                    alibi_log2, soft_cap, window_left, rope_inv_scale, rope_log2_theta, DTYPE, DOT_PREC,
                                    True, BLOCK_N, PAGE_SIZE, HEAD_QK_A, HEAD_QK_B, HEAD_VO, CAUSAL, CUSTOM_MASK, False,
                                    SOFT_CAP, ALIBI, K_ROPE, SPLIT, TMA, SHARED_ROWS, SCALE_POS, CLAMP_PAGES)

    seen = l_i > 0.0
    out_scale = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0) * v_scale
    if V_SCALE_T:
        out_scale = out_scale * tl.load(v_scale_ptr).to(tl.float32)
    out = acc * out_scale[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row_ok = offs_m < qo_len
    offs_dv = tl.arange(0, HEAD_VO)
    direct = row_ok
    if SPLIT:  # a chunk of a split tile: partial state [partial row, head, HEAD_VO] fp32, [partial row, head]
        partial = row_ok & (part_base >= 0)
        direct = row_ok & (part_base < 0)
        prow = (part_base + (offs_m - m0) * num_chunks + chunk).to(tl.int64) * NUM_QO_HEADS + head
        tl.store(PO + prow[:, None] * HEAD_VO + offs_dv[None, :], out, mask=partial[:, None])
        tl.store(PLSE + prow, lse, mask=partial)
    o_rows = (q_start + offs_m).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(O + o_rows[:, None] + offs_dv[None, :] * stride_od, out.to(O.dtype.element_ty), mask=direct[:, None])
    if HAS_LSE:
        l_rows = (q_start + offs_m).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
        tl.store(LSE + l_rows, lse, mask=direct)


@triton.jit(do_not_specialize=["num_pages"])  # one compile for any cache size
def fa2_prefill_kernel(Q, K, V, O, LSE, PO, PLSE, work_ptr, num_work_ptr, qo_indptr_ptr, kv_indptr_ptr,
                       kv_indices_ptr, mask_ptr, tiles_ptr, sinks_ptr, alibi_ptr,
                       q_scale_ptr, k_scale_ptr, v_scale_ptr,
                       qk_scale, v_scale, soft_cap, rope_inv_scale, rope_log2_theta, window_left, num_pages,
                       stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                       stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                       stride_lt, stride_lh,
                       NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       HEAD_QK_A: tl.constexpr, HEAD_QK_B: tl.constexpr, HEAD_VO: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                       CAUSAL: tl.constexpr, CUSTOM_MASK: tl.constexpr, WINDOW: tl.constexpr,
                       SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, ROPE: tl.constexpr, K_ROTATED: tl.constexpr,
                       SINKS: tl.constexpr, HAS_LSE: tl.constexpr, Q_SCALE_T: tl.constexpr, K_SCALE_T: tl.constexpr,
                       V_SCALE_T: tl.constexpr, SPLIT: tl.constexpr, PERSISTENT: tl.constexpr,
                       TMA: tl.constexpr, SHARED_ROWS: tl.constexpr, SCALE_POS: tl.constexpr,
                       CLAMP_PAGES: tl.constexpr):
    """Grid: one program per (work item, head) or, PERSISTENT (CUDA-graph mode), a fixed
    number of programs striding over item * heads with the item count read from memory.
    SPLIT: some items are KV chunks whose partial states go to PO/PLSE (never with PERSISTENT).
    TMA: K/V tiles through device-side tensor descriptors (prefill_tma.py; ragged KV only).
    SCALE_POS: qk_scale is > 0 and no q/k scale tensor multiplies it (see _attn_tiles).
    K_ROTATED: K arrives rotated by RoPE (prefill_rope.py): ROPE rotates the Q tiles only.
    CLAMP_PAGES: every page id read is clamped to the last of the cache's ``num_pages`` (see
    _attn_tiles)."""
    last_page = (num_pages - 1).to(tl.uint32)
    if PERSISTENT:
        total = tl.load(num_work_ptr) * NUM_QO_HEADS
        for pid in range(tl.program_id(0), total, tl.num_programs(0)):
            _prefill_one(pid, Q, K, V, O, LSE, PO, PLSE, work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                         mask_ptr, tiles_ptr, sinks_ptr, alibi_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                         qk_scale, v_scale, soft_cap, rope_inv_scale, rope_log2_theta, window_left, last_page,
                         stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                         stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                         stride_lt, stride_lh, NUM_QO_HEADS, GROUP, HEAD_QK_A, HEAD_QK_B, HEAD_VO,
                         BLOCK_M, BLOCK_N, PAGE_SIZE, DTYPE, DOT_PREC, CAUSAL, CUSTOM_MASK, WINDOW,
                         SOFT_CAP, ALIBI, ROPE, K_ROTATED, SINKS, HAS_LSE, Q_SCALE_T, K_SCALE_T, V_SCALE_T, SPLIT, TMA,
                         SHARED_ROWS, SCALE_POS, CLAMP_PAGES)
    else:
        _prefill_one(tl.program_id(0), Q, K, V, O, LSE, PO, PLSE, work_ptr, qo_indptr_ptr, kv_indptr_ptr,
                     kv_indices_ptr, mask_ptr, tiles_ptr, sinks_ptr, alibi_ptr, q_scale_ptr, k_scale_ptr,
                     v_scale_ptr, qk_scale, v_scale, soft_cap, rope_inv_scale, rope_log2_theta, window_left,
                     last_page, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                     stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                     stride_lt, stride_lh, NUM_QO_HEADS, GROUP, HEAD_QK_A, HEAD_QK_B, HEAD_VO,
                     BLOCK_M, BLOCK_N, PAGE_SIZE, DTYPE, DOT_PREC, CAUSAL, CUSTOM_MASK, WINDOW,
                     SOFT_CAP, ALIBI, ROPE, K_ROTATED, SINKS, HAS_LSE, Q_SCALE_T, K_SCALE_T, V_SCALE_T, SPLIT, TMA,
                     SHARED_ROWS, SCALE_POS, CLAMP_PAGES)
