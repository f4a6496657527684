"""cudnn backend on a GPU: parity with the float64 oracle (decode, paged and ragged prefill;
causal, window, GQA, lse, empty requests), CUDA-graph capture and replay, clear errors."""
from __future__ import annotations

import dataclasses
import functools
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


def run_cudnn(problem, params, inputs, *, reasons=()):
    """Plan and run on the cudnn backend; ``reasons``: the Reason codes expected from its caps
    (the kernel still runs, to test what a Reason guards)."""
    device = device_of(inputs.q.device)
    assert sorted(r.code for r in Cudnn.supports(problem, device)) == sorted(reasons)
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


@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (8, 8)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_decode_with_lse(heads, layout):
    """GQA lse used to come back NaN for all but the first head of each group: the ragged one-row
    Stats bug of cuDNN (NVIDIA/cudnn-frontend#1083). Decode rows are dense since, which spares it."""
    problem, params, inputs = make_case("decode", [1] * len(DECODE_KV), DECODE_KV, heads=heads, layout=layout)
    # out and lse are views of larger buffers whose two extra rows hold a finite sentinel: a write
    # past the batch's rows (e.g. the group heads stepped along the row axis) shows up there
    rows = inputs.q.shape[0]
    out_buf = torch.full((rows + 2, *inputs.out.shape[1:]), 7.0, dtype=inputs.out.dtype, device=inputs.out.device)
    lse_buf = torch.full((rows + 2, inputs.lse.shape[1]), 7.0, dtype=torch.float32, device=inputs.lse.device)
    out_buf[:rows], lse_buf[:rows] = float("nan"), float("nan")
    case = (problem, params, dataclasses.replace(inputs, out=out_buf[:rows], lse=lse_buf[:rows]))
    run_cudnn(*case)
    check(*case)
    assert (out_buf[rows:] == 7.0).all() and (lse_buf[rows:] == 7.0).all(), "written past the batch's rows"


@pytest.mark.parametrize("op", ["prefill_paged", "prefill_ragged"])
def test_one_row_prefill_with_gqa_lse(op):
    """At most one query row per request, GQA and lse: declared as two rows (plan.bucket_options)."""
    case = make_case(op, [1, 0, 1, 1], [40, 5, 0, 300], heads=(8, 2), dims=(64, 64))
    plan = run_cudnn(*case)
    assert plan.opts.max_q == 2
    check(*case)


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


# --- FlashInfer's plan-less entry points: device metadata only, no host read --------------------
import flashdispatch as fi  # noqa: E402
from flashdispatch.backends.cudnn import direct as cudnn_direct  # noqa: E402


def entry_cache(kv_lens, *, heads, page_size, dtype, dim=128, width=None, combined=False, seed=0):
    """HND caches with shuffled pages and a [batch, width] table; unused table columns point at a
    page no request owns (attending to it would show); K/V may be views of one [pages, 2, ...]."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda", 0)
    pages = [-(-n // page_size) for n in kv_lens]
    width = width or max(pages + [1])
    total = sum(pages) + 2
    order = torch.randperm(total, generator=g)
    table = torch.full((len(kv_lens), width), int(order[-1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    shape = (total, heads[1], page_size, dim)
    if combined:
        both = torch.randn(total, 2, *shape[1:], generator=g).to(dtype).to(dev)
        k, v = both[:, 0], both[:, 1]
    else:
        k, v = (torch.randn(*shape, generator=g).to(dtype).to(dev) for _ in range(2))
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=dev).view(-1, 1, 1, 1)
    return k, v, table.to(dev), lens


def entry_reference(q, k, v, table, qo_lens, kv_lens, *, causal, scale):
    """(out, lse base 2) of the reference backend through the wrappers (host-planned)."""
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=q.device)
    qo = torch.tensor([0] + list(qo_lens)).cumsum(0).to(torch.int32)
    if table is not None:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend="reference")
        w.plan(qo, None, None, None, q.shape[1], k.shape[1], q.shape[2], k.shape[2], head_dim_vo=v.shape[3],
               causal=causal, sm_scale=scale, q_data_type=q.dtype, block_tables=table.cpu(),
               seq_lens=torch.tensor(kv_lens, dtype=torch.int32))
        return w.run(q, (k, v), return_lse=True)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="reference")
    w.plan(qo, torch.tensor([0] + list(kv_lens)).cumsum(0).to(torch.int32), q.shape[1], k.shape[1], q.shape[2],
           v.shape[2], causal=causal, sm_scale=scale, q_data_type=q.dtype)
    return w.run(q, k, v, return_lse=True)


def assert_matches(out, lse, ref_out, ref_lse):
    torch.cuda.synchronize()
    out, ref_out, ref_lse = out.double().cpu(), ref_out.double().cpu(), ref_lse.double().cpu()
    assert not out.isnan().any(), "NaN in out"
    err = (out - ref_out).norm() / ref_out.norm().clamp_min(1e-30)
    assert err < Cudnn.tolerance_for(torch.bfloat16), f"relative error {err:.3e}"
    blind = torch.isinf(ref_lse).all(dim=1)
    assert (out[blind] == 0).all(), "rows that see no key must be 0"
    if lse is not None:
        lse = lse.double().cpu()
        assert not lse.isnan().any(), "NaN in lse"
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and (lse[torch.isinf(lse)] < 0).all()
        finite = torch.isfinite(ref_lse)
        assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-2


def nan_tensor(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@functools.cache
def entry_ws() -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_entry_decode(dtype, heads, page_size):
    kv_lens = [1000, 0, 17, 513, 64, 1]            # batch 6 (not a power of two); one empty request
    k, v, table, lens = entry_cache(kv_lens, heads=heads, page_size=page_size, dtype=dtype, width=1024 // page_size)
    q = torch.randn(len(kv_lens), heads[0], 128, dtype=dtype, device="cuda")
    out = nan_tensor(len(kv_lens), heads[0], 128, dtype=dtype)
    result = fi.cudnn_batch_decode_with_kv_cache(q, k, v, 128 ** -0.5, entry_ws(), max_sequence_kv=1024,
                                                 actual_seq_lens_kv=lens, block_tables=table, out=out)
    assert result is out
    assert_matches(out, None, *entry_reference(q, k, v, table, [1] * len(kv_lens), kv_lens, causal=False,
                                               scale=128 ** -0.5))


@pytest.mark.parametrize("width,combined", [(32, False), (40, True)])
def test_entry_decode_passes_the_callers_metadata_through(width, combined):
    """A table as wide as the bucket's 32 pages or wider: no copies."""
    kv_lens = [512, 0, 300, 1, 16, 17, 480, 99]
    k, v, table, lens = entry_cache(kv_lens, heads=(32, 8), page_size=16, dtype=torch.bfloat16, width=width,
                                    combined=combined)
    q = torch.randn(8, 32, 128, dtype=torch.bfloat16, device="cuda")
    out = nan_tensor(8, 32, 128, dtype=torch.bfloat16)
    fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.1, entry_ws(), max_sequence_kv=512, actual_seq_lens_kv=lens.view(-1),
                                        block_tables=table, out=out)
    assert_matches(out, None, *entry_reference(q, k, v, table, [1] * 8, kv_lens, causal=False, scale=0.1))


PREFILL_QO, PREFILL_KV = [7, 12, 0, 3, 100, 1], [40, 5, 9, 0, 300, 1]   # req 1: qo > kv; req 3: no keys


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,heads,page_size", [(torch.bfloat16, (32, 8), 16), (torch.float16, (8, 8), 64),
                                                   (torch.bfloat16, (8, 8), 64), (torch.float16, (32, 8), 16)])
def test_entry_prefill_paged(dtype, heads, page_size, causal):
    k, v, table, lens_kv = entry_cache(PREFILL_KV, heads=heads, page_size=page_size, dtype=dtype,
                                       width=-(-320 // page_size))
    q = torch.randn(sum(PREFILL_QO), heads[0], 128, dtype=dtype, device="cuda")
    lens_q = torch.tensor(PREFILL_QO, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
    out, lse = nan_tensor(q.shape[0], heads[0], 128, dtype=dtype), nan_tensor(q.shape[0], heads[0], dtype=torch.float32)
    fi.cudnn_batch_prefill_with_kv_cache(q, k, v, 0.08, entry_ws(), max_token_per_sequence=128, max_sequence_kv=320,
                                         actual_seq_lens_q=lens_q, actual_seq_lens_kv=lens_kv, block_tables=table,
                                         causal=causal, return_lse=True, out=out, lse=lse)
    assert_matches(out, lse, *entry_reference(q, k, v, table, PREFILL_QO, PREFILL_KV, causal=causal, scale=0.08))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,heads", [(torch.bfloat16, (32, 8)), (torch.float16, (8, 8))])
def test_entry_prefill_ragged(dtype, heads, causal):
    q = torch.randn(sum(PREFILL_QO), heads[0], 128, dtype=dtype, device="cuda")
    k, v = (torch.randn(sum(PREFILL_KV), heads[1], 128, dtype=dtype, device="cuda") for _ in range(2))
    lens_q, lens_kv = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (PREFILL_QO, PREFILL_KV))
    out, lse = nan_tensor(q.shape[0], heads[0], 128, dtype=dtype), nan_tensor(q.shape[0], heads[0], dtype=torch.float32)
    fi.cudnn_batch_prefill_with_kv_cache(q, k, v, 0.08, entry_ws(), max_token_per_sequence=100, max_sequence_kv=300,
                                         actual_seq_lens_q=lens_q, actual_seq_lens_kv=lens_kv, causal=causal,
                                         return_lse=True, out=out, lse=lse)
    assert_matches(out, lse, *entry_reference(q, k, v, None, PREFILL_QO, PREFILL_KV, causal=causal, scale=0.08))


def test_entry_prefill_with_caller_offsets():
    """batch_offsets_q/o/stats/k/v with gaps between requests: each lands where its offsets say."""
    qo_lens, kv_lens, h, d = [30, 0, 64], [50, 20, 64], 8, 128
    q_rows, o_rows, kv_rows = [0, 40, 40], [5, 50, 60], [3, 60, 90]
    q = torch.randn(110, h, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(160, 2, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    rows = [r for s, n in zip(o_rows, qo_lens) for r in range(s, s + n)]
    gaps = [r for r in range(130) if r not in rows]
    out, lse = nan_tensor(130, h, d, dtype=torch.bfloat16), nan_tensor(130, h, dtype=torch.float32)
    out[gaps], lse[gaps] = 7.0, 7.0            # rows of no request: must keep these (NaN would survive x log2e)

    def off(rows, total, stride):
        return torch.tensor(rows + [total], dtype=torch.int32, device="cuda") * stride

    fi.cudnn_batch_prefill_with_kv_cache(
        q, k, v, 0.08, entry_ws(), max_token_per_sequence=64, max_sequence_kv=64, causal=True, return_lse=True,
        actual_seq_lens_q=torch.tensor(qo_lens, dtype=torch.int32, device="cuda"),
        actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
        batch_offsets_q=off(q_rows, 110, h * d), batch_offsets_o=off(o_rows, 130, h * d),
        batch_offsets_stats=off(o_rows, 130, h), batch_offsets_k=off(kv_rows, 160, 2 * d),
        batch_offsets_v=off(kv_rows, 160, 2 * d), out=out, lse=lse)
    packed = [torch.cat([t[s:s + n] for s, n in zip(starts, lens)]) for t, starts, lens in
              ((q, q_rows, qo_lens), (k, kv_rows, kv_lens), (v, kv_rows, kv_lens))]
    assert_matches(out[rows], lse[rows], *entry_reference(*packed, None, qo_lens, kv_lens, causal=True, scale=0.08))
    assert (out[gaps] == 7).all() and (lse[gaps] == 7).all(), "rows of no request keep their values"


def test_entry_points_do_not_synchronise():
    k, v, table, lens = entry_cache([300, 7, 0], heads=(32, 8), page_size=16, dtype=torch.bfloat16, width=20)
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens_q = torch.tensor([5, 7, 2], dtype=torch.int32, device="cuda")
    qp = torch.randn(14, 32, 128, dtype=torch.bfloat16, device="cuda")

    # a batch size no other test uses: its decode graph and seq_len_q ones are made under "error" too
    k7, v7, table7, lens7 = entry_cache([300, 7, 0, 45, 19, 1, 64], heads=(32, 8), page_size=16,
                                        dtype=torch.bfloat16, width=20)
    q7 = torch.randn(7, 32, 128, dtype=torch.bfloat16, device="cuda")

    def calls(q, k, v, table, lens):
        fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.1, entry_ws(), max_sequence_kv=320, actual_seq_lens_kv=lens,
                                            block_tables=table)
        fi.cudnn_batch_prefill_with_kv_cache(qp, k, v, 0.1, entry_ws(), max_token_per_sequence=8,
                                             max_sequence_kv=320, actual_seq_lens_q=lens_q, actual_seq_lens_kv=lens[:3],
                                             block_tables=table[:3], causal=True, return_lse=True)

    calls(q, k, v, table, lens)               # first call of the buckets: builds their graphs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls(q, k, v, table, lens)
        cudnn_direct._ones_of_stream.cache_clear()
        calls(q7, k7, v7, table7, lens7)      # new decode batch (graph built here), prefill bucket as before
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_entry_cuda_graph_capture_replays_new_lengths_and_pages():
    kv_lens, new_lens = [300, 0, 45, 128, 7], [0, 200, 45, 1, 256]
    k, v, table, lens = entry_cache(kv_lens, heads=(32, 8), page_size=16, dtype=torch.bfloat16, width=20)
    new_table = torch.randint(0, k.shape[0], (5, 20), dtype=torch.int32, device="cuda")
    q = torch.randn(5, 32, 128, dtype=torch.bfloat16, device="cuda")
    qp = torch.randn(40, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens_q = torch.tensor([8, 8, 8, 8, 8], dtype=torch.int32, device="cuda")
    out, outp = nan_tensor(5, 32, 128, dtype=torch.bfloat16), nan_tensor(40, 32, 128, dtype=torch.bfloat16)
    lse = nan_tensor(40, 32, dtype=torch.float32)

    def step():
        fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.1, entry_ws(), max_sequence_kv=320, actual_seq_lens_kv=lens,
                                            block_tables=table, out=out, is_cuda_graph_compatible=True)
        fi.cudnn_batch_prefill_with_kv_cache(qp, k, v, 0.1, entry_ws(), max_token_per_sequence=8,
                                             max_sequence_kv=320, actual_seq_lens_q=lens_q, actual_seq_lens_kv=lens,
                                             block_tables=table, causal=True, return_lse=True, out=outp, lse=lse,
                                             is_cuda_graph_compatible=True)

    step()                                    # eager: builds the buckets' graphs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32).view(-1, 1, 1, 1))
    table.copy_(new_table)
    lens_q.copy_(torch.tensor([8, 3, 8, 1, 8], dtype=torch.int32))     # rows past their sum: not written
    for t in (q, qp):
        t.copy_(torch.randn_like(t))
    for t in (out, outp, lse):
        t.fill_(float("nan"))
    graph.replay()
    assert_matches(out, None, *entry_reference(q, k, v, table, [1] * 5, new_lens, causal=False, scale=0.1))
    ref = entry_reference(qp[:28], k, v, table, [8, 3, 8, 1, 8], new_lens, causal=True, scale=0.1)
    assert_matches(outp[:28], lse[:28], *ref)
    with pytest.raises(RuntimeError, match="cannot be built during CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.1, entry_ws(), max_sequence_kv=100,
                                                actual_seq_lens_kv=lens, block_tables=table, out=out,
                                                is_cuda_graph_compatible=True)


def test_entry_checked_mode_reads_and_names_bad_lengths(monkeypatch):
    k, v, table, lens = entry_cache([30, 7], heads=(8, 8), page_size=16, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setenv("FLASHDISPATCH_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=r"actual_seq_lens_kv\[0\]=30 is outside the accepted range "
                                         r"\[0, max_sequence_kv=16\]"):
        fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.1, entry_ws(), max_sequence_kv=16, actual_seq_lens_kv=lens,
                                            block_tables=table)
