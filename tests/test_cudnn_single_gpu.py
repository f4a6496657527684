"""cudnn's one-request dense prefill graph on a GPU: parity with the float64 oracle (causal
top-left and bottom-right, window, GQA, lse, more queries than keys), the ragged fallback when
the tensors hold rows before the request, and single_prefill_with_kv_cache going through it."""
from __future__ import annotations

import pytest
import torch

from tests.test_cudnn_gpu import Cudnn, check, make_case, run_cudnn

pytestmark = pytest.mark.gpu
if Cudnn.availability():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="; ".join(map(str, Cudnn.availability())))]


def _ran_single(plan) -> bool:
    """Whether the plan's last run used the dense one-request graph."""
    return plan._bound is not None and plan._bound[0][1].single


@pytest.mark.parametrize("q_len,kv_len,causal,window", [
    (40, 40, True, -1),      # top-left == bottom-right
    (23, 61, True, -1),      # bottom-right
    (50, 17, False, -1),     # more queries than keys, no mask
    (40, 40, True, 7),
    (30, 45, False, 5),
    (64, 64, False, -1),
])
@pytest.mark.parametrize("lse", [True, False])
def test_single_request_dense_graph(q_len, kv_len, causal, window, lse):
    case = make_case("prefill_ragged", [q_len], [kv_len], causal=causal, window=window, lse=lse, heads=(8, 2))
    plan = run_cudnn(*case)
    assert _ran_single(plan), "one request with tensors of its own rows takes the dense graph"
    check(*case)


def test_single_query_row_gqa_lse():
    """One query row, GQA, lse: the dense form must write every head's lse (the one-row ragged
    kernel wrote only the first head of each group). If this fails, refuse q_len 1 in
    plan.single_options when return_lse and heads differ."""
    case = make_case("prefill_ragged", [1], [70], causal=True, lse=True, heads=(8, 2))
    plan = run_cudnn(*case)
    assert _ran_single(plan)
    check(*case)


def test_rows_before_the_request_fall_back_to_the_ragged_graph():
    """qo_indptr = [3, 3 + L]: q holds 3 rows before the request, which only the offsets can skip."""
    problem, params, inputs = make_case("prefill_ragged", [29], [29], causal=True, lse=True, heads=(8, 2))
    dev = inputs.q.device
    pad_q = torch.cat([torch.randn(3, *inputs.q.shape[1:], device=dev).to(inputs.q.dtype), inputs.q])
    out = torch.full((pad_q.shape[0], *inputs.out.shape[1:]), float("nan"), dtype=inputs.out.dtype, device=dev)
    lse = torch.full((pad_q.shape[0], inputs.lse.shape[1]), float("nan"), device=dev)
    params.qo_indptr = torch.tensor([3, 32], dtype=torch.int32, device=dev)
    shifted = type(inputs)(pad_q, inputs.kv, out, lse)
    plan = run_cudnn(problem, params, shifted)
    assert not _ran_single(plan), "q rows != the request's rows: ragged graph"
    params.qo_indptr = torch.tensor([0, 29], dtype=torch.int32, device=dev)
    plan = run_cudnn(problem, params, inputs)
    assert _ran_single(plan)
    check(problem, params, inputs)
    err = (out[3:].float() - inputs.out.float()).norm() / inputs.out.float().norm()
    assert err < 1e-2, f"ragged fallback differs from the dense graph: {err:.2e}"
    assert (lse[3:] - inputs.lse).abs().max() < 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_single_prefill_api_uses_the_dense_graph(causal):
    import flashdispatch as fi
    from flashdispatch.backends.cudnn import graphs

    torch.manual_seed(0)
    q = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = fi.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="cudnn", return_lse=True)
    assert any(o.single and o.max_q == 300 for o, _ in graphs.GRAPHS._graphs), "no dense single graph was built"
    kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kr.float()) / 128 ** 0.5
    if causal:
        scores.masked_fill_(torch.ones(300, 300, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr.float())
    assert (out.float() - ref).norm() / ref.norm() < 1e-2
    ref_lse = scores.logsumexp(-1).transpose(0, 1) / torch.log(torch.tensor(2.0))
    assert (lse - ref_lse).abs().max() < 2e-2, "lse must be base 2"
