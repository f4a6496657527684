"""A wrapper's next plan() with the same batch size and scalar arguments refreshes the last plan
(`Backend.replan`) where the backend can: fa2 decode swaps in the new page table when it reads the
table directly and its layout stays (no request split, or the kernel's own split with as many
chunk slots). Every refreshed run is checked against a float64 dense computation on new lengths
and pages; anything else must plan afresh."""
import pytest
import torch

import flashdispatch as flashinfer
from flashdispatch.dispatch.registry import backend_class

from test_api import dense_attention, paged_to_dense, rel


PAGE, HQ, HKV, D, PAGES = 16, 4, 2, 64, 96


@pytest.fixture
def fresh_plans(monkeypatch):
    """Counts the fa2 plans made afresh (not refreshed)."""
    fa2 = backend_class("fa2")
    made = []
    original = fa2.plan

    def counting(self, problem, device, params):
        made.append(problem)
        return original(self, problem, device, params)

    monkeypatch.setattr(fa2, "plan", counting)
    return made


@pytest.fixture
def launched(monkeypatch):
    """(key, arguments) of every launch of the tensors (`BoundKernel.launch_with_spec`), the only
    launches under the interpreter."""
    from flashdispatch.backends.fa2.launch import BoundKernel
    calls = []
    original = BoundKernel.launch_with_spec

    def recording(self, spec, grid, args):
        calls.append((spec, args))
        original(self, spec, grid, args)

    monkeypatch.setattr(BoundKernel, "launch_with_spec", recording)
    return calls


def _table(lens, seed, pages=PAGES, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = [(x + PAGE - 1) // PAGE for x in lens]
    indptr = torch.tensor([0] + [sum(n[:i + 1]) for i in range(len(n))], dtype=torch.int32)
    last = torch.tensor([x - (c - 1) * PAGE if c else 0 for x, c in zip(lens, n)], dtype=torch.int32)
    return tuple(t.to(device) for t in (indptr, torch.randperm(pages, generator=g)[:sum(n)].int(), last))


def _check(wrapper, kv, table, sm_scale=None, return_lse=False, heads=HQ):
    q = torch.randn(len(table[2]), heads, D).half()
    got = wrapper.run(q, kv, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    for b in range(len(table[2])):
        k, v = paged_to_dense(kv, *table, PAGE, b)
        ref, ref_lse = dense_attention(q[b:b + 1], k, v, sm_scale=sm_scale)
        assert rel(out[b:b + 1], ref) < 4e-3
        if return_lse and k.shape[0]:
            assert torch.allclose(lse[b].double(), ref_lse[0], atol=2e-3)


@pytest.mark.interpreted
@pytest.mark.parametrize("repeat", [1, 4], ids=["partitioned", "never-split"])
def test_replan_refreshes_the_table_and_stays_exact(fresh_plans, repeat):
    """4 requests x 2 KV heads: the refresh works the partition out (under the 8-SM CPU target);
    16 x 2 fill it, so no length can split a request (the refresh's shortcut)."""
    torch.manual_seed(0)
    kv = torch.randn(PAGES * repeat, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    w.plan(*_table([40, 0, 130, 17] * repeat, 0, PAGES * repeat), HQ, HKV, D, PAGE, data_type=torch.float16)
    assert w._planned.plan.direct, "the case must plan the direct-table kernel, the one a re-plan refreshes"
    assert len(fresh_plans) == 1
    for seed, lens in enumerate(([16, 77, 3, 200], [1, 1, 0, 48], [250, 9, 64, 33]), 1):
        lens = lens * repeat
        table = _table(lens, seed, PAGES * repeat)
        w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)
        _check(w, kv, table)
        _check(w, kv, table, return_lse=True)  # a variant first asked for after the re-plan
    assert len(fresh_plans) == 2  # the plan, and the lse variant at its first run


@pytest.mark.interpreted
def test_replan_plans_afresh_when_the_scalars_batch_or_workspace_change(fresh_plans):
    torch.manual_seed(1)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    w.plan(*_table([40, 90, 130], 0), HQ, HKV, D, PAGE, data_type=torch.float16)
    table = _table([41, 89, 100], 1)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    _check(w, kv, table, sm_scale=0.3)
    table = _table([41, 89], 2)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    _check(w, kv, table, sm_scale=0.3)
    w.reset_workspace_buffer(torch.zeros(1 << 22, dtype=torch.uint8))
    w.plan(*_table([5, 6], 3), HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    assert len(fresh_plans) == 4


@pytest.mark.interpreted
@pytest.mark.parametrize("merge", ["fused", "merge_kernel"])
def test_replan_of_a_split_keeps_the_kernels_split_while_its_slots_stay(fresh_plans, monkeypatch, merge):
    """A short request plans the unsplit direct kernel; a long one needs the policy's split, which
    the kernel derives itself from the tables (chunk slots per request): planned afresh. Re-plans
    whose lengths keep the slot count are refreshed (the split length may change), ones that need
    other slots plan afresh, and one that would idle most of its grid (a long request among short
    ones) takes the work array. Each plan() and its lse variant count two fresh plans; every run
    is checked against the dense computation, lse too. The fused merge (in the decode kernel) and
    the merge kernel (info rows the decode kernel writes) both."""
    # block_n 64: the chunk lengths and slot counts below are in 64-token steps
    config = '{"block_n": 64, "fused_merge_max_chunks": 0}' if merge == "merge_kernel" else '{"block_n": 64}'
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", config)
    torch.manual_seed(2)
    pages = 420
    kv = torch.randn(pages, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")

    def plan(lens, seed):
        table = _table(lens, seed, pages)
        w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)
        _check(w, kv, table, return_lse=True)
        p = w._planned.plan
        return (p.direct, p.split_slots, p.split_tokens, len(fresh_plans))

    assert plan([20], 0) == (True, 1, 0, 2)
    assert plan([1500], 1) == (True, 5, 256, 4)
    assert plan([1400], 2) == (True, 5, 256, 4)  # refreshed
    assert plan([3000, 2900], 3) == (True, 8, 368, 6)
    assert plan([3200, 3100], 4) == (True, 8, 393, 6)  # refreshed with another split length
    assert plan([3300, 2000], 5) == (True, 9, 331, 8)
    assert plan([1200, 30, 30, 30], 6)[::3] == (False, 10)  # 4 x 4 slots for 7 chunks: the work array
    assert w._planned.plan.fused_merge == (merge == "fused")


@pytest.mark.interpreted
def test_a_refresh_keeps_the_launch_keys_while_its_own_arguments_keep_their_specialisation(fresh_plans, launched,
                                                                                           monkeypatch):
    """A refreshed plan whose tables and scalars specialise as the last plan's did keeps its kept
    launch keys (`SpecKeys.carried`: on a GPU its first run() then launches by address with no key
    to work out); a page table off 16-byte alignment, or a split length whose divisibility by 16
    changes, takes new ones. Every launch's key is the `spec_key` of its arguments."""
    from flashdispatch.backends.fa2.launch import spec_key
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"block_n": 64}')
    torch.manual_seed(3)
    pages = 420
    kv = torch.randn(pages, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    kept = []

    def plan(lens, seed, offset=0):
        indptr, indices, last = _table(lens, seed, pages)
        if offset:  # the same indices one int32 past a 16-byte boundary
            indices = torch.cat([torch.zeros(offset, dtype=torch.int32), indices])[offset:]
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, data_type=torch.float16)
        _check(w, kv, (indptr, indices, last))
        p = w._planned.plan
        kept.append(p._specs)
        return p.split_tokens, len(fresh_plans)

    assert plan([1500], 1) == (256, 1)
    assert plan([1400], 2) == (256, 1) and kept[1] is kept[0]  # refreshed: the same keys
    assert plan([1400], 2, offset=1) == (256, 1) and kept[2] is not kept[1]
    assert plan([3000, 2900], 3) == (368, 2)
    assert plan([3200, 3100], 4) == (393, 2) and kept[4] is not kept[3]  # 368 divides by 16, 393 not
    assert launched and all(spec == spec_key(args) for spec, args in launched)


@pytest.mark.interpreted
def test_a_plan_and_its_refreshed_copy_launch_with_the_keys_of_their_arguments(launched, monkeypatch):
    """The launch keys a plan shares with its refreshed copy (`SpecKeys.carried`) are right for
    both, run alternately with inputs of several kinds (lse or not, fp16 or fp32 out, a strided
    out, a q off 16-byte alignment: no key kept), also while the keys are dropped at their limit:
    every launch's key (decode and merge) is the `spec_key` of its arguments."""
    from flashdispatch.backends.base import AttentionInputs, PagedKV
    from flashdispatch.backends.fa2.launch import spec_key
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"block_n": 64, "fused_merge_max_chunks": 0}')
    torch.manual_seed(4)
    kv = PagedKV.of_combined(torch.randn(420, 2, PAGE, HKV, D).half(), "NHD")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    plans = []
    for lens, seed in (([1500], 1), ([1400], 2)):
        w.plan(*_table(lens, seed, 420), HQ, HKV, D, PAGE, data_type=torch.float16)
        plans.append(w._planned.plan)
    first, second = plans
    assert first is not second and first._specs is second._specs and first._merge is not None
    q = torch.randn(1, HQ, D).half()
    misaligned_q = torch.cat([torch.zeros(1, dtype=torch.half), q.flatten()])[1:].view(1, HQ, D)
    for _ in range(2):
        for plan in (second, first, second):
            for q_in, out, lse in ((q, torch.empty(1, HQ, D).half(), None),
                                   (q, torch.empty(1, HQ, D).half(), torch.empty(1, HQ)),
                                   (q, torch.empty(1, HQ, D), torch.empty(1, HQ)),  # only out's dtype differs
                                   (q, torch.empty(1, HQ, 2 * D).half()[..., :D], torch.empty(1, HQ)),
                                   (misaligned_q, torch.empty(1, HQ, D).half(), None)):
                plan.run(AttentionInputs(q_in, kv, out, lse))
        first._specs.limit = 2  # from the second round on, the kept keys are dropped as kinds come
    assert len(launched) == 60 and all(spec is None or spec == spec_key(args) for spec, args in launched)
    assert sum(spec is None for spec, _ in launched) == 6  # the misaligned q's decode launches


def _same_as_a_fresh_plan(planned) -> None:
    """A refreshed fa2 decode plan launches what a plan made afresh from its params would: the same
    grid, kernel constants, scalars and work rows (`plan_decode` directly: not counted as a plan)."""
    from flashdispatch.backends.fa2.decode import plan_decode
    fresh = plan_decode(planned.problem, planned.device, planned.params)
    got = planned.plan
    assert (got._grid, got._consts, got._plan_scalars, got.config) == (
        fresh._grid, fresh._consts, fresh._plan_scalars, fresh.config)
    assert torch.equal(got.work, fresh.work) and got.info.numel() == fresh.info.numel() == 0


@pytest.mark.interpreted
def test_replan_of_one_work_row_per_request_rebuilds_the_rows(fresh_plans):
    """MHA (2/2 heads: the host's work array, no direct table), 4 requests x 2 heads under the CPU
    target: lengths that split no request give one work row per request, and a re-plan whose
    lengths keep that rebuilds and uploads the rows alone (what a fresh plan launches); lengths
    that split a request, and the re-plan after them, plan afresh. Each plan() and its lse
    variant count two fresh plans; every run is checked against the dense computation, lse too."""
    torch.manual_seed(6)
    pages = 400
    kv = torch.randn(pages, 2, PAGE, 2, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")

    def plan(lens, seed):
        table = _table(lens, seed, pages)
        w.plan(*table, 2, 2, D, PAGE, data_type=torch.float16)
        _check(w, kv, table, return_lse=True, heads=2)
        p = w._planned.plan
        assert not p.direct
        if p.whole_rows:
            _same_as_a_fresh_plan(w._planned)
        return p.whole_rows, p.n_merge, len(fresh_plans)

    assert plan([40, 0, 130, 17], 0) == (True, 0, 2)
    assert plan([16, 77, 3, 200], 1) == (True, 0, 2)  # refreshed, the lse variant too
    assert plan([900, 5, 5, 5], 2) == (False, 1, 4)  # the long request splits
    assert plan([300, 300, 300, 300], 3) == (True, 0, 6)  # after a split plan: afresh
    assert plan([250, 9, 64, 0], 4) == (True, 0, 6)


@pytest.mark.interpreted
def test_graph_replan_of_one_work_row_per_request_rewrites_the_rows_in_place():
    """Graph mode, MHA, 16 requests x 2 heads (one chunk slot each: one work row per request): a
    re-plan rewrites the rows at the captured plan's addresses with its grid and constants, so the
    captured plan object run on the new inputs (a replay) gives the new lengths' attention."""
    from flashdispatch.backends.base import AttentionInputs, PagedKV

    torch.manual_seed(7)
    batch, pages = 16, 200
    kv = torch.randn(pages, 2, PAGE, 2, D).half()
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (batch + 1, pages, batch)]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(1 << 22, dtype=torch.uint8), use_cuda_graph=True, backend="fa2",
        paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    w.plan(*_table([40, 0, 130, 17] * 4, 0, pages), 2, 2, D, PAGE, data_type=torch.float16)
    captured = w._planned.plan
    assert captured.whole_rows
    for seed, lens in enumerate(([16, 77, 3, 200] * 4, [1, 90, 0, 33] * 4), 1):
        table = _table(lens, seed, pages)
        w.plan(*table, 2, 2, D, PAGE, data_type=torch.float16)
        now = w._planned.plan
        assert now is not captured and now.whole_rows
        assert (now._grid, now._consts, now._plan_scalars, now._table_addrs) == (
            captured._grid, captured._consts, captured._plan_scalars, captured._table_addrs)
        _same_as_a_fresh_plan(w._planned)
        q = torch.randn(batch, 2, D).half()
        out = torch.full((batch, 2, D), float("nan"), dtype=torch.float16)
        w._planned.backend.run(captured, AttentionInputs(q, PagedKV(kv[:, 0], kv[:, 1], "NHD"), out))
        for b in range(batch):
            k, v = paged_to_dense(kv, *table, PAGE, b)
            assert rel(out[b:b + 1], dense_attention(q[b:b + 1], k, v)[0]) < 4e-3, (seed, b)


@pytest.mark.interpreted
@pytest.mark.parametrize("op, rows", [("decode", 1), ("prefill", 1), ("prefill", 0)])
def test_a_graph_captured_on_empty_requests_replays_a_replan_with_pages(op, rows):
    """Graph mode, every request empty at capture (prefill: with one query row, or none, so no
    work item at all): the plan must still hold the fixed indices buffer's and the work list's
    addresses (an empty view's data_ptr() is 0), so a replay after a re-plan that uses pages reads
    the new table (emulated by running the captured plan object on the new inputs)."""
    from flashdispatch.backends.base import AttentionInputs, PagedKV

    torch.manual_seed(3)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D).half()
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (2, PAGES, 1)]
    ws = torch.zeros(1 << 22, dtype=torch.uint8)
    if op == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, use_cuda_graph=True, backend="fa2", paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
            paged_kv_last_page_len_buffer=bufs[2])
        plan = lambda table, qo: w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)  # noqa: E731
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, use_cuda_graph=True, backend="fa2", qo_indptr_buf=torch.zeros(2, dtype=torch.int32),
            paged_kv_indptr_buf=bufs[0], paged_kv_indices_buf=bufs[1], paged_kv_last_page_len_buf=bufs[2])
        plan = lambda table, qo: w.plan(torch.tensor([0, qo], dtype=torch.int32), *table, HQ, HKV, D,  # noqa: E731
                                        PAGE, q_data_type=torch.float16)
    q = torch.randn(1, HQ, D).half()
    plan(_table([0], 0), rows)
    assert not w.run(q[:rows], kv).any()  # an empty request: zeros
    captured = w._planned
    table = _table([70], 1)
    plan(table, 1)
    out = torch.full((1, HQ, D), float("nan"), dtype=torch.float16)
    captured.backend.run(captured.plan, AttentionInputs(q, PagedKV(kv[:, 0], kv[:, 1], "NHD"), out))
    k, v = paged_to_dense(kv, *table, PAGE, 0)
    assert rel(out, dense_attention(q, k, v)[0]) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_a_graph_capture_on_no_rows_is_refused(op):
    """Prefill under CUDA graphs: a capture of run() on an empty q (paged: no query rows) or empty
    k/v (ragged: no keys) is refused before any launch (those tensors have no address, a replay
    after a re-plan with rows would read through null pointers); one row is captured, and replays
    after re-plans of other lengths equal eager runs."""
    dev = "cuda"
    ws = torch.zeros(1 << 22, dtype=torch.uint8, device=dev)
    q_buf = torch.randn(8, HQ, D, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32, device=dev)
    qo_buf, kv_buf = torch.zeros(2, **i32), torch.zeros(2, **i32)
    if op == "paged":
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, use_cuda_graph=True, backend="fa2", qo_indptr_buf=qo_buf, paged_kv_indptr_buf=kv_buf,
            paged_kv_indices_buf=torch.zeros(PAGES, **i32), paged_kv_last_page_len_buf=torch.zeros(1, **i32))

        def attend(rows, keys):
            table = _table([keys], 5, device=dev)
            w.plan(torch.tensor([0, rows], **i32), *table, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
            return lambda: w.run(q_buf[:rows], kv)
        empty, refused = attend(0, 40), "an empty q"
    else:
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, use_cuda_graph=True, backend="fa2",
                                                            qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf)
        k_buf = torch.randn(64, HKV, D, device=dev, dtype=torch.bfloat16)

        def attend(rows, keys):
            w.plan(torch.tensor([0, rows], **i32), torch.tensor([0, keys], **i32), HQ, HKV, D,
                   q_data_type=torch.bfloat16)
            return lambda: w.run(q_buf[:rows], k_buf[:keys], k_buf[:keys])
        empty, refused = attend(1, 0), "an empty k and v"
    empty()  # eager: nothing to read
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=f"captured with {refused}"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            empty()
    run = attend(1, 40)
    run()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for keys in (25, 0, 40):  # re-plans of the captured row: the replay reads their tables
        ref = attend(1, keys)().clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), keys


@pytest.mark.gpu
@pytest.mark.parametrize("batch, max_len, split, hkv", [(128, 640, False, 8), (16, 2048, True, 8), (2, 9000, True, 8),
                                                       (128, 640, False, 32)],
                         ids=["unsplit", "split-fused", "split-merge-kernel", "mha-work-rows"])
def test_replan_on_the_gpu_matches_the_reference(fresh_plans, batch, max_len, split, hkv, monkeypatch):
    """bf16, 32/8 heads (MHA 32/32: the host's work array of one row per request, whose re-plans
    rebuild the rows alone): batch 128 splits nothing (on a GPU of up to 256 SMs); 16 requests of up to
    2048 tokens split into at most 16 chunks (the fused merge), 2 of up to 9000 into more (the
    merge kernel, after the decode kernel's info rows), each request on its own (16 mixed requests
    would take the line: few_line_mixed off). Re-plans with new lengths and pages, on device
    tables, each run against the reference backend's, lse too."""
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"few_line_mixed": 0}')
    torch.manual_seed(3)
    hq, d = 32, 128
    pages = batch * (max_len // PAGE + 1)
    kv = torch.randn(pages, 2, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, backend="fa2")
    ref = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(ws), backend="reference")
    g = torch.Generator().manual_seed(4)
    for seed in range(4):
        # similar lengths: the kernel's own split; unsplit, the longest under 1.5 x the mean (wider
        # spreads past one wave pack: DecodeConfig.wave_pack_spread)
        low = max_len * 9 // 10 if split else max_len // 2
        lens = torch.randint(low, max_len + 1, (batch,), generator=g).tolist()
        table = _table(lens, seed, pages, "cuda")
        for wrapper in (w, ref):
            wrapper.plan(*table, hq, hkv, d, PAGE, data_type=torch.bfloat16)
        p = w._planned.plan
        assert (p.direct, p.whole_rows) == (False, True) if hkv == hq else p.direct and (p.split_slots > 1) == split
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        out, lse = w.run(q, kv, return_lse=True)
        ref_out, ref_lse = ref.run(q, kv, return_lse=True)
        assert rel(out, ref_out) < 2e-2
        full = torch.tensor(lens, device="cuda") > 0
        assert torch.allclose(lse[full], ref_lse[full], atol=2e-2)
        assert torch.equal(out[~full], torch.zeros_like(out[~full])) and bool(torch.isneginf(lse[~full]).all())
    if not split:
        assert len(fresh_plans) == 2  # the first plan, and its lse variant at the first run


@pytest.mark.interpreted
def test_a_graph_variant_that_fails_its_first_plan_does_not_fail_later_plans(monkeypatch):
    """Graph mode re-plans, at each plan(), every variant that has a metadata buffer: a variant
    refused at its first plan (here q_len_per_req=2, made to fail) must not keep one, or every
    later plan() would raise its error."""
    fa2 = backend_class("fa2")
    original = fa2.plan

    def refusing(self, problem, device, params):
        if problem.mask_mode == "causal":
            raise flashinfer.Unsupported("stand-in refusal of q_len_per_req=2")
        return original(self, problem, device, params)

    monkeypatch.setattr(fa2, "plan", refusing)
    torch.manual_seed(5)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(1 << 22, dtype=torch.uint8), use_cuda_graph=True, backend="fa2",
        paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(PAGES, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    w.plan(*_table([40, 9], 0), HQ, HKV, D, PAGE, data_type=torch.float16)
    with pytest.raises(flashinfer.Unsupported, match="stand-in refusal"):
        w.run(torch.randn(4, HQ, D).half(), kv, q_len_per_req=2)
    table = _table([70, 33], 1)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)
    _check(w, kv, table)
