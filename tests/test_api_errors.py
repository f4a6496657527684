"""Bad input gets a ValueError/TypeError (or Unsupported) naming the argument and the value,
before anything is launched (DESIGN.md, Reliability)."""
import pytest
import torch

import flashdispatch as fi

WS = torch.empty(1 << 20, dtype=torch.uint8)
INDPTR = torch.tensor([0, 2, 5], dtype=torch.int32)
INDICES = torch.tensor([4, 0, 1, 3, 2], dtype=torch.int32)
LAST = torch.tensor([3, 8], dtype=torch.int32)


def decode_wrapper(**plan_kw):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    args = dict(indptr=INDPTR, indices=INDICES, last_page_len=LAST, num_qo_heads=4, num_kv_heads=2, head_dim=32,
                page_size=8, q_data_type=torch.float16)
    args.update(plan_kw)
    w.plan(**args)
    return w


def cache(pages=6, dtype=torch.float16):
    return torch.randn(pages, 2, 8, 2, 32).to(dtype)


Q = torch.randn(2, 4, 32).half()


@pytest.mark.parametrize("kw, err, match", [
    (dict(indices=INDICES.long()), TypeError, "indices.dtype=int64"),
    (dict(indptr=INDPTR.long()), TypeError, "indptr.dtype=int64"),
    (dict(indptr=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError, r"indptr\[0\]=1"),
    (dict(indptr=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(last_page_len=torch.tensor([0, 8], dtype=torch.int32)), ValueError, r"last_page_len\[0\]=0"),
    (dict(last_page_len=torch.tensor([3, 9], dtype=torch.int32)), ValueError, r"last_page_len\[1\]=9"),
    (dict(last_page_len=torch.tensor([3], dtype=torch.int32)), ValueError, "last_page_len has 1 entries"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError, "not a multiple"),
    (dict(head_dim=0), ValueError, "head_dim=0"),
    (dict(page_size=-1), ValueError, "page_size=-1"),
    (dict(indices=torch.tensor([4, 0, -1, 3, 2], dtype=torch.int32)), ValueError, "negative page index"),
    (dict(indices=INDICES[:3]), ValueError, "indices has 3 entries"),
    (dict(q_data_type="float17"), ValueError, "q_data_type='float17'"),
    (dict(pos_encoding_mode="ROPE"), ValueError, "pos_encoding_mode='ROPE'"),
    (dict(window_left=-2), ValueError, "window_left=-2"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap=-1.0"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    (dict(indices=torch.zeros(1, dtype=torch.int32).expand(1 << 31)), ValueError,  # no memory: stride 0
     "indices has 2147483648 entries; at most 2"),
    (dict(indptr=INDPTR.to("meta")), ValueError, "indptr is on meta"),
    (dict(page_size=1 << 31), ValueError, r"page_size=2147483648 is above 2\^31 - 1"),
    (dict(page_size=1 << 30, last_page_len=torch.tensor([1 << 30, 1], dtype=torch.int32)), ValueError,
     "request 0 holds 2147483648 KV tokens"),  # (int32 lengths would wrap to negative)
    (dict(head_dim_vo=32.0), ValueError, "head_dim_vo=32.0"),
    (dict(head_dim_vo=0), ValueError, "head_dim_vo=0"),
    (dict(sm_scale="x"), TypeError, "sm_scale='x' must be a float in"),
    (dict(sm_scale=True), TypeError, "sm_scale=True"),
    (dict(logits_soft_cap=2.4e38), ValueError, "logits_soft_cap=2.4e\\+38"),  # (x log2 e: inf in float32)
    (dict(sm_scale=1e-40), ValueError, "sm_scale=1e-40 must be a float in \\[1e-30, 1e30\\]"),
    (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap=1e\\+39 must be None or a float in \\[0, 1e30\\]"),
    (dict(rope_theta=[1e4]), TypeError, r"rope_theta=\[10000.0\]"),
])
def test_decode_plan_rejects(kw, err, match):
    with pytest.raises(err, match=match):
        decode_wrapper(**kw)


def test_decode_plan_accepts_empty_requests():
    w = decode_wrapper(indptr=torch.tensor([0, 0, 5], dtype=torch.int32),
                       last_page_len=torch.tensor([0, 8], dtype=torch.int32))
    o, lse = w.run(Q, cache(), return_lse=True)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()


def test_mla_plans_queries_beyond_their_keys_as_empty_rows():
    """A request with queries but no KV, and one with more queries than keys (non-causal and
    causal): rows that see no key give 0 and lse -inf, as in the prefill wrappers."""
    m = fi.BatchMLAPagedAttentionWrapper(WS)
    for causal in (False, True):
        m.plan(torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32),
               torch.tensor([0], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 4, 64, 32, 8, causal,
               0.1, torch.float16, torch.float16)
        out, lse = m.run(torch.randn(5, 4, 64).half(), torch.randn(5, 4, 32).half(), torch.randn(1, 8, 64).half(),
                         torch.randn(1, 8, 32).half(), return_lse=True)
        empty = [0, 1, 2] if causal else [0, 1]  # causal: request 1's first query sits before both keys
        assert not out[empty].any() and torch.isneginf(lse[empty]).all()
        assert torch.isfinite(lse[3:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("make_args, err, match", [
    (lambda: (Q.float(), cache()), TypeError, "q.dtype=float32"),
    (lambda: (Q[:1], cache()), ValueError, r"q has shape \[1, 4, 32\]"),
    (lambda: (Q, cache(pages=4)), ValueError, "reference page 4, but paged_kv_cache has only 4 pages"),
    (lambda: (Q, cache().transpose(2, 3)), ValueError, "HND layout"),
    (lambda: (Q, cache()[:, :, :, :, :16]), ValueError, "paged_kv_cache"),
    (lambda: (Q, cache()[:, 0]), ValueError, "5-D"),
    (lambda: (Q, cache(dtype=torch.bfloat16)), TypeError, "kv_data_type"),
    (lambda: (Q, (cache()[:, 0], cache()[:, 1, :3])), ValueError, "differ"),
    (lambda: (Q.to("meta"), cache()), ValueError, "planned device"),
])
def test_decode_run_rejects(make_args, err, match):
    w = decode_wrapper()
    q, kv = make_args()
    with pytest.raises(err, match=match):
        w.run(q, kv)


@pytest.mark.parametrize("kw, err, match", [
    (dict(out=torch.empty(2, 4, 16).half()), ValueError, r"out has shape \[2, 4, 16\]"),
    (dict(out=torch.empty(2, 4, 32)), TypeError, "out.dtype=float32"),
    (dict(lse=torch.empty(2, 4).half(), return_lse=True), TypeError, "lse.dtype=float16"),
    (dict(lse=torch.empty(2, 3), return_lse=True), ValueError, r"lse has shape \[2, 3\]"),
    (dict(out=torch.empty(2, 4, 32, device="meta").half()), ValueError, "out is on meta"),
    (dict(q_scale=torch.ones(2)), ValueError, "q_scale must hold one element"),
    (dict(k_scale="1.0"), TypeError, "k_scale"),
    (dict(k_scale=float("nan")), ValueError, "k_scale=nan must be a float in \\[-1e30, 1e30\\]"),
    (dict(v_scale=1e300), ValueError, "v_scale=1e\\+300"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req"),
    (dict(out=torch.empty(1, 4, 32).half().expand(2, 4, 32)), ValueError, "out has elements that share memory"),
    (dict(lse=torch.empty(1, 4).expand(2, 4), return_lse=True), ValueError, "lse has elements that share memory"),
])
def test_decode_run_rejects_outputs_and_scales(kw, err, match):
    w = decode_wrapper()
    q = Q if kw.get("q_len_per_req", 1) in (0, 1) else Q.repeat(kw["q_len_per_req"], 1, 1)
    with pytest.raises(err, match=match):
        w.run(q, cache(), **kw)


def test_run_before_plan_and_extra_args():
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    with pytest.raises(ValueError, match="before plan"):
        w.run(Q, cache())
    with pytest.raises(TypeError, match="extra positional"):
        decode_wrapper().run(Q, cache(), 1.0)
    p = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    with pytest.raises(ValueError, match="before plan"):
        p.run(Q, Q, Q)


def test_fa2_decode_names_the_tensor_without_a_contiguous_head_dim():
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend="fa2")
    w.plan(INDPTR, INDICES, LAST, 4, 2, 64, 8, q_data_type=torch.float16)
    kv = torch.randn(6, 2, 8, 2, 64).half()
    with pytest.raises(ValueError, match=r"contiguous head_dim \(last stride 1\): out \(stride \(512, 128, 2\)\) not"):
        w.run(torch.randn(2, 4, 64).half(), kv, out=torch.empty(2, 4, 128).half()[..., ::2])


def test_run_after_a_failed_plan_is_refused_until_a_plan_succeeds():
    """A plan() refused by its argument checks must not leave run() on the last plan's tables."""
    w = decode_wrapper()
    with pytest.raises(ValueError, match=r"last_page_len\[0\]=0"):
        w.plan(INDPTR, INDICES, torch.tensor([0, 8], dtype=torch.int32), 4, 2, 32, 8, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=r"refused until a plan\(\) succeeds: .*last_page_len\[0\]=0"):
        w.run(Q, cache())
    w.plan(INDPTR, INDICES, LAST, 4, 2, 32, 8, q_data_type=torch.float16)
    assert w.run(Q, cache()).shape == (2, 4, 32)
    qo, kv = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    p = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    p.plan(qo, kv, 4, 2, 32)
    with pytest.raises(ValueError, match="num_qo_heads=3"):
        p.plan(qo, kv, 3, 2, 32)
    with pytest.raises(ValueError, match="refused until a plan"):
        p.run(torch.randn(7, 4, 32).half(), torch.randn(9, 2, 32).half(), torch.randn(9, 2, 32).half())


def test_constructor_rejects():
    with pytest.raises(ValueError, match="kv_layout='NDH'"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NDH")
    with pytest.raises(ValueError, match="backend='fa9'"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="fa9")
    with pytest.raises(fi.Unsupported, match="jit_args"):
        fi.BatchPrefillWithPagedKVCacheWrapper(WS, jit_args=[1])
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(None)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS, use_cuda_graph=True)
    for sizes in ((0, 8, 0), (4, 8, 2)):
        with pytest.raises(ValueError, match="fix the batch size: batch_size \\+ 1 and batch_size entries"):
            fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *(torch.zeros(n, dtype=torch.int32) for n in sizes))


def test_cuda_graph_buffers_checked():
    bufs = [torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int32), torch.empty(2, dtype=torch.int32)]
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs)
    with pytest.raises(ValueError, match="paged_kv_indices_buffer holds 3 entries"):
        w.plan(INDPTR, INDICES, LAST, 4, 2, 32, 8, data_type=torch.float16)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, bufs[0], torch.empty(8, dtype=torch.int32), bufs[2])
    with pytest.raises(ValueError, match="fixes batch_size=2"):
        w.plan(torch.tensor([0, 5], dtype=torch.int32), INDICES, LAST[:1], 4, 2, 32, 8)
    w.plan(INDPTR, INDICES, LAST, 4, 2, 32, 8, data_type=torch.float16)
    assert torch.equal(bufs[0], INDPTR) and w.run(Q, cache()).shape == (2, 4, 32)


def test_prefill_plan_rejects():
    qo = torch.tensor([0, 3, 7], dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    base = (qo, INDPTR, INDICES, LAST, 4, 2, 32, 8)
    with pytest.raises(ValueError, match="qo_indptr has 2 entries"):
        w.plan(qo[:2], *base[1:])
    with pytest.raises(ValueError, match=r"custom_mask has shape \[3\], expected the flattened masks"):
        w.plan(*base, custom_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(fi.Unsupported, match="prefix_len_ptr"):
        w.plan(*base, prefix_len_ptr=torch.zeros(2, dtype=torch.int32))
    w.plan(*base, causal=True)
    with pytest.raises(ValueError, match=r"q has shape \[6, 4, 32\]"):
        w.run(torch.randn(6, 4, 32).half(), cache())
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    r.plan(qo, torch.tensor([0, 3, 9], dtype=torch.int32), 4, 2, 32, causal=True)
    with pytest.raises(ValueError, match=r"k has shape \[8, 2, 32\]"):
        r.run(torch.randn(7, 4, 32).half(), torch.randn(8, 2, 32).half(), torch.randn(9, 2, 32).half())
    kv = torch.randn(9, 2, 32).half()
    with pytest.raises(ValueError, match="o_scale=nan must be a float in"):
        r.run(torch.randn(7, 4, 32).half(), kv, kv, o_scale=float("nan"))
    with pytest.raises(TypeError, match="v_scale='2'"):
        r.run(torch.randn(7, 4, 32).half(), kv, kv, v_scale="2", o_scale=0.5)


def test_requested_backend_that_cannot_run_lists_reasons():
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, backend="cudnn")
    with pytest.raises(fi.Unsupported) as e:
        w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 4, 2, 32,
               logits_soft_cap=30.0)
    assert "cudnn" in str(e.value) and "soft_cap" in str(e.value)


def test_cudnn_entry_points_validate_before_selection():
    q = torch.randn(2, 8, 64).half()
    hnd = torch.randn(10, 2, 16, 64).half()
    nhd = hnd.transpose(1, 2).contiguous()
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32).view(2, 1, 1, 1)
    with pytest.raises(ValueError, match="cuDNN expects HND"):
        fi.cudnn_batch_decode_with_kv_cache(q, nhd, nhd, 0.1, WS, max_sequence_kv=48, actual_seq_lens_kv=lens,
                                            block_tables=tables)
    with pytest.raises(fi.Unsupported, match="batch_offsets"):
        fi.cudnn_batch_decode_with_kv_cache(q, hnd, hnd, 0.1, WS, max_sequence_kv=48, actual_seq_lens_kv=lens,
                                            block_tables=tables, batch_offsets_q=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(fi.Unsupported, match="cudnn"):  # valid input, but no cuDNN on this machine
        fi.cudnn_batch_decode_with_kv_cache(q, hnd, hnd, 0.1, WS, max_sequence_kv=48, actual_seq_lens_kv=lens,
                                            block_tables=tables)


def test_xqa_checks_its_caches_and_names_its_scalars():
    k = torch.randn(8, 16, 2, 64).half()
    out = torch.zeros(2, 1, 4, 64).half()
    args = (torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([[20], [40]], dtype=torch.int32), out, WS,
            None, 2, 16)
    q = torch.randn(2, 1, 4, 64).half()
    with pytest.raises(ValueError, match=r"v_cache has shape \[4, 16, 2, 64\], expected \[8, 16, 2, \*\]"):
        fi.xqa(q, k, k[:4].clone(), *args)
    for kw, match in ((dict(q_scale=-1.0), "q_scale=-1.0 must be a float in"),
                      (dict(kv_scale="1"), "kv_scale='1'"), (dict(rcp_out_scale=float("inf")), "rcp_out_scale=inf"),
                      (dict(sliding_win_size=1.5), "sliding_win_size=1.5 must be an int")):
        with pytest.raises((ValueError, TypeError), match=match):
            fi.xqa(q, k, k, *args, **kw)
    with pytest.raises(TypeError, match="page_table must be a torch.Tensor, got list"):
        fi.xqa(q, k, k, args[0].tolist(), *args[1:])
    fi.xqa(q, k, k, *args, q_scale=torch.tensor([0.5]), rcp_out_scale=2.0)  # tensor scales: read by the kernels
    assert out.abs().sum() > 0


def test_trtllm_rejects():
    q = torch.randn(2, 8, 64).half()
    kv = torch.randn(10, 2, 2, 16, 64).half()
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(fi.Unsupported, match="nvfp4"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables, torch.tensor([3, 4]), 32, out_dtype="nvfp4")
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=40 needs 3 pages"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables, torch.tensor([3, 40]), 64)
    with pytest.raises(ValueError, match="kv_layout='XYZ'"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables, torch.tensor([3, 4]), 32, kv_layout="XYZ")
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor, got list"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables.tolist(), torch.tensor([3, 4]), 32)
    with pytest.raises(ValueError, match="block_tables must have 2 dimensions"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables[0], torch.tensor([3, 4]), 32)
    cum_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    for args, match in (((0, 32, 1.0, 1.0, 2, cum_q, None), "max_q_len=0"),
                        ((1, 32.0, 1.0, 1.0, 2, cum_q, None), "max_kv_len=32.0"),
                        ((1, 32, 1.0, 1.0, 2, cum_q, cum_q[:2]), r"cum_seq_lens_kv has shape \[2\]")):
        with pytest.raises((ValueError, TypeError), match=match):
            fi.trtllm_batch_context_with_kv_cache(q, kv, WS, tables, torch.tensor([3, 4], dtype=torch.int32), *args)


def test_mla_rejects():
    w = fi.BatchMLAPagedAttentionWrapper(WS)
    qo = torch.arange(3, dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    kv_indices = torch.tensor([0, 2, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_len_arr\[0\]=40 does not fit"):
        w.plan(qo, kv_indptr, kv_indices, torch.tensor([40, 5], dtype=torch.int32), 4, 64, 16, 16, False, 0.1,
               torch.float16, torch.float16)
    with pytest.raises(fi.Unsupported, match="use_profiler"):
        w.plan(qo, kv_indptr, kv_indices, torch.tensor([20, 5], dtype=torch.int32), 4, 64, 16, 16, False, 0.1,
               torch.float16, torch.float16, use_profiler=True)
    w.plan(qo, kv_indptr, kv_indices, torch.tensor([20, 5], dtype=torch.int32), 4, 64, 16, 16, False, 0.1,
           torch.float16, torch.float16)
    q_nope, q_pe = torch.randn(2, 4, 64).half(), torch.randn(2, 4, 16).half()
    with pytest.raises(ValueError, match="only 2 pages"):
        w.run(q_nope, q_pe, torch.randn(2, 16, 64).half(), torch.randn(2, 16, 16).half())
    with pytest.raises(ValueError, match="kpe_cache"):
        w.run(q_nope, q_pe, torch.randn(3, 16, 64).half(), torch.randn(3, 16, 8).half())


def test_cascade_and_packbits_reject():
    v = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"s_b has shape \[3, 3\]"):
        fi.merge_state(v, torch.randn(3, 2), v, torch.randn(3, 3))
    with pytest.raises(TypeError, match="s_a.dtype=float16"):
        fi.merge_state(v, torch.randn(3, 2).half(), v, torch.randn(3, 2))
    with pytest.raises(TypeError, match="s.dtype=float16"):  # merge_state_in_place's own names
        fi.merge_state_in_place(v, torch.randn(3, 2).half(), v, torch.randn(3, 2))
    shared = torch.randn(1, 2, 8).expand(3, 2, 8)
    with pytest.raises(ValueError, match="v has elements that share memory"):
        fi.merge_state_in_place(shared, torch.randn(3, 2), v, torch.randn(3, 2))
    with pytest.raises(ValueError, match="num_heads and head_dim must be at least 1"):
        fi.merge_states(torch.randn(3, 2, 2, 0), torch.randn(3, 2, 2))
    out, lse = fi.merge_states(torch.randn(3, 0, 2, 8), torch.randn(3, 0, 2))  # no state: the empty one
    assert not out.any() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="bitorder='middle'"):
        fi.packbits(torch.ones(3, dtype=torch.bool), "middle")


def test_block_table_and_single_decode_arguments():
    tables = torch.tensor([[4, 0], [1, 3]], dtype=torch.int32)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS)
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        w.plan(None, None, None, 4, 2, 32, 8, block_tables=tables, seq_lens=[5, 8])
    with pytest.raises(ValueError, match="seq_lens holds a length 2147483653 above 2"):
        w.plan(None, None, None, 4, 2, 32, 8, block_tables=tables, seq_lens=torch.tensor([5, (1 << 31) + 5]))
    with pytest.raises(TypeError, match="seq_lens.dtype=float32"):
        w.plan(None, None, None, 4, 2, 32, 8, block_tables=tables, seq_lens=torch.tensor([5.7, 8.2]))
    w.plan(None, None, None, 4, 2, 32, 8, block_tables=tables.to(torch.uint32), seq_lens=torch.tensor([5, 16]),
           q_data_type=torch.float16)  # FlashInfer documents uint32 tables
    ref = fi.BatchDecodeWithPagedKVCacheWrapper(WS)
    ref.plan(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([4, 1, 3], dtype=torch.int32),
             torch.tensor([5, 8], dtype=torch.int32), 4, 2, 32, 8, q_data_type=torch.float16)
    kv = cache()
    assert torch.equal(w.run(Q, kv), ref.run(Q, kv))
    with pytest.raises(ValueError, match=r"differ in head_dim \(32 != 64\)"):
        fi.single_decode_with_kv_cache(torch.randn(4, 32).half(), torch.randn(20, 2, 64).half(),
                                       torch.randn(20, 2, 64).half())
    with pytest.raises(ValueError, match="float_workspace_buffer must be contiguous"):
        fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 12, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="int_workspace_buffer must be contiguous"):
        w.reset_workspace_buffer(WS, torch.empty(1 << 12, dtype=torch.uint8)[::2])


def test_append_checks_shapes_and_keeps_bad_indices_inside_the_cache():
    cache = torch.zeros(4, 2, 8, 2, 32)
    key, val = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    tables = (torch.tensor([3, 0, 1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32))
    args = (torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([0, 9, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"append_key has shape \[3, 1, 32\], expected \[\*, 2, 32\]"):
        fi.append_paged_kv_cache(key[:, :1], val[:, :1], *args, cache, *tables, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"positions has shape \[2\], expected \[3\]"):
        fi.append_paged_kv_cache(key, val, args[0], args[1][:2], cache, *tables, torch.tensor([2, 3]))
    bad = (torch.tensor([-1, 7, 1], dtype=torch.int32), torch.tensor([-5, 900, 2], dtype=torch.int32))
    fi.append_paged_kv_cache(key, val, *bad, cache, torch.tensor([3, 0, 99], dtype=torch.int32), tables[1],
                             torch.tensor([2, 3]))  # clamped: written inside the cache, no IndexError
    assert cache.abs().sum() > 0


def test_graph_mode_mask_needs_its_fixed_buffers():
    qo = torch.tensor([0, 3, 7], dtype=torch.int32)
    kv = torch.tensor([0, 5, 9], dtype=torch.int32)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, use_cuda_graph=True,
                                                qo_indptr_buf=torch.zeros(3, dtype=torch.int32),
                                                kv_indptr_buf=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="custom_mask_buf and mask_indptr_buf"):
        w.plan(qo, kv, 4, 2, 32, custom_mask=torch.ones(3 * 5 + 4 * 4, dtype=torch.bool))


def test_block_tables_with_negative_pages_are_rejected():
    q = torch.randn(2, 8, 64).half()
    kv = torch.randn(10, 2, 2, 16, 64).half()
    tables = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="negative page index -1"):
        fi.trtllm_batch_decode_with_kv_cache(q, kv, WS, tables, torch.tensor([20, 4]), 32)
    with pytest.raises(ValueError, match="page_size=0"):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(WS)
        w.plan(None, None, None, 8, 2, 64, 0, block_tables=tables, seq_lens=torch.tensor([20, 4]))


def test_graph_buffers_must_be_on_the_wrapper_device():
    meta = [torch.zeros(3, dtype=torch.int32, device="meta"), torch.zeros(3, dtype=torch.int32)]
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, use_cuda_graph=True, qo_indptr_buf=meta[0], kv_indptr_buf=meta[1])
    with pytest.raises(ValueError, match="qo_indptr_buf is on meta"):
        w.plan(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32), 4, 2, 32)


def test_prefill_errors_name_the_prefill_arguments():
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    qo = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[1\]=9"):
        w.plan(qo, INDPTR, INDICES, torch.tensor([3, 9], dtype=torch.int32), 4, 2, 32, 8)
    with pytest.raises(ValueError, match="paged_kv_indices has 3 entries, but paged_kv_indptr"):
        w.plan(qo, INDPTR, INDICES[:3], LAST, 4, 2, 32, 8)


def test_a_refused_graph_plan_leaves_every_fixed_buffer_as_it_was():
    """All buffers are checked before any is written: a captured graph never replays one new table
    beside another's old counts (the indptr of 8 pages against an indices buffer of 6)."""
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(6, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs)
    w.plan(INDPTR, INDICES, LAST, 4, 2, 32, 8, data_type=torch.float16)
    before = [b.clone() for b in bufs]
    with pytest.raises(ValueError, match="paged_kv_indices_buffer holds 6 entries, but this plan needs 8"):
        w.plan(torch.tensor([0, 4, 8], dtype=torch.int32), torch.arange(8, dtype=torch.int32), LAST, 4, 2, 32, 8,
               data_type=torch.float16)
    assert all(torch.equal(b, o) for b, o in zip(bufs, before))

    qo, kv = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    tables = [torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)]
    small_mask = [torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32)]
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, use_cuda_graph=True, qo_indptr_buf=tables[0],
                                                kv_indptr_buf=tables[1], custom_mask_buf=small_mask[0],
                                                mask_indptr_buf=small_mask[1])
    with pytest.raises(ValueError, match="custom_mask_buf holds 2 entries"):
        w.plan(qo, kv, 4, 2, 32, custom_mask=torch.ones(3 * 5 + 4 * 4, dtype=torch.bool))
    assert not any(t.any() for t in tables + small_mask)

    paged = [torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
             torch.zeros(2, dtype=torch.int32)]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, use_cuda_graph=True, qo_indptr_buf=paged[0],
                                               paged_kv_indptr_buf=paged[1], paged_kv_indices_buf=paged[2],
                                               paged_kv_last_page_len_buf=paged[3], custom_mask_buf=small_mask[0],
                                               mask_indptr_buf=small_mask[1])
    lens = (LAST + 8 * (INDPTR[1:] - INDPTR[:-1] - 1)).tolist()  # 11 and 32 tokens
    with pytest.raises(ValueError, match="custom_mask_buf holds 2 entries"):
        w.plan(qo, INDPTR, INDICES, LAST, 4, 2, 32, 8, custom_mask=torch.ones(3 * lens[0] + 4 * lens[1],
                                                                                dtype=torch.bool))
    assert not any(t.any() for t in paged + small_mask)

    mla_bufs = dict(qo_indptr=torch.zeros(3, dtype=torch.int32), kv_indptr=torch.zeros(3, dtype=torch.int32),
                    kv_indices=torch.zeros(8, dtype=torch.int32), kv_len_arr=torch.zeros(2, dtype=torch.int32))
    m = fi.BatchMLAPagedAttentionWrapper(WS, use_cuda_graph=True, **mla_bufs)
    with pytest.raises(ValueError, match="sm_scale=nan"):
        m.plan(torch.tensor([0, 1, 2], dtype=torch.int32), INDPTR, INDICES, torch.tensor([11, 20], dtype=torch.int32),
               4, 64, 32, 8, False, float("nan"), torch.float16, torch.float16)
    assert not any(t.any() for t in mla_bufs.values())


def test_reference_plans_claims_of_more_keys_than_the_cache_without_indexing_them():
    """A huge claimed page_size: the reference's plan() indexes no key (run() does, once it has
    checked the cache), so 2^25 claimed tokens cost nothing until run() refuses the cache."""
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend="reference")
    big = 1 << 25
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([big], dtype=torch.int32), 4, 2, 32, big, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=f"expected \\[\\*, {big}, 2, 32\\]"):
        w.run(torch.randn(1, 4, 32).half(), torch.randn(1, 2, 16, 2, 32).half())


def test_single_prefill_mask_must_be_a_tensor():
    q, k = torch.randn(5, 4, 32).half(), torch.randn(7, 2, 32).half()
    with pytest.raises(TypeError, match="custom_mask must be a torch.Tensor, got list"):
        fi.single_prefill_with_kv_cache(q, k, k, custom_mask=[[True] * 7] * 5)
