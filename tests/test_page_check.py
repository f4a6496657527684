"""Page indices the API has not checked: the fa2 decode and paged prefill kernels clamp each one
into the cache, and a decode or paged prefill plan() with its lengths on the host checks the
indices on the GPU without waiting (`deferred_check.DeferredPageCheck._finish_page_check`)."""
import json
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import flashdispatch as fd
from flashdispatch import checks
from flashdispatch.backends.fa2.decode_config import CONFIG_ENV
from flashdispatch.deferred_check import DeferredPageCheck
from flashdispatch.planned import WrapperBase, refuse_runs_after_failure

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 64, 8
OPS = ("decode", "prefill")


class Case(NamedTuple):
    op: str
    indptr: torch.Tensor  # int32 on the CPU, as last and qo_indptr
    indices: torch.Tensor
    last: torch.Tensor
    qo_indptr: torch.Tensor  # prefill: up to 3 causal query rows a request (as many as its kv_len)
    q: torch.Tensor
    cache: torch.Tensor


def tables(gen, lens, num_pages):
    """indptr, random distinct page indices in [0, num_pages), last_page_len (int32, CPU)."""
    pages = [-(-n // PAGE) for n in lens]
    indptr = torch.tensor([0] + pages).cumsum(0).int()
    indices = torch.randperm(num_pages, generator=gen)[: int(indptr[-1])].int()
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


def case(op, seed, lens, num_pages, device, dtype=torch.float16):
    """Tables plus q and a cache of random values on every page (a clamped index reads real data)."""
    gen = torch.Generator().manual_seed(seed)
    indptr, indices, last = tables(gen, lens, num_pages)
    qo_lens = [1] * len(lens) if op == "decode" else [min(n, 3) for n in lens]
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).int()
    q = torch.randn(int(qo_indptr[-1]), HEADS, DIM, generator=gen).to(device, dtype)
    cache = torch.randn(num_pages, 2, PAGE, KV_HEADS, DIM, generator=gen).to(device, dtype)
    return Case(op, indptr, indices.to(device), last, qo_indptr, q, cache)


def wrapper(c: Case, backend, **kw):
    ws = torch.empty(16 << 20, dtype=torch.uint8, device=c.q.device)
    cls = fd.BatchDecodeWithPagedKVCacheWrapper if c.op == "decode" else fd.BatchPrefillWithPagedKVCacheWrapper
    return cls(ws, "NHD", backend=backend, **kw)


def plan(w, c: Case, indices=None, on=None):
    """Plan ``c`` (its indices, or ``indices``), the lengths on ``on`` (None: the CPU)."""
    indptr, last, qo = (t if on is None else t.to(on) for t in (c.indptr, c.last, c.qo_indptr))
    indices = c.indices if indices is None else indices
    kw = dict(q_data_type=c.q.dtype, kv_data_type=c.q.dtype)
    if c.op == "decode":
        w.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **kw)
    else:
        w.plan(qo, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, causal=True, **kw)


def attend(backend, c: Case, indices=None, on=None):
    w = wrapper(c, backend)
    plan(w, c, indices, on)
    return w.run(c.q, c.cache)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("op, page_prefetch", [("decode", False), ("decode", True), ("prefill", None)])
def test_fa2_clamps_page_indices_outside_the_cache(monkeypatch, op, page_prefetch):
    """With the check off, indices past the cache and negative ones read the cache's last page:
    fa2 equals the reference run on the clamped indices (no read outside the cache). Decode's both
    page loads: at the tile's use, and a tile ahead (`DecodeConfig.page_prefetch`, the default on GPUs)."""
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "0")
    if page_prefetch is not None:
        monkeypatch.setenv(CONFIG_ENV, json.dumps({"page_prefetch": page_prefetch}))
    pages = 12
    c = case(op, 0, [9, 17, 30], pages, "cpu")
    bad = c.indices.clone()
    bad[[0, 3, 6]] = torch.tensor([pages, -2, pages + 1000], dtype=torch.int32)
    clamped = torch.where((bad < 0) | (bad >= pages), pages - 1, bad).int()
    got = attend("fa2", c, bad)
    assert rel(got, attend("reference", c, clamped)) < 2e-3
    assert rel(got, attend("reference", c)) > 1e-2  # the clamp changed pages


@pytest.mark.parametrize("op", OPS)
def test_cpu_tables_are_checked_inside_plan(op):
    """Indices on the CPU (the tests' fa2 under the interpreter): no deferred check."""
    c = case(op, 1, [9, 17], 8, "cpu")
    c.indices[2] = -5
    w = wrapper(c, "fa2")
    with pytest.raises(ValueError, match="negative page index -5"):
        plan(w, c)
    assert not w._page_checking()


def test_fa2_prefill_clamps_only_indices_unchecked_at_plan(monkeypatch):
    """The prefill kernel's clamp (`PrefillPlan.clamp_pages`) only where plan() has not checked
    the indices before returning: check off, or deferred; and under CUDA graphs, whose replays
    follow later plans."""
    c = case("prefill", 7, [9, 17], 8, "cpu")
    w = wrapper(c, "fa2")
    plan(w, c)
    assert not w._planned.plan.clamp_pages
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "0")
    plan(w, c)
    assert w._planned.plan.clamp_pages
    monkeypatch.delenv(checks.CHECK_INPUTS_ENV)
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (3, 3, 8, 2)]
    g = wrapper(c, "fa2", use_cuda_graph=True, qo_indptr_buf=bufs[0], paged_kv_indptr_buf=bufs[1],
                paged_kv_indices_buf=bufs[2], paged_kv_last_page_len_buf=bufs[3])
    plan(g, c)
    assert g._planned.plan.clamp_pages


class _Reduction:
    """Stands in for `device_read.IndexRangeReader`: the (min, max) of the indices, ready when
    ``ready`` says so."""

    def __init__(self):
        self.pending, self.ready, self.asked = False, False, 0

    def start(self, indices, used, upload=None):
        self.pending, self.range = True, (int(indices[:used].min()), int(indices[:used].max()))
        return None if upload is None else [torch.from_numpy(a.astype("int32")) for a in upload]

    def done(self):
        self.asked += 1
        return self.ready

    def result(self):
        self.pending = False
        return self.range


class _Wrapper(DeferredPageCheck, WrapperBase):
    """The mixin on a wrapper's state (CPU: the deferred path itself needs indices on a GPU), with
    WrapperBase's refusal of run() after a failed plan()."""

    def __init__(self, graph: bool, clamps: bool = True):
        self._use_cuda_graph = graph
        self._page_reader = _Reduction()
        self.variant = SimpleNamespace(max_page_index=0, problem=None,
                                       backend=SimpleNamespace(clamps_page_indices=lambda problem: clamps))
        self._variants = {"run": self.variant}
        self._planned = self.variant

    @refuse_runs_after_failure
    def plan(self, high: int, low: int = 1, error: Exception | None = None):
        """A plan of indices (3, high, low); ``error``: its planning raises that."""
        def planning():
            if error is not None:
                raise error
        self._finish_page_check()
        self._begin_page_check(torch.tensor([3, high, low]), 3, 0)
        self._planning_with_page_check(planning)

    def run(self, pages: int):
        self._page_check_at_run(self._variant("run"), pages)


def test_deferred_check_ends_against_the_caches_its_plan_ran_on():
    """Eager wrappers: the smallest cache a run() got since the plan (a 64-page run read clamped
    pages, a later 200-page run does not excuse it), none when no run() came (the engine may grow
    its cache); graph wrappers: the last run()'s, whose cache replays read. The largest index is
    recorded when the check raises, so a retried run() on that cache is refused."""
    w = _Wrapper(graph=False)
    w.run(64)
    w.plan(150)
    w.plan(150)  # no run() since: nothing to check the index against
    assert w.variant.max_page_index == 150
    w.run(64)
    w.run(200)
    with pytest.raises(ValueError, match="reference page 150, but paged_kv_cache has only 64 pages"):
        w.plan(150)
    assert w.variant.max_page_index == 150  # run() checks it against the cache it gets
    g = _Wrapper(graph=True)
    g.run(64)  # the capture's run()
    g.plan(150)
    with pytest.raises(ValueError, match="only 64 pages \\(the cache of the last run\\(\\)\\)"):
        g.plan(150)  # replays of that plan read the 64-page cache


def test_a_negative_index_refuses_every_run_of_its_plan():
    """No cache makes a negative index valid: once the check finds one, run() refuses that plan
    (a retried run() too, which would read clamped pages) until a plan() succeeds."""
    w = _Wrapper(graph=False)
    w.plan(20, low=-4)
    w._page_reader.ready = True
    for _ in range(2):
        with pytest.raises(ValueError, match="negative page index -4"):
            w.run(64)
    with pytest.raises(ValueError, match="run\\(\\) refused until a plan\\(\\) succeeds"):
        w.run(200)
    w.plan(20)
    w.run(64)
    assert not w._page_checking() and w.variant.max_page_index == 20
    r = _Wrapper(graph=False, clamps=False)  # a backend that does not clamp: the check ends in plan()
    with pytest.raises(ValueError, match="negative page index -2"):
        r.plan(20, low=-2)
    with pytest.raises(ValueError, match="refused until a plan\\(\\) succeeds: .*negative page index -2"):
        r.run(64)  # the plan stays installed: its run() would read page -2
    r.plan(20)
    r.run(64)


def test_runs_ask_whether_the_check_ran_at_the_1st_2nd_4th_8th_run_after_its_plan():
    """The reduction is asked about (an event query) at the 1st, 2nd, 4th, 8th, ... run() after
    its plan(): a step's runs, issued ahead of the GPU, ask a few times, and a plan run many times
    still ends its check (a bad index is then refused before the launch)."""
    w = _Wrapper(graph=False)
    w.plan(20)
    for _ in range(9):
        w.run(64)
    assert w._page_reader.asked == 4 and w._page_checking()  # runs 1, 2, 4, 8
    w._page_reader.ready = True
    for _ in range(6):
        w.run(64)  # runs 10-15 do not ask
    assert w._page_reader.asked == 4 and w._page_checking()
    w.run(64)  # run 16 asks, finds it ran: ended before the launch
    assert w._page_reader.asked == 5 and not w._page_checking() and w.variant.max_page_index == 20
    w._page_reader.ready = False
    w.plan(150)  # (index 150: past the 64 pages of its runs)
    w.run(64)
    assert w._page_reader.asked == 6 and w._page_checking()
    w._page_reader.ready = True
    with pytest.raises(ValueError, match="reference page 150, but paged_kv_cache has only 64 pages"):
        w.run(64)  # run 2 asks: refused before its launch, as at every later run() on that cache


def test_a_run_of_a_backend_that_does_not_clamp_ends_the_check_first():
    """A run() whose variant's backend reads page indices unclamped waits for a pending check
    (and ends it) before its launch, whether or not this run() would ask."""
    w = _Wrapper(graph=False)
    w.plan(20)
    w.run(64)  # asks: not run yet
    w.variant.backend = SimpleNamespace(clamps_page_indices=lambda problem: False)
    w.run(64)
    assert not w._page_checking() and w.variant.max_page_index == 20


def test_a_plan_that_fails_refuses_run_until_a_plan_succeeds():
    """A plan() that fails while planning has replaced the tables: run() must not launch on them
    unchecked (the failed plan's check is dropped); the next plan() that succeeds lifts it."""
    w = _Wrapper(graph=False)
    w.plan(20)
    w.run(64)
    with pytest.raises(RuntimeError, match="stand-in"):
        w.plan(30, low=-1, error=RuntimeError("stand-in planning error"))
    assert not w._page_checking()
    with pytest.raises(ValueError, match="refused until a plan\\(\\) succeeds: the last plan\\(\\) raised "
                                         "RuntimeError: stand-in planning error"):
        w.run(64)
    w.plan(30)
    w.run(64)


# --- on the GPU: plan() with host lengths does not wait for the GPU ---------------------------------
def gpu_case(op, seed, pages=64, lens=(40, 7, 0, 130), dtype=torch.bfloat16):
    return case(op, seed, list(lens), pages, "cuda", dtype)


def busy_gpu() -> torch.cuda.Event:
    """~100 ms of GPU work queued on the current stream; the event after it."""
    torch.cuda._sleep(200_000_000)
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_host_lengths_plan_and_run_do_not_wait_for_the_gpu(op):
    c = gpu_case(op, 2)
    w = wrapper(c, "fa2")
    plan(w, c)
    w.run(c.q, c.cache)  # compiles
    torch.cuda.synchronize()
    busy = busy_gpu()
    plan(w, c)
    out = w.run(c.q, c.cache)
    assert not busy.query(), "plan() or run() waited for the GPU"
    assert w._page_checking()  # still pending: ends at the next plan()
    torch.cuda.synchronize()
    assert rel(out, attend("reference", c, on="cuda")) < 2e-2
    plan(w, c)  # ends the last check (valid)
    torch.cuda.synchronize()
    w.run(c.q, c.cache)  # finds this plan's check done: the largest index is now what run() checks
    assert not w._page_checking() and w._planned.max_page_index == int(c.indices.max())


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_a_bad_index_found_before_the_run_refuses_the_launch(op):
    c = gpu_case(op, 3)
    c.indices[5] = -3
    w = wrapper(c, "fa2")
    plan(w, c)  # returns: the check is on its way
    torch.cuda.synchronize()
    out = torch.full((c.q.shape[0], HEADS, DIM), float("nan"), dtype=c.q.dtype, device="cuda")
    with pytest.raises(ValueError, match="negative page index -3"):
        w.run(c.q, c.cache, out=out)
    with pytest.raises(ValueError, match="refused until a plan\\(\\) succeeds: .*negative page index -3"):
        w.run(c.q, c.cache, out=out)  # a retry too: no cache makes that index valid
    assert out.isnan().all()  # nothing was launched
    c.indices[5] = c.cache.shape[0] + 4
    plan(w, c)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"reference page {c.cache.shape[0] + 4}, but paged_kv_cache has only"):
        w.run(c.q, c.cache, out=out)
    assert out.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_a_bad_index_found_after_the_run_fails_the_next_plan(op):
    c = gpu_case(op, 4)
    bad = c.indices.clone()
    bad[7] = c.cache.shape[0] + 9
    w = wrapper(c, "fa2")
    plan(w, c)
    w.run(c.q, c.cache)
    torch.cuda.synchronize()
    busy_gpu()
    plan(w, c, bad)
    w.run(c.q, c.cache)  # launched before the check ran: reads the last page for the bad index
    with pytest.raises(ValueError, match=f"reference page {c.cache.shape[0] + 9}, but paged_kv_cache has only "
                                         f"{c.cache.shape[0]} pages \\(the smallest cache a run\\(\\) got since "
                                         "that plan\\(\\)\\)"):
        plan(w, c)
    plan(w, c)  # the wrapper goes on
    assert rel(w.run(c.q, c.cache), attend("reference", c, on="cuda")) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_a_backend_that_does_not_clamp_checks_inside_plan(op):
    c = gpu_case(op, 5)
    c.indices[1] = -7
    w = wrapper(c, "reference")
    busy_gpu()
    with pytest.raises(ValueError, match="negative page index -7"):
        plan(w, c)
    assert not w._page_checking()
    with pytest.raises(ValueError, match="refused until a plan\\(\\) succeeds: .*negative page index -7"):
        w.run(c.q, c.cache)  # the reference would read the page torch wraps -7 to


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_a_plan_that_raises_leaves_no_check_pending(op):
    """A plan() refused after its lengths were read (here: a CUDA-graph indices buffer too small)
    queues no check, or drops the one it queued: the next plan() is not failed by these indices."""
    c = gpu_case(op, 8)
    batch = len(c.last)
    small = torch.zeros(2, dtype=torch.int32, device="cuda")
    if op == "decode":
        bufs = dict(paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                    paged_kv_indices_buffer=small,
                    paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    else:
        sizes = (("qo_indptr_buf", batch + 1), ("paged_kv_indptr_buf", batch + 1),
                 ("paged_kv_last_page_len_buf", batch))
        bufs = {name: torch.zeros(n, dtype=torch.int32, device="cuda") for name, n in sizes}
        bufs["paged_kv_indices_buf"] = small
    w = wrapper(c, "fa2", use_cuda_graph=True, **bufs)
    c.indices[3] = -1
    with pytest.raises(ValueError, match="paged_kv_indices_buf.* holds 2 entries"):
        plan(w, c)
    assert not w._page_checking()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["fa2", "reference"])
def test_a_plan_is_checked_against_the_cache_of_its_own_run(op, backend):
    """An engine that grows its cache between steps: a plan's indices past the cache of the last
    run() are refused only by a run() on a cache too small for them; neither a backend that does
    not clamp (its check ends inside plan()) nor the next plan() with no run() between refuses
    them."""
    small = gpu_case(op, 9)
    grown = gpu_case(op, 10, pages=200)
    grown.indices[0] = 199
    w = wrapper(small, backend)
    plan(w, small)
    w.run(small.q, small.cache)
    plan(w, grown)
    plan(w, grown)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"reference page 199, but paged_kv_cache has only {small.cache.shape[0]}"):
        w.run(grown.q, small.cache)
    assert rel(w.run(grown.q, grown.cache), attend("reference", grown, on="cuda")) < 2e-2


@pytest.mark.gpu
def test_a_graph_replay_of_a_bad_plan_fails_the_next_plan():
    """CUDA graphs: the replay runs no Python; the next plan() ends the check."""
    c = gpu_case("decode", 6)
    batch, pages = len(c.last), c.cache.shape[0]
    bufs = [torch.zeros(n, dtype=torch.int32, device="cuda") for n in (batch + 1, pages, batch)]
    ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = fd.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *bufs, "NHD")
    plan(w, c)
    out = w.run(c.q, c.cache)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.run(c.q, c.cache)
    bad = c.indices.clone()
    bad[0] = pages + 2
    plan(w, c, bad)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"reference page {pages + 2}"):
        plan(w, c)
    plan(w, c)
    graph.replay()
    assert rel(out, attend("reference", c, on="cuda")) < 2e-2


@pytest.mark.gpu
def test_host_lengths_reach_the_gpu_with_the_check():
    """A decode plan() with its lengths on the host gets indptr and last_page_len onto the GPU
    from the page check's own launch: on one wrapper, a batch size, other lengths of it, another
    size, the first size again (its kept device views), each run as the reference does."""
    w = None
    for seed, lens in enumerate([(40, 7, 0, 130), (41, 8, 1, 131), (200, 1, 17, 9, 64, 33), (3, 90, 2, 5)]):
        c = gpu_case("decode", seed, pages=128, lens=lens)
        w = w or wrapper(c, "fa2")
        plan(w, c)
        assert w._plan_args.indptr.is_cuda and w._plan_args.last_page_len.is_cuda
        assert w._plan_args.indptr.tolist() == c.indptr.tolist()
        assert w._plan_args.last_page_len.tolist() == c.last.tolist()
        out = w.run(c.q, c.cache)
        assert rel(out, attend("reference", c, on="cuda")) < 2e-2, lens
