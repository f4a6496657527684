"""cudnn backend without a GPU: availability and its reasons, declared caps, extra checks,
bucketing, graph-cache keys and the empty-row rule."""
from __future__ import annotations

import torch

from flashdispatch.backends.base import AttentionParams
from flashdispatch.backends.cudnn import HEAD_DIMS, CudnnBackend
from flashdispatch.backends.cudnn.graphs import GraphCache, Geometry, pow2_bucket
from flashdispatch.backends.cudnn.plan import empty_rows, graph_options
from flashdispatch.dispatch.problem import Device, Problem
from flashdispatch.dispatch.registry import backend_class

H200 = Device("cuda", 0, (9, 0), "NVIDIA H200", 132)
A100 = Device("cuda", 0, (8, 0), "NVIDIA A100", 108)
T4 = Device("cuda", 0, (7, 5), "Tesla T4", 40)


def problem(op="decode", **kw):
    base = dict(op=op, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128,
                page_size=0 if op == "prefill_ragged" else 16, kv_layout="HND", return_lse=op != "decode")
    base.update(kw)
    return Problem(**base)


def codes(reasons):
    return {r.code for r in reasons}


def caps_reasons(p, device=H200):
    """Caps + extra checks, without availability (this machine has no GPU)."""
    from flashdispatch.dispatch.caps import check_caps

    reasons = check_caps(CudnnBackend.caps_for(p.op), p, device)
    return reasons or CudnnBackend.extra_checks(p, device)


def test_registered_and_unavailable_here_with_reasons():
    assert backend_class("cudnn") is CudnnBackend
    reasons = CudnnBackend.availability()
    if torch.cuda.is_available():
        return
    assert reasons, "no GPU here: cudnn must say why it cannot run"
    text = " ".join(map(str, reasons))
    assert "no CUDA device" in text or "not importable" in text


def test_version_names_frontend_and_both_cudnn_versions():
    v = CudnnBackend.version()
    if v is not None:
        assert v.startswith("cudnn-frontend ") and "torch: cuDNN" in v


def test_supported_problems_have_no_cap_reasons():
    for op in ("decode", "prefill_paged", "prefill_ragged"):
        for mask in ("none", "causal"):
            assert caps_reasons(problem(op, mask_mode=mask, window_left=31)) == [], (op, mask)
    assert caps_reasons(problem("prefill_ragged", head_dim_qk=192, head_dim_vo=128)) == []
    assert caps_reasons(problem("decode", kv_layout="NHD", page_size=1)) == []


def test_head_dims_page_sizes_dtypes():
    assert (96, 96) in HEAD_DIMS and (256, 256) in HEAD_DIMS and (192, 128) in HEAD_DIMS
    assert "head_dim" in codes(caps_reasons(problem(head_dim_qk=100, head_dim_vo=100)))
    assert "head_dim" in codes(caps_reasons(problem(head_dim_qk=264, head_dim_vo=264)))
    assert "page_size" in codes(caps_reasons(problem(page_size=12)))
    r = caps_reasons(problem(q_dtype=torch.float32, kv_dtype=torch.float32, o_dtype=torch.float32))
    assert "dtype" in codes(r) and any("fp32" in x.detail for x in r)
    assert "dtype" in codes(caps_reasons(problem(kv_dtype=torch.float8_e4m3fn)))
    mixed = caps_reasons(problem(q_dtype=torch.float16))
    assert codes(mixed) == {"dtype"} and "differ" in mixed[0].detail


def test_unsupported_features_are_reasons():
    cases = {
        "feature.soft_cap": dict(logits_soft_cap=30.0),
        "feature.alibi": dict(pos_encoding_mode="ALIBI", mask_mode="causal"),
        "feature.rope": dict(pos_encoding_mode="ROPE_LLAMA"),
        "feature.custom_mask": dict(mask_mode="custom"),
        "feature.sinks": dict(sinks=True),
        "q_len_per_req": dict(q_len_per_req=4),
    }
    for code, kw in cases.items():
        assert code in codes(caps_reasons(problem("prefill_paged" if code == "feature.custom_mask" else "decode", **kw))), code
    assert "op" in codes(caps_reasons(problem("mla")))


def test_gqa_decode_lse_is_a_reason_but_mha_and_prefill_are_not():
    assert "feature.lse" in codes(caps_reasons(problem(return_lse=True), H200))
    assert caps_reasons(problem(return_lse=True, num_kv_heads=32), H200) == []
    assert caps_reasons(problem("prefill_paged", return_lse=True), H200) == []


def test_architecture_limits():
    assert "compute_capability" in codes(caps_reasons(problem(), T4))
    assert caps_reasons(problem(head_dim_qk=256, head_dim_vo=256), H200) == []
    assert "head_dim" in codes(caps_reasons(problem(head_dim_qk=256, head_dim_vo=256), A100))
    assert caps_reasons(problem("prefill_paged", head_dim_qk=256, head_dim_vo=256), A100) == []
    assert "head_dim" in codes(caps_reasons(problem("prefill_ragged", head_dim_qk=192, head_dim_vo=128), A100))


def test_pow2_bucket():
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 64, 65)] == [1, 1, 2, 4, 4, 8, 32, 64, 128]


def _params(qo_lens, kv_lens, page_size=16):
    qo = [0]
    for n in qo_lens:
        qo.append(qo[-1] + n)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return AttentionParams(qo_indptr=i32(qo), kv_indptr=i32([0] * (len(kv_lens) + 1)), kv_lens=i32(kv_lens),
                           qo_lens_host=list(qo_lens), kv_lens_host=list(kv_lens), sm_scale=0.1)


def test_graph_options_bucket_batch_pages_and_rows():
    o = graph_options(problem("decode"), H200, _params([1] * 5, [40, 0, 16, 129, 1]))
    assert (o.batch, o.max_q, o.max_pages, o.max_kv, o.paged) == (8, 1, 16, 256, True)
    same = graph_options(problem("decode"), H200, _params([1] * 7, [200, 3, 3, 3, 3, 3, 3]))
    assert same == o, "any batch <= 8 with <= 16 pages per request shares the graph"
    r = graph_options(problem("prefill_ragged", mask_mode="causal"), H200, _params([5, 17], [33, 0]))
    assert (r.batch, r.max_q, r.max_pages, r.max_kv, r.paged, r.causal) == (2, 32, 0, 64, False, True)
    empty = graph_options(problem("decode"), H200, _params([1], [0]))
    assert (empty.max_pages, empty.max_kv) == (1, 16)


def test_graph_cache_keys_and_lru():
    o1 = graph_options(problem("decode"), H200, _params([1] * 3, [40, 7, 9]))
    o2 = graph_options(problem("decode", window_left=8, mask_mode="causal"), H200, _params([1] * 3, [40, 7, 9]))
    assert o1 != o2 and hash(o1) != hash(o2)
    hnd = Geometry((1024, 128, 1), (10, 8, 16, 128), (32768, 2048, 128, 1), (10, 8, 16, 128),
                   (32768, 2048, 128, 1), (1024, 128, 1), (8, 1), "HND")
    nhd = Geometry((1024, 128, 1), (10, 16, 8, 128), (32768, 1024, 128, 1), (10, 16, 8, 128),
                   (32768, 1024, 128, 1), (1024, 128, 1), (8, 1), "NHD")
    cache = GraphCache(capacity=2)
    cache.put(o1, hnd, "g1")
    cache.put(o1, nhd, "g2")
    assert cache.get(o1, hnd) == "g1" and cache.get(o1, nhd) == "g2"
    cache.get(o1, hnd)                     # hnd is now the most recent
    cache.put(o2, hnd, "g3")               # evicts (o1, nhd)
    assert cache.get(o1, nhd) is None and cache.get(o1, hnd) == "g1" and len(cache) == 2


def test_empty_rows():
    # req0: 5 queries over 3 keys (causal: rows 0,1 blind); req1: no keys; req2: no queries; req3 fine
    assert empty_rows([5, 2, 0, 3], [3, 0, 4, 9], causal=True) == [0, 1, 5, 6]
    assert empty_rows([5, 2, 0, 3], [3, 0, 4, 9], causal=False) == [5, 6]
    assert empty_rows([1, 1, 1], [0, 5, 0], causal=False) == [0, 2]


def test_plan_refuses_cpu():
    import pytest

    with pytest.raises(ValueError, match="CUDA device"):
        CudnnBackend().plan(problem(), Device("cpu"), _params([1], [4]))
