"""Page indices the API has not checked: the fa2 decode kernel clamps each one into the cache, and
a decode plan() with its lengths on the host checks the indices on the GPU without waiting
(`BatchDecodeWithPagedKVCacheWrapper._finish_page_check`)."""
import json

import pytest
import torch

import flashdispatch as fd
from flashdispatch import checks
from flashdispatch.backends.fa2.decode_config import CONFIG_ENV

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 64, 8


def tables(gen, lens, num_pages):
    """indptr, random distinct page indices in [0, num_pages), last_page_len (int32, CPU)."""
    pages = [-(-n // PAGE) for n in lens]
    indptr = torch.tensor([0] + pages).cumsum(0).int()
    indices = torch.randperm(num_pages, generator=gen)[: int(indptr[-1])].int()
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


def case(seed, lens, num_pages, device, dtype=torch.float16):
    """Tables plus q and a cache of random values on every page (a clamped index reads real data)."""
    gen = torch.Generator().manual_seed(seed)
    indptr, indices, last = tables(gen, lens, num_pages)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen).to(device, dtype)
    cache = torch.randn(num_pages, 2, PAGE, KV_HEADS, DIM, generator=gen).to(device, dtype)
    return indptr, indices, last, q, cache


def wrapper(backend, device, **kw):
    ws = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    return fd.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend, **kw)


def plan(w, indptr, indices, last, dtype=torch.float16):
    w.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype, kv_data_type=dtype)


def decode(backend, indptr, indices, last, q, cache):
    w = wrapper(backend, q.device)
    plan(w, indptr, indices, last, q.dtype)
    return w.run(q, cache)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("page_prefetch", [False, True])
def test_fa2_decode_clamps_page_indices_outside_the_cache(monkeypatch, page_prefetch):
    """With the check off, indices past the cache and negative ones read the cache's last page:
    fa2 equals the reference run on the clamped indices (no read outside the cache). Both page
    loads: at the tile's use, and a tile ahead (`DecodeConfig.page_prefetch`, the default on GPUs)."""
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "0")
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"page_prefetch": page_prefetch}))
    pages = 12
    indptr, indices, last, q, cache = case(0, [9, 17, 30], pages, "cpu")
    bad = indices.clone()
    bad[[0, 3, 6]] = torch.tensor([pages, -2, pages + 1000], dtype=torch.int32)
    clamped = torch.where((bad < 0) | (bad >= pages), pages - 1, bad).int()
    got = decode("fa2", indptr, bad, last, q, cache)
    want = decode("reference", indptr, clamped, last, q, cache)
    assert rel(got, want) < 2e-3
    assert rel(got, decode("reference", indptr, indices, last, q, cache)) > 1e-2  # the clamp changed pages


def test_cpu_tables_are_checked_inside_plan():
    """Indices on the CPU (the tests' fa2 under the interpreter): no deferred check."""
    indptr, indices, last, _, _ = case(1, [9, 17], 8, "cpu")
    indices[2] = -5
    w = wrapper("fa2", "cpu")
    with pytest.raises(ValueError, match="negative page index -5"):
        plan(w, indptr, indices, last)
    assert not w._page_checking()


# --- on the GPU: plan() with host lengths does not wait for the GPU ---------------------------------
def gpu_case(seed, pages=64, lens=(40, 7, 0, 130), dtype=torch.bfloat16):
    indptr, indices, last, q, cache = case(seed, list(lens), pages, "cuda", dtype)
    return indptr, indices.cuda(), last, q, cache


def busy_gpu() -> torch.cuda.Event:
    """~100 ms of GPU work queued on the current stream; the event after it."""
    torch.cuda._sleep(200_000_000)
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.mark.gpu
def test_host_lengths_plan_and_run_do_not_wait_for_the_gpu():
    indptr, indices, last, q, cache = gpu_case(2)
    w = wrapper("fa2", "cuda")
    plan(w, indptr, indices, last, q.dtype)
    w.run(q, cache)  # compiles
    torch.cuda.synchronize()
    busy = busy_gpu()
    plan(w, indptr, indices, last, q.dtype)
    out = w.run(q, cache)
    assert not busy.query(), "plan() or run() waited for the GPU"
    assert w._page_checking()  # still pending: ends at the next plan()
    torch.cuda.synchronize()
    want = decode("reference", indptr.cuda(), indices, last.cuda(), q, cache)
    assert rel(out, want) < 2e-2
    plan(w, indptr, indices, last, q.dtype)  # ends the last check (valid)
    torch.cuda.synchronize()
    w.run(q, cache)  # finds this plan's check done: the largest index is now what run() checks
    assert not w._page_checking() and w._planned.max_page_index == int(indices.max())


@pytest.mark.gpu
def test_a_bad_index_found_before_the_run_refuses_the_launch():
    indptr, indices, last, q, cache = gpu_case(3)
    indices[5] = -3
    w = wrapper("fa2", "cuda")
    plan(w, indptr, indices, last, q.dtype)  # returns: the check is on its way
    torch.cuda.synchronize()
    out = torch.full((q.shape[0], HEADS, DIM), float("nan"), dtype=q.dtype, device="cuda")
    with pytest.raises(ValueError, match="negative page index -3"):
        w.run(q, cache, out=out)
    assert out.isnan().all()  # nothing was launched
    indices[5] = cache.shape[0] + 4
    plan(w, indptr, indices, last, q.dtype)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"reference page {cache.shape[0] + 4}, but paged_kv_cache has only"):
        w.run(q, cache, out=out)
    assert out.isnan().all()


@pytest.mark.gpu
def test_a_bad_index_found_after_the_run_fails_the_next_plan():
    indptr, indices, last, q, cache = gpu_case(4)
    good = indices.clone()
    indices[7] = cache.shape[0] + 9
    w = wrapper("fa2", "cuda")
    plan(w, indptr, good, last, q.dtype)
    w.run(q, cache)
    torch.cuda.synchronize()
    busy_gpu()
    plan(w, indptr, indices, last, q.dtype)
    w.run(q, cache)  # launched before the check ran: reads the last page for the bad index
    with pytest.raises(ValueError, match=f"reference page {cache.shape[0] + 9}, but paged_kv_cache has only "
                                         f"{cache.shape[0]} pages \\(the cache of the last run\\(\\)\\)"):
        plan(w, indptr, good, last, q.dtype)
    plan(w, indptr, good, last, q.dtype)  # the wrapper goes on
    want = decode("reference", indptr.cuda(), good, last.cuda(), q, cache)
    assert rel(w.run(q, cache), want) < 2e-2


@pytest.mark.gpu
def test_a_backend_that_does_not_clamp_checks_inside_plan():
    indptr, indices, last, q, cache = gpu_case(5)
    indices[1] = -7
    w = wrapper("reference", "cuda")
    busy_gpu()
    with pytest.raises(ValueError, match="negative page index -7"):
        plan(w, indptr, indices, last, q.dtype)
    assert not w._page_checking()


@pytest.mark.gpu
def test_a_graph_replay_of_a_bad_plan_fails_the_next_plan():
    """CUDA graphs: the replay runs no Python; the next plan() ends the check."""
    indptr, indices, last, q, cache = gpu_case(6)
    batch, pages = len(last), cache.shape[0]
    bufs = [torch.zeros(n, dtype=torch.int32, device="cuda") for n in (batch + 1, pages, batch)]
    ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = fd.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *bufs, "NHD")
    plan(w, indptr, indices, last, q.dtype)
    out = w.run(q, cache)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.run(q, cache)
    bad = indices.clone()
    bad[0] = pages + 2
    plan(w, indptr, bad, last, q.dtype)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"reference page {pages + 2}"):
        plan(w, indptr, indices, last, q.dtype)
    plan(w, indptr, indices, last, q.dtype)
    graph.replay()
    want = decode("reference", indptr.cuda(), indices, last.cuda(), q, cache)
    assert rel(out, want) < 2e-2
