"""The public FlashInfer-compatible API on the CPU: the seed document's examples (fewer layers),
every entry point's shapes and numerics against a float64 dense computation."""
import math

import numpy as np
import pytest
import torch

import flashdispatch as flashinfer
from flashdispatch.dispatch.registry import backend_class

WS = torch.empty(1 << 20, dtype=torch.uint8)
# the reference's declared float32 tolerance (float32 CPU math against float64; BLAS rounding varies
# with threads and alignment, one run reached 3.2e-5)
FP32_TOL = backend_class("reference").tolerance_for(torch.float32)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each API test runs on the CPU here, and on CUDA tensors in the GPU suite (any backend auto picks)."""
    return torch.device(request.param)


def on(device, *tensors):
    moved = [t.to(device) for t in tensors]
    return moved[0] if len(moved) == 1 else moved


def dense_attention(q, k, v, *, causal=False, mask=None, sm_scale=None, window_left=-1, sinks=None):
    """float64 attention of one request: q [Lq, Hq, D], k/v [Lk, Hkv, D] -> (out [Lq, Hq, Dv], lse2)."""
    q, k, v = q.double(), k.double(), v.double()
    lq, hq, d = q.shape
    lk, hkv = k.shape[:2]
    g = hq // hkv
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * (sm_scale if sm_scale is not None else 1 / math.sqrt(d))
    pos = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep &= j <= pos
    if mask is not None:
        keep = mask.clone()
    if window_left >= 0:
        keep &= j >= pos - window_left
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, lq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, (lse / math.log(2)).T


def paged_to_dense(kv_cache, indptr, indices, last, page_size, b, layout="NHD"):
    pages = indices[indptr[b]:indptr[b + 1]].long()
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    n = len(pages)
    kv_len = (n - 1) * page_size + int(last[b]) if n else 0
    return k[pages].reshape(-1, *k.shape[2:])[:kv_len], v[pages].reshape(-1, *v.shape[2:])[:kv_len]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


SEED_INDPTR = torch.tensor([0, 17, 29, 44, 48, 66, 100, 128], dtype=torch.int32)
SEED_LAST = torch.tensor([1, 7, 14, 4, 3, 1, 16], dtype=torch.int32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_seed_batch_decode_example(layout, device):
    torch.manual_seed(0)
    indices = torch.randperm(128).int()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(on(device, WS), layout, backend="reference")
    wrapper.plan(*on(device, SEED_INDPTR, indices, SEED_LAST), 64, 8, 128, 16, pos_encoding_mode="NONE",
                 data_type=torch.float32)
    shape = (128, 2, 16, 8, 128) if layout == "NHD" else (128, 2, 8, 16, 128)
    for _ in range(2):
        kv = torch.randn(shape)
        q = torch.randn(7, 64, 128)
        o, lse = (t.cpu() for t in wrapper.run(*on(device, q, kv), return_lse=True))
        assert o.shape == torch.Size([7, 64, 128]) and lse.shape == (7, 64)
        for b in range(7):
            k, v = paged_to_dense(kv, SEED_INDPTR, indices, SEED_LAST, 16, b, layout)
            ref, ref_lse = dense_attention(q[b:b + 1], k, v)
            assert rel(o[b], ref[0]) < FP32_TOL
            assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-4)
    assert wrapper.decision.backend == "reference"


def test_seed_paged_prefill_example_causal_equals_custom_mask(device):
    torch.manual_seed(1)
    qo_indptr = torch.tensor([0, 33, 44, 55, 66, 77, 88, 100], dtype=torch.int32)
    indices = torch.arange(128).int()
    q_at_layer = torch.randn(2, 100, 64, 128).half()
    kv_at_layer = torch.randn(2, 128, 2, 16, 16, 128, dtype=torch.float16)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(on(device, WS), "NHD")
    wrapper.plan(*on(device, qo_indptr, SEED_INDPTR, indices, SEED_LAST), 64, 16, 128, 16, causal=True)
    outputs = [wrapper.run(*on(device, q_at_layer[i], kv_at_layer[i])).cpu() for i in range(2)]
    assert outputs[0].shape == torch.Size([100, 64, 128])
    qo_len = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv_len = (16 * (SEED_INDPTR[1:] - SEED_INDPTR[:-1] - 1) + SEED_LAST).tolist()
    mask = torch.cat([torch.tril(torch.full((qo_len[i], kv_len[i]), True), diagonal=kv_len[i] - qo_len[i]).flatten()
                      for i in range(7)])
    wrapper.plan(*on(device, qo_indptr, SEED_INDPTR, indices, SEED_LAST), 64, 16, 128, 16,
                 custom_mask=on(device, mask))
    for i in range(2):
        o_custom = wrapper.run(*on(device, q_at_layer[i], kv_at_layer[i])).cpu()
        assert torch.allclose(o_custom, outputs[i], rtol=1e-3, atol=1e-3)
    q, kv = q_at_layer[0], kv_at_layer[0]
    for b in range(7):
        k, v = paged_to_dense(kv, SEED_INDPTR, indices, SEED_LAST, 16, b)
        ref, _ = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], k, v, causal=True)
        assert rel(outputs[0][qo_indptr[b]:qo_indptr[b + 1]], ref) < 2e-3


def test_seed_ragged_prefill_example(device):
    torch.manual_seed(2)
    qo_indptr = torch.tensor([0, 33, 44, 55, 66, 77, 88, 100], dtype=torch.int32)
    kv_indptr = qo_indptr.clone()
    q = torch.randn(100, 64, 128).half()
    k = torch.randn(100, 16, 128).half()
    v = torch.randn(100, 16, 128).half()
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(on(device, WS), "NHD")
    wrapper.plan(*on(device, qo_indptr, kv_indptr), 64, 16, 128, causal=True)
    o = wrapper.run(*on(device, q, k, v)).cpu()
    assert o.shape == torch.Size([100, 64, 128])
    lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    mask = torch.cat([torch.tril(torch.full((n, n), True)).flatten() for n in lens])
    wrapper.plan(*on(device, qo_indptr, kv_indptr), 64, 16, 128, custom_mask=on(device, mask))
    assert torch.allclose(wrapper.run(*on(device, q, k, v)).cpu(), o, rtol=1e-3, atol=1e-3)
    for b in range(7):
        s, e = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ref, _ = dense_attention(q[s:e], k[s:e], v[s:e], causal=True)
        assert rel(o[s:e], ref) < 2e-3


def test_seed_mla_example_shape_and_values(device):
    torch.manual_seed(3)
    batch, heads, ckv, kpe, kv_len = 6, 16, 512, 64, 99
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.int8, device=device),
                                                     backend="reference")
    q_indptr = torch.arange(0, batch + 1).int()
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    kv_indptr = torch.arange(0, batch + 1).int() * kv_len
    kv_indices = torch.arange(0, batch * kv_len).int()
    q_nope = torch.randn(batch, heads, ckv)
    q_pe = torch.randn(batch, heads, kpe)
    ckv_c = torch.randn(batch * kv_len, 1, ckv)
    kpe_c = torch.randn(batch * kv_len, 1, kpe)
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    w.plan(*on(device, q_indptr, kv_indptr, kv_indices, kv_lens), heads, ckv, kpe, 1, False, sm_scale, q_nope.dtype,
           ckv_c.dtype)
    o, lse = (t.cpu() for t in w.run(*on(device, q_nope, q_pe, ckv_c, kpe_c), return_lse=True))
    assert o.shape == torch.Size([batch, heads, ckv])
    _, lse_e = (t.cpu() for t in w.run(*on(device, q_nope, q_pe, ckv_c, kpe_c), return_lse=True,
                                       return_lse_base_on_e=True))
    assert torch.allclose(lse_e, lse * math.log(2), atol=1e-5)
    for b in range(batch):
        rows = slice(b * kv_len, (b + 1) * kv_len)
        k = torch.cat([ckv_c[rows], kpe_c[rows]], -1)
        ref, ref_lse = dense_attention(torch.cat([q_nope[b:b + 1], q_pe[b:b + 1]], -1), k, ckv_c[rows],
                                       sm_scale=sm_scale)
        assert rel(o[b], ref[0]) < FP32_TOL
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-4)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_and_prefill(layout, device):
    torch.manual_seed(4)
    k = torch.randn(37, 4, 64)
    v = torch.randn(37, 4, 64)
    q = torch.randn(8, 64)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    o, lse = (t.cpu() for t in flashinfer.single_decode_with_kv_cache(*on(device, q, kk, vv), kv_layout=layout,
                                                                      return_lse=True, backend="reference"))
    ref, ref_lse = dense_attention(q[None], k, v)
    assert o.shape == (8, 64) and lse.shape == (8,)
    assert rel(o, ref[0]) < FP32_TOL and torch.allclose(lse.double(), ref_lse[0], atol=1e-4)
    qp = torch.randn(11, 8, 64)
    o = flashinfer.single_prefill_with_kv_cache(*on(device, qp, kk, vv), causal=True, kv_layout=layout,
                                                window_left=5, backend="reference").cpu()
    ref, _ = dense_attention(qp, k, v, causal=True, window_left=5)
    assert rel(o, ref) < FP32_TOL
    o2, lse2 = (t.cpu() for t in flashinfer.single_prefill_with_kv_cache_return_lse(
        *on(device, qp, kk, vv), causal=True, kv_layout=layout, window_left=5, backend="reference"))
    assert torch.equal(o, o2) and lse2.shape == (11, 8)


def test_single_prefill_custom_and_packed_mask_agree():
    torch.manual_seed(5)
    q, k, v = torch.randn(9, 4, 32), torch.randn(20, 2, 32), torch.randn(20, 2, 32)
    mask = torch.rand(9, 20) > 0.4
    o1 = flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    packed = flashinfer.packbits(mask.flatten(), bitorder="little")
    o2 = flashinfer.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed)
    ref, _ = dense_attention(q, k, v, mask=mask)
    assert rel(o1, ref) < FP32_TOL and torch.equal(o1, o2)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = torch.randn(3, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 2] = True
    o, lse = flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert torch.allclose(o[1], v[2], atol=1e-6)


def test_decode_q_len_per_req_is_causal_in_the_block():
    torch.manual_seed(6)
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    last = torch.tensor([3, 8], dtype=torch.int32)
    indices = torch.randperm(6).int()
    kv = torch.randn(6, 2, 8, 2, 32)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(indptr, indices, last, 4, 2, 32, 8, data_type=torch.float32)
    q = torch.randn(2 * 3, 4, 32)
    o = w.run(q, kv, q_len_per_req=3)
    for b in range(2):
        k, v = paged_to_dense(kv, indptr, indices, last, 8, b)
        ref, _ = dense_attention(q[3 * b:3 * b + 3], k, v, causal=True)
        assert rel(o[3 * b:3 * b + 3], ref) < FP32_TOL
    assert w.run(q[::3].contiguous(), kv).shape == (2, 4, 32)


def test_trtllm_and_xqa_entry_points_match_the_wrapper(device):
    torch.manual_seed(7)
    page, hq, hkv, d = 16, 8, 2, 64
    lens = torch.tensor([40, 16, 1], dtype=torch.int32)
    tables = torch.tensor([[3, 0, 5], [1, 9, 9], [7, 9, 9]], dtype=torch.int32)
    k_cache = torch.randn(10, hkv, page, d)
    v_cache = torch.randn(10, hkv, page, d)
    q = torch.randn(3, hq, d)
    scale = 0.3
    o = flashinfer.trtllm_batch_decode_with_kv_cache(q.to(device), on(device, k_cache, v_cache), on(device, WS),
                                                     on(device, tables), lens, 64, bmm1_scale=scale,
                                                     bmm2_scale=2.0, backend="reference").cpu()
    for b in range(3):
        pages = tables[b, :(int(lens[b]) + page - 1) // page].long()
        k = k_cache[pages].transpose(1, 2).reshape(-1, hkv, d)[:lens[b]]
        v = v_cache[pages].transpose(1, 2).reshape(-1, hkv, d)[:lens[b]]
        ref, _ = dense_attention(q[b:b + 1], k, v, sm_scale=scale)
        assert rel(o[b], 2.0 * ref[0]) < FP32_TOL
    out = torch.empty(3, 1, hq, d, device=device)
    with flashinfer.use_backends(["reference"]):  # fp32 data: the reference's float32 math, on any device
        flashinfer.xqa(*on(device, q[:, None], k_cache, v_cache, tables, lens[:, None]), out, on(device, WS), None, hkv,
                       page, kv_layout="HND", q_scale=scale * math.sqrt(d))
    assert rel(out[:, 0].cpu(), o / 2.0) < 1e-5
    sinks = torch.randn(hq)
    o_s = flashinfer.trtllm_batch_decode_with_kv_cache(q.to(device), on(device, k_cache, v_cache), on(device, WS),
                                                       on(device, tables), lens, 64, bmm1_scale=scale,
                                                       sinks=sinks.to(device), backend="reference").cpu()
    pages = tables[0, :3].long()
    k = k_cache[pages].transpose(1, 2).reshape(-1, hkv, d)[:40]
    v = v_cache[pages].transpose(1, 2).reshape(-1, hkv, d)[:40]
    ref, _ = dense_attention(q[:1], k, v, sm_scale=scale, sinks=sinks)
    assert rel(o_s[0], ref[0]) < FP32_TOL


def test_trtllm_context_matches_paged_prefill():
    torch.manual_seed(8)
    page, hq, hkv, d = 8, 4, 4, 32
    seq = torch.tensor([20, 9], dtype=torch.int32)
    qlen = torch.tensor([5, 9])
    tables = torch.tensor([[2, 0, 4], [1, 3, 3]], dtype=torch.int32)
    cache = torch.randn(5, 2, hkv, page, d)
    cum_q = torch.tensor([0, 5, 14], dtype=torch.int32)
    q = torch.randn(14, hq, d)
    o = flashinfer.trtllm_batch_context_with_kv_cache(q, cache, WS, tables, seq, 9, 20, 0.2, 1.0, 2, cum_q, None)
    for b in range(2):
        pages = tables[b, :(int(seq[b]) + page - 1) // page].long()
        k = cache[pages, 0].transpose(1, 2).reshape(-1, hkv, d)[:seq[b]]
        v = cache[pages, 1].transpose(1, 2).reshape(-1, hkv, d)[:seq[b]]
        ref, _ = dense_attention(q[cum_q[b]:cum_q[b + 1]], k, v, causal=True, sm_scale=0.2)
        assert rel(o[cum_q[b]:cum_q[b + 1]], ref) < FP32_TOL
    assert qlen.sum() == 14


def test_trtllm_mla_matches_wrapper():
    torch.manual_seed(9)
    b, heads, rank, rope, page = 2, 4, 64, 16, 8
    kv = torch.randn(6, page, rank + rope)
    tables = torch.tensor([[4, 1, 0], [2, 5, 5]], dtype=torch.int32)
    seq = torch.tensor([19, 3], dtype=torch.int32)
    query = torch.randn(b, 1, heads, rank + rope)
    o = flashinfer.trtllm_batch_decode_with_kv_cache_mla(query, kv, WS, 128, rank, rope, tables, seq, 24,
                                                         bmm1_scale=0.1)
    assert o.shape == (b, 1, heads, rank)
    for i in range(b):
        pages = tables[i, :(int(seq[i]) + page - 1) // page].long()
        rows = kv[pages].reshape(-1, rank + rope)[:seq[i]]
        ref, _ = dense_attention(query[i, :, :, :], rows[:, None], rows[:, None, :rank], sm_scale=0.1)
        assert rel(o[i, 0], ref[0]) < FP32_TOL


def test_merge_state_and_states():
    torch.manual_seed(10)
    q, k, v = torch.randn(4, 2, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    full, _ = flashinfer.single_prefill_with_kv_cache(q, k, v, return_lse=True)
    a = flashinfer.single_prefill_with_kv_cache(q, k[:10], v[:10], return_lse=True)
    b = flashinfer.single_prefill_with_kv_cache(q, k[10:], v[10:], return_lse=True)
    vm, sm = flashinfer.merge_state(a[0], a[1], b[0], b[1])
    assert rel(vm, full) < FP32_TOL
    vs, ss = flashinfer.merge_states(torch.stack([a[0], b[0]], 1), torch.stack([a[1], b[1]], 1))
    assert torch.allclose(vs, vm) and torch.allclose(ss, sm)
    v_in, s_in = a[0].clone(), a[1].clone()
    flashinfer.merge_state_in_place(v_in, s_in, b[0], b[1])
    assert torch.allclose(v_in, vm, atol=1e-6)


def test_packbits_matches_numpy():
    x = torch.rand(45) > 0.5
    for order in ("big", "little"):
        assert np.array_equal(flashinfer.packbits(x, order).numpy(), np.packbits(x.numpy(), bitorder=order))
    indptr = torch.tensor([0, 3, 3, 20, 45], dtype=torch.int32)
    y, new = flashinfer.segment_packbits(x, indptr, bitorder="little")
    parts = [np.packbits(x[indptr[i]:indptr[i + 1]].numpy(), bitorder="little") for i in range(4)]
    assert np.array_equal(y.numpy(), np.concatenate(parts))
    assert new.tolist() == [0, 1, 1, 4, 8]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_gpu_segment_pack_kernel_matches_numpy(dtype):
    """bitpack.pack_segments (the CUDA path of segment_packbits; here under Triton's interpreter):
    37 segments of random lengths, empty ones, an unaligned first offset, more output bytes than
    one program packs, both bit orders."""
    from flashdispatch.bitpack import pack_segments
    gen = torch.Generator().manual_seed(9)
    lens = torch.randint(0, 700, (37,), generator=gen)
    lens[[3, 4, 20]] = 0
    ip = torch.cat([torch.tensor([5]), 5 + torch.cumsum(lens, 0)])
    x = (torch.rand(int(ip[-1]) + 9, generator=gen) > 0.4).to(dtype)
    new = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum((lens + 7) // 8, 0)])
    assert int(new[-1]) > 1024
    for order in ("big", "little"):
        y = pack_segments(x, ip, new, int(new[-1]), order)
        parts = [np.packbits(x[ip[i]:ip[i + 1]].numpy() != 0, bitorder=order) for i in range(37)]
        assert np.array_equal(y.numpy(), np.concatenate(parts))


def test_gpu_segment_pack_kernel_strided_and_expanded_input():
    """Views the kernel cannot read as dense memory (every other element, a broadcast) are packed
    from a dense copy: the right bits, no read past the storage."""
    from flashdispatch.bitpack import pack_segments
    ip, new = torch.tensor([0, 20, 32]), torch.tensor([0, 3, 5])
    strided = torch.tensor([1, 0] * 32, dtype=torch.bool)[::2]  # all True
    expanded = torch.ones(1, dtype=torch.bool).expand(32)
    for x in (strided, expanded):
        y = pack_segments(x, ip, new, 5, "little")
        assert y.tolist() == [255, 255, 15, 255, 15]


@pytest.mark.gpu
def test_packbits_on_cuda_match_numpy():
    """segment_packbits on CUDA tensors (the Triton kernel) and packbits: 300 segments of random
    lengths (a 40M-bit mask), both bit orders, against numpy on the host."""
    gen = torch.Generator().manual_seed(10)
    lens = torch.randint(0, 300_000, (300,), generator=gen)
    ip = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
    x = torch.rand(int(ip[-1]), generator=gen) > 0.5
    for order in ("big", "little"):
        y, new = flashinfer.segment_packbits(x.cuda(), ip.cuda(), bitorder=order)
        parts = [np.packbits(x[ip[i]:ip[i + 1]].numpy(), bitorder=order) for i in range(300)]
        assert np.array_equal(y.cpu().numpy(), np.concatenate(parts))
        assert new.cpu().tolist() == np.cumsum([0] + [len(p) for p in parts]).tolist()
        assert np.array_equal(flashinfer.packbits(x[:1001].cuda(), order).cpu().numpy(),
                              np.packbits(x[:1001].numpy(), bitorder=order))


def test_segment_packbits_rejects_bad_indptr():
    x = torch.ones(10, dtype=torch.bool)
    for bad in ([-1, 4], [0, 6, 4], [0, 11]):
        with pytest.raises(ValueError, match="indptr must start"):
            flashinfer.segment_packbits(x, torch.tensor(bad), bitorder="little")


@pytest.mark.parametrize("indptr", [[0, 16, 16, 40, 64], [3, 19, 43], [5, 5]], ids=["aligned", "offset_start", "empty"])
def test_segment_packbits_whole_byte_segments(indptr):
    """Segments of whole bytes take one packbits (also from an unaligned first offset): the same
    bytes and offsets as numpy's per-segment packing, in both bit orders."""
    x = torch.rand(70, generator=torch.Generator().manual_seed(4)) > 0.5
    ip = torch.tensor(indptr, dtype=torch.int64)
    for order in ("big", "little"):
        y, new = flashinfer.segment_packbits(x, ip, bitorder=order)
        parts = [np.packbits(x[indptr[i]:indptr[i + 1]].numpy(), bitorder=order) for i in range(len(indptr) - 1)]
        assert np.array_equal(y.numpy(), np.concatenate(parts)) and y.dtype == torch.uint8
        assert new.dtype == torch.int32 and new.tolist() == [(v - indptr[0]) // 8 for v in indptr]


def test_append_paged_kv_cache_round_trip():
    torch.manual_seed(11)
    page, hkv, d = 4, 2, 8
    cache = torch.zeros(6, 2, page, hkv, d)
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    kv_indices = torch.tensor([5, 0, 1, 3, 2], dtype=torch.int32)
    last = torch.tensor([3, 1], dtype=torch.int32)
    seq = flashinfer.get_seq_lens(kv_indptr, last, page)
    assert seq.tolist() == [7, 9]
    append_indptr = torch.tensor([0, 7, 16], dtype=torch.int32)
    key, val = torch.randn(16, hkv, d), torch.randn(16, hkv, d)
    bi, pos = flashinfer.get_batch_indices_positions(append_indptr, seq, 16)
    flashinfer.append_paged_kv_cache(key, val, bi, pos, cache, kv_indices, kv_indptr, last)
    k, v = paged_to_dense(cache, kv_indptr, kv_indices, last, page, 1)
    assert torch.equal(k, key[7:]) and torch.equal(v, val[7:])


def test_explain_and_overrides_on_cpu():
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(SEED_INDPTR, torch.arange(128).int(), SEED_LAST, 8, 8, 64, 16, data_type=torch.float32)
    text = flashinfer.explain(w)
    assert "reference" in text and "<- selected" in text
    for name in ("fa2", "cudnn", "fa3", "xqa", "trtllm-gen", "cutlass"):
        assert name in text
    with pytest.raises(flashinfer.Unsupported, match="cudnn"):
        bad = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend="cudnn")
        bad.plan(SEED_INDPTR, torch.arange(128).int(), SEED_LAST, 8, 8, 64, 16, data_type=torch.float32)
    with flashinfer.use_backends(["reference"]):
        w.plan(SEED_INDPTR, torch.arange(128).int(), SEED_LAST, 8, 8, 64, 16, data_type=torch.float32)
    assert w.decision.backend == "reference"


@pytest.mark.parametrize("backend", ["reference", "fa2"])
def test_graph_mode_wrappers_sharing_a_workspace_keep_their_own_plans(backend):
    """Serving engines share one float workspace between wrappers: plan A, plan B, run A must give
    A's result (plan metadata lives in each wrapper's own int workspace)."""
    torch.manual_seed(12)
    shared = torch.zeros(1 << 22, dtype=torch.uint8)
    page, hq, hkv, d = 4, 4, 2, 64
    kv = torch.randn(40, 2, page, hkv, d).half()
    wrappers, cases = [], []
    for lens in ([9, 30], [17, 2]):
        bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(40, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32)]
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(shared, "NHD", use_cuda_graph=True, backend=backend,
                                                          paged_kv_indptr_buffer=bufs[0],
                                                          paged_kv_indices_buffer=bufs[1],
                                                          paged_kv_last_page_len_buffer=bufs[2])
        pages = [(n + page - 1) // page for n in lens]
        indptr = torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32)
        indices = torch.randperm(40)[:sum(pages)].int()
        last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
        w.plan(indptr, indices, last, hq, hkv, d, page, data_type=torch.float16)
        wrappers.append(w)
        cases.append((indptr, indices, last))
    q = torch.randn(2, hq, d).half()
    out = wrappers[0].run(q, kv)
    indptr, indices, last = cases[0]
    for b in range(2):
        k, v = paged_to_dense(kv, indptr, indices, last, page, b)
        ref, _ = dense_attention(q[b:b + 1], k, v)
        assert rel(out[b], ref[0]) < 4e-3


def test_graph_mode_plan_on_views_of_its_own_buffers(monkeypatch):
    """An engine that writes its tables into the CUDA-graph buffers and passes views of them: plan()
    copies nothing into them, and the result is right."""
    torch.manual_seed(13)
    page, hq, hkv, d, lens = 4, 4, 2, 64, [9, 30]
    kv = torch.randn(40, 2, page, hkv, d).half()
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(40, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), "NHD",
                                                      use_cuda_graph=True, backend="fa2",
                                                      paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                                                      paged_kv_last_page_len_buffer=bufs[2])
    pages = [(n + page - 1) // page for n in lens]
    bufs[0].copy_(torch.tensor([0, pages[0], sum(pages)]))
    bufs[1][:sum(pages)] = torch.randperm(40)[:sum(pages)].int()
    bufs[2].copy_(torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)]))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a, **k: copies.append(t) or real_copy(t, src, *a, **k))
    w.plan(bufs[0], bufs[1][:sum(pages)], bufs[2], hq, hkv, d, page, data_type=torch.float16)
    assert not [t for t in copies if any(t.data_ptr() == b.data_ptr() for b in bufs)]
    q = torch.randn(2, hq, d).half()
    out = w.run(q, kv)
    for b in range(2):
        k, v = paged_to_dense(kv, bufs[0], bufs[1], bufs[2], page, b)
        ref, _ = dense_attention(q[b:b + 1], k, v)
        assert rel(out[b], ref[0]) < 4e-3


@pytest.mark.parametrize("strided", [0, 1, 2])
def test_graph_mode_buffers_must_be_contiguous(strided):
    """A CUDA graph reads the fixed buffers in place: a strided one (a column of a 2-D tensor) would
    be copied per plan, leaving a captured graph on an old copy; the wrapper refuses it, naming it."""
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(40, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    bufs[strided] = torch.zeros(bufs[strided].numel(), 2, dtype=torch.int32)[:, 0]
    names = ["paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"]
    with pytest.raises(ValueError, match=f"{names[strided]} must be contiguous"):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), "NHD",
                                                      use_cuda_graph=True, backend="fa2", **dict(zip(names, bufs)))


def test_explain_a_described_gpu_judges_capabilities_not_this_machine():
    from flashdispatch.dispatch.explain import describe_device
    text = flashinfer.explain(op="decode", heads="32/8", head_dim=128, page_size=16, features="soft_cap",
                              logits_soft_cap=30.0, device=describe_device("sm90"))
    lines = {line.split()[0]: line for line in text.splitlines()[2:] if line.startswith("  ") and line.split()}
    assert "OK" in lines["fa2"] and "<- selected" in lines["fa2"]
    assert "feature.soft_cap" in lines["cudnn"] and "device" not in lines["cudnn"]
    assert "not_implemented" in lines["xqa"]


def test_lse_is_chosen_for_when_a_run_asks_for_it(monkeypatch):
    """A backend without lse serves run(); run(return_lse=True) plans the lse variant then, and an
    explicitly requested backend that cannot give lse says so."""
    import dataclasses

    from flashdispatch import planned
    from flashdispatch.backends.reference import BACKEND as Reference
    from flashdispatch.dispatch import registry

    caps = {op: dataclasses.replace(c, features=c.features - {"lse"}) for op, c in Reference.caps.items()}
    NoLse = type("NoLse", (Reference,), {"name": "xqa", "caps": caps})
    real = registry.backend_class
    fake = lambda name: NoLse if name == "xqa" else real(name)  # noqa: E731
    monkeypatch.setattr(registry, "backend_class", fake)
    monkeypatch.setattr(planned, "get_backend", lambda name: fake(name)())
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend="xqa")
    w.plan(SEED_INDPTR, torch.arange(128).int(), SEED_LAST, 8, 8, 64, 16, data_type=torch.float32)
    kv, q = torch.randn(128, 2, 16, 8, 64), torch.randn(7, 8, 64)
    assert w.run(q, kv).shape == (7, 8, 64) and w.decision.backend == "xqa"
    with pytest.raises(flashinfer.Unsupported, match="feature.lse"):
        w.run(q, kv, return_lse=True)


def test_graph_mode_variants_keep_their_own_metadata_and_are_replanned():
    """Graph mode: q_len/lse variants of one plan() have their own metadata buffers (no clash when a
    run switches variant), and a re-plan refreshes every variant used before (what a captured
    graph replays: emulated by running the old plan object on the new inputs)."""
    from flashdispatch.backends.base import AttentionInputs, PagedKV

    torch.manual_seed(13)
    page, hq, hkv, d, pages = 16, 4, 2, 64, 64  # long enough for fa2 to split: the metadata differs per q_len
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(pages, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(  # fa2: Triton (interpreted here), plans in the int workspace
        torch.zeros(1 << 22, dtype=torch.uint8), use_cuda_graph=True, backend="fa2", paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    kv = torch.randn(pages, 2, page, hkv, d).half()

    def plan(lens, seed):
        g = torch.Generator().manual_seed(seed)
        n = [(x + page - 1) // page for x in lens]
        table = (torch.tensor([0, n[0], sum(n)], dtype=torch.int32), torch.randperm(pages, generator=g)[:sum(n)].int(),
                 torch.tensor([x - (c - 1) * page for x, c in zip(lens, n)], dtype=torch.int32))
        w.plan(*table, hq, hkv, d, page, data_type=torch.float16)
        return table

    def check(out, table, q, q_len):
        for b in range(2):
            k, v = paged_to_dense(kv, table[0], table[1], table[2], page, b)
            ref, _ = dense_attention(q[b * q_len:(b + 1) * q_len], k, v, causal=q_len > 1)
            assert rel(out[b * q_len:(b + 1) * q_len], ref) < 4e-3

    table = plan([600, 250], 0)
    q1, q32 = torch.randn(2, hq, d).half(), torch.randn(64, hq, d).half()
    check(w.run(q1, kv), table, q1, 1)
    check(w.run(q32, kv, q_len_per_req=32), table, q32, 32)
    out, lse = w.run(q1, kv, return_lse=True)
    check(out, table, q1, 1)
    check(w.run(q1, kv), table, q1, 1)  # back to the first variant: its metadata is intact
    captured = w._variants[32, False]
    table = plan([300, 700], 1)  # re-plan: other lengths and pages, same batch
    out = torch.full((64, hq, d), float("nan"), dtype=torch.float16)
    captured.backend.run(captured.plan, AttentionInputs(q32, PagedKV(kv[:, 0], kv[:, 1], "NHD"), out))
    check(out, table, q32, 32)


def test_single_decode_on_fa2_with_a_long_kv_has_a_workspace_for_its_split():
    torch.manual_seed(14)
    q, k, v = torch.randn(32, 64).half(), torch.randn(600, 8, 64).half(), torch.randn(600, 8, 64).half()
    o = flashinfer.single_decode_with_kv_cache(q, k, v, backend="fa2")
    ref, _ = dense_attention(q[None], k, v)
    assert rel(o, ref[0]) < 4e-3


def test_trtllm_mla_accepts_a_tensor_bmm1_scale():
    torch.manual_seed(15)
    kv = torch.randn(6, 8, 80)
    tables = torch.tensor([[4, 1, 0], [2, 5, 5]], dtype=torch.int32)
    seq = torch.tensor([19, 3], dtype=torch.int32)
    query = torch.randn(2, 1, 4, 80)
    args = (query, kv, WS, 128, 64, 16, tables, seq, 24)
    o_f = flashinfer.trtllm_batch_decode_with_kv_cache_mla(*args, bmm1_scale=0.1)
    o_t = flashinfer.trtllm_batch_decode_with_kv_cache_mla(*args, bmm1_scale=torch.tensor([0.1]))
    assert torch.allclose(o_f, o_t)
