"""cudnn's one-request prefill graph without a GPU: when a plan gets it (`plan.single_options`)
and what `build_graph` hands the frontend for it (dense exact-length tensors, no offsets,
lengths or padding mask; top-left causal when qo_len == kv_len)."""
from __future__ import annotations

import sys

import torch

from flashdispatch.backends.cudnn.graphs import Geometry, build_graph
from flashdispatch.backends.cudnn.plan import bucket_options, single_options
from tests.test_cudnn import _fake_frontend, problem


def _single(q_lens, kv_lens, **kw):
    return single_options(problem("prefill_ragged", **kw), 0, q_lens, kv_lens)


def test_one_request_gets_the_exact_dense_graph():
    o = _single([4096], [4096], mask_mode="causal")
    assert (o.single, o.batch, o.max_q, o.max_kv, o.paged, o.dense_rows) == (True, 1, 4096, 4096, False, False)
    odd = _single([3000], [5000], mask_mode="causal")
    assert (odd.max_q, odd.max_kv) == (3000, 5000), "exact lengths, not power-of-two buckets"
    assert _single([3001], [5000], mask_mode="causal") != odd, "one graph per exact length pair"
    assert _single([1], [33], return_lse=True).max_q == 1, "dense rows need no second query row"


def test_single_graph_is_refused_where_it_cannot_serve():
    assert _single([8, 8], [8, 8]) is None, "two requests"
    assert single_options(problem("prefill_paged"), 0, [8], [8]) is None, "paged K/V"
    assert _single([8], [8], use_cuda_graph=True) is None, "a re-plan must reuse the captured graph"
    assert _single([0], [8]) is None and _single([8], [0]) is None, "empty request"
    assert _single([9], [8], mask_mode="causal") is None, "dense bottom-right needs qo_len <= kv_len"
    assert _single([9], [8], window_left=3) is None
    assert _single([9], [8]) is not None, "no mask: any lengths"


def _fake_single_graph(monkeypatch, opts, q, k, v, out, lse):
    fake, made = _fake_frontend()
    fake.diagonal_alignment.TOP_LEFT = "top_left"
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    geo = Geometry(q.stride(), None, k.stride(), None, v.stride(), out.stride(),
                   None if lse is None else lse.stride(), "ragged")
    build_graph(opts, geo, handle="h")
    return made[0]


def test_single_graph_declares_pytorchs_dense_layout(monkeypatch):
    S, Hq, Hk, D = 40, 8, 2, 64
    q, k, v = torch.empty(S, Hq, D), torch.empty(S, Hk, D), torch.empty(S, Hk, D)
    out, lse = torch.empty(S, Hq, D), torch.empty(S, Hq)
    p = problem("prefill_ragged", num_qo_heads=Hq, num_kv_heads=Hk, head_dim_qk=D, head_dim_vo=D,
                mask_mode="causal", return_lse=True)
    g = _fake_single_graph(monkeypatch, single_options(p, 0, [S], [S]), q, k, v, out, lse)
    t = g.tensors
    assert t["q"].decl["dim"] == [1, Hq, S, D] and t["q"].decl["stride"] == [S * Hq * D, D, Hq * D, 1]
    assert t["k"].decl["dim"] == [1, Hk, S, D] and t["k"].decl["stride"] == [S * Hk * D, D, Hk * D, 1]
    assert t["o"].decl["dim"] == [1, Hq, S, D] and t["o"].decl["stride"] == [S * Hq * D, D, Hq * D, 1]
    assert t["stats"].decl["dim"] == [1, Hq, S, 1] and t["stats"].decl["stride"] == [S * Hq, 1, Hq, 1]
    assert all(r.ragged is None for r in t.values()), "no ragged offsets"
    assert not any(n.endswith("_offsets") or n.startswith("seq_len") for n in t), "no offsets or lengths"
    kw = g.sdpa_kw
    assert "use_padding_mask" not in kw and "seq_len_q" not in kw and "seq_len_kv" not in kw
    assert kw["diagonal_band_right_bound"] == 0 and "diagonal_alignment" not in kw, \
        "qo_len == kv_len: top-left causal (the default alignment), as PyTorch's is_causal"
    assert kw["generate_stats"] and g.modes == ["A", "FALLBACK"]


def test_single_graph_appends_bottom_right_and_windows(monkeypatch):
    Sq, Skv, H, D = 23, 61, 4, 64
    q, out = torch.empty(Sq, H, D), torch.empty(Sq, H, D)
    kv_hnd = torch.empty(H, Skv, D)                       # an HND ragged K/V, viewed as [tokens, heads, dim]
    k = v = kv_hnd.transpose(0, 1)
    p = problem("prefill_ragged", num_qo_heads=H, num_kv_heads=H, head_dim_qk=D, head_dim_vo=D,
                mask_mode="causal", window_left=7, return_lse=False)
    g = _fake_single_graph(monkeypatch, single_options(p, 0, [Sq], [Skv]), q, k, v, out, None)
    assert g.tensors["k"].decl["stride"] == [H * Skv * D, Skv * D, D, 1], "heads-first K keeps its strides"
    kw = g.sdpa_kw
    assert kw["diagonal_alignment"] == "bottom_right" and kw["diagonal_band_right_bound"] == 0
    assert kw["diagonal_band_left_bound"] == 8 and not kw["generate_stats"]
    assert "stats" not in {n for n, r in g.tensors.items() if r.output}


def test_bucket_graphs_are_unchanged():
    """A batch keeps the bucketed ragged graph (the single flag is off)."""
    o = bucket_options(problem("prefill_ragged", mask_mode="causal"), 0, batch=1, max_q=3000, max_kv=3000)
    assert (o.single, o.max_q, o.max_kv) == (False, 4096, 4096)
