"""fa2 split-KV paged decode on a CUDA GPU (``pytest -m gpu``), against the reference backend.

Grid over batch/lengths, page size, layout, dtype (bf16, fp16, fp8 e4m3 KV) and head dim, then
every feature, CUDA-graph capture + replay after a re-plan, and batch invariance.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from oracle import assert_close, make_paged_case, reference_backend_result, run_fa2_decode

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.5e-1}
WORKSPACE_BYTES = 128 << 20


def _case(kv_lens, **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 128)
    kw.setdefault("q_dtype", torch.bfloat16)
    # NaN in the cache slots no request uses: only the grid's (oracle marks them token by token)
    kw.setdefault("poison_unused", False)
    return make_paged_case("decode", kv_lens=list(kv_lens), device="cuda", **kw)


def _check(case, **kw):
    ref_out, ref_lse = reference_backend_result(case)
    run_fa2_decode(case, **kw)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


LENGTHS = {"one-long": [4097], "mixed": [0, 1, 15, 16, 17, 300, 2000]}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.float16,) * 2,
                                    (torch.bfloat16, torch.float8_e4m3fn)], ids=["bf16", "fp16", "fp8kv"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_grid(lengths, page_size, layout, dtypes, head_dim):
    case = _case(LENGTHS[lengths], page_size=page_size, kv_layout=layout, q_dtype=dtypes[0],
                 kv_dtype=dtypes[1], head_dim_qk=head_dim, seed=page_size + head_dim, poison_unused=True,
                 k_scale=0.8 if dtypes[1] != dtypes[0] else None, v_scale=1.5 if dtypes[1] != dtypes[0] else None)
    _check(case)


@pytest.mark.parametrize("feature", [
    dict(window_left=100), dict(logits_soft_cap=30.0), dict(pos_encoding_mode="ALIBI"),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5), dict(sinks=True),
    dict(sm_scale=0.05), dict(return_lse=False), dict(kv_storage="tuple"),
    dict(q_len_per_req=4, mask_mode="causal"), dict(q_len_per_req=3, mask_mode="none", num_qo_heads=32),
    dict(kv_dtype=torch.float8_e4m3fn, tensor_scales=(1.2, 0.5, 2.0)),
    dict(num_qo_heads=32, num_kv_heads=4, o_dtype=torch.float32),
    dict(kv_dtype=torch.float8_e5m2, q_dtype=torch.float16, k_scale=0.7, v_scale=1.3),
], ids=lambda f: ",".join(sorted(f)))
@pytest.mark.parametrize("split", [{}, {"fixed_split_size": 8}, {"disable_split_kv": True}],
                         ids=["auto", "fixed8", "nosplit"])
@pytest.mark.parametrize("swap", [False, True], ids=["default", "swap-flipped"])
def test_features(feature, split, swap):
    """Every feature x split, with the dtype's default dots and with DecodeConfig.swap_ab flipped
    (fp8 KV runs swapped by default)."""
    feature = dict(feature)
    scales = feature.pop("tensor_scales", None)
    if scales:  # 1-element device tensors, read by the kernel (no host sync)
        feature.update(zip(("q_scale", "k_scale", "v_scale"), (torch.tensor([x], device="cuda") for x in scales)))
    case = _case([0, 33, 700, 3000], seed=3, **feature)
    config = {"swap_ab": case.problem.kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)} if swap else None
    _check(case, config=config, **split)


@pytest.mark.parametrize("feature", [
    dict(logits_soft_cap=50.0, window_left=200, sinks=True), dict(pos_encoding_mode="ROPE_LLAMA"),
    dict(pos_encoding_mode="ALIBI"), dict(q_len_per_req=3, mask_mode="causal"),
], ids=["softcap+window+sinks", "rope", "alibi", "qlen3"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_features_other_head_dims(head_dim, kv_dtype, feature):
    """The d64 and d256 defaults (their own tiles, unlike d128's) with the features that change the
    kernel's code, split by the default policy (a long request) or not."""
    case = _case([0, 33, 700, 5000], head_dim_qk=head_dim, kv_dtype=kv_dtype, seed=head_dim + 5,
                 **_fp8_scales(kv_dtype), **feature)
    _check(case)


def _captured(case, indices_slots: int, config=None):
    """(plan, graph): ``case`` planned in CUDA-graph mode on fixed buffers (the wrapper's kv_indices
    buffer of ``indices_slots`` entries, its indptr and last_page_len buffers, workspaces) and its
    run() captured (compiled outside)."""
    from flashdispatch.backends.fa2.decode import plan_decode
    prm = case.params
    indices = torch.zeros(indices_slots, dtype=torch.int32, device="cuda")
    indices[:prm.kv_indices.numel()] = prm.kv_indices
    prm.kv_indices = indices
    prm.kv_indptr, prm.kv_last_page_len = prm.kv_indptr.clone(), prm.kv_last_page_len.clone()
    prm.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    prm.int_workspace = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    plan = plan_decode(case.problem, case.device, prm, config)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(case.inputs)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.inputs)
    return plan, graph


def _replanned(case, lens, config=None):
    """Re-plan ``case`` (captured by `_captured`) for other kv lengths on random pages, written into
    the same kv_indices, indptr and last_page_len buffers; returns (plan, its params)."""
    from flashdispatch.backends.fa2.decode import plan_decode
    prm, indices = case.params, case.params.kv_indices
    counts = [-(-n // 16) for n in lens]
    new_pages = torch.randperm(case.inputs.kv.k.shape[0], device="cuda")[:sum(counts)].int()
    indices[:new_pages.numel()] = new_pages
    prm.kv_indptr.copy_(torch.tensor([0] + counts, device="cuda").cumsum(0))
    prm.kv_last_page_len.copy_(torch.tensor([n - (c - 1) * 16 if c else 0 for n, c in zip(lens, counts)]))
    prm_b = dataclasses.replace(prm, kv_lens_host=list(lens), kv_indices=indices,
                                kv_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    return plan_decode(case.problem, case.device, prm_b, config), prm_b


def _assert_replay_is_replanned(case, graph, prm_b):
    """New q, poisoned out/lse, one replay of ``graph``: the result is the reference's for the
    re-planned params ``prm_b`` (see `_replanned`)."""
    inputs = case.inputs
    inputs.q.copy_(torch.randn_like(inputs.q))
    inputs.out.fill_(float("nan"))
    inputs.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_backend_result(dataclasses.replace(case, params=prm_b))
    assert_close(inputs.out, inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


@pytest.mark.parametrize("head_dim, kv_heads, kv_dtype, own_split", [
    (128, 2, torch.bfloat16, False), (64, 2, torch.bfloat16, False), (256, 2, torch.float8_e4m3fn, False),
    (128, 8, torch.float8_e4m3fn, False), (64, 2, torch.bfloat16, True), (256, 2, torch.float8_e4m3fn, True)],
    ids=["gqa", "d64", "d256-fp8kv", "mha-fp8kv", "d64-own-split", "d256-fp8kv-own-split"])
def test_cuda_graph_replay_after_replan(head_dim, kv_heads, kv_dtype, own_split):
    """Capture on one plan, re-plan (same batch size, other lengths and pages, same buffers),
    replay: the result is the new plan's. The defaults (on the line under one wave,
    `DecodeConfig.graph_few_line`) and, for d64 and fp8 d256, each request split on its own."""
    case = _case([100, 5000, 0, 64], use_cuda_graph=True, extra_pages=400, seed=4, head_dim_qk=head_dim,
                 num_kv_heads=kv_heads, kv_dtype=kv_dtype, **_fp8_scales(kv_dtype))
    config = OWN_SPLIT if own_split else None
    plan, graph = _captured(case, 2048, config)
    assert plan.line != own_split
    _, prm_b = _replanned(case, [3000, 17, 900, 1], config)
    _assert_replay_is_replanned(case, graph, prm_b)


def test_batch_invariance_fixed_split():
    big = _case([3000, 10, 777, 4096, 0], seed=6)
    run_fa2_decode(big, fixed_split_size=16)
    out_big, lse_big = big.inputs.out.clone(), big.inputs.lse.clone()
    single = _case([4096], seed=6)
    starts = big.params.kv_indptr.tolist()
    single.params.kv_indices = big.params.kv_indices[starts[3]:starts[4]].clone()
    single.inputs = dataclasses.replace(single.inputs, q=big.inputs.q[3:4].clone(), kv=big.inputs.kv)
    run_fa2_decode(single, fixed_split_size=16)
    assert torch.equal(single.inputs.out, out_big[3:4]) and torch.equal(single.inputs.lse, lse_big[3:4])


# --- fused split-KV merge (DecodeConfig.fused_merge_max_chunks): `pytest -m gpu -k fused` -----
FUSED = {"fused_merge_max_chunks": 1 << 16}   # fused whatever the chunk count
UNFUSED = {"fused_merge_max_chunks": 0}  # split plans merge in the second kernel
OWN_SPLIT = {"graph_few_line": False}  # graph plans under one wave split each request themselves (not the line)


def _fp8_scales(kv_dtype) -> dict:
    return dict(k_scale=0.8, v_scale=1.5) if kv_dtype != torch.bfloat16 else {}


@pytest.mark.parametrize("lse", [True, False], ids=["lse", "nolse"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("kv_len", [1000, 8192, 32768])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_fused_merge_grid(batch, kv_len, kv_dtype, lse):
    """The split policy's plans (every shape here splits) with the merge in the decode kernel."""
    case = _case([kv_len] * batch, kv_dtype=kv_dtype, return_lse=lse, seed=batch + kv_len, **_fp8_scales(kv_dtype))
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, config=FUSED)
    assert plan.fused_merge and not plan.counters.any()
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[kv_dtype])


@pytest.mark.parametrize("split", [{}, {"fixed_split_size": 4}], ids=["policy", "fixed4"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("lengths", [[32768], [8192] * 16, [0, 17, 5000, 32768, 300, 8192]],
                         ids=["1x32768", "16x8192", "mixed"])
def test_fused_merge_back_to_back_runs_identical(lengths, kv_dtype, split):
    """50 runs queued back to back (out/lse poisoned before each): a program that merged before
    every partial was visible, or a counter not back at 0, would change some result. The merge
    order is fixed, so every run must equal the first bit for bit."""
    case = _case(lengths, kv_dtype=kv_dtype, seed=len(lengths), **_fp8_scales(kv_dtype))
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, config=FUSED, **split)
    assert plan.fused_merge
    out, lse = case.inputs.out, case.inputs.lse
    assert_close(out, lse, ref_out, ref_lse, TOL[kv_dtype])
    first = out.clone(), lse.clone()
    runs = []
    for _ in range(50):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        plan.run(case.inputs)
        runs.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    bad = [i for i, (o, s) in enumerate(runs) if not (torch.equal(o, first[0]) and torch.equal(s, first[1]))]
    assert not bad, f"runs {bad} differ from the first"
    assert not plan.counters.any()


def test_fused_merge_cuda_graph_replay_after_replans():
    """Capture a fused plan, re-plan twice (same batch size, other lengths and pages, same
    buffers: the counters stay at their address and are zeroed by the plan), replay three times
    back to back after each: the new plan's result every time, counters back to 0."""
    case = _case([100, 5000, 0, 64], use_cuda_graph=True, extra_pages=2000, seed=8)
    plan, graph = _captured(case, 4096, {**FUSED, **OWN_SPLIT})
    assert plan.fused_merge
    inputs = case.inputs
    for lens in ([3000, 17, 900, 1], [20000, 0, 16, 7000]):
        replan, prm_b = _replanned(case, lens, {**FUSED, **OWN_SPLIT})
        assert replan.counters.data_ptr() == plan.counters.data_ptr()
        inputs.q.copy_(torch.randn_like(inputs.q))
        ref_out, ref_lse = reference_backend_result(dataclasses.replace(case, params=prm_b))
        results = []
        for _ in range(3):
            inputs.out.fill_(float("nan"))
            inputs.lse.fill_(float("nan"))
            graph.replay()
            results.append((inputs.out.clone(), inputs.lse.clone()))
        torch.cuda.synchronize()
        for out, lse in results:
            assert_close(out, lse, ref_out, ref_lse, TOL[torch.bfloat16])
        assert not plan.counters.any()


def test_one_plan_run_with_other_strides_and_misaligned_tensors():
    """run() keeps Triton's specialisation per call kind (strides, 16-byte alignment): q, out and
    lse of other strides, and q/out starting off a 16-byte boundary, each still match the reference."""
    import flashdispatch as fi
    torch.manual_seed(5)
    heads, kv_heads, d, page, lens = 8, 2, 128, 16, [40, 700, 1]
    pages = [-(-n // page) for n in lens]
    indptr = torch.tensor([0, *pages], dtype=torch.int32).cumsum(0).int().cuda()
    indices = torch.randperm(sum(pages), dtype=torch.int32).cuda()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32).cuda()
    cache = torch.randn(sum(pages), 2, page, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    wrappers = {}
    for backend in ("fa2", "reference"):
        w = wrappers[backend] = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), "NHD", backend=backend)
        w.plan(indptr, indices, last, heads, kv_heads, d, page, q_data_type=torch.bfloat16)
    wide = torch.randn(len(lens), heads, 2 * d + 1, dtype=torch.bfloat16, device="cuda")
    qs = {"contiguous": wide[:, :, :d].contiguous(), "strided": wide[:, :, :d], "misaligned": wide[:, :, 1:d + 1]}
    for name, q in list(qs.items()) * 2:  # twice: the second run of each kind takes the kept key
        ref, ref_lse = wrappers["reference"].run(q.contiguous(), cache, return_lse=True)
        out_buf = torch.full((len(lens) * heads * d + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = out_buf[1:].view(len(lens), heads, d) if name == "misaligned" else None
        got, lse = wrappers["fa2"].run(q, cache, out=out, return_lse=True)
        assert_close(got, lse, ref.double().cpu(), ref_lse.cpu(), TOL[torch.bfloat16])


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("feature", [{}, dict(window_left=100), dict(q_len_per_req=4, mask_mode="causal"),
                                     dict(kv_layout="HND", page_size=1)], ids=lambda f: ",".join(sorted(f)) or "plain")
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "work_array"])
def test_unsplit_direct_table_or_work_array(dtypes, feature, direct):
    """Unsplit plans with DecodeConfig.direct_table (kernel reads kv_indptr / last_page_len, the
    default) and with a work array, on the GPU."""
    case = _case(LENGTHS["mixed"], q_dtype=dtypes[0], kv_dtype=dtypes[1], seed=21,
                 k_scale=0.8 if dtypes[1] != dtypes[0] else None, **feature)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, config={"direct_table": direct}, disable_split_kv=True)
    assert plan.direct == direct
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


def test_max_registers_reaches_ptxas():
    """DecodeConfig.max_registers caps the compiled kernel's registers (Triton's maxnreg) without
    changing the result (72: a cap no other test uses, so the kernels checked are this plan's)."""
    from flashdispatch.backends.fa2.decode_kernel import decode_kernel
    case = _case(LENGTHS["mixed"], q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=23)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, config={"direct_table": True, "max_registers": 72}, disable_split_kv=True)
    assert plan.direct and plan.block_m == 16
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[torch.bfloat16])
    kernels = decode_kernel.device_caches[torch.cuda.current_device()][0].values()
    capped = [k for k in kernels if getattr(k.metadata, "maxnreg", None) == 72]
    assert capped and all(k.n_regs <= 72 for k in capped), [(k.n_regs, k.n_spills) for k in capped]


@pytest.mark.parametrize("layout, features", [("NHD", {}), ("HND", {"window_left": 100, "sinks": True})],
                         ids=["nhd", "hnd-window-sinks"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8kv"])
def test_wave_tiles_by_batch(kv_dtype, layout, features):
    """32/8 heads, d128 on this GPU's SMs: the batch sizes whose program counts (x 8 KV heads)
    `wave_choice` gives each wave tile (and does not split for waves) run it and match the
    reference, NHD, and HND with a window and sinks."""
    from flashdispatch.backends.fa2.decode_split import split_target
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.backends.fa2.decode_waves import wave_choice
    from flashdispatch.dispatch.problem import Problem
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = default_config(Problem("decode", torch.bfloat16, kv_dtype, torch.bfloat16, 32, 8, 128, 128, page_size=16))
    by_tile = {}
    gen = torch.Generator().manual_seed(43)
    window = features.get("window_left", -1)
    for batch in range(sms * cfg.ctas_per_sm // 8, sms * 4):
        lens = torch.randint(0, 400, (batch,), generator=gen).tolist()
        tokens = sum(min(n, 1 + window) if window >= 0 else n for n in lens) / batch  # as the plan's mean_tokens
        if split_target(batch, cfg, 8, sms, tokens) is None:
            by_tile.setdefault(wave_choice(cfg, batch * 8, sms)[0], lens)
    assert len(by_tile) == len(cfg.wave_tiles), {tile: len(lens) for tile, lens in by_tile.items()}
    scales = dict(k_scale=0.8, v_scale=1.5) if kv_dtype != torch.bfloat16 else {}
    for tile, lens in by_tile.items():
        case = _case(lens, num_qo_heads=32, num_kv_heads=8, kv_dtype=kv_dtype, kv_layout=layout, seed=43,
                     **scales, **features)
        ref_out, ref_lse = reference_backend_result(case)
        plan = run_fa2_decode(case)
        assert (plan.config.block_n, plan.config.num_stages) == tile
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[kv_dtype])


@pytest.mark.parametrize("heads, head_dim, page_size, kv_dtype", [
    ((32, 8), 128, 16, torch.bfloat16), ((32, 32), 128, 16, torch.bfloat16), ((32, 8), 256, 16, torch.bfloat16),
    ((32, 8), 128, 1, torch.bfloat16), ((32, 8), 128, 16, torch.float8_e4m3fn)],
    ids=["gqa", "mha", "d256", "page1", "fp8kv"])
def test_wave_split_by_batch(heads, head_dim, page_size, kv_dtype):
    """Defaults with a wave split (DecodeConfig.wave_split_ctas), on this GPU's SMs: the
    first batch past one wave whose waves `split_target` finds wasteful splits its requests and
    matches the reference; the first past one wave that it keeps whole runs unsplit and matches
    too (fp8's equal-ish lengths would pack on the line instead: wave_pack_below off here)."""
    from flashdispatch.backends.fa2.decode_split import split_target
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.dispatch.problem import Problem
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_heads = heads[1]
    cfg = default_config(Problem("decode", torch.bfloat16, kv_dtype, torch.bfloat16, *heads, head_dim,
                                 head_dim, page_size=page_size))
    # past one wave (of the most resident tile) and at least the few-programs split's target
    # (page 1: 3 per SM, below 4)
    per_sm = max([t[2] for t in cfg.wave_tiles] or [cfg.wave_slots])
    first = max(sms * per_sm // kv_heads + 1, -(-sms * cfg.ctas_per_sm // kv_heads))
    by_split = {}
    gen = torch.Generator().manual_seed(44)
    # lengths where either decision holds for dozens of batches, the longest under 1.5 x the mean
    # (wider spreads pack: DecodeConfig.wave_pack_spread)
    for batch in range(first, 2 * first):
        lens = torch.randint(2500, 4500, (batch,), generator=gen).tolist()
        by_split.setdefault(split_target(batch, cfg, kv_heads, sms, sum(lens) / batch) is not None, lens)
    assert set(by_split) == {True, False}, {split: len(lens) for split, lens in by_split.items()}
    for split, lens in sorted(by_split.items()):
        batch = len(lens)
        case = _case(lens, num_qo_heads=heads[0], num_kv_heads=kv_heads, head_dim_qk=head_dim, page_size=page_size,
                     kv_dtype=kv_dtype, seed=44, **_fp8_scales(kv_dtype))
        ref_out, ref_lse = reference_backend_result(case)
        plan = run_fa2_decode(case, {"wave_pack_below": 0})
        assert (plan.max_chunks > 1) == split, (batch, plan.max_chunks)
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[kv_dtype])


@pytest.mark.parametrize("lengths", [[32768], [8192] * 16, [0, 17, 5000, 32768, 300, 8192]],
                         ids=["1x32768", "16x8192", "mixed"])
def test_pdl_merge_waits_for_the_decode_grid(lengths):
    """The merge kernel launched as a programmatic dependent (sm90+, DecodeConfig.pdl) starts while
    the decode grid runs: it must still read this run's partials. Runs alternate between two q
    inputs, 30 of each queued back to back: a merge that read the previous run's partials would
    give the other input's result, and every run must equal the first of its input bit for bit."""
    case = _case(lengths, seed=len(lengths))
    plan = run_fa2_decode(case, config=UNFUSED)
    assert plan.n_merge and not plan.fused_merge
    assert plan.pdl == (torch.cuda.get_device_capability() >= (9, 0))
    inputs = case.inputs
    q_a, q_b = inputs.q.clone(), torch.randn_like(inputs.q)
    expected = []
    for q in (q_a, q_b):
        inputs.q.copy_(q)
        ref_out, ref_lse = reference_backend_result(case)
        plan.run(inputs)
        assert_close(inputs.out, inputs.lse, ref_out, ref_lse, TOL[torch.bfloat16])
        expected.append((inputs.out.clone(), inputs.lse.clone()))
    runs = []
    for i in range(60):
        inputs.q.copy_((q_a, q_b)[i % 2])
        inputs.out.fill_(float("nan"))
        inputs.lse.fill_(float("nan"))
        plan.run(inputs)
        runs.append((inputs.out.clone(), inputs.lse.clone()))
    torch.cuda.synchronize()
    bad = [i for i, (o, s) in enumerate(runs)
           if not (torch.equal(o, expected[i % 2][0]) and torch.equal(s, expected[i % 2][1]))]
    assert not bad, f"runs {bad} differ from the first run of their input"
    if plan.pdl:  # the merge really went out as a programmatic dependent launch
        from flashdispatch.backends.fa2.merge import _merge_decode_kernel
        kernels = _merge_decode_kernel.device_caches[torch.cuda.current_device()][0].values()
        assert any(k.metadata.launch_pdl for k in kernels)


def test_pdl_merge_cuda_graph_replay_after_replan():
    """A captured plan with the merge kernel (programmatic dependent launch on sm90+), re-planned
    for other lengths and replayed: the new plan's result."""
    case = _case([100, 30000, 0, 64], use_cuda_graph=True, extra_pages=2000, seed=9)
    plan, graph = _captured(case, 4096, {**UNFUSED, **OWN_SPLIT})
    assert plan.n_merge and not plan.fused_merge
    assert plan.pdl == (torch.cuda.get_device_capability() >= (9, 0))
    replan, prm_b = _replanned(case, [3000, 17, 20000, 1], {**UNFUSED, **OWN_SPLIT})
    assert (replan.pdl, replan.n_merge) == (plan.pdl, plan.n_merge)  # the captured launches still fit
    _assert_replay_is_replanned(case, graph, prm_b)


def test_sm90_compiles_every_feature_and_work_layout():
    """The CPU suite's matrix of Triton code generation (test_fa2_decode.py), compiled to cubin
    (layouts, LLVM, ptxas; no GPU needed, but ~2-6 s a combination: the GPU suite runs it, on the
    GPU machine's cores)."""
    from test_fa2_decode import MATRIX, _compile_matrix
    jobs = min(16, os.cpu_count() or 1)
    lines = _compile_matrix("--jobs", str(jobs), *(str(d) for d, _ in MATRIX))
    assert len(lines) == sum(n for _, n in MATRIX)
