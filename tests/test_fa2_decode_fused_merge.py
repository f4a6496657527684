"""fa2 decode's fused split-KV merge (`DecodeConfig.fused_merge_max_chunks`) under the Triton
interpreter (CPU), against the float64 oracle and the merge kernel.

The interpreter runs the programs one after another, so these check the arithmetic and the
bookkeeping (which program merges, counter indices and reset); the races are the GPU tests'.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from oracle import assert_close
from test_fa2_decode import F16, TOL, WORKSPACE_BYTES, _case, _check, _GraphBuffers, _run

pytestmark = pytest.mark.interpreted

FUSED = {"fused_merge_max_chunks": 1 << 16}   # fused whatever the chunk count
UNFUSED = {"fused_merge_max_chunks": 0}


@pytest.fixture
def no_merge_launch(monkeypatch):
    """Fused plans must not launch the merge kernel."""
    from flashdispatch.backends.fa2 import merge

    def fail(*args, **kwargs):
        raise AssertionError("a fused_merge plan launched the merge kernel")
    monkeypatch.setattr(merge.DecodeMerge, "__call__", fail)


@pytest.mark.parametrize("config", [UNFUSED, FUSED], ids=["merge_kernel", "fused"])
def test_every_request_split(config):
    """The plan's shortcut where every request is split (each work item a partial, merge row =
    request) merges like the general case, whose requests are partly split."""
    case = _case(kv_lens=(40, 300, 17, 129), seed=49)
    plan = _check(case, fixed_split_size=1, config=config)
    work = plan.work.view(-1, 8)
    assert (work[:, 5] >= 0).all() and plan.n_merge == 4
    assert work[:, 5].tolist() == list(range(len(work))) and work[:, 7].tolist() == work[:, 0].tolist()


def _check_fused(case, **run_kw):
    """Fused plan against the oracle; split requests merged in-kernel, counters back to zero."""
    plan = _check(case, config={**FUSED, **run_kw.pop("config", {})}, **run_kw)
    assert plan.fused_merge and plan.n_merge > 0, "the case must split some request"
    assert not plan.counters.any(), "the last program of each counter must reset it"
    return plan


@pytest.mark.parametrize("fixed_split_size", [1, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("return_lse", [True, False])
def test_fused_merge_forced_splits(no_merge_launch, return_lse, page_size, heads, fixed_split_size):
    """An empty request and an unsplit one next to split ones (1..many chunks)."""
    lens = (0, 2, 9, 40) if page_size == 1 else (0, 5, 37, 300)
    case = _case(lens, page_size=page_size, num_qo_heads=heads[0], num_kv_heads=heads[1],
                 return_lse=return_lse, seed=20)
    plan = _check_fused(case, fixed_split_size=fixed_split_size)
    work = plan.work.view(-1, 8)
    assert ((work[:, 5] < 0) == (work[:, 7] < 0)).all(), "merge rows exactly on the split items"


@pytest.mark.parametrize("q_len,heads,config", [(3, (8, 2), {}), (20, (8, 1), {"max_block_m": 16}),
                                                (4, (4, 4), {"heads_fastest": False})])
def test_fused_merge_q_len_per_req(no_merge_launch, q_len, heads, config):
    """Causal multi-row requests; several row blocks per KV head (one counter each)."""
    case = _case((0, 2, 40, 150), q_len_per_req=q_len, mask_mode="causal", num_qo_heads=heads[0],
                 num_kv_heads=heads[1], seed=21)
    plan = _check_fused(case, fixed_split_size=2, config=config)
    assert plan.counters.numel() == plan.n_merge * heads[1] * plan.row_blocks


@pytest.mark.parametrize("feature", [
    dict(sinks=True), dict(sinks=True, return_lse=False), dict(window_left=60, logits_soft_cap=5.0),
    dict(o_dtype=torch.float32), dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.3),
], ids=lambda f: ",".join(sorted(f)))
def test_fused_merge_features(no_merge_launch, feature):
    case = _case(seed=22, **feature)
    _check_fused(case, fixed_split_size=2)
    _check_fused(case, config={"min_chunk_tokens": 16, "block_n": 16})  # the split policy's chunks


def test_fused_merge_strided_out_and_lse(no_merge_launch):
    """out and lse written through their strides (views into larger buffers)."""
    case = _case(seed=23)
    total, heads, dim = case.inputs.out.shape
    out_buf = torch.full((total, heads, 2 * dim), 7.0, dtype=case.inputs.out.dtype)
    lse_buf = torch.full((total, 2 * heads), 7.0)
    case.inputs = dataclasses.replace(case.inputs, out=out_buf[:, :, dim:], lse=lse_buf[:, ::2])
    _check_fused(case, fixed_split_size=1)
    assert (out_buf[:, :, :dim] == 7).all() and (lse_buf[:, 1::2] == 7).all(), "wrote outside the views"


def test_fused_merge_consecutive_runs(no_merge_launch):
    """The same plan run twice: counters zero after each run, identical results."""
    case = _case((0, 5, 37, 300), sinks=True, seed=24)
    plan = _check_fused(case, fixed_split_size=1)
    first = case.inputs.out.clone(), case.inputs.lse.clone()
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    plan.run(case.inputs)
    assert not plan.counters.any()
    assert torch.equal(case.inputs.out, first[0]) and torch.equal(case.inputs.lse, first[1])


def test_fused_merge_matches_merge_kernel():
    """Same partials, same merge arithmetic: the fused and the two-kernel results agree to float32
    rounding (the tiles, hence the summation order, differ)."""
    case = _case((0, 5, 37, 300), o_dtype=torch.float32, q_len_per_req=2, seed=30)
    results = []
    for config in (UNFUSED, FUSED):
        _run(case, fixed_split_size=1, config=config)
        results.append((case.inputs.out.clone(), case.inputs.lse.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


def test_fused_merge_counter_gates_the_merge(no_merge_launch):
    """A counter that does not start at 0 never reaches chunks - 1 within one launch: the rows it
    guards (one request's query heads of one KV head) stay unmerged, everything else is merged,
    and the counter ends at start + chunks: each program of the request arrived exactly once."""
    case = _case((0, 5, 37, 300), seed=25)
    ref_out, ref_lse = case.oracle()
    plan = _run(case, fixed_split_size=1, config=FUSED)
    counters = plan.counters.view(plan.n_merge, 2, plan.row_blocks)  # 2 KV heads
    chunks = plan.info.view(plan.n_merge, 4)[:, 2]
    counters[1, 1, 0] = -1  # merge row 1 = request 3, KV head 1 = query heads 4..7
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    plan.run(case.inputs)
    assert counters[1, 1, 0] == chunks[1] - 1 and counters.sum() == chunks[1] - 1
    assert torch.isnan(case.inputs.out[3, 4:]).all() and torch.isnan(case.inputs.lse[3, 4:]).all()
    keep = torch.ones(case.inputs.out.shape[:2], dtype=torch.bool)
    keep[3, 4:] = False
    assert_close(case.inputs.out[keep], case.inputs.lse[keep], ref_out[keep], ref_lse[keep], TOL[F16])
    counters.zero_()
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[F16])


def test_fused_merge_cuda_graph_replan(no_merge_launch):
    """Graph mode: counters in the int workspace at one address across re-plans, the kernel's own
    split (direct table) and the work array's alike, zeroed by each fresh plan, back to zero after
    each run; a plan made first and run after a re-plan of the same kind equals the re-plan's
    result (what a captured graph replays)."""
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    iws = torch.zeros(1 << 20, dtype=torch.uint8)
    bufs = _GraphBuffers()
    plans = []
    own_split = {"config": {"min_chunk_tokens": 32}}
    for lens, seed, split in (((10, 200, 33), 26, own_split), ((300, 0, 17), 27, own_split),
                              ((300, 0, 17), 27, {"fixed_split_size": 8}), ((40, 41, 0), 28, {"fixed_split_size": 1})):
        if plans:
            plans[0].counters.fill_(5)  # e.g. an aborted launch: the next plan must zero them
        case = bufs.adopt(_case(lens, use_cuda_graph=True, sinks=True, seed=seed))
        plans.append(_check_fused(case, workspace=ws, int_workspace=iws, **split))
        assert plans[-1].counters.data_ptr() == plans[0].counters.data_ptr()
        assert plans[-1].counters.data_ptr() - iws.data_ptr() + plans[-1].counters.nbytes <= iws.numel()
        if len(plans) in (2, 4):  # the first plan of this kind, run on the re-plan's tables
            ref = case.inputs.out.clone(), case.inputs.lse.clone()
            case.inputs.out.fill_(float("nan"))
            case.inputs.lse.fill_(float("nan"))
            plans[-2].run(case.inputs)
            assert torch.equal(case.inputs.out, ref[0]) and torch.equal(case.inputs.lse, ref[1])
            assert not plans[-2].counters.any()
    assert [p.direct for p in plans] == [True, True, False, False]


def test_fused_merge_without_splits_and_config_check():
    """Nothing split: no counters, the plain kernel; fused_merge_max_chunks is an int >= 0."""
    case = _case(seed=29)
    plan = _check(case, disable_split_kv=True, config=FUSED)
    assert plan.n_merge == 0 and not plan.fused_merge and plan.counters is None
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="fused_merge_max_chunks"):
            DecodeConfig(fused_merge_max_chunks=bad)


@pytest.mark.parametrize("values", [256, 8192])
def test_fused_merge_tile_sizes(no_merge_launch, values):
    """fused_merge_values sets the [rows, partials, head_dim] tile of one merge round: fewer
    partials per round than chunks (256) and more (8192) merge alike; a bad size is refused."""
    from flashdispatch.backends.fa2.decode_variant import merge_tile
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    assert merge_tile(4, 128, 4096) == (4, 8) and merge_tile(4, 128, 8192) == (4, 16)
    assert merge_tile(1, 128, 8192) == (1, 64) and merge_tile(16, 128, 256) == (2, 2)
    _check_fused(_case((3, 70, 300), seed=26), fixed_split_size=1, config={"fused_merge_values": values})
    for bad in (0, 100, 128, 8192.0, True):
        with pytest.raises(ValueError, match="fused_merge_values"):
            DecodeConfig(fused_merge_values=bad)


@pytest.mark.parametrize("limit", [2, 3])
def test_fused_merge_only_up_to_max_chunks(limit):
    """Requests of at most ``limit`` chunks: fused, no counters left set; one more chunk: the merge
    kernel (the last program would merge many partials alone)."""
    case = _case((0, 40, 48), page_size=16, seed=31)   # 3 pages each for the longer requests
    plan = _check(case, fixed_split_size=1, config={"fused_merge_max_chunks": limit})
    assert plan.max_chunks == 3 and plan.fused_merge == (limit >= 3)
    assert plan.counters is None or not plan.counters.any()
