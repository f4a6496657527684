"""The cascade wrappers (MultiLevelCascadeAttentionWrapper, the shared-prefix decode and prefill
wrappers) against dense float64 attention over each request's keys: random paged caches with
shuffled pages, GQA, a causal last level, empty levels, fp32/fp16, NHD/HND, on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

import flashdispatch as fi

WS = torch.empty(1 << 20, dtype=torch.uint8)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
HQ, HKV, D, PAGE = 4, 2, 16, 4


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _dense(q, k, v, visible, scale):
    """q [n, Hq, D], k/v [L, Hkv, D], visible [n, L] -> float64 softmax attention [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", p, v)


class Pages:
    """A paged cache [num_pages, 2, ...] of random keys/values and page tables carved from it in a
    shuffled page order."""

    def __init__(self, num_pages, dtype, layout, gen, page=PAGE, dim=D, device="cpu"):
        shape = (num_pages, 2, page, HKV, dim) if layout == "NHD" else (num_pages, 2, HKV, page, dim)
        self.cache, self.layout = torch.randn(shape, generator=gen).to(device, dtype), layout
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.page, self.dim = page, dim

    def table(self, kv_lens):
        """(indptr, indices, last_page_len) int32 for requests of ``kv_lens`` keys, and each
        request's (k, v) tokens [kv_len, HKV, dim]."""
        indptr, indices, last, tokens = [0], [], [], []
        for n in kv_lens:
            pages = [self.free.pop() for _ in range(-(-n // self.page))]
            indptr.append(indptr[-1] + len(pages))
            indices += pages
            last.append(n - (len(pages) - 1) * self.page if pages else 0)
            kv = self.cache[pages]
            kv = kv if self.layout == "NHD" else kv.transpose(2, 3)
            tokens.append((kv[:, 0].reshape(-1, HKV, self.dim)[:n], kv[:, 1].reshape(-1, HKV, self.dim)[:n]))
        as_i32 = [torch.tensor(x, dtype=torch.int32, device=self.cache.device) for x in (indptr, indices, last)]
        return as_i32, tokens


def _visible(qo_len, prefix_len, tail_len, causal):
    """[qo_len, prefix + tail] visibility: all of the prefix; the tail causal (bottom-right) or all."""
    i, j = torch.arange(qo_len)[:, None], torch.arange(tail_len)[None, :]
    tail = j <= i + tail_len - qo_len if causal else torch.ones(qo_len, tail_len, dtype=torch.bool)
    return torch.cat([torch.ones(qo_len, prefix_len, dtype=torch.bool), tail], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal,layout", [(False, "NHD"), (True, "NHD"), (True, "HND")])
def test_multi_level_matches_dense(dtype, causal, layout):
    """Three levels: a prefix of all requests, one of requests 0-1 (request 2 has none), each
    request's own keys (request 1 none); causal masks the last level only."""
    gen = torch.Generator().manual_seed(3 + causal)
    pages = Pages(40, dtype, layout, gen)
    qo_lens, groups = [2, 1, 3], [[0, 1], [2]]
    shared_t, shared_kv = pages.table([9])
    group_t, group_kv = pages.table([6, 0])
    unique_t, unique_kv = pages.table([5, 0, 7])
    total = sum(qo_lens)
    qo = [torch.tensor([0, total], dtype=torch.int32), torch.tensor([0, 3, total], dtype=torch.int32),
          torch.tensor([0, 2, 3, total], dtype=torch.int32)]
    w = fi.MultiLevelCascadeAttentionWrapper(3, WS, layout, backend="reference")
    tables = [shared_t, group_t, unique_t]
    w.plan(qo, *[[t[i] for t in tables] for i in range(3)], HQ, HKV, D, PAGE, causal=causal, q_data_type=dtype)
    q = torch.randn(total, HQ, D, generator=gen).to(dtype)
    out = w.run(q, pages.cache)
    assert out.shape == (total, HQ, D) and out.dtype == dtype
    row = 0
    for b, qo_len in enumerate(qo_lens):
        g = 0 if b in groups[0] else 1
        parts = [shared_kv[0], group_kv[g], unique_kv[b]]
        k, v = (torch.cat([p[i] for p in parts]) for i in (0, 1))
        prefix = len(parts[0][0]) + len(parts[1][0])
        visible = _visible(qo_len, prefix, len(parts[2][0]), causal)
        ref = _dense(q[row:row + qo_len], k, v, visible, 1 / math.sqrt(D))
        assert _rel(out[row:row + qo_len], ref) <= TOL[dtype], f"request {b}"
        row += qo_len


def test_multi_level_one_level_is_the_paged_prefill():
    gen = torch.Generator().manual_seed(5)
    pages = Pages(12, torch.float32, "NHD", gen)
    (indptr, indices, last), _ = pages.table([5, 9])
    qo = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(5, HQ, D, generator=gen)
    w = fi.MultiLevelCascadeAttentionWrapper(1, WS, backend="reference")
    w.begin_forward([qo], [indptr], [indices], [last], HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32)
    ref = fi.BatchPrefillWithPagedKVCacheWrapper(WS, backend="reference")
    ref.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32)
    assert torch.equal(w.forward(q, pages.cache), ref.run(q, pages.cache))
    assert "level 0:" in w.explain() and w.is_cuda_graph_enabled is False


@pytest.mark.parametrize("dtype,layout,shared_len", [(torch.float32, "NHD", 11), (torch.float16, "HND", 6),
                                                     (torch.float32, "NHD", 0)])
def test_shared_prefix_decode_matches_dense(dtype, layout, shared_len):
    gen = torch.Generator().manual_seed(shared_len)
    pages = Pages(16, dtype, layout, gen)
    (indptr, indices, last), unique = pages.table([3, 0, 10])
    k_shared, v_shared = (torch.randn(shared_len, HKV, D, generator=gen).to(dtype) for _ in range(2))
    w = fi.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(WS, layout, backend="reference")
    w.begin_forward(indptr, indices, last, HQ, HKV, D, PAGE, data_type=dtype)
    q = torch.randn(3, HQ, D, generator=gen).to(dtype)
    shared_args = (k_shared, v_shared) if layout == "NHD" else (k_shared.transpose(0, 1), v_shared.transpose(0, 1))
    out = w.forward(q, *shared_args, pages.cache)
    assert out.shape == (3, HQ, D) and out.dtype == dtype
    for b, (k_u, v_u) in enumerate(unique):
        k, v = torch.cat([k_shared, k_u]), torch.cat([v_shared, v_u])
        ref = _dense(q[b:b + 1], k, v, torch.ones(1, len(k), dtype=torch.bool), 1 / math.sqrt(D))
        if len(k) == 0:
            assert not out[b].any()
        else:
            assert _rel(out[b:b + 1], ref) <= TOL[dtype], f"request {b}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_shared_prefix_prefill_matches_dense(dtype, causal):
    """Every query sees the whole shared prefix; causal masks its own keys (bottom-right); a
    forward() with other dtypes, causal or sm_scale than the last plan plans again."""
    gen = torch.Generator().manual_seed(7 + causal)
    pages = Pages(16, dtype, "NHD", gen)
    qo_lens = [3, 1, 2]
    (indptr, indices, last), unique = pages.table([4, 6, 9])
    qo = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    k_shared, v_shared = (torch.randn(7, HKV, D, generator=gen).to(dtype) for _ in range(2))
    w = fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(WS, "NHD", backend="reference")
    w.begin_forward(qo, indptr, indices, last, HQ, HKV, D, PAGE)
    q = torch.randn(6, HQ, D, generator=gen).to(dtype)
    for sm_scale in (None, 0.3):
        out = w.forward(q, k_shared, v_shared, pages.cache, causal=causal, sm_scale=sm_scale)
        scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
        row = 0
        for b, (qo_len, (k_u, v_u)) in enumerate(zip(qo_lens, unique)):
            visible = _visible(qo_len, 7, len(k_u), causal)
            ref = _dense(q[row:row + qo_len], torch.cat([k_shared, k_u]), torch.cat([v_shared, v_u]), visible, scale)
            assert _rel(out[row:row + qo_len], ref) <= TOL[dtype], f"request {b}, sm_scale={sm_scale}"
            row += qo_len


def test_cascade_wrappers_refuse_bad_arguments():
    w = fi.MultiLevelCascadeAttentionWrapper(2, WS, backend="reference")
    qo = torch.tensor([0, 2], dtype=torch.int32)
    one = [torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([3], dtype=torch.int32)]
    with pytest.raises(ValueError, match="qo_indptr_arr has 1 entries, expected num_levels=2"):
        w.plan([qo], [one[0]] * 2, [one[1]] * 2, [one[2]] * 2, HQ, HKV, D, PAGE)
    with pytest.raises(TypeError, match="paged_kv_indices_arr must be a list"):
        w.plan([qo] * 2, [one[0]] * 2, one[1], [one[2]] * 2, HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match=r"levels' qo_indptr\[-1\] differ \(\[2, 3\]\)"):
        w.plan([qo, torch.tensor([0, 3], dtype=torch.int32)], [one[0]] * 2, [one[1]] * 2, [one[2]] * 2,
               HQ, HKV, D, PAGE, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="num_levels=0 must be a positive int"):
        fi.MultiLevelCascadeAttentionWrapper(0, WS)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs qo_indptr_buf"):
        fi.MultiLevelCascadeAttentionWrapper(1, WS, use_cuda_graph=True, qo_indptr_buf_arr=[None],
                                             paged_kv_indptr_buf_arr=[None], paged_kv_indices_buf_arr=[None],
                                             paged_kv_last_page_len_buf_arr=[None])
    with pytest.raises(ValueError, match="int_workspace_buffers has 1 entries"):
        w.reset_workspace_buffer(WS, [torch.empty(8, dtype=torch.uint8)])
    k = torch.randn(4, HKV, D)
    for cls in (fi.BatchDecodeWithSharedPrefixPagedKVCacheWrapper, fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.forward\(\) called before begin_forward\(\)"):
            cls(WS).forward(torch.randn(1, HQ, D), k, k, torch.randn(2, 2, PAGE, HKV, D))


def test_cascade_names_are_flashinfers():
    import flashdispatch.cascade as cascade
    for name in ("MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
                 "BatchPrefillWithSharedPrefixPagedKVCacheWrapper"):
        assert getattr(cascade, name) is getattr(fi, name) and name in fi.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_wrappers_on_gpu_match_the_reference(dtype):
    """The three wrappers with the selected backends (fa2 / cuDNN prefill and decode, fa2 merge) on
    the GPU against the same wrappers on the reference backend: head_dim 128, pages of 16."""
    gen = torch.Generator().manual_seed(11)
    pages = Pages(64, dtype, "NHD", gen, page=16, dim=128, device="cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    shared_t, _ = pages.table([100])
    unique_t, _ = pages.table([37, 0, 300])
    qo = torch.tensor([0, 5, 6, 14], dtype=torch.int32, device="cuda")
    q = torch.randn(14, HQ, 128, generator=gen).to("cuda", dtype)
    k_shared, v_shared = (torch.randn(80, HKV, 128, generator=gen).to("cuda", dtype) for _ in range(2))
    results = {}
    for backend in ("auto", "reference"):
        multi = fi.MultiLevelCascadeAttentionWrapper(2, ws, backend=backend)
        multi.plan([torch.tensor([0, 14], dtype=torch.int32, device="cuda"), qo],
                   *[[shared_t[i], unique_t[i]] for i in range(3)], HQ, HKV, 128, 16, causal=True, q_data_type=dtype)
        decode = fi.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws, backend=backend)
        decode.begin_forward(*unique_t, HQ, HKV, 128, 16, data_type=dtype)
        prefill = fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws, backend=backend)
        prefill.begin_forward(qo, *unique_t, HQ, HKV, 128, 16)
        results[backend] = (multi.run(q, pages.cache), decode.forward(q[:3], k_shared, v_shared, pages.cache),
                            prefill.forward(q, k_shared, v_shared, pages.cache, causal=True))
    for got, want in zip(results["auto"], results["reference"]):
        assert not got.isnan().any() and _rel(got, want.double()) <= {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
