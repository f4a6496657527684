"""The Triton split-KV paged decode kernel.

One program = one work item (a request's chunk of tokens) x one KV head x one block of
query rows. The rows are every (q row, query head) pair that reads this KV head
(``q_len_per_req * group`` of them, padded to at least 16 for the tensor cores), so each
KV byte is read once per chunk. Tokens are visited BLOCK_N at a time across pages, with a
page-table lookup per token row, each page index clamped to the cache's ``num_pages`` (as
unsigned: a negative one too), so an index the API has not checked yet (a deferred check, or
FLASHDISPATCH_CHECK_INPUTS=0) never reads outside the cache; Triton pipelines the gathers
(num_stages). K is loaded
either as K^T tiles [HEAD_DIM, BLOCK_N] or, with K_ROWS, as [BLOCK_N, HEAD_DIM] rows transposed
in registers (a different shared-memory path; see DecodeConfig.k_rows).

A work row (int32, `WORK_COLS` wide) holds: request, first page index in kv_indices,
token start, token end, kv_len, output slot (-1: write out/lse directly, else the partial
slot in the workspace) and whether the chunk is the request's first (it carries the sink).
A request index < 0 marks an idle program (CUDA-graph grids are fixed). Column 7 is the
split request's merge row (-1 for direct writes): its row of the merge info array
(merge.py: out row base, first partial slot, number of chunks) and of the arrival counters.

DIRECT: no work array; work_ptr is the API's kv_indptr and last_ptr its last_page_len. Without
DIRECT_SPLIT a work item is a request, read whole. With it a work item is (chunk slot, request),
split_slots slots per request, slot-major: the program applies decode.py's split policy to its
request's length (split_tokens, max_splits, balanced BLOCK_N-rounded chunks), exits when its slot is past
the request's chunks, writes its partial to slot request x split_slots + chunk (directly to out
when the request has one chunk), and the merge row is the request (the merge kernel's info row
is written by chunk 0's first unit; its count is 1 for a request not split, which the merge
kernel skips).

TABLE (with DIRECT): a block-table call's tables (FlashInfer's trtllm / xqa functions): work_ptr
is seq_lens, kv_indices_ptr the ``[batch, width]`` table (row stride ``table_stride``); a length is
clamped to [0, ``table_tokens``] (its row). TOTAL_SPLIT (with DIRECT_SPLIT): each program sums the
lengths for the policy's split length (decode.py's `_place_table`; decode_requests.py). With LINE
the line's positions are the running sum of the clamped lengths' pages.

ITEMS (DecodeConfig.pack_items; work array only): each program runs ITEMS consecutive work rows
one after the other, all for its (KV head, row block): a packed plan's equal piece of the requests'
tokens laid end to end, one row per request it touches (idle rows return at once).

LINE (DecodeConfig.wave_pack_line; with DIRECT): a packed plan whose pieces the kernel finds itself.
The requests' pages lie end to end as kv_indptr numbers them, each after a gap of ``line_gap`` pages
that stands for the cost of one more segment (DecodeConfig.line_segment_tokens): request r's first
page sits at position kv_indptr[r] - kv_indptr[0] + line_gap x (r + 1). The line is cut into
``line_groups`` equal pieces of positions, one per item group (piece = ceil((pages + line_gap x
requests) / line_groups)), so a piece where many short requests start reads fewer pages. Where the
pages are the batch x the first request's (requests of equal length, as a rule), the line is cut
into ``line_even_groups`` pieces instead, a divisor of the batch, so that no request of equal length
is cut (decode_split.py's `line_groups`). The grid holds the larger count; the groups past the
lengths' count end at once. A program runs, one after the other, every request its piece touches:
the one begun before it (if any) and those whose first page lies in it (an empty request, in the
piece where it stands; the last piece takes any at the end), found by counting the requests'
positions below the piece's bounds (decode_requests.py). A request on s pieces from piece f is split
into s segments whose partials take slots f + request .. f + request + s - 1 (two segments never
share a slot: a request's segments come after its predecessors' on the line), and its first
segment's program writes the merge info row (out row, f + request, s) as DIRECT_SPLIT does, or
merges in place with the fused merge. plan() builds nothing, and the grid (groups x units) depends
on the batch size alone. Each request is a call of the item body, not inlined (`_decode_item_call`).

FUSED_MERGE (DecodeConfig.fused_merge_max_chunks): no second kernel merges the partials. Each
program of a split work item, once its partial rows are stored, passes a CTA barrier (every
thread's stores issued before) and adds 1 to the int32 counter of its (merge row, KV head, row
block) with an acq_rel atomic at GPU scope (the release publishes the CTA's stores, made visible
to the atomic's thread by the barrier; the same pattern as CUTLASS's semaphore). Only the program
that reads old == chunks - 1 goes on: every other chunk's partial is published by then and its
acquire (one thread, then a barrier for the rest) orders the loads after it. That program reads
the request's partials of its own rows with L2-only (.cg) loads (L1 is not coherent across SMs),
merges them with merge.py's `_merge_row_block` (the merge kernel's step; MERGE_BLOCK_R rows x
MERGE_BLOCK_S partials per load round, so few dependent rounds sit on the kernel's tail), writes
out/lse, sets its counter back to 0 for the next launch (no other program touches that counter
again this launch).
No program waits for another, so there is no deadlock whatever the scheduling.

FP16_DOTS (fp8 KV only, DecodeConfig.fp8_dot_dtype="fp16"): both dots run in fp16 whatever q's
dtype, because Triton's fp8 -> fp16 is one packed instruction per two values
(cvt.rn.f16x2.e4m3x2; e5m2 by byte permutes) while fp8 e4m3 -> bf16 on sm90 adds two scalar cvt.bf16.f16 per
pair (the conversion, not the memory, bounded the bf16-q fp8 decode). Every step is exact or
more precise than the bf16 dots, and nothing overflows for finite inputs:
- K and V: fp8 -> fp16 is exact (e4m3 max 448, e5m2 max 57344 < 65504).
- q: each row is scaled in fp32 by a power of two 2^x chosen from its max |q| so that the max
  lands in [2^14, 2^15), then rounded to fp16 (exact for bf16 and fp16 q); 2^-x joins the
  score scale. x is clamped to [-113, 126]: rows whose max |q| is below 2^-112 (or zero) use
  2^126 and stay below 2^14. Limit: elements under 2^-28 x their row's max |q| may become
  fp16 subnormals (fewer bits), under 2^-39 x it they may flush to 0.
- RoPE: the rotated K (|x| up to sqrt(2) x the fp8 max, 81k for e5m2) is halved before the
  fp16 rounding and the score scale doubled.
- P (<= 1) in fp16: 11 significant bits (bf16: 8), but weights below 2^-14 of the row max lose
  bits and below 2^-25 flush to 0 (the fp32 denominator still counts them).
- Both dots accumulate in fp32.

PAGE_PREFETCH: the page numbers of the next tile are loaded one step ahead and carried in the
loop state. Without it the K/V gathers depend on a page-table load of the same step, a two-level
load chain for which Triton's pipeliner gives K and V (num_stages - 1) // 2 buffers: one for
num_stages 2..4, i.e. no copy in flight while the tile is computed. With it K/V get num_stages - 1.

V_STAGED (fp8 KV with fp16 dots): V is converted to fp16 in registers right after its tile arrives
(4 bytes per 32-bit register, one instruction per pair: `_fp8_to_f16_regs`) and reaches the
P @ V dot through a fp16 shared tile (ldmatrix.trans). Without it Triton converts V inside the dot operand layout, where
each fp8 value is its own ld.shared.b8 (V's tokens, the dot's K dimension, are not contiguous in
memory) plus a byte pack per pair. The conversion is inline PTX (marked impure so that Triton does
not move it back behind the operand load); the interpreter cannot run it (decode.py passes False).

SWAP_AB (DecodeConfig.swap_ab): both dots are computed transposed, S^T = K Q^T and
O^T = V^T P^T, so the program's query rows are the mma's N (8 wide) instead of its M (16 tall):
a GQA group of 4 pads to 8 rows instead of 16, and half of the mma and exp2 work on padding
goes. The scores and the accumulator are transposed back as register layouts (tl.trans), so
the masks, the softmax and the epilogue are the same code either way.

SHARED_KV_ROWS (DecodeConfig.shared_kv_rows, where V's page and slot strides are K's, as in a 5-D
cache): V's token rows are read at K's row offsets from V's own head base, so each row's 64-bit
address is worked out once instead of twice (sm90 fp8 d128: 7 % fewer instructions a step).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ..common import TRITON_INTERPRETED
from .decode_requests import line_requests, table_line_pages, table_line_requests, total_split_tokens
from .merge import _merge_row_block, finish_state
from .paging import page_of, slot_in_page
from .trig import rope_halves, rope_sincos, tanh

WORK_COLS = 8


@triton.jit
def _row_pow2(x):
    """(2^e, 2^-e) per row of x [rows, cols] (fp32), exact powers of two: max |row| * 2^e in
    [2^14, 2^15); e clamped to [-113, 126] (zero rows: 2^126)."""
    amax = tl.max(tl.abs(x), 1)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2 amax) + 127
    e_bits = tl.minimum(tl.maximum(268 - biased, 14), 253)  # 14 - floor(log2 amax) + 127
    up = (e_bits << 23).to(tl.float32, bitcast=True)
    down = ((254 - e_bits) << 23).to(tl.float32, bitcast=True)
    return up, down


# fp8 -> fp16 (exact) as inline PTX, four bytes of $2 into the fp16 pairs $0 and $1 (constraints
# "=r,=r,r", pack 4); decode_gluon_kernel.py converts with them too. e4m3: one cvt.rn.f16x2.e4m3x2
# per pair (sm89+, as e4m3 KV itself); e5m2 is the high byte of the fp16 of the same value: one
# byte permute per pair, on any GPU.
E4M3X4_TO_F16: tl.constexpr = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                                           "cvt.rn.f16x2.e4m3x2 $1, hi; }")
E5M2X4_TO_F16: tl.constexpr = tl.constexpr("{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x1404; "
                                           "prmt.b32 $1, $2, z, 0x3424; }")


@triton.jit
def _fp8_to_f16_regs(x, E5M2: tl.constexpr):
    """fp8 -> fp16 (exact), four values per 32-bit register, in the layout x is in
    (E4M3X4_TO_F16 / E5M2X4_TO_F16)."""
    return tl.inline_asm_elementwise(E5M2X4_TO_F16 if E5M2 else E4M3X4_TO_F16, "=r,=r,r",
                                     [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _merge_if_last(po_ptr, plse_ptr, out_ptr, lse_ptr, counter_ptr, first, chunks, req, hk, rb,
                   stride_ot, stride_oh, stride_lt, stride_lh, NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr,
                   QLEN: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Count this program's partial in; the last of the request's ``chunks`` chunks (partials
    ``first``...) merges the program's rows (KV head hk, row block rb), BLOCK_R at a time, into
    out/lse and resets the counter (see FUSED_MERGE above)."""
    tl.debug_barrier()  # all threads' partial stores come before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == chunks - 1:
        tl.debug_barrier()  # the acquire (one thread) comes before every thread's loads
        g_end = tl.minimum(rb * BLOCK_M + BLOCK_M, QLEN * GROUP)
        for g0 in range(rb * BLOCK_M, g_end, BLOCK_R):
            g = g0 + tl.arange(0, BLOCK_R)
            qi = g // GROUP
            hq = hk * GROUP + g % GROUP
            row = (req * QLEN + qi).to(tl.int64)
            _merge_row_block(po_ptr + (qi * NUM_QO_HEADS + hq) * HEAD_DIM, plse_ptr + qi * NUM_QO_HEADS + hq,
                             out_ptr + row * stride_ot + hq * stride_oh, lse_ptr + row * stride_lt + hq * stride_lh,
                             g < g_end, first, chunks, QLEN * NUM_QO_HEADS * HEAD_DIM, QLEN * NUM_QO_HEADS,
                             BLOCK_R, BLOCK_S, HEAD_DIM, WRITE_LSE)
        tl.store(counter_ptr, 0)


@triton.jit
def _decode_item(
    item, unit,
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, merge_info_ptr, counters_ptr,
    work_ptr, last_ptr, kv_indices_ptr, slopes_ptr, sinks_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, v_scale, window_left, soft_cap, rope_rcp_scale, rope_log2_theta, split_tokens, split_slots, max_splits,
    last_page, table_stride, table_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, QLEN: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
    ROPE: tl.constexpr, SINKS: tl.constexpr, WRITE_LSE: tl.constexpr,
    Q_SCALE_T: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, K_ROWS: tl.constexpr,
    FP16_DOTS: tl.constexpr, PAGE_PREFETCH: tl.constexpr, V_STAGED: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_BLOCK_R: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
    DIRECT: tl.constexpr, DIRECT_SPLIT: tl.constexpr, SWAP_AB: tl.constexpr, SHARED_KV_ROWS: tl.constexpr,
    LINE: tl.constexpr, TABLE: tl.constexpr, piece_start, piece_end, piece, line_at, group,
):
    """Row ``item`` of the work array (or the direct table's request / chunk slot) for one
    (KV head, row block) ``unit``: the program of the module docstring; an idle row returns. LINE:
    ``item`` is a request, read on item group ``group``'s piece of the line (positions
    [piece_start, piece_end), ``piece`` a piece), its first page at position ``line_at``."""
    UNITS: tl.constexpr = NUM_QO_HEADS // GROUP * ROW_BLOCKS
    wrow = work_ptr + item * 8  # WORK_COLS
    if DIRECT:  # work_ptr is kv_indptr: the request's pages and length from the API's tables
        if DIRECT_SPLIT:  # item = chunk slot x request: the slots of every request's first chunk
            # come first, so a request's unused slots (shorter than its slots can hold) are at the
            # grid's end, launched last
            n_req = tl.num_programs(0) // (UNITS * split_slots)
            req = item % n_req
            chunk_idx = item // n_req
        else:  # item = request, its whole KV
            req = item
            chunk_idx = 0
        if TABLE:  # work_ptr is seq_lens, kv_indices_ptr the block table: the request's row, its
            # length clamped to that row (plan() read neither, so nothing checked them)
            page_base = req.to(tl.int64) * table_stride
            kv_len = tl.minimum(tl.maximum(tl.load(work_ptr + req), 0), table_tokens)
            pages = (kv_len + PAGE - 1) // PAGE
        else:
            page_base = tl.load(work_ptr + req)
            pages = tl.load(work_ptr + req + 1) - page_base
            kv_len = tl.where(pages > 0, (pages - 1) * PAGE + tl.load(last_ptr + req), 0)
        tok_start = 0
        if WINDOW:
            tok_start = tl.maximum(kv_len - QLEN - window_left, 0)
        tok_end = kv_len
        slot = -1
        is_first = 1
        if DIRECT_SPLIT:
            # decode_split.py's policy for this request (chunk_tokens): n chunks of split_tokens
            # (at most max_splits), balanced and rounded up to whole BLOCK_N steps, then as many
            # chunks of that length as the tokens need; a chunk slot past them is idle. Tables
            # changed after plan() could need more chunks than the plan's slots: the last slot then
            # takes the rest, so every chunk arrives (the fused merge's counters return to 0).
            eff = kv_len - tok_start
            n_chunks = tl.minimum(tl.maximum(eff // split_tokens, 1), max_splits)
            per = (eff + n_chunks - 1) // n_chunks
            chunk = tl.maximum(BLOCK_N, (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
            n_chunks = tl.minimum(tl.maximum((eff + chunk - 1) // chunk, 1), split_slots)
            if chunk_idx >= n_chunks:
                return
            if not FUSED_MERGE:  # the merge kernel's row of this request: out row, first partial, chunks
                if chunk_idx == 0 and unit == 0:
                    info = merge_info_ptr + req * 4
                    tl.store(info, req * QLEN)
                    tl.store(info + 1, req * split_slots)
                    tl.store(info + 2, n_chunks)
            tok_start += chunk_idx * chunk
            tok_end = tl.where(chunk_idx == n_chunks - 1, kv_len, tl.minimum(tok_start + chunk, kv_len))
            if n_chunks > 1:
                slot = req * split_slots + chunk_idx
            is_first = (chunk_idx == 0).to(tl.int32)
        if LINE:  # the request's segment on this piece (positions on the line: module docstring)
            at = line_at
            seg_first = at // piece
            n_chunks = (at + tl.maximum(pages - 1, 0)) // piece - seg_first + 1  # empty: 1
            lo_page = tl.maximum(at, piece_start) - at
            tok_start = lo_page * PAGE
            tok_end = tl.minimum((tl.minimum(pages, piece_end - at)) * PAGE, kv_len)
            is_first = (lo_page == 0).to(tl.int32)
            if n_chunks > 1:
                slot = group + req
            if not FUSED_MERGE:
                if lo_page == 0 and unit == 0:
                    info = merge_info_ptr + req * 4
                    tl.store(info, req * QLEN)
                    tl.store(info + 1, seg_first + req)
                    tl.store(info + 2, n_chunks)
    else:
        req = tl.load(wrow)
        if req < 0:
            return
        page_base = tl.load(wrow + 1)
        tok_start = tl.load(wrow + 2)
        tok_end = tl.load(wrow + 3)
        kv_len = tl.load(wrow + 4)
        slot = tl.load(wrow + 5)
        is_first = tl.load(wrow + 6)
    hk = unit // ROW_BLOCKS
    rb = unit % ROW_BLOCKS

    # Query rows: g -> (q row qi, query head hq).
    g = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = g < QLEN * GROUP
    qi = g // GROUP
    hq = hk * GROUP + g % GROUP
    q_row = (req * QLEN + qi).to(tl.int64)
    pos = qi + kv_len - QLEN  # query position
    q_off = q_row * stride_qt + hq * stride_qh
    dt = q_ptr.dtype.element_ty  # the dots' input dtype
    if FP16_DOTS:
        dt = tl.float16

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
        sin_q, cos_q = rope_sincos(pos, offs_half, rope_rcp_scale, rope_log2_theta, HEAD_DIM, ROPE)
        q1r, q2r = rope_halves(q1.to(tl.float32), q2.to(tl.float32), sin_q, cos_q)
        if FP16_DOTS:
            q_up, q_down = _row_pow2(tl.maximum(tl.abs(q1r), tl.abs(q2r)))
            q1r = q1r * q_up[:, None]
            q2r = q2r * q_up[:, None]
            s_row = s_mul * 2.0 * q_down  # x2: K is halved below
        q1 = q1r.to(dt)
        q2 = q2r.to(dt)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if FP16_DOTS:
            qf = q.to(tl.float32)
            q_up, q_down = _row_pow2(qf)
            q = (qf * q_up[:, None]).to(dt)
            s_row = s_mul * q_down
    offs_dv = tl.arange(0, HEAD_DIM)

    # Softmax state in base 2; the first chunk starts from the sink logit (no value).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + hq, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        first = (tl.zeros([BLOCK_M], tl.int32) + is_first) != 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first & (sink > float("-inf")), 1.0, l_i)
    if SWAP_AB:  # acc^T: the query rows are the dots' N
        acc = tl.zeros([HEAD_DIM, BLOCK_M], tl.float32)
        if ROPE:
            q1t = tl.trans(q1)
            q2t = tl.trans(q2)
        else:
            qt = tl.trans(q)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_head = k_ptr + hk * stride_kh
    v_head = v_ptr + hk * stride_vh
    # PAGE_PREFETCH: page numbers clamped as they are loaded, a step ahead (clamped at their use
    # instead, fp8 read 1.6-2.6 % less on the H200: perf-notes, session 34); here the first tile's
    # (nothing to read when empty)
    if PAGE_PREFETCH:
        page_next = tl.load(kv_indices_ptr + page_base + tl.minimum(tok_start + offs_n, tok_end - 1) // PAGE,
                            mask=(offs_n * 0 + tok_start) < tok_end, other=0)
        page_next = tl.minimum(page_next.to(tl.uint32), last_page)
    for start in range(tok_start, tok_end, BLOCK_N):
        t = start + offs_n
        tc = tl.minimum(t, tok_end - 1)  # clamped: loads stay in bounds, scores masked below
        if PAGE_PREFETCH:
            page = page_next.to(tl.int64)
            page_next = tl.load(kv_indices_ptr + page_base + page_of(tl.minimum(t + BLOCK_N, tok_end - 1), PAGE))
            page_next = tl.minimum(page_next.to(tl.uint32), last_page)
        else:
            page = tl.minimum(tl.load(kv_indices_ptr + page_base + page_of(tc, PAGE)).to(tl.uint32), last_page)
            page = page.to(tl.int64)
        in_page = slot_in_page(tc, PAGE)
        k_off = page * stride_kp + in_page * stride_ks
        v_off = k_off if SHARED_KV_ROWS else page * stride_vp + in_page * stride_vs
        if ROPE:
            k1 = tl.load(k_head + k_off[:, None] + offs_half[None, :]).to(tl.float32)
            k2 = tl.load(k_head + k_off[:, None] + HALF + offs_half[None, :]).to(tl.float32)
            sin_k, cos_k = rope_sincos(t, offs_half, rope_rcp_scale, rope_log2_theta, HEAD_DIM, ROPE)
            k1r, k2r = rope_halves(k1, k2, sin_k, cos_k)
            if FP16_DOTS:  # |rotated fp8| <= sqrt(2) x 57344 would overflow fp16
                k1r = k1r * 0.5
                k2r = k2r * 0.5
            if SWAP_AB:
                s = tl.trans(tl.dot(k1r.to(dt), q1t) + tl.dot(k2r.to(dt), q2t))
            else:
                s = tl.dot(q1, tl.trans(k1r.to(dt))) + tl.dot(q2, tl.trans(k2r.to(dt)))
        elif K_ROWS:
            k = tl.load(k_head + k_off[:, None] + offs_d[None, :])
            if SWAP_AB:
                s = tl.trans(tl.dot(k.to(dt), qt))
            else:
                s = tl.dot(q, tl.trans(k.to(dt)))
        else:
            k = tl.load(k_head + k_off[None, :] + offs_d[:, None])
            if SWAP_AB:
                s = tl.trans(tl.dot(tl.trans(k.to(dt)), qt))
            else:
                s = tl.dot(q, k.to(dt))
        if FP16_DOTS:
            s = s * s_row[:, None]
        else:
            s = s * s_mul
        if ALIBI:
            s += slope[:, None] * (t[None, :] - pos[:, None]).to(tl.float32)
        if SOFT_CAP:
            s = soft_cap * tanh(s * (1.0 / soft_cap))
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
        if V_STAGED:
            tl.static_assert(dt == tl.float16, "V_STAGED needs fp16 dots")
            v = _fp8_to_f16_regs(v, v_ptr.dtype.element_ty == tl.float8e5)
        if SWAP_AB:
            acc = tl.dot(tl.trans(v.to(dt)), tl.trans(p.to(dt)), acc * alpha[None, :])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v.to(dt))
        m_i = m_new

    if SWAP_AB:
        acc = tl.trans(acc)
    o, lse = finish_state(acc, l_i, m_i, v_scale_ptr, v_scale, V_SCALE_T)
    if slot < 0:
        o_ptrs = out_ptr + (q_row * stride_ot + hq * stride_oh)[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + q_row * stride_lt + hq * stride_lh, lse, mask=row_ok)
    else:
        prow = (slot * QLEN + qi).to(tl.int64) * NUM_QO_HEADS + hq
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_dv[None, :], o, mask=row_ok[:, None])
        tl.store(plse_ptr + prow, lse, mask=row_ok)
        if FUSED_MERGE:
            if DIRECT_SPLIT:  # merge row = request
                merge_row = req
                merge_first = req * split_slots
                merge_chunks = n_chunks
            elif LINE:
                merge_row = req
                merge_first = seg_first + req
                merge_chunks = n_chunks
            else:
                merge_row = tl.load(wrow + 7)
                merge_first = tl.load(merge_info_ptr + merge_row * 4 + 1)  # MERGE_INFO_COLS
                merge_chunks = tl.load(merge_info_ptr + merge_row * 4 + 2)
            _merge_if_last(po_ptr, plse_ptr, out_ptr, lse_ptr, counters_ptr + merge_row * UNITS + unit,
                           merge_first, merge_chunks, req, hk, rb, stride_ot, stride_oh, stride_lt, stride_lh,
                           NUM_QO_HEADS, GROUP, QLEN, BLOCK_M, HEAD_DIM, MERGE_BLOCK_R, MERGE_BLOCK_S, WRITE_LSE)


# A line program's requests, one call each (not inlined): inlined in the dynamic loop over them,
# LLVM hoists the body's loop-invariant offset tensors (the epilogue's and the fused merge's too)
# out of that loop, where they stay live through the token loop (bf16 d128: 168 registers, 3
# programs per SM, 2.85 TB/s at 128x4096:var); called, 128 registers and 4 per SM. (The interpreter
# calls Python either way, and two of its kernel functions over one Python function clash.)
_decode_item_call = _decode_item if TRITON_INTERPRETED else triton.jit(noinline=True)(_decode_item.fn)


@triton.jit(do_not_specialize=["split_tokens", "split_slots", "max_splits", "n_requests", "line_gap",
                               "line_groups", "line_even_groups", "num_pages", "table_stride",
                               "table_tokens", "split_target"])  # per plan, cache and table
def decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, merge_info_ptr, counters_ptr,
    work_ptr, last_ptr, kv_indices_ptr, slopes_ptr, sinks_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, v_scale, window_left, soft_cap, rope_rcp_scale, rope_log2_theta, split_tokens, split_slots, max_splits,
    table_stride, table_tokens, split_target, n_requests, line_gap, line_groups, line_even_groups, num_pages,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, QLEN: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
    ROPE: tl.constexpr, SINKS: tl.constexpr, WRITE_LSE: tl.constexpr,
    Q_SCALE_T: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, K_ROWS: tl.constexpr,
    FP16_DOTS: tl.constexpr, HEADS_FASTEST: tl.constexpr, PAGE_PREFETCH: tl.constexpr, V_STAGED: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_BLOCK_R: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
    DIRECT: tl.constexpr, DIRECT_SPLIT: tl.constexpr, PDL_TRIGGER: tl.constexpr, SWAP_AB: tl.constexpr,
    ITEMS: tl.constexpr, LINE: tl.constexpr, LINE_BLOCK: tl.constexpr, TABLE: tl.constexpr,
    TOTAL_SPLIT: tl.constexpr, SHARED_KV_ROWS: tl.constexpr,
):
    if PDL_TRIGGER:  # the merge kernel may launch now (DecodeConfig.pdl); it waits for this grid
        gdc_launch_dependents()
    # 1-D grid of item groups x (kv head, row block) units. HEADS_FASTEST: the programs resident
    # together read every head of the same pages; else one head of many requests at a time.
    UNITS: tl.constexpr = NUM_QO_HEADS // GROUP * ROW_BLOCKS
    if HEADS_FASTEST:
        unit = tl.program_id(0) % UNITS
        group = tl.program_id(0) // UNITS
    else:
        n_groups = tl.num_programs(0) // UNITS
        unit = tl.program_id(0) // n_groups
        group = tl.program_id(0) % n_groups
    tl.static_assert(ITEMS == 1 or not DIRECT, "the direct table is one item per program")
    # the cache's last page: every page index read is clamped to [0, last_page] (as unsigned, so a
    # negative one clamps too), so no index the API could not check reads outside the cache
    last_page = (num_pages - 1).to(tl.uint32)
    tl.static_assert(not LINE or (DIRECT and not DIRECT_SPLIT), "the line is read from the direct table")
    tl.static_assert(not TABLE or DIRECT, "a block table is read as the direct table")
    tl.static_assert(not TOTAL_SPLIT or (TABLE and DIRECT_SPLIT), "the total's split is a block table's")
    if TOTAL_SPLIT:
        split_tokens = total_split_tokens(work_ptr, n_requests, table_tokens, window_left, split_tokens, split_target,
                                          QLEN, WINDOW, UNITS, LINE_BLOCK)
    if LINE:  # this item group's piece of the line (module docstring)
        if TABLE:
            pages, first_pages = table_line_pages(work_ptr, n_requests, table_tokens, PAGE, LINE_BLOCK)
        else:
            line_base = tl.load(work_ptr)
            pages = tl.load(work_ptr + n_requests) - line_base
            first_pages = tl.load(work_ptr + 1) - line_base
        # requests as long as the first (likely all equal): line_even_groups pieces, else
        # line_groups; the groups past them idle
        even = pages == first_pages * n_requests
        n_groups = tl.where(even, line_even_groups, line_groups)
        positions = pages + line_gap * n_requests
        piece = tl.maximum((positions + n_groups - 1) // n_groups, 1)
        piece_start = group * piece
        piece_end = piece_start + piece
        first = tl.zeros_like(group)
        end = first
        at = first  # the next request's first position (TABLE: carried from request to request)
        if group < n_groups:
            if TABLE:
                first, end, at = table_line_requests(work_ptr, n_requests, table_tokens, line_gap, piece_start,
                                                     piece_end, PAGE, LINE_BLOCK)
            else:
                first, end = line_requests(work_ptr, n_requests, line_gap, piece_start, piece_end, LINE_BLOCK)
            end = tl.where(group == n_groups - 1, n_requests, end)  # the last piece: any empty one at the end
        for req in range(first, end):
            if not TABLE:
                at = tl.load(work_ptr + req) - line_base + line_gap * (req + 1)
            _decode_item_call(
                req, unit, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, merge_info_ptr,
                counters_ptr, work_ptr, last_ptr, kv_indices_ptr, slopes_ptr, sinks_ptr, q_scale_ptr, k_scale_ptr,
                v_scale_ptr, qk_scale, v_scale, window_left, soft_cap, rope_rcp_scale, rope_log2_theta, split_tokens,
                split_slots, max_splits, last_page, table_stride, table_tokens, stride_qt, stride_qh, stride_ot,
                stride_oh, stride_lt, stride_lh,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, NUM_QO_HEADS, GROUP, QLEN, ROW_BLOCKS,
                PAGE,
                HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFT_CAP, ALIBI, ROPE, SINKS, WRITE_LSE, Q_SCALE_T,
                K_SCALE_T, V_SCALE_T, K_ROWS, FP16_DOTS, PAGE_PREFETCH, V_STAGED, FUSED_MERGE,
                MERGE_BLOCK_R, MERGE_BLOCK_S, DIRECT, DIRECT_SPLIT, SWAP_AB, SHARED_KV_ROWS, LINE, TABLE, piece_start,
                piece_end, piece, at, group)
            if TABLE:
                at += (tl.minimum(tl.maximum(tl.load(work_ptr + req), 0), table_tokens) + PAGE - 1) // PAGE + line_gap
    else:
        for i in tl.static_range(ITEMS):  # ITEMS: the work rows of a packed plan's program
            _decode_item(
                group * ITEMS + i, unit, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, merge_info_ptr,
                counters_ptr, work_ptr, last_ptr, kv_indices_ptr, slopes_ptr, sinks_ptr, q_scale_ptr, k_scale_ptr,
                v_scale_ptr, qk_scale, v_scale, window_left, soft_cap, rope_rcp_scale, rope_log2_theta, split_tokens,
                split_slots, max_splits, last_page, table_stride, table_tokens, stride_qt, stride_qh, stride_ot,
                stride_oh, stride_lt, stride_lh,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, NUM_QO_HEADS, GROUP, QLEN, ROW_BLOCKS,
                PAGE,
                HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFT_CAP, ALIBI, ROPE, SINKS, WRITE_LSE, Q_SCALE_T,
                K_SCALE_T, V_SCALE_T, K_ROWS, FP16_DOTS, PAGE_PREFETCH, V_STAGED, FUSED_MERGE,
                MERGE_BLOCK_R, MERGE_BLOCK_S, DIRECT, DIRECT_SPLIT, SWAP_AB, SHARED_KV_ROWS, False, TABLE, 0, 0, 1, 0,
                group)
