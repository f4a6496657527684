"""Bad values of the prefill, MLA and page entry points get a ValueError/TypeError naming the
argument, before anything runs (DESIGN.md, Reliability); and a plan of absurd lengths costs no
memory in proportion to them. The cases come from the session-54 audit."""
import resource

import pytest
import torch

import flashdispatch as fi

WS = torch.empty(1 << 20, dtype=torch.uint8)
I32 = dict(dtype=torch.int32)
Q = torch.randn(4, 4, 64).half()
K = torch.randn(6, 4, 64).half()


def _mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))


@pytest.mark.parametrize("kv_len, causal", [(5, False), (2 ** 31 - 1, True)])
def test_reference_plan_holds_no_memory_per_query_row(kv_len, causal):
    """qo_indptr = [0, 2^31 - 1] used to build the whole batch's row blocks (and their masks) in
    plan(), about 90 GB with 5 keys; the rows are now cut at run time, after run() has checked q
    against the plan. (An address-space limit of 8 GB above what is mapped keeps a regression
    from taking the machine's memory.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + (8 << 30), hard))
    try:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, backend="reference")
        w.plan(torch.tensor([0, 2 ** 31 - 1], **I32), torch.tensor([0, kv_len], **I32), 4, 4, 64, causal=causal,
               q_data_type=torch.float16)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    with pytest.raises(ValueError, match=r"q has shape \[4, 4, 64\], expected \[2147483647, 4, 64\]"):
        w.run(Q, K, K)


@pytest.mark.parametrize("mask, err, match", [
    (torch.ones(4, 6, dtype=torch.bool, device="meta"), ValueError, "custom_mask is on the meta device"),
    (torch.ones(6, 4, dtype=torch.bool), ValueError,
     r"custom_mask has shape \[6, 4\], expected \[qo_len, kv_len\] = \[4, 6\] or flattened"),
    (torch.ones(2, 12, dtype=torch.bool), ValueError, r"custom_mask has shape \[2, 12\]"),
    (torch.zeros(4, 6), TypeError, "custom_mask.dtype=float32 is not accepted; expected bool"),  # (an additive mask?)
])
def test_single_prefill_mask_shape_dtype_device(mask, err, match):
    with pytest.raises(err, match=match):
        fi.single_prefill_with_kv_cache(Q, K, K, custom_mask=mask)


def test_single_prefill_takes_2d_and_flat_masks_alike():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 4, 32), torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    o2 = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    o1 = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.flatten())
    assert torch.equal(o1, o2) and not torch.equal(o2, fi.single_prefill_with_kv_cache(q, k, v))


def test_batch_mask_must_be_flat():
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    qo, kv = torch.tensor([0, 2, 5], **I32), torch.tensor([0, 3, 7], **I32)
    with pytest.raises(ValueError, match=r"custom_mask has shape \[2, 9\], expected the flattened masks .* = \[18\]"):
        w.plan(qo, kv, 4, 2, 32, custom_mask=torch.ones(2, 9, dtype=torch.bool))


def test_ragged_plan_checks_v_and_o_indptr():
    qo, kv = torch.tensor([0, 2, 5], **I32), torch.tensor([0, 3, 7], **I32)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    with pytest.raises(TypeError, match="o_indptr must be a torch.Tensor, got list"):
        w.plan(qo, kv, 4, 2, 32, o_indptr=[0, 2, 5])
    with pytest.raises(TypeError, match="v_indptr.dtype=int64 is not accepted"):
        w.plan(qo, kv, 4, 2, 32, v_indptr=kv.long())
    w.plan(qo, kv, 4, 2, 32, o_indptr=qo.clone(), v_indptr=kv.clone())  # equal offsets: accepted


def test_cudnn_prefill_dispatch_checks_v_cache_and_kv_maximum():
    q, k = torch.randn(7, 4, 64).half(), torch.randn(30, 2, 64).half()
    args = dict(max_token_per_sequence=16, max_sequence_kv=32, actual_seq_lens_q=torch.tensor([3, 4], **I32),
                causal=False, return_lse=False, backend="reference")
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor, got NoneType"):
        fi.cudnn_batch_prefill_with_kv_cache(q, k, None, 0.1, WS, actual_seq_lens_kv=torch.tensor([20, 10], **I32),
                                             **args)
    with pytest.raises(ValueError, match="actual_seq_lens_kv holds 33 > max_sequence_kv=32"):
        fi.cudnn_batch_prefill_with_kv_cache(q, k, k, 0.1, WS, actual_seq_lens_kv=torch.tensor([33, 10], **I32),
                                             **args)


def test_trtllm_context_checks_max_q_len():
    q, cache = torch.randn(14, 4, 32), torch.randn(5, 2, 4, 8, 32)
    tables, seq = torch.tensor([[2, 0, 4], [1, 3, 3]], **I32), torch.tensor([20, 9], **I32)
    with pytest.raises(ValueError, match="cum_seq_lens_q holds a request of 9 query tokens, above max_q_len=8"):
        fi.trtllm_batch_context_with_kv_cache(q, cache, WS, tables, seq, 8, 20, 0.2, 1.0, 2,
                                              torch.tensor([0, 5, 14], **I32), None)


MLA_Q = torch.randn(2, 1, 4, 80).half()
MLA_KV = torch.randn(6, 8, 80).half()
MLA_TABLES = torch.tensor([[0, 1, 2], [3, 4, 5]], **I32)


@pytest.mark.parametrize("kw, err, match", [
    (dict(query=torch.randn(2, 1, 0, 80).half()), ValueError, "the query's head count=0 must be a positive int"),
    (dict(out=torch.empty(2, 1, 4, 65).half()), ValueError, r"out has shape \[2, 1, 4, 65\], expected \[2, 1, 4, 64\]"),
    (dict(out=torch.empty(2, 4, 64).half()), ValueError, r"out has shape \[2, 4, 64\], expected \[2, 1, 4, 64\]"),
    (dict(lse=torch.empty(3), return_lse=True), ValueError, r"lse has shape \[3\], expected \[2, 1, 4\]"),
    (dict(max_seq_len=1.5), ValueError, "max_seq_len=1.5 must be a positive int"),
    (dict(bmm2_scale=1j), TypeError, "bmm2_scale=1j must be a float"),
    (dict(bmm2_scale=torch.ones(2)), ValueError, "bmm2_scale must hold one element"),
    (dict(kv_lora_rank=64.0), ValueError, "kv_lora_rank=64.0 must be a positive int"),
    (dict(kv_lora_rank=-8, qk_rope_head_dim=88), ValueError, "kv_lora_rank=-8 must be a positive int"),
    (dict(qk_rope_head_dim=None), ValueError, "qk_rope_head_dim=None must be a positive int"),
])
def test_trtllm_mla_values(kw, err, match):
    args = dict(query=MLA_Q, kv_cache=MLA_KV, workspace_buffer=WS, qk_nope_head_dim=128, kv_lora_rank=64,
                qk_rope_head_dim=16, block_tables=MLA_TABLES, seq_lens=torch.tensor([20, 7], **I32), max_seq_len=24)
    args.update(kw)
    with pytest.raises(err, match=match):
        fi.trtllm_batch_decode_with_kv_cache_mla(**args)


def test_append_refuses_non_float_keys_and_expanded_caches():
    k = torch.randn(3, 2, 16)
    tables = dict(batch_indices=torch.tensor([0, 0, 1], **I32), positions=torch.tensor([0, 1, 0], **I32),
                  kv_indices=torch.tensor([0, 1], **I32), kv_indptr=torch.tensor([0, 1, 2], **I32),
                  kv_last_page_len=torch.tensor([2, 1], **I32))
    cache = torch.zeros(4, 2, 8, 2, 16, dtype=torch.float16)
    for bad in (k.to(torch.complex64), k.int()):
        with pytest.raises(TypeError, match="append_key.dtype=.* is not accepted; expected a floating dtype"):
            fi.append_paged_kv_cache(bad, k, paged_kv_cache=cache, **tables)
    expanded = torch.zeros(1, 8, 2, 16, dtype=torch.float16).expand(4, -1, -1, -1)
    with pytest.raises(ValueError, match=r"paged_kv_cache \(k\) has elements that share memory"):
        fi.append_paged_kv_cache(k, k, paged_kv_cache=(expanded, expanded.clone()), **tables)
    fi.append_paged_kv_cache(k, k, paged_kv_cache=cache, **tables)
    assert torch.equal(cache[0, 0, :2], k[:2].half()) and torch.equal(cache[1, 1, 0], k[2].half())
