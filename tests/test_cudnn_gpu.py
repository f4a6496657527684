"""cudnn backend on a GPU: parity with the float64 oracle (decode, paged and ragged prefill;
causal, window, GQA, lse, empty requests), CUDA-graph capture and replay, clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from flashdispatch.backends.base import AttentionInputs, AttentionParams, PagedKV, RaggedKV
from flashdispatch.dispatch.problem import Problem, device_of
from flashdispatch.dispatch.registry import backend_class
from tests.oracle import oracle_attention

pytestmark = pytest.mark.gpu

Cudnn = backend_class("cudnn")
_unavailable = Cudnn.availability()
if _unavailable:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="; ".join(map(str, _unavailable)))]


def make_case(op, qo_lens, kv_lens, *, heads=(8, 2), dims=(128, 128), page_size=16, layout="HND",
              dtype=torch.bfloat16, causal=False, window=-1, lse=True, seed=0, workspace_bytes=64 << 20):
    """Problem, params, inputs on cuda:0 with random data, shuffled pages, NaN-poisoned outputs."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda", 0)
    hq, hk = heads
    dqk, dvo = dims
    batch = len(kv_lens)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    qo_indptr = [0]
    for n in qo_lens:
        qo_indptr.append(qo_indptr[-1] + n)
    q = torch.randn(qo_indptr[-1], hq, dqk, generator=g).to(dtype).to(dev)
    params = dict(qo_indptr=as_i32(qo_indptr), kv_lens=as_i32(kv_lens), qo_lens_host=list(qo_lens),
                  kv_lens_host=list(kv_lens), sm_scale=1.0 / math.sqrt(dqk),
                  workspace=torch.empty(workspace_bytes, dtype=torch.uint8, device=dev))
    if op == "prefill_ragged":
        kv_indptr = [0]
        for n in kv_lens:
            kv_indptr.append(kv_indptr[-1] + n)
        k = torch.randn(kv_indptr[-1], hk, dqk, generator=g).to(dtype).to(dev)
        v = torch.randn(kv_indptr[-1], hk, dvo, generator=g).to(dtype).to(dev)
        kv, page_size = RaggedKV(k, v), 0
        params["kv_indptr"] = as_i32(kv_indptr)
    else:
        pages = [-(-n // page_size) for n in kv_lens]
        total_pages = sum(pages) + 3
        order = torch.randperm(total_pages, generator=g).tolist()
        kv_indptr, indices = [0], []
        for n in pages:
            indices += order[kv_indptr[-1]:kv_indptr[-1] + n]
            kv_indptr.append(kv_indptr[-1] + n)
        shape = (total_pages, page_size, hk) if layout == "NHD" else (total_pages, hk, page_size)
        if dqk == dvo:  # one tensor holding K and V: the views are not contiguous
            both = torch.randn(total_pages, 2, *shape[1:], dqk, generator=g).to(dtype).to(dev)
            k, v = both[:, 0], both[:, 1]
        else:
            k = torch.randn(*shape, dqk, generator=g).to(dtype).to(dev)
            v = torch.randn(*shape, dvo, generator=g).to(dtype).to(dev)
        kv = PagedKV(k, v, layout)
        last = [0 if p == 0 else n - (p - 1) * page_size for n, p in zip(kv_lens, pages)]
        params.update(kv_indptr=as_i32(kv_indptr), kv_indices=as_i32(indices), kv_last_page_len=as_i32(last))
    problem = Problem(op, dtype, dtype, dtype, hq, hk, dqk, dvo, page_size=page_size, kv_layout=layout,
                      mask_mode="causal" if causal else "none", window_left=window, return_lse=lse)
    out = torch.full((q.shape[0], hq, dvo), float("nan"), dtype=dtype, device=dev)
    lse_t = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device=dev) if lse else None
    return problem, AttentionParams(**params), AttentionInputs(q, kv, out, lse_t)


def run_cudnn(problem, params, inputs):
    device = device_of(inputs.q.device)
    assert Cudnn.supports(problem, device) == []
    backend = Cudnn()
    plan = backend.plan(problem, device, params)
    backend.run(plan, inputs)
    torch.cuda.synchronize()
    return plan


def check(problem, params, inputs):
    ref_out, ref_lse = oracle_attention(problem, params, inputs)
    out = inputs.out.double().cpu()
    assert not out.isnan().any(), "NaN in out (unwritten or masked rows)"
    err = (out - ref_out).norm() / ref_out.norm().clamp_min(1e-30)
    assert err < Cudnn.tolerance_for(problem.kv_dtype), f"relative error {err:.3e}"
    blind = torch.isinf(ref_lse).all(dim=1)
    assert (out[blind] == 0).all(), "rows without keys must be 0"
    if inputs.lse is not None:
        lse = inputs.lse.double().cpu()
        assert not lse.isnan().any()
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and (lse[torch.isinf(lse)] < 0).all()
        finite = torch.isfinite(ref_lse)
        assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-2


DECODE_KV = [37, 0, 16, 129, 1]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode(layout, dtype):
    case = make_case("decode", [1] * len(DECODE_KV), DECODE_KV, layout=layout, dtype=dtype, lse=False)
    run_cudnn(*case)
    check(*case)


def test_gqa_decode_with_lse_is_a_reason():
    problem, _, inputs = make_case("decode", [1] * len(DECODE_KV), DECODE_KV)
    reasons = Cudnn.supports(problem, device_of(inputs.q.device))
    assert [r.code for r in reasons] == ["feature.lse"]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_page_sizes_and_heads(page_size):
    case = make_case("decode", [1] * 3, [70, 5, 200], heads=(4, 4), dims=(64, 64), page_size=page_size)
    run_cudnn(*case)
    check(*case)


@pytest.mark.parametrize("causal,window", [(False, -1), (True, -1), (True, 0), (True, 9)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_prefill(causal, window, layout):
    # request 1 has more queries than keys (causal: blind rows), request 2 has no queries, 3 no keys
    case = make_case("prefill_paged", [7, 12, 0, 3, 20], [40, 5, 9, 0, 20], causal=causal, window=window,
                     layout=layout, heads=(8, 2), dims=(64, 64))
    run_cudnn(*case)
    check(*case)


@pytest.mark.parametrize("causal,window", [(False, -1), (True, -1), (True, 4)])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_ragged_prefill(causal, window, dims):
    case = make_case("prefill_ragged", [5, 17, 0, 2], [33, 9, 4, 0], causal=causal, window=window,
                     heads=(6, 2), dims=dims)
    run_cudnn(*case)
    check(*case)


def test_two_plans_share_a_workspace_and_a_graph():
    """Plan twice (same bucket, one float workspace, as wrappers sharing it do), then run both."""
    first = make_case("prefill_ragged", [3, 4], [8, 6], causal=True, lse=False)
    second = make_case("prefill_ragged", [2, 4], [7, 6], causal=True, lse=False, seed=1)
    second[1].workspace = first[1].workspace
    backend, device = Cudnn(), device_of(first[2].q.device)
    plan_a = backend.plan(first[0], device, first[1])
    plan_b = backend.plan(second[0], device, second[1])
    assert plan_a.opts == plan_b.opts
    backend.run(plan_a, first[2])
    backend.run(plan_b, second[2])
    torch.cuda.synchronize()
    check(*first)
    check(*second)
    assert plan_b.build_seconds == 0.0, "the second plan reuses the first one's graph"


def _shorter_requests(params, page_size, new_lens):
    """The same pages, each request cut to new_lens (<= its old length): a re-plan for replay."""
    dev = params.kv_indptr.device
    indptr, indices = params.kv_indptr.tolist(), params.kv_indices.tolist()
    new_indptr, new_indices, last = [0], [], []
    for b, n in enumerate(new_lens):
        pages = -(-n // page_size)
        new_indices += indices[indptr[b]:indptr[b] + pages]
        new_indptr.append(new_indptr[-1] + pages)
        last.append(0 if pages == 0 else n - (pages - 1) * page_size)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    return AttentionParams(qo_indptr=params.qo_indptr, kv_indptr=i32(new_indptr), kv_lens=i32(new_lens),
                           qo_lens_host=params.qo_lens_host, kv_lens_host=list(new_lens), sm_scale=params.sm_scale,
                           kv_indices=i32(new_indices), kv_last_page_len=i32(last), workspace=params.workspace)


def test_cuda_graph_capture_replay_and_replan():
    problem, params, inputs = make_case("decode", [1] * 4, [50, 3, 0, 90], heads=(4, 4), layout="HND")
    problem = problem.with_(use_cuda_graph=True)
    # the wrapper's int workspace (contract extension): plan metadata at addresses that outlive a plan
    params.int_workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=inputs.q.device)
    backend, device = Cudnn(), device_of(inputs.q.device)
    plan = backend.plan(problem, device, params)
    backend.run(plan, inputs)          # warm-up: builds the graph for this layout
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.run(plan, inputs)
    inputs.q.copy_(torch.randn_like(inputs.q))
    inputs.out.fill_(float("nan"))
    inputs.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(problem, params, inputs)
    # re-plan in the same bucket (same workspace): the captured graph reads the new metadata
    replanned = _shorter_requests(params, problem.page_size, [0, 2, 0, 77])
    replanned.int_workspace = params.int_workspace
    second = backend.plan(problem, device, replanned)
    assert second.opts == plan.opts
    inputs.out.fill_(float("nan"))
    inputs.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(problem, replanned, inputs)


def test_workspace_too_small_names_the_buffer():
    problem, params, inputs = make_case("prefill_ragged", [64], [64], workspace_bytes=4096)
    plan = Cudnn().plan(problem, device_of(inputs.q.device), params)
    graph_needs = None
    try:
        plan.run(inputs)
    except ValueError as e:
        assert "float_workspace_buffer" in str(e)
        graph_needs = True
    if graph_needs is None:  # this graph needs no workspace beyond the metadata: nothing to check
        pytest.skip("the cuDNN graph needs no workspace here")


def test_misaligned_q_is_an_error_not_a_crash():
    problem, params, inputs = make_case("prefill_ragged", [4], [4], dims=(64, 64))
    wide = torch.randn(4, 8, 65, dtype=inputs.q.dtype, device=inputs.q.device)
    inputs.q = wide[:, :, 1:]
    plan = Cudnn().plan(problem, device_of(inputs.q.device), params)
    with pytest.raises(ValueError, match="q needs"):
        plan.run(inputs)
