"""fa2's fp8 decode kernel with explicit layouts (Triton's Gluon, `triton.experimental.gluon`).

Where decode_kernel.py leaves register and shared-memory layouts to Triton, this kernel fixes
each one (perf-notes, session 49: 424 instructions a 32-token step against 503, no bank
conflicts, 120-128 registers). One warp per (request, KV head), the whole request (or, SPLIT,
one chunk of it, whose partial merge.py merges); 32-token tiles (two pages of 16) copied by
cp.async into `STAGES` swizzled buffers, and two mma.sync dots whose A operands are loaded
straight from the fp8 tiles in 16-byte rows:

- S^T = K Q^T: K's head dims are permuted (`_k_index`) so each lane's 16 bytes of a token are its
  A-operand k slots; Q^T is loaded once, in the B-operand layout, with the same permutation;
- O^T = V^T P^T: V^T's rows are permuted (`_v_index`, undone at the store) so each lane's 16 bytes
  of a token are its A-operand rows; neighbouring tokens are paired by a layout change before the
  fp8 -> fp16 conversion; P^T comes from S^T's accumulator by shuffles.

Numerics as decode_kernel.py's FP16_DOTS: both dots in fp16, q scaled per head by a power of two
(its max |q| into [2^14, 2^15)) before its fp16 rounding, the inverse joining the score scale;
fp32 accumulators and softmax; lse in base 2. Every page index is clamped to the cache's pages.
Gluon has no interpreter: this kernel runs on the GPU only (sm89+ for the e4m3 conversion; the
plan takes it on sm90, where it was measured: decode_gluon.py).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .decode_kernel import E4M3X4_TO_F16, E5M2X4_TO_F16

PAGE: gl.constexpr = gl.constexpr(16)
TILE: gl.constexpr = gl.constexpr(32)  # tokens a step: two pages

# one warp; mma.sync m16n8k16, fp16 operands (k_width 2), fp32 accumulators
MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
OP_A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
OP_B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
# cp.async of one [2 pages, 16 tokens, 128 d] fp8 tile: 16 bytes a lane, a row (128 B) per 8 lanes
COPY: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 4, 0], [0, 8, 0], [1, 0, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0]], warp_bases=[], block_bases=[],
    shape=[2, 16, 128])
# K as the first dot's A operand, logical [token, k] with d = _k_index(k); registers ordered so
# each token's 16 bytes are one 16-byte shared load
K_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [8, 0], [0, 64], [16, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[32, 128])
# V^T as the second dot's A operand, logical [m, token] with d = _v_index(m): loaded as 16-byte
# rows (V_LOAD), then token pairs side by side (V_PAIRS) for the pairwise conversion
V_PAIRS: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [16, 0], [32, 0], [64, 0], [0, 8], [0, 16]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[128, 32])
V_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [16, 0], [32, 0], [64, 0], [0, 1], [0, 8], [0, 16]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[128, 32])
# Q^T [128 k, 8 heads] as loaded (its per-head scale is worked out here, then it becomes OP_B)
Q_LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 8], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                        order=[0, 1])


def _swizzled_layout() -> gl.SharedLinearLayout:
    """The K and V buffers' shared layout ([stages, 2 pages, 16 tokens, 128 d], the stage dim
    implied): the 16-byte chunk c of row r (page * 16 + token) sits at c ^ f(r), f(1) = 4,
    f(2) = 2, f(4) = 4, f(8) = 1, so neither the cp.async stores nor either operand's 16-byte
    loads conflict on a bank (as `gl.bank_conflicts` counts them)."""
    f = {1: 4, 2: 2, 4: 4, 8: 1}
    bases = [[0, 0, 1 << i] for i in range(7)]
    bases += [[0, 1 << i, 16 * f[1 << i]] for i in range(4)]
    bases.append([1, 0, 0])
    return gl.SharedLinearLayout(offset_bases=bases)


TILES: gl.constexpr = _swizzled_layout()


@gluon.jit
def _fp8_to_f16(x, E5M2: gl.constexpr):
    """fp8 -> fp16 (exact), four values a register: decode_kernel.py's PTX (e4m3 by
    cvt.rn.f16x2.e4m3x2, sm89+; e5m2 by byte permutes), pure here (Gluon places each load and
    layout change itself)."""
    return gl.inline_asm_elementwise(E5M2X4_TO_F16 if E5M2 else E4M3X4_TO_F16, "=r,=r,r",
                                     [x.to(gl.uint8, bitcast=True)], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _scaled(s, col_scale):
    """s x col_scale per column, rounded (mul.rn: not fused into the softmax's subtraction of the
    max, so the max token's exponent is exactly 0; fused, scores past ~2^100 put it at +-2^70)."""
    s, scale = gl.broadcast(s, col_scale[None, :])
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [s, scale], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _let_dependents_launch():
    """griddepcontrol.launch_dependents: a grid launched after this one with programmatic dependent
    launch (the split's merge, which waits for this grid to end) may start launching now."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _k_view(buf):
    """A tile buffer as the first dot's A operand K [token, k] (d = _k_index(k))."""
    # [2, 16, 128] -> [32 token, 128 k]; d's bits (d0..d6) = (k0, k3, k4, k5, k1, k2, k6)
    v = buf.reshape([32, 2, 2, 2, 2, 2, 2, 2])  # token, d6, d5, d4, d3, d2, d1, d0
    v = v.permute([0, 1, 4, 5, 6, 2, 3, 7])      # token, k6..k0 = d6, d3, d2, d1, d5, d4, d0
    return v.reshape([32, 128])


@gluon.jit
def _v_view(buf):
    """A tile buffer as the second dot's A operand V^T [m, token] (d = _v_index(m))."""
    # [2, 16, 128] -> [128 m, 32 token]; d's bits (d0..d6) = (m3, m4, m5, m6, m0, m1, m2)
    v = buf.reshape([32, 2, 2, 2, 2, 2, 2, 2])  # token, d6, d5, d4, d3, d2, d1, d0
    v = v.permute([4, 5, 6, 7, 1, 2, 3, 0])      # m6..m0 = d3, d2, d1, d0, d6, d5, d4; token
    return v.reshape([128, 32])


@gluon.jit
def _k_index(k):
    return (k & 1) | (((k >> 3) & 7) << 1) | (((k >> 1) & 3) << 4) | (k & 64)


@gluon.jit
def _v_index(m):
    return ((m >> 3) & 15) | ((m & 7) << 4)


@gluon.jit
def _issue(k_buf, v_buf, k_head, v_head, pages_ptr, n_pages, last_page, c_page, k_rows, v_rows, c_row, tile,
           kv_len, stride_kp, stride_vp, MASKED: gl.constexpr, SHARED_KV: gl.constexpr):
    """cp.async of tile ``tile`` (two pages) of K and V into their buffers."""
    slot = tile * 2 + c_page
    if MASKED:
        page = gl.load(pages_ptr + slot, mask=slot < n_pages, other=0)
    else:
        page = gl.load(pages_ptr + slot)
    # clamped as unsigned: no index (a negative one too) reads outside the cache
    page = gl.minimum(page.to(gl.uint32, bitcast=True), last_page).to(gl.int64)
    k_at = k_head + (page * stride_kp)[:, None, None] + k_rows
    if SHARED_KV:
        v_at = v_head + (page * stride_kp)[:, None, None] + k_rows
    else:
        v_at = v_head + (page * stride_vp)[:, None, None] + v_rows
    if MASKED:
        ok = tile * 32 + c_row < kv_len
        cp.async_copy_global_to_shared(k_buf, k_at, mask=ok)
        cp.async_copy_global_to_shared(v_buf, v_at, mask=ok)
    else:
        cp.async_copy_global_to_shared(k_buf, k_at)
        cp.async_copy_global_to_shared(v_buf, v_at)


@gluon.jit
def _step(k_buf, v_buf, q_t, m_i, l_i, acc, col_scale, offs_t, tile, kv_len, STAGES: gl.constexpr,
          MASKED: gl.constexpr, E5M2: gl.constexpr):
    """One 32-token tile: S^T = K Q^T, the online softmax over tokens, O^T += V^T P^T."""
    cp.wait_group(STAGES - 1)
    gl.thread_barrier()
    k8 = _k_view(k_buf).load(K_LOAD)
    k16 = gl.convert_layout(_fp8_to_f16(k8, E5M2), OP_A)
    s_t = _scaled(mma_v2(k16, q_t, gl.full([32, 8], 0.0, gl.float32, layout=MMA)), col_scale)
    if MASKED:
        s_t = gl.where((tile * 32 + offs_t < kv_len)[:, None], s_t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s_t - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    p_b = gl.convert_layout(p.to(gl.float16), OP_B)
    v8 = _v_view(v_buf).load(V_LOAD)
    v16 = _fp8_to_f16(gl.convert_layout(v8, V_PAIRS), E5M2)
    acc = mma_v2(gl.convert_layout(v16, OP_A), p_b, acc * alpha[None, :])
    gl.thread_barrier()  # the buffer is refilled next
    return m_new, l_i, acc


@gluon.jit
def _load_q(q_ptr, req, kvh, stride_qr, stride_qh, qk_scale, GROUP: gl.constexpr):
    """(Q^T [128 k, 8 heads] in fp16 as the B operand, each head scaled by a power of two; the
    score scale per head [8]: qk_scale over that power)."""
    offs_k = gl.arange(0, 128, layout=gl.SliceLayout(1, Q_LOAD))
    offs_n = gl.arange(0, 8, layout=gl.SliceLayout(0, Q_LOAD))
    rows = req.to(gl.int64) * stride_qr + (kvh * GROUP + offs_n).to(gl.int64) * stride_qh
    q = gl.load(q_ptr + rows[None, :] + _k_index(offs_k)[:, None], mask=(offs_n < GROUP)[None, :], other=0.0)
    q = q.to(gl.float32)
    amax = gl.max(gl.abs(q), 0)
    biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2 amax) + 127
    e_bits = gl.minimum(gl.maximum(268 - biased, 14), 253)  # max |q| x 2^e in [2^14, 2^15)
    up = (e_bits << 23).to(gl.float32, bitcast=True)
    down = ((254 - e_bits) << 23).to(gl.float32, bitcast=True)
    q16 = gl.convert_layout((q * up[None, :]).to(gl.float16), OP_B)
    return q16, gl.convert_layout(down * qk_scale, gl.SliceLayout(0, MMA))


# num_pages is the cache's (it may change at every run(), which keeps each call kind's specialisation:
# a cache of one page would otherwise become a constant); splits and chunk_tiles a plan's
@gluon.jit(do_not_specialize=["num_pages", "splits", "chunk_tiles"])
def fp8_decode_gluon_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, indptr_ptr, indices_ptr, last_ptr, q_scale_ptr, k_scale_ptr,
        v_scale_ptr, qk_scale, v_scale, num_pages, splits, chunk_tiles, stride_qr, stride_qh, stride_or, stride_oh,
        stride_lr, stride_lh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, E5M2: gl.constexpr,
        SHARED_KV: gl.constexpr, WRITE_LSE: gl.constexpr, Q_SCALE_T: gl.constexpr, K_SCALE_T: gl.constexpr,
        V_SCALE_T: gl.constexpr, SPLIT: gl.constexpr):
    """Program (row, KV head): without SPLIT, row = request and its whole KV (kv_indptr /
    kv_indices / kv_last_page_len, page 16) for its GROUP query heads, into out [batch, qo_heads,
    128] and, with WRITE_LSE, lse [batch, qo_heads] (base 2); with SPLIT, row = request x
    ``splits`` + chunk and the chunk's ``chunk_tiles`` tiles of 32 tokens, into out and lse rows
    ``row`` (the split-KV partials: a chunk past the request's end writes 0 and -inf), letting the
    merge's grid launch as it starts.
    ``qk_scale``: sm_scale x log2(e) x the host's q/k scales; *_SCALE_T: a device scale read
    from its pointer and applied too."""
    pid = gl.program_id(0)
    row = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    req = row // splits if SPLIT else row
    page_lo = gl.load(indptr_ptr + req)
    n_pages = gl.load(indptr_ptr + req + 1) - page_lo
    kv_len = gl.where(n_pages > 0, (n_pages - 1) * PAGE + gl.load(last_ptr + req), 0)
    kv_len = gl.minimum(gl.maximum(kv_len, 0), n_pages * PAGE)  # within the request's pages
    n_tiles = gl.cdiv(kv_len, TILE)
    n_full = kv_len // TILE
    first = 0
    if SPLIT:  # this chunk's tiles: [first, n_tiles) of which [first, n_full) are full
        _let_dependents_launch()
        chunk = row - req * splits
        first = chunk * chunk_tiles
        # the last chunk reads to the request's end whatever the plan's lengths said
        n_tiles = gl.where(chunk == splits - 1, n_tiles, gl.minimum(n_tiles, first + chunk_tiles))
        n_full = gl.minimum(n_full, n_tiles)
    last_page = (num_pages - 1).to(gl.uint32)
    if Q_SCALE_T:
        qk_scale = qk_scale * gl.load(q_scale_ptr).to(gl.float32)
    if K_SCALE_T:
        qk_scale = qk_scale * gl.load(k_scale_ptr).to(gl.float32)
    q_t, col_scale = _load_q(q_ptr, req, kvh, stride_qr, stride_qh, qk_scale, GROUP)

    k_bufs = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, 2, 16, 128], TILES)
    v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, 2, 16, 128], TILES)
    c_page = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    c_tok = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY)))
    c_d = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    k_rows = c_tok[None, :, None] * stride_kt + c_d[None, None, :]
    v_rows = c_tok[None, :, None] * stride_vt + c_d[None, None, :]
    c_row = (c_page * 16)[:, None, None] + c_tok[None, :, None] + 0 * c_d[None, None, :]
    pages_ptr = indices_ptr + page_lo
    k_head = k_ptr + kvh.to(gl.int64) * stride_kh
    v_head = v_ptr + kvh.to(gl.int64) * stride_vh

    for s in gl.static_range(STAGES - 1):
        if first + s < n_full:
            _issue(k_bufs.index(s), v_bufs.index(s), k_head, v_head, pages_ptr, n_pages, last_page, c_page, k_rows,
                   v_rows, c_row, first + s, kv_len, stride_kp, stride_vp, False, SHARED_KV)
        elif first + s < n_tiles:
            _issue(k_bufs.index(s), v_bufs.index(s), k_head, v_head, pages_ptr, n_pages, last_page, c_page, k_rows,
                   v_rows, c_row, first + s, kv_len, stride_kp, stride_vp, True, SHARED_KV)
        cp.commit_group()

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.full([8], 0.0, gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.full([128, 8], 0.0, gl.float32, layout=MMA)
    offs_t = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    # j: the j-th tile of this program (tile first + j, buffer j % STAGES)
    steady = gl.maximum(n_full - first - (STAGES - 1), 0)
    for j in range(steady):  # every tile issued and computed here is full: no masks
        nxt = j + STAGES - 1
        _issue(k_bufs.index(nxt % STAGES), v_bufs.index(nxt % STAGES), k_head, v_head, pages_ptr, n_pages,
               last_page, c_page, k_rows, v_rows, c_row, first + nxt, kv_len, stride_kp, stride_vp, False, SHARED_KV)
        cp.commit_group()
        m_i, l_i, acc = _step(k_bufs.index(j % STAGES), v_bufs.index(j % STAGES), q_t, m_i, l_i, acc, col_scale,
                              offs_t, first + j, kv_len, STAGES, False, E5M2)
    for j in range(steady, n_tiles - first):
        nxt = j + STAGES - 1
        if first + nxt < n_tiles:
            _issue(k_bufs.index(nxt % STAGES), v_bufs.index(nxt % STAGES), k_head, v_head, pages_ptr, n_pages,
                   last_page, c_page, k_rows, v_rows, c_row, first + nxt, kv_len, stride_kp, stride_vp, True,
                   SHARED_KV)
        cp.commit_group()
        m_i, l_i, acc = _step(k_bufs.index(j % STAGES), v_bufs.index(j % STAGES), q_t, m_i, l_i, acc, col_scale,
                              offs_t, first + j, kv_len, STAGES, True, E5M2)
    cp.wait_group(0)

    if V_SCALE_T:
        v_scale = v_scale * gl.load(v_scale_ptr).to(gl.float32)
    l_safe = gl.where(l_i == 0, 1.0, l_i)  # an empty request or chunk: out 0, lse -inf
    o = acc * (v_scale / l_safe)[None, :]
    offs_m = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    offs_h = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    head = kvh * GROUP + offs_h
    o_rows = row.to(gl.int64) * stride_or + head.to(gl.int64) * stride_oh
    gl.store(out_ptr + o_rows[None, :] + _v_index(offs_m)[:, None], o.to(out_ptr.dtype.element_ty),
             mask=(offs_h < GROUP)[None, :])
    if WRITE_LSE:
        lse = gl.where(l_i == 0, float("-inf"), m_i + gl.log2(l_safe))
        gl.store(lse_ptr + row.to(gl.int64) * stride_lr + head * stride_lh, lse, mask=offs_h < GROUP)
