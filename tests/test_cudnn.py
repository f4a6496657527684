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
        assert code in codes(caps_reasons(problem("prefill_paged" if code == "feature.custom_mask" else "decode",
                                                  **kw))), code
    assert "op" in codes(caps_reasons(problem("mla")))


def test_lse_is_supported_for_every_op_and_grouping():
    # GQA decode lse was a Reason until the dense-row decode graph passed test_decode_with_lse on
    # the H200 (cuDNN's one-row ragged kernel wrote the lse of the first head of each group only)
    for op in ("decode", "prefill_paged", "prefill_ragged"):
        for kv_heads in (8, 32):
            assert caps_reasons(problem(op, return_lse=True, num_kv_heads=kv_heads), H200) == [], (op, kv_heads)


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
    p = graph_options(problem("prefill_paged"), H200, _params([3, 1, 1, 2, 1], [40, 0, 16, 129, 1]))
    assert (p.batch, p.max_q, p.max_pages, p.max_kv, p.paged, p.dense_rows) == (8, 4, 16, 256, True, False)
    same = graph_options(problem("prefill_paged"), H200, _params([1] * 6 + [4], [200, 3, 3, 3, 3, 3, 3]))
    assert same == p, "any batch <= 8 with <= 4 rows and <= 16 pages per request shares the graph"
    r = graph_options(problem("prefill_ragged", mask_mode="causal"), H200, _params([5, 17], [33, 0]))
    assert (r.batch, r.max_q, r.max_pages, r.max_kv, r.paged, r.causal) == (2, 32, 0, 64, False, True)
    empty = graph_options(problem("decode"), H200, _params([1], [0]))
    assert (empty.max_pages, empty.max_kv) == (1, 16)


def test_decode_graphs_have_dense_rows_and_the_exact_batch():
    """FlashInfer's decode graph: q/o/lse one dense row per request, so the batch cannot be rounded up
    (a bigger graph would read and write rows past the tensors); pages are still bucketed."""
    o = graph_options(problem("decode"), H200, _params([1] * 5, [40, 0, 16, 129, 1]))
    assert (o.batch, o.max_q, o.max_pages, o.max_kv, o.dense_rows) == (5, 1, 16, 256, True)
    other = graph_options(problem("decode"), H200, _params([1] * 7, [200, 3, 3, 3, 3, 3, 3]))
    assert (other.batch, other.max_pages) == (7, 16) and other != o
    lse = graph_options(problem("decode", return_lse=True), H200, _params([1] * 5, [40, 0, 16, 129, 1]))
    assert (lse.max_q, lse.dense_rows, lse.return_lse) == (1, True, True), "dense rows keep one query row"


def test_ragged_rows_with_gqa_lse_declare_two_query_rows():
    """cuDNN's one-row ragged kernel writes the lse of only the first head of each GQA group:
    prefill calls with at most one row per request declare two rows when that lse is wanted."""
    one_row = _params([1, 0, 1], [9, 4, 0])
    for op in ("prefill_paged", "prefill_ragged"):
        assert graph_options(problem(op, return_lse=True), H200, one_row).max_q == 2, op
        assert graph_options(problem(op, return_lse=False), H200, one_row).max_q == 1, op
        assert graph_options(problem(op, return_lse=True, num_kv_heads=32), H200, one_row).max_q == 1, op
        assert graph_options(problem(op, return_lse=True), H200, _params([3, 1], [9, 4])).max_q == 4, op


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


# --- what build_graph hands cuDNN, recorded by a stand-in for the frontend ---------------------------
class _Rec:
    """A frontend tensor: what it was declared with and what was set on it."""

    def __init__(self, **decl):
        self.decl, self.ragged, self.output = decl, None, False

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.decl["dim"] = list(dim)
        return self

    def set_stride(self, stride):
        self.decl["stride"] = list(stride)
        return self

    def set_uid(self, uid):
        self.decl["uid"] = uid
        return self

    def set_data_type(self, dt):
        self.decl["data_type"] = dt
        return self


class _FakeGraph:
    def __init__(self, **kw):
        self.kw, self.tensors, self.sdpa_kw, self.modes = kw, {}, None, None

    def tensor(self, name, **decl):
        self.tensors[name] = _Rec(name=name, **decl)
        return self.tensors[name]

    def sdpa(self, **kw):
        self.sdpa_kw = kw
        self.tensors["o"], self.tensors["stats"] = _Rec(name="o"), _Rec(name="stats")
        return self.tensors["o"], self.tensors["stats"]

    def build(self, modes):
        self.modes = modes

    def get_workspace_size(self):
        return 4096


def _fake_frontend():
    from types import SimpleNamespace as NS

    graphs_made = []

    def pygraph(**kw):
        graphs_made.append(_FakeGraph(**kw))
        return graphs_made[-1]

    ns = NS(data_type=NS(HALF="half", BFLOAT16="bf16", FLOAT="f32", INT32="i32"), pygraph=pygraph,
            diagonal_alignment=NS(BOTTOM_RIGHT="bottom_right"), heur_mode=NS(A="A", FALLBACK="FALLBACK"))
    return ns, graphs_made


def _built(monkeypatch, opts, geo):
    import sys

    from flashdispatch.backends.cudnn.graphs import build_graph

    fake, made = _fake_frontend()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    built = build_graph(opts, geo, handle="h")
    assert built.workspace_size == 4096 and made[0].modes == ["A", "FALLBACK"]
    return made[0]


def test_decode_graph_is_flashinfers_dense_layout(monkeypatch):
    """Decode q/o/lse as FlashInfer's cudnn decode graph declares them: [B, H, 1, D] with the row stride
    on both the batch and the seq axis, no ragged offsets; paged HND caches and a [B, 1, W, 1] table."""
    from flashdispatch.backends.cudnn.plan import bucket_options

    B, Hq, Hk, D, P = 3, 32, 8, 128, 16
    packed_qkv = torch.empty(B, Hq + 2 * Hk, D)            # q sliced out of a fused projection
    q, out, lse = packed_qkv[:, :Hq], torch.empty(B, Hq, D), torch.empty(B, Hq)
    cache = torch.empty(40, Hk, P, D)
    opts = bucket_options(problem("decode", return_lse=True), 0, batch=B, max_q=1, max_kv=1000)
    geo = Geometry(q.stride(), tuple(cache.shape), cache.stride(), tuple(cache.shape), cache.stride(), out.stride(),
                   lse.stride(), "HND")
    g = _built(monkeypatch, opts, geo)
    t = g.tensors
    row = (Hq + 2 * Hk) * D
    assert t["q"].decl["dim"] == [B, Hq, 1, D] and t["q"].decl["stride"] == [row, D, row, 1]
    assert t["o"].decl["dim"] == [B, Hq, 1, D] and t["o"].decl["stride"] == [Hq * D, D, Hq * D, 1]
    assert t["stats"].decl["dim"] == [B, Hq, 1, 1] and t["stats"].decl["stride"] == [Hq, 1, Hq, 1]
    assert t["o"].output and t["stats"].output and t["stats"].decl["data_type"] == "f32"
    assert all(t[n].ragged is None for n in ("q", "o", "stats")), "decode rows carry no ragged offsets"
    assert not any(name.endswith("_offsets") for name in t), "no offset tensors in a decode graph"
    assert t["k_cache"].decl["dim"] == [40, Hk, P, D] and t["k_cache"].decl["stride"] == list(cache.stride())
    assert t["table_k"].decl["dim"] == [B, 1, 64, 1] and t["table_k"].decl["stride"] == [64, 64, 1, 1]
    assert t["seq_len_q"].decl["dim"] == [B, 1, 1, 1] and t["seq_len_kv"].decl["dim"] == [B, 1, 1, 1]
    kw = g.sdpa_kw
    assert kw["use_padding_mask"] and kw["generate_stats"] and kw["paged_attention_max_seq_len_kv"] == 64 * P
    assert not any(k.startswith("diagonal") for k in kw), "plain decode has no mask options"
    assert t["attn_scale"].decl["is_pass_by_value"]


def test_decode_graph_nhd_cache_and_window(monkeypatch):
    from flashdispatch.backends.cudnn.plan import bucket_options

    B, H, D, P = 2, 4, 64, 8
    q, out = torch.empty(B, H, D), torch.empty(B, H, D)
    nhd = torch.empty(10, P, H, D)
    opts = bucket_options(problem("decode", num_qo_heads=H, num_kv_heads=H, head_dim_qk=D, head_dim_vo=D,
                                  page_size=P, kv_layout="NHD", window_left=5), 0, batch=B, max_q=1, max_kv=30)
    geo = Geometry(q.stride(), tuple(nhd.shape), nhd.stride(), tuple(nhd.shape), nhd.stride(), out.stride(), None,
                   "NHD")
    g = _built(monkeypatch, opts, geo)
    assert g.tensors["k_cache"].decl["dim"] == [10, H, P, D]
    assert g.tensors["k_cache"].decl["stride"] == [P * H * D, D, H * D, 1]
    assert g.sdpa_kw["diagonal_band_left_bound"] == 6 and g.sdpa_kw["diagonal_alignment"] == "bottom_right"
    assert "diagonal_band_right_bound" not in g.sdpa_kw and not g.sdpa_kw["generate_stats"]
    assert g.tensors["q"].ragged is None and "stats" not in {n for n, r in g.tensors.items() if r.output}


def test_prefill_graph_keeps_ragged_rows(monkeypatch):
    from flashdispatch.backends.cudnn.plan import bucket_options

    Hq, Hk, D = 8, 2, 64
    q, k, out, lse = torch.empty(20, Hq, D), torch.empty(30, Hk, D), torch.empty(20, Hq, D), torch.empty(20, Hq)
    opts = bucket_options(problem("prefill_ragged", num_qo_heads=Hq, num_kv_heads=Hk, head_dim_qk=D, head_dim_vo=D,
                                  mask_mode="causal"), 0, batch=3, max_q=7, max_kv=12)
    geo = Geometry(q.stride(), None, k.stride(), None, k.stride(), out.stride(), lse.stride(), "ragged")
    g = _built(monkeypatch, opts, geo)
    t = g.tensors
    assert t["q"].decl["dim"] == [4, Hq, 8, D] and t["q"].decl["stride"] == [8 * Hq * D, D, Hq * D, 1]
    assert t["stats"].decl["stride"] == [8 * Hq, 1, Hq, 1]
    for name, off in (("q", "q_offsets"), ("o", "o_offsets"), ("stats", "stats_offsets"), ("k", "k_offsets")):
        assert t[name].ragged is t[off] and t[off].decl["dim"] == [5, 1, 1, 1], name
    assert g.sdpa_kw["diagonal_band_right_bound"] == 0 and "paged_attention_k_table" not in g.sdpa_kw


def test_plan_metadata_has_no_row_offsets_for_dense_rows():
    from flashdispatch.backends.cudnn.plan import _Metadata

    dense = graph_options(problem("decode", return_lse=True), H200, _params([1] * 3, [5, 9, 1]))
    assert set(_Metadata.sizes(dense)) == {"seq_q", "seq_kv", "qo_indptr", "table"}
    assert _Metadata.sizes(dense)["table"] == 3 * dense.max_pages
    ragged = graph_options(problem("prefill_ragged"), H200, _params([2, 3], [5, 9]))
    assert {"q_off", "o_off", "lse_off", "k_off", "v_off", "kv_indptr"} <= set(_Metadata.sizes(ragged))
    assert _Metadata.size(dense) == 4 * 256 and _Metadata.size(ragged) == 9 * 256
