"""Bad values of the decode entry points (the plain wrapper, trtllm, xqa, merge_state) get a
ValueError/TypeError naming the argument the caller passed, before anything is launched: ints
past int64 or int32, scales whose product overflows float32, lengths that would wrap, buffers
that share memory (DESIGN.md, Reliability). The cases come from an audit of ~1,000 probes."""
import numpy as np
import pytest
import torch

import flashdispatch as fi

WS = torch.empty(1 << 20, dtype=torch.uint8)
INDPTR = torch.tensor([0, 2, 5], dtype=torch.int32)
INDICES = torch.tensor([4, 0, 1, 3, 2], dtype=torch.int32)
LAST = torch.tensor([3, 8], dtype=torch.int32)
Q = torch.randn(2, 4, 64).half()
CACHE = torch.randn(6, 2, 8, 2, 64).half()
I32 = dict(dtype=torch.int32)


def decode_wrapper(backend="auto", **plan_kw):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend=backend)
    w.plan(INDPTR, INDICES, LAST, 4, 2, 64, 8, q_data_type=torch.float16, **plan_kw)
    return w


@pytest.mark.parametrize("kw, err, match", [
    (dict(sm_scale=10 ** 400), ValueError, "sm_scale=1000.* must be a float in"),  # (float() overflows)
    (dict(logits_soft_cap=-10 ** 400), ValueError, "logits_soft_cap=-1000"),
    (dict(rope_theta=10 ** 400), ValueError, "rope_theta=1000"),
    (dict(sm_scale=np.complex128(1 + 1j)), TypeError, r"sm_scale=np.complex128\(1\+1j\)"),
    (dict(sm_scale=torch.tensor(1 + 1j)), TypeError, "sm_scale=tensor"),
    (dict(window_left=2 ** 63), ValueError, r"window_left=9223372036854775808 must be an int in \[-1, 2\^31 - 1\]"),
    (dict(backend="fa2", fixed_split_size=2 ** 60), ValueError, "fixed_split_size=1152921504606846976 is above"),
    (dict(data_type="abc"), ValueError, "data_type='abc' is not a dtype name"),
])
def test_decode_plan_values(kw, err, match):
    with pytest.raises(err, match=match):
        decode_wrapper(**kw)


@pytest.mark.parametrize("backend", ["reference", "fa2"])
def test_scores_scale_product_within_float32(backend):
    """Each scale inside [-1e30, 1e30] but the product past it: the scores would be inf, the softmax
    NaN. Refused at run() with the product named; a tensor scale's value is not read."""
    w = decode_wrapper(backend)
    with pytest.raises(ValueError, match=r"sm_scale x q_scale x k_scale = 1.25e\+39"):
        w.run(Q, CACHE, q_scale=1e20, k_scale=1e20)
    with pytest.raises(ValueError, match=r"sm_scale x q_scale x k_scale = 1e\+60"):
        decode_wrapper(backend, sm_scale=1e30).run(Q, CACHE, k_scale=1e30)
    with pytest.raises(ValueError, match=r"q_len_per_req=9223372036854775808 is above 2147483647"):
        w.run(Q, CACHE, q_len_per_req=2 ** 63)
    out = w.run(Q, CACHE, q_scale=1e10, k_scale=torch.tensor([1e20]))  # (a tensor: read by the kernels)
    assert out.shape == Q.shape


def test_before_plan_names_the_method():
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS)
    with pytest.raises(ValueError, match=r"explain\(\) called before plan\(\)"):
        w.explain()
    with pytest.raises(ValueError, match="decision called before plan"):
        w.decision


@pytest.mark.parametrize("backend", ["reference", "fa2"])
def test_graph_buffers_may_not_share_memory(backend):
    """indptr and last_page_len as views of one tensor: each plan() overwrites the other's entries
    (fa2 read the wrong lengths, the reference indexed past its cache). Refused at construction."""
    t = torch.zeros(3, **I32)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer and paged_kv_last_page_len_buffer share memory"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS, use_cuda_graph=True, backend=backend, paged_kv_indptr_buffer=t,
                                              paged_kv_indices_buffer=torch.zeros(5, **I32),
                                              paged_kv_last_page_len_buffer=t[1:])
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="paged_kv_indices_buffer and float_workspace_buffer share memory"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, backend=backend,
                                              paged_kv_indptr_buffer=torch.zeros(3, **I32),
                                              paged_kv_indices_buffer=ws[:64].view(torch.int32),
                                              paged_kv_last_page_len_buffer=torch.zeros(2, **I32))
    with pytest.raises(ValueError, match="qo_indptr_buf and kv_indptr_buf share memory"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(WS, use_cuda_graph=True, qo_indptr_buf=t, kv_indptr_buf=t)


def test_graph_wrapper_of_no_request_on_fa2():
    """A CUDA-graph wrapper of batch 0 carved no partials (the plan's tables held None)."""
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, use_cuda_graph=True, backend="fa2",
                                              paged_kv_indptr_buffer=torch.zeros(1, **I32),
                                              paged_kv_indices_buffer=torch.zeros(1, **I32),
                                              paged_kv_last_page_len_buffer=torch.zeros(0, **I32))
    w.plan(torch.zeros(1, **I32), torch.zeros(0, **I32), torch.zeros(0, **I32), 4, 2, 64, 8)
    assert w.run(torch.zeros(0, 4, 64).half(), torch.randn(3, 2, 8, 2, 64).half()).shape == (0, 4, 64)


def test_merge_state_names_its_argument():
    v, s = torch.randn(3, 2, 8).half(), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"v_a has shape \[3, 0, 8\]: num_heads and head_dim"):
        fi.merge_state(v[:, :0], s[:, :0], v[:, :0], s[:, :0])


TRT_Q = torch.randn(2, 4, 64).half()
TRT_KV = torch.randn(10, 2, 2, 16, 64).half()
TRT_TABLES = torch.tensor([[0, 1], [2, 3]], **I32)
TRT_LENS = torch.tensor([20, 4], **I32)


@pytest.mark.parametrize("kw, err, match", [
    (dict(bmm2_scale=torch.tensor([1.0]), o_scale=float("nan")), ValueError, "o_scale=nan"),
    (dict(bmm2_scale=2.0, o_scale="ab"), TypeError, "o_scale='ab'"),
    (dict(bmm2_scale="2"), TypeError, "bmm2_scale='2'"),
    (dict(bmm2_scale=1e20, o_scale=1e20), ValueError, r"bmm2_scale x o_scale = 1e\+20 x 1e\+20"),
    (dict(bmm1_scale=torch.ones(2)), ValueError, "bmm1_scale must hold one element"),
    (dict(bmm2_scale=torch.ones(2)), ValueError, "bmm2_scale must hold one element"),
    (dict(out=np.empty((2, 4, 64), np.float16)), TypeError, "out must be a torch.Tensor, got ndarray"),
    (dict(max_q_len=-3), ValueError, "max_q_len=-3 must be a positive int"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req=0 must be a positive int"),
    (dict(max_q_len=1, q_len_per_req=2, cum_seq_lens_q=torch.tensor([0, 2, 4], **I32)), ValueError,
     "a request of 2 query tokens, above max_q_len=1"),
    (dict(mask=torch.ones(2, 1, 2, dtype=torch.uint16), seq_lens=[20, 4]), TypeError,
     "seq_lens must be a torch.Tensor, got list"),
    (dict(query=torch.randn(2, 4, 32).half()), ValueError, "query has head_dim=32, but the cache's keys have 64"),
    (dict(block_tables=torch.tensor([[0, 99], [2, 3]], **I32), backend="reference"), ValueError,
     "block_tables references page 99, but the cache has only 10 pages"),
])
def test_trtllm_decode_values(kw, err, match):
    args = dict(query=TRT_Q, kv_cache=TRT_KV, workspace_buffer=WS, block_tables=TRT_TABLES, seq_lens=TRT_LENS,
                max_seq_len=32)
    args.update(kw)
    with pytest.raises(err, match=match):
        fi.trtllm_batch_decode_with_kv_cache(**args)


def test_wrapper_block_tables_named():
    tables = torch.tensor([[0, -1], [2, 3]], **I32)
    with pytest.raises(ValueError, match="block_tables holds a negative page index -1"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS).plan(None, None, None, 4, 2, 32, 8, block_tables=tables,
                                                       seq_lens=torch.tensor([10, 4], **I32))


XQA_K = torch.randn(8, 16, 2, 64).half()
XQA_TABLE = torch.arange(8, **I32).view(2, 4)


def xqa(q=None, seq_lens=None, output=None, **kw):
    q = torch.randn(2, 1, 4, 64).half() if q is None else q
    output = torch.zeros_like(q) if output is None else output
    seq_lens = torch.tensor([[20], [40]], **I32) if seq_lens is None else seq_lens
    fi.xqa(q, XQA_K, XQA_K, XQA_TABLE, seq_lens, output, WS, None, 2, 16, **kw)
    return output


@pytest.mark.parametrize("kw, err, match", [
    (dict(q=torch.randn(2, 1, 2, 4, 64).half(), q_seq_len=2.0), ValueError, "q_seq_len=2.0 must be a positive int"),
    (dict(q=torch.randn(2, 1, 2, 4, 64).half(), q_seq_len=2, seq_lens=torch.tensor([1, 40], **I32),
          mask=torch.ones(2, 2, 2, dtype=torch.uint16)), ValueError, "request 0 has 2 query tokens but only 1"),
    (dict(seq_lens=[20, 40], mask=torch.ones(2, 1, 2, dtype=torch.uint16)), TypeError,
     "seq_lens must be a torch.Tensor, got list"),
    (dict(seq_lens=torch.tensor([2 ** 32 + 20, 40])), ValueError, "seq_lens holds a length 4294967316 above"),
    (dict(seq_lens=torch.tensor([20.9, 40.9])), TypeError, "seq_lens.dtype=float32 is not accepted"),
    (dict(seq_lens=torch.tensor([True, True])), TypeError, "seq_lens.dtype=bool is not accepted"),
    (dict(output=torch.zeros(2, 1, 4, 64, **I32)), TypeError, "output.dtype=int32 is not accepted"),
    (dict(q_scale=1e20, kv_scale=1e20), ValueError, r"q_scale x kv_scale = 1e\+20 x 1e\+20"),
    (dict(kv_scale=1e20, rcp_out_scale=1e20), ValueError, r"kv_scale x rcp_out_scale"),
    (dict(q=torch.randn(2, 1, 4, 32).half()), ValueError, "query has head_dim=32, but the cache's keys have 64"),
])
def test_xqa_values(kw, err, match):
    with pytest.raises(err, match=match):
        xqa(**kw)


def test_xqa_names_its_page_table_and_runs_batch_0():
    with pytest.raises(ValueError, match="page_table references page 8, but the cache has only 8 pages"):
        fi.xqa(torch.randn(2, 1, 4, 64).half(), XQA_K, XQA_K, XQA_TABLE + 1, torch.tensor([20, 64], **I32),
               torch.zeros(2, 1, 4, 64).half(), WS, None, 2, 16)
    q = torch.zeros(0, 1, 4, 64).half()
    fi.xqa(q, XQA_K, XQA_K, torch.zeros(0, 4, **I32), torch.zeros(0, 1, **I32), torch.zeros_like(q), WS, None, 2, 16)


def test_cudnn_prefill_dispatch_refuses_negative_lengths():
    """A negative query length made the row offsets run backwards: fa2 wrote outside its output
    (the process aborted with heap corruption), the reference read garbage."""
    q, cache = torch.randn(7, 4, 64).half(), torch.randn(10, 2, 16, 64).half()
    args = dict(max_token_per_sequence=16, max_sequence_kv=32, block_tables=torch.tensor([[0, 1], [2, 3]], **I32),
                causal=False, return_lse=False, backend="reference")
    with pytest.raises(ValueError, match="actual_seq_lens_q holds a negative length -3"):
        fi.cudnn_batch_prefill_with_kv_cache(q, cache, cache, 0.1, WS, actual_seq_lens_q=torch.tensor([10, -3], **I32),
                                             actual_seq_lens_kv=torch.tensor([20, 10], **I32), **args)
    with pytest.raises(ValueError, match="actual_seq_lens_kv has 3 entries, but actual_seq_lens_q has 2"):
        fi.cudnn_batch_prefill_with_kv_cache(q, cache, cache, 0.1, WS, actual_seq_lens_q=torch.tensor([3, 4], **I32),
                                             actual_seq_lens_kv=torch.tensor([20, 10, 5], **I32), **args)


def test_complex_scale_tensors_and_huge_head_dims_refused():
    w = decode_wrapper("reference")
    with pytest.raises(TypeError, match=r"k_scale.dtype=torch.complex64: a scale tensor must be real"):
        w.run(Q, CACHE, k_scale=torch.tensor([1j], dtype=torch.complex64))
    with pytest.raises(ValueError, match="head_dim_qk=1000.* is above 2147483647"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(WS).plan(torch.tensor([0, 2], **I32), torch.tensor([0, 5], **I32),
                                                         4, 2, 10 ** 400)
    with pytest.raises(ValueError, match="head_dim=1000.* is above 2147483647"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WS).plan(INDPTR, INDICES, LAST, 4, 2, 10 ** 400, 8)


def test_page_helpers_check_their_arguments():
    indptr, last = torch.tensor([0, 2, 5], **I32), torch.tensor([3, 8], **I32)
    with pytest.raises(TypeError, match="kv_indptr must be a torch.Tensor, got ndarray"):
        fi.get_seq_lens(indptr.numpy(), last, 8)
    with pytest.raises(ValueError, match=r"kv_last_page_len has shape \[1\], expected \[2\]"):
        fi.get_seq_lens(indptr, last[:1], 8)
    for page_size in (0, 8.5, 2 ** 40):
        with pytest.raises(ValueError, match="page_size="):
            fi.get_seq_lens(indptr, last, page_size)
    assert fi.get_seq_lens(indptr, last, 8).tolist() == [11, 24]
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        fi.get_batch_indices_positions(indptr, [11, 24], 5)
    with pytest.raises(ValueError, match=r"seq_lens has shape \[1\], expected \[2\]"):
        fi.get_batch_indices_positions(indptr, torch.tensor([11], **I32), 5)
    with pytest.raises(ValueError, match="nnz=-1 must be an int in"):
        fi.get_batch_indices_positions(indptr, torch.tensor([11, 24], **I32), -1)
