"""The block-table entry points (TensorRT-LLM / XQA style: block_tables + seq_lens, no plan):
the page table they build, and fa2 on requests long enough to split, whose partials go to the
caller's workspace_buffer."""
import numpy as np
import pytest
import torch

import flashdispatch as fi
from flashdispatch.dispatch.registry import backend_class
from flashdispatch.page import block_table_to_indptr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_to_indptr_takes_each_requests_pages_in_use(device):
    """Each request's first ceil(len / page) table entries, end to end, from a strided table with
    negative entries past the pages in use (never read); the pages' (min, max) checked and read."""
    torch.manual_seed(4)
    wide = torch.randint(-50, 0, (5, 16), dtype=torch.int32)
    lens = torch.tensor([9, 0, 40, 1, 17], dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        wide[b, :2 * (-(-n // 8))] = torch.randperm(100)[: 2 * (-(-n // 8))].int()
    tables = wide[:, ::2].to(device)  # [5, 8], stride 2: the gather reads a view as it is
    indptr, indices, last, kv_lens, max_page = block_table_to_indptr(tables, lens.to(device), 8)
    pages = [-(-n // 8) for n in lens.tolist()]
    want = torch.cat([wide[b, ::2][:p] for b, p in enumerate(pages)])
    assert indptr.tolist() == [0, *np.cumsum(pages).tolist()] and indptr.device.type == "cpu"
    assert indices.device == tables.device and torch.equal(indices.cpu(), want)
    assert last.tolist() == [1, 0, 8, 1, 1] and kv_lens.tolist() == lens.tolist()
    assert max_page == int(want.max())
    assert block_table_to_indptr(tables, lens, 8, check_indices=False).max_page is None
    empty = block_table_to_indptr(tables, torch.zeros(5, dtype=torch.int32), 8)
    assert empty.indices.numel() == 0 and empty.max_page == -1 and empty.indptr.tolist() == [0] * 6
    tables[3, 0] = -6  # request 3 uses its first page
    with pytest.raises(ValueError, match="block_tables holds a negative page index -6"):
        block_table_to_indptr(tables, lens, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_trtllm_and_xqa_decode_on_fa2_split_long_requests_in_the_callers_workspace(device):
    """A request long enough for fa2 to split: its partials go to workspace_buffer (it was passed
    on as no workspace, and such a call raised 'float_workspace_buffer too small: 0 bytes')."""
    torch.manual_seed(5)
    page, hq, hkv, d = 16, 4, 2, 64
    lens = torch.tensor([700, 5], dtype=torch.int32)
    tables = torch.randperm(100)[:90].int().view(2, 45)  # request 1 reads its first page only
    cache = torch.randn(100, 2, hkv, page, d).half()  # HND
    q = torch.randn(2, hq, d).half()
    args = [t.to(device) for t in (q, cache)]
    outs = {}
    for backend in ("fa2", "reference"):
        ws = torch.full((1 << 20,), 255, dtype=torch.uint8, device=device)
        outs[backend] = fi.trtllm_batch_decode_with_kv_cache(*args, ws, tables.to(device), lens.to(device), 720,
                                                             bmm1_scale=d ** -0.5, backend=backend)
        assert (ws != 255).any() == (backend == "fa2")  # fa2 split: partials in the caller's workspace
    assert rel(outs["fa2"], outs["reference"]) < 4e-3
    out = torch.empty(2, 1, hq, d, dtype=torch.float16, device=device)
    ws = torch.full((1 << 20,), 255, dtype=torch.uint8, device=device)
    nhd = cache.to(device).transpose(2, 3)  # [pages, 2, page, heads, d] views
    with fi.use_backends(["fa2"]):
        fi.xqa(args[0][:, None], nhd[:, 0], nhd[:, 1], tables.to(device), lens[:, None].to(device), out, ws, None,
               hkv, page)
    assert (ws != 255).any()
    assert rel(out[:, 0], outs["reference"]) < 4e-3


@pytest.mark.parametrize("device", DEVICES)
def test_trtllm_decode_calls_refresh_the_last_plan_for_new_tables(device, monkeypatch):
    """Calls of one problem and batch size refresh the last call's plan for their own lengths and
    tables (fa2 refreshes what it can, plans afresh otherwise): each equals the reference; a call
    with another workspace plans into that one."""
    fa2 = backend_class("fa2")  # patched on the class: pytest < 9.2 leaves an instance's bound method behind
    real, refreshed = fa2.replan, []
    monkeypatch.setattr(fa2, "replan", lambda *a: refreshed.append(real(*a)) or refreshed[-1])
    torch.manual_seed(6)
    page, hq, hkv, d = 16, 4, 2, 64
    cache = torch.randn(100, 2, hkv, page, d).half().to(device)
    q = torch.randn(2, hq, d).half().to(device)
    workspaces = [torch.full((1 << 20,), 255, dtype=torch.uint8, device=device) for _ in range(2)]
    for i, lens in enumerate(([700, 5], [30, 400], [1, 17], [690, 9], [700, 5])):
        tables = torch.randperm(100)[:90].int().view(2, 45).to(device)
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        ws = workspaces[i == 4]
        outs = [fi.trtllm_batch_decode_with_kv_cache(q, cache, w, tables, seq, 720, bmm1_scale=d ** -0.5,
                                                     backend=b) for b, w in (("fa2", ws), ("reference", ws))]
        assert rel(outs[0], outs[1]) < 4e-3, lens
    assert any(p is not None for p in refreshed)  # at least one call took the last plan, refreshed
    assert (workspaces[1] != 255).any()  # the last call's split went to its own workspace


def test_a_workspace_buffer_that_is_not_a_tensor_on_the_querys_device_is_refused():
    q, cache = torch.randn(2, 4, 64).half(), torch.randn(10, 2, 2, 16, 64).half()
    tables, lens = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([5, 20], dtype=torch.int32)
    with pytest.raises(TypeError, match="workspace_buffer must be a torch.Tensor, got NoneType"):
        fi.trtllm_batch_decode_with_kv_cache(q, cache, None, tables, lens, 32, backend="fa2")
    with pytest.raises(ValueError, match="workspace_buffer is on meta, but the planned device is cpu"):
        fi.trtllm_batch_decode_with_kv_cache(q, cache, torch.zeros(16, dtype=torch.uint8, device="meta"), tables,
                                             lens, 32, backend="fa2")


def _kept_table_plans():
    from flashdispatch.planned import block_table_plans
    return [p for p in block_table_plans._plans.values() if p.params.block_tables is not None]


def _table_case(device, page, lens, layout, q_len=1, hq=8, hkv=2, d=64, width=None, seed=0, kv_dtype=torch.half):
    """q, a 5-D cache of random pages, a wide random block table and int32 seq_lens."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(-(-max(lens) // page), 1) + 3
    pages = len(lens) * width + 4
    shape = (pages, 2, page, hkv, d) if layout == "NHD" else (pages, 2, hkv, page, d)
    cache = torch.randn(shape, generator=g).to(kv_dtype)
    tables = torch.randperm(pages, generator=g)[: len(lens) * width].int().view(len(lens), width)
    q = torch.randn(len(lens) * q_len, hq, d, generator=g).half()
    return q.to(device), cache.to(device), tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page,layout,q_len,window,sinks,heads,kv_dtype", [
    (1, "NHD", 1, -1, False, (8, 2), torch.half), (16, "HND", 1, -1, True, (8, 2), torch.half),
    (64, "NHD", 1, 37, False, (8, 2), torch.half), (16, "NHD", 2, -1, False, (8, 2), torch.half),
    (16, "HND", 3, 50, True, (8, 2), torch.half), (16, "NHD", 1, -1, False, (4, 4), torch.half),
    (16, "NHD", 1, -1, False, (8, 2), torch.float8_e4m3fn), (16, "HND", 2, 40, False, (4, 4), torch.float8_e4m3fn)])
def test_trtllm_decode_on_fa2_reads_the_block_table_itself(device, page, layout, q_len, window, sinks, heads,
                                                           kv_dtype):
    """fa2 plans a block-table decode without the lengths (`block_table_plan`): the kernel reads
    seq_lens and the table, splits the long requests itself and writes every row (out poisoned
    with NaN); an empty request gets 0. Equal to the reference, which converts the table; GQA and
    MHA, 16-bit and fp8 KV (whose configs use the work array elsewhere)."""
    lens = [300, 0, 17, 129, 1 if q_len == 1 else q_len, 64]
    q, cache, tables, seq = _table_case(device, page, lens, layout, q_len, *heads, kv_dtype=kv_dtype)
    kw = dict(bmm1_scale=0.125, bmm2_scale=0.5, window_left=window, kv_layout=layout, q_len_per_req=q_len,
              sinks=torch.randn(q.shape[1], device=device) if sinks else None)
    ws = torch.zeros(1 << 21, dtype=torch.uint8, device=device)
    out = torch.full_like(q, float("nan"))
    got = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 300, out=out, backend="fa2", **kw)
    want = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 300, backend="reference", **kw)
    assert got is out and not got.isnan().any()
    assert rel(got, want) < (4e-3 if kv_dtype == torch.half else 2e-2)
    assert got.view(len(lens), q_len, -1)[1].abs().max() == 0  # the empty request
    kept = _kept_table_plans()
    assert len(kept) == 1 and kept[0].params.block_tables is tables and kept[0].plan.table


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_calls_reuse_their_plan_for_new_tables_and_longer_lengths(device, monkeypatch):
    """Later calls run the kept plan as it is (the same tensors, new values) or refreshed for
    other tensors, without planning afresh; lengths past max_seq_len still read every token (the
    kernel balances them over the plan's chunk slots); xqa plans for the table's rows."""
    fa2 = backend_class("fa2")  # patched on the class: pytest < 9.2 leaves an instance's bound method behind
    planned_afresh = []
    real_plan = fa2.plan
    monkeypatch.setattr(fa2, "plan", lambda *a: planned_afresh.append(1) or real_plan(*a))
    q, cache, tables, seq = _table_case(device, 16, [200, 40, 90], "NHD", width=40, seed=1)
    ws = torch.zeros(1 << 21, dtype=torch.uint8, device=device)
    for i, lens in enumerate(([200, 40, 90], [3, 256, 128], [600, 5, 640])):  # the last past max_seq_len=256
        seq.copy_(torch.tensor(lens))
        if i == 2:
            tables = tables[:, torch.randperm(40)].contiguous()  # other tensors: a refresh
            seq = seq.clone()
        outs = [fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 256, bmm1_scale=0.125,
                                                     kv_layout="NHD", backend=b) for b in ("fa2", "reference")]
        assert rel(outs[0], outs[1]) < 4e-3, lens
    assert len(planned_afresh) == 1 and len(_kept_table_plans()) == 1
    out = torch.empty(3, 1, 8, 64, dtype=torch.float16, device=device)
    with fi.use_backends(["fa2"]):
        fi.xqa(q[:, None], cache[:, 0], cache[:, 1], tables, seq[:, None], out, ws, None, 2, 16)
    assert rel(out[:, 0], outs[1]) < 4e-3
    assert len(planned_afresh) == 2 and _kept_table_plans()[-1].params.kv_lens_host[0] == 40 * 16


def test_block_table_values_on_the_host_are_checked():
    """CPU tensors are read and checked (no sync to save): a page outside the cache, a length its
    row cannot hold, fewer KV tokens than query rows."""
    q, cache, tables, seq = _table_case("cpu", 16, [40, 20], "NHD", q_len=2)
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    call = lambda t, s: fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, t, s, 64, q_len_per_req=2,  # noqa: E731
                                                              kv_layout="NHD", backend="fa2")
    bad = tables.clone()
    bad[1, 1] = cache.shape[0]
    with pytest.raises(ValueError, match=f"block_tables references page {cache.shape[0]}, but the cache has only"):
        call(bad, seq)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=100 needs 7 pages of page_size=16, but block_tables has "
                                         r"only 6 columns"):
        call(tables, torch.tensor([100, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="request 1 has 2 query tokens but only 1 KV tokens"):
        call(tables, torch.tensor([40, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seq_len=0"):
        fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 0, q_len_per_req=2, kv_layout="NHD",
                                             backend="fa2")


@pytest.mark.gpu
def test_block_table_decode_on_the_gpu_reads_nothing_back_and_replays_in_a_cuda_graph():
    """On the GPU a call makes no host sync (torch's sync debug mode raises on one), clamps what it
    cannot check (a length past its row, a page past the cache: no fault, the context stays
    usable), and a captured call replays for new lengths and tables written into its tensors."""
    q, cache, tables, seq = _table_case("cuda", 16, [300, 0, 17, 129], "HND", width=40, seed=2)
    ws = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    call = lambda: fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 512,  # noqa: E731
                                                         bmm1_scale=0.125, kv_layout="HND", backend="fa2")
    call()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 512, bmm1_scale=0.125, kv_layout="HND",
                                               backend="reference")
    assert rel(out, ref) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for lens in ([5, 400, 0, 222], [512, 512, 1, 2]):
        seq.copy_(torch.tensor(lens))
        tables.copy_(tables[torch.randperm(4, device="cuda")])
        graph.replay()
        ref = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 512, bmm1_scale=0.125,
                                                   kv_layout="HND", backend="reference")
        assert rel(captured, ref) < 4e-3, lens
    seq.copy_(torch.tensor([10 ** 6, 16, 0, 3]))  # past its row: clamped to the row's pages
    tables[1, 0] = 1 << 30  # past the cache: the last page read in its place
    assert call().isfinite().all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [-1, 100])
def test_block_table_plans_under_one_wave_split_by_the_requests_own_total(device, window, monkeypatch):
    """Under one wave of programs off the line (graph_few_line off) the kernel splits each request by
    the policy's length for the requests' own total (TOTAL_SPLIT, in table_split_slots times the
    bound's chunk slots): equal to the reference, as the bound's split (table_split_slots 0) is; a
    workspace too small for the wider slots keeps the bound's slots. Past one wave no request is
    split by the bound's policy."""
    q, cache, tables, seq = _table_case(device, 16, [2000, 3, 700, 0, 1200, 64], "NHD", width=130, seed=3)
    want = fi.trtllm_batch_decode_with_kv_cache(q, cache, torch.zeros(1 << 22, dtype=torch.uint8, device=device),
                                                tables, seq, 2000, window_left=window, kv_layout="NHD",
                                                backend="reference")
    from flashdispatch.backends.fa2.decode_workspace import partial_bytes
    plans = {}
    for slots, small in (("0", False), ("1.5", False), ("1.5", True)):
        monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG",
                           f'{{"table_split_slots": {slots}, "graph_few_line": false}}')
        # small: room for the bound's chunk slots only (a partial is 8 heads x 64 floats + lse)
        ws = torch.zeros(partial_bytes(6 * plans["0"][1], 8, 64) if small else 1 << 22, dtype=torch.uint8,
                         device=device)
        got = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 2000, window_left=window,
                                                   kv_layout="NHD", backend="fa2")
        assert rel(got, want) < 4e-3, (slots, small)
        plan = _kept_table_plans()[-1].plan
        plans[slots if not small else "small"] = (plan.total_split, plan.split_slots)
    bound = plans["0"]
    assert not bound[0] and plans["1.5"] == (True, max(2, -(-3 * bound[1] // 2)))
    assert plans["small"] == (bound[1] > 1, bound[1])  # the total split in the bound's slots, if any


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [None, 8], ids=["block256", "block8"])
def test_block_table_plans_past_one_wave_take_the_line(device, block, monkeypatch):
    """More programs than ctas_per_sm x SMs (8 SMs on the CPU, 132 on the H200) of a config that
    packs: the kernel cuts the requests' pages, summed from seq_lens, into the line's pieces, as a
    CUDA-graph plan does (it cannot know the lengths either), whatever lengths later calls bring
    in the same tensors: mixed with empty ones, equal, one long request, lengths past max_seq_len
    (to their rows' end). LINE_BLOCK 8: the requests are counted over several
    blocks, the running sum carried. Without packing (wave_pack_spread 0) one program per request
    and KV head. Each call equal to the reference."""
    from flashdispatch.backends.fa2 import decode_variant
    if block is not None:
        if device == "cuda":
            pytest.skip("LINE_BLOCK is a constexpr of the kernel cache: tried on the interpreter")
        monkeypatch.setattr(decode_variant, "LINE_BLOCK", block)
        decode_variant.kernel_constants.cache_clear()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    batch = 4 * sms // 2 + 3  # x 2 KV heads: past 4 programs per SM
    q, cache, tables, seq = _table_case(device, 16, [(37 * b) % 300 for b in range(batch)], "NHD", width=20, seed=4)
    ws = torch.zeros(1 << 22, dtype=torch.uint8, device=device)
    rounds = ([(37 * b) % 300 for b in range(batch)], [160] * batch, [0] * (batch - 1) + [320],
              [320 if b % 3 == 0 else b % 5 for b in range(batch)])
    try:
        for lens in rounds:
            seq.copy_(torch.tensor(lens))
            got, want = (fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 300, kv_layout="NHD",
                                                              backend=b) for b in ("fa2", "reference"))
            assert rel(got, want) < 4e-3, lens[:6]
        plan = _kept_table_plans()[-1].plan
        assert plan.line and plan.table and len(_kept_table_plans()) == 1
        if device == "cpu":
            assert plan._grid == (plan.line_groups * 2,) and plan._grid[0] < batch * 2
        monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"wave_pack_spread": 0}')
        got = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 256, kv_layout="NHD", backend="fa2")
        assert rel(got, want) < 4e-3
        plan = _kept_table_plans()[-1].plan
        assert not plan.line and plan.split_slots == 1 and plan._grid == (batch * 2,)
    finally:
        decode_variant.kernel_constants.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_plans_under_one_wave_take_the_line_with_graph_few_line(device, monkeypatch):
    """Under one wave a config that packs with graph_few_line (the GQA defaults: the last call, fp16
    d64, without the override) puts a block table's requests on the line too (a batch of one stays
    off it): mixed and equal lengths, empty ones, fp16 and e4m3 KV, GQA and MHA, q_len_per_req 2,
    against the reference."""
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"graph_few_line": true, "pack_items": 4}')
    for seed, (lens, heads, kv_dtype, q_len) in enumerate((
            ([900, 0, 17, 400, 2, 0], (8, 2), torch.half, 1), ([256] * 6, (8, 2), torch.half, 1),
            ([700, 3, 0, 250], (4, 4), torch.float8_e4m3fn, 1), ([600, 2, 64, 0, 130], (8, 2), torch.half, 2),
            ([1000], (8, 2), torch.half, 1))):
        q, cache, tables, seq = _table_case(device, 16, lens, "HND", q_len, *heads, seed=10 + seed,
                                            kv_dtype=kv_dtype)
        ws = torch.zeros(1 << 22, dtype=torch.uint8, device=device)
        got, want = (fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 1024, kv_layout="HND",
                                                          q_len_per_req=q_len, backend=b) for b in ("fa2", "reference"))
        assert rel(got, want) < (4e-3 if kv_dtype == torch.half else 2e-2), lens
        assert _kept_table_plans()[-1].plan.line == (len(lens) > 1), lens
    monkeypatch.delenv("FLASHDISPATCH_FA2_DECODE_CONFIG")
    q, cache, tables, seq = _table_case(device, 16, [900, 0, 17, 400, 2, 0], "HND", 1, 8, 2, seed=10)
    ws = torch.zeros(1 << 22, dtype=torch.uint8, device=device)
    got, want = (fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, 1024, kv_layout="HND", backend=b)
                 for b in ("fa2", "reference"))
    assert rel(got, want) < 4e-3 and _kept_table_plans()[-1].plan.line


@pytest.mark.gpu
def test_block_table_line_on_the_gpu_replays_in_a_cuda_graph():
    """bf16 32/8 d128 (the defaults with graph_few_line): 16 requests under one wave and 160 past
    it take the line; a captured call replays for mixed, equal, empty and one-long lengths written
    into its tensors (the fused merge's counters back at zero after each replay), equal to the
    reference."""
    for batch, seed in ((16, 20), (160, 21)):
        g = torch.Generator().manual_seed(seed)
        width, page = 64, 16
        q = torch.randn(batch, 32, 128, generator=g).to("cuda", torch.bfloat16)
        cache = torch.randn(batch * width + 3, 2, page, 8, 128, generator=g).to("cuda", torch.bfloat16)
        tables = torch.randperm(batch * width, generator=g).int().view(batch, width).cuda()
        seq = torch.randint(1, width * page, (batch,), generator=g).int().cuda()
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        call = lambda: fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, width * page,  # noqa: E731
                                                             kv_layout="NHD", backend="fa2")
        call()
        plan = _kept_table_plans()[-1].plan
        assert plan.line and plan.fused_merge, batch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for lens in (torch.randint(0, width * page, (batch,), generator=g), torch.full((batch,), 700),
                     torch.tensor([0] * (batch - 1) + [width * page])):
            seq.copy_(lens)
            graph.replay()
            ref = fi.trtllm_batch_decode_with_kv_cache(q, cache, ws, tables, seq, width * page, kv_layout="NHD",
                                                       backend="reference")
            assert rel(captured, ref) < 1e-2, (batch, lens[:4].tolist())
            assert not plan.counters.any(), batch  # the fused merge's counters, left at zero by the replay
