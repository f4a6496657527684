"""fa2 split-KV paged decode on a CUDA GPU (``pytest -m gpu``), against a float32 torch reference.

Grid over batch/lengths, page size, layout, dtype (bf16, fp16, fp8 e4m3 KV) and head dim, then
every feature, CUDA-graph capture + replay after a re-plan, and batch invariance.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from oracle import assert_close, make_paged_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 8e-2}
WORKSPACE_BYTES = 128 << 20


def _scale(x) -> torch.Tensor | float:
    return 1.0 if x is None else (x.float().reshape(()) if isinstance(x, torch.Tensor) else float(x))


def torch_reference(case):
    """(out, lse base 2) in float32, one request at a time, every decode feature."""
    p, prm, inp = case.problem, case.params, case.inputs
    k_all, v_all = inp.kv.k, inp.kv.v
    if inp.kv.layout == "HND":
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
    group, ql, d = p.num_qo_heads // p.num_kv_heads, p.q_len_per_req, p.head_dim_qk
    scale = prm.sm_scale * _scale(inp.q_scale) * _scale(inp.k_scale)
    out = torch.zeros(inp.q.shape[0], p.num_qo_heads, d, dtype=torch.float32, device=inp.q.device)
    lse = torch.full((inp.q.shape[0], p.num_qo_heads), -math.inf, device=inp.q.device)
    indptr = prm.kv_indptr.tolist()
    for b, kv_len in enumerate(prm.kv_lens_host):
        pages = prm.kv_indices[indptr[b]:indptr[b + 1]].long()
        k = k_all[pages].reshape(-1, p.num_kv_heads, d)[:kv_len].float().repeat_interleave(group, 1)
        v = v_all[pages].reshape(-1, p.num_kv_heads, d)[:kv_len].float().repeat_interleave(group, 1)
        q = inp.q[b * ql:(b + 1) * ql].float()
        pos = torch.arange(ql, device=q.device) + kv_len - ql
        j = torch.arange(kv_len, device=q.device)
        if p.pos_encoding_mode == "ROPE_LLAMA":
            inv = 1.0 / prm.rope_theta ** (torch.arange(d // 2, device=q.device, dtype=torch.float64) * 2 / d)

            def rope(x, at):
                ang = (at.double() / prm.rope_scale)[:, None] * inv
                c, s = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
                x1, x2 = x.chunk(2, -1)
                return x * c + torch.cat([-x2, x1], -1) * s
            q, k = rope(q, pos), rope(k, j)
        s = torch.einsum("ihd,jhd->hij", q, k) * scale
        if p.pos_encoding_mode == "ALIBI":
            from flashdispatch.backends.common import alibi_slopes
            s = s + alibi_slopes(p.num_qo_heads, q.device)[:, None, None] * (j[None, :] - pos[:, None])
        if p.logits_soft_cap > 0:
            s = p.logits_soft_cap * torch.tanh(s / p.logits_soft_cap)
        keep = torch.ones(ql, kv_len, dtype=torch.bool, device=q.device)
        if p.mask_mode == "causal":
            keep &= j[None, :] <= pos[:, None]
        if p.window_left >= 0:
            keep &= j[None, :] >= pos[:, None] - p.window_left
        s = s.masked_fill(~keep, -math.inf)
        if inp.sinks is not None:
            s = torch.cat([s, inp.sinks.float()[:, None, None].expand(-1, ql, 1)], -1)
        m = s.amax(-1, keepdim=True).clamp_min(-1e30)
        e = torch.exp(s - m)
        den = e.sum(-1)
        probs = e[..., :kv_len] / den.clamp_min(1e-30)[..., None]
        o = torch.einsum("hij,jhd->ihd", probs, v) * _scale(inp.v_scale)
        out[b * ql:(b + 1) * ql] = o
        lse[b * ql:(b + 1) * ql] = ((m[..., 0] + torch.log(den)) / math.log(2)).transpose(0, 1)
    return out, lse


def _case(kv_lens, **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 128)
    kw.setdefault("q_dtype", torch.bfloat16)
    return make_paged_case("decode", kv_lens=list(kv_lens), device="cuda", poison_unused=False, **kw)


def _run(case, config=None, **params):
    from flashdispatch.backends.fa2.decode import plan_decode
    prm = case.params
    prm.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for name, value in params.items():
        setattr(prm, name, value)
    case.inputs.out.fill_(float("nan"))
    if case.inputs.lse is not None:
        case.inputs.lse.fill_(float("nan"))
    plan = plan_decode(case.problem, case.device, prm, config)
    plan.run(case.inputs)
    torch.cuda.synchronize()
    return plan


def _check(case, **kw):
    ref_out, ref_lse = torch_reference(case)
    _run(case, **kw)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


LENGTHS = {"one-long": [4097], "mixed": [0, 1, 15, 16, 17, 300, 2000]}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.float16,) * 2,
                                    (torch.bfloat16, torch.float8_e4m3fn)], ids=["bf16", "fp16", "fp8kv"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_grid(lengths, page_size, layout, dtypes, head_dim):
    case = _case(LENGTHS[lengths], page_size=page_size, kv_layout=layout, q_dtype=dtypes[0],
                 kv_dtype=dtypes[1], head_dim_qk=head_dim, seed=page_size + head_dim,
                 k_scale=0.8 if dtypes[1] != dtypes[0] else None, v_scale=1.5 if dtypes[1] != dtypes[0] else None)
    _check(case)


@pytest.mark.parametrize("feature", [
    dict(window_left=100), dict(logits_soft_cap=30.0), dict(pos_encoding_mode="ALIBI"),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5), dict(sinks=True),
    dict(sm_scale=0.05), dict(return_lse=False), dict(kv_storage="tuple"),
    dict(q_len_per_req=4, mask_mode="causal"), dict(q_len_per_req=3, mask_mode="none", num_qo_heads=32),
    dict(kv_dtype=torch.float8_e4m3fn, q_scale=torch.tensor([1.2], device="cuda"),
         k_scale=torch.tensor([0.5], device="cuda"), v_scale=torch.tensor([2.0], device="cuda")),
    dict(num_qo_heads=32, num_kv_heads=4, o_dtype=torch.float32),
], ids=lambda f: ",".join(sorted(f)))
@pytest.mark.parametrize("split", [{}, {"fixed_split_size": 8}, {"disable_split_kv": True}], ids=["auto", "fixed8", "nosplit"])
def test_features(feature, split):
    _check(_case([0, 33, 700, 3000], seed=3, **feature), **split)


def test_cuda_graph_replay_after_replan():
    """Capture on one plan, re-plan (same batch size, other lengths and pages, same buffers),
    replay: the result is the new plan's."""
    from flashdispatch.backends.fa2.decode import plan_decode
    case = _case([100, 5000, 0, 64], use_cuda_graph=True, extra_pages=400, seed=4)
    prm, inputs = case.params, case.inputs
    indices = torch.zeros(2048, dtype=torch.int32, device="cuda")  # the wrapper's fixed buffer
    indices[:prm.kv_indices.numel()] = prm.kv_indices
    prm.kv_indices = indices
    prm.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    plan = plan_decode(case.problem, case.device, prm)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(inputs)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(inputs)

    lens = [3000, 17, 900, 1]
    counts = [-(-n // 16) for n in lens]
    new_pages = torch.randperm(inputs.kv.k.shape[0], device="cuda")[:sum(counts)].int()
    indices[:new_pages.numel()] = new_pages
    indptr = torch.tensor([0] + counts, device="cuda").cumsum(0).int()
    prm_b = dataclasses.replace(prm, kv_lens_host=lens, kv_indptr=indptr, kv_indices=indices,
                                kv_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                kv_last_page_len=torch.tensor([n - (c - 1) * 16 for n, c in zip(lens, counts)],
                                                              dtype=torch.int32, device="cuda"))
    plan_decode(case.problem, case.device, prm_b)
    inputs.q.copy_(torch.randn_like(inputs.q))
    inputs.out.fill_(float("nan"))
    inputs.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = torch_reference(dataclasses.replace(case, params=prm_b))
    assert_close(inputs.out, inputs.lse, ref_out, ref_lse, TOL[torch.bfloat16])


def test_batch_invariance_fixed_split():
    big = _case([3000, 10, 777, 4096, 0], seed=6)
    _run(big, fixed_split_size=16)
    out_big, lse_big = big.inputs.out.clone(), big.inputs.lse.clone()
    single = _case([4096], seed=6)
    starts = big.params.kv_indptr.tolist()
    single.params.kv_indices = big.params.kv_indices[starts[3]:starts[4]].clone()
    single.inputs = dataclasses.replace(single.inputs, q=big.inputs.q[3:4].clone(), kv=big.inputs.kv)
    _run(single, fixed_split_size=16)
    assert torch.equal(single.inputs.out, out_big[3:4]) and torch.equal(single.inputs.lse, lse_big[3:4])
