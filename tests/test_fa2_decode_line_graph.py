"""fa2 decode's line under CUDA graphs: past one wave, a graph plan of a config that packs leaves
the packing to the kernel whatever the lengths (under one wave too with
`DecodeConfig.graph_few_line`, the d128 defaults), so a graph captured on one batch replays any
later lengths of the same batch size packed (mixed or equal, empty requests, one request over
most pieces).

CPU: the plans' layout on a described H200 (no launch), graph plans under the Triton interpreter
re-planned in place against the float64 oracle, and a graph-mode wrapper of the public API. GPU
(``-m gpu``): a captured graph replayed after re-plans, against the reference backend.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_fa2_decode_line import LINE


def _layout(plan) -> tuple:
    """What a captured graph replays of a plan: grid, kernel constants, launch scalars, merge
    kernel or not, the int-workspace offsets of its merge rows and counters, and the float
    workspace's partials (offsets of lse and outputs, bytes)."""
    base = plan.counters if plan.counters is not None else plan.info
    iws, fws = base.untyped_storage().data_ptr(), plan.plse.untyped_storage().data_ptr()
    offsets = tuple(t.data_ptr() - iws if t is not None else None for t in (plan.info, plan.counters))
    partials = (plan.plse.data_ptr() - fws, plan.po.data_ptr() - fws, plan.workspace_bytes)
    return plan._grid, plan._consts, plan._plan_scalars, plan._merge is None, offsets, partials


def test_graph_line_plans_on_the_h200():
    """bf16 and fp8 d128 graph plans of 128 and 256 requests take the line for mixed and equal
    lengths alike, with the eager mixed plans' config and one layout (a grid of the larger of
    one wave of mixed pieces and about two equal requests to a piece: 256 bf16 in 128), merged in the kernel
    (fused_merge_max_chunks 0: the merge kernel); a refresh only swaps the tables. So do MHA plans
    (eager too) and graph plans with wave_pack_line false (eagerly the host packs). With a sliding
    window or with wave_pack_spread 0 they do not (the graph's direct split); under one wave they do
    where graph_few_line says and there is more than one request."""
    from test_fa2_decode_waves import F16, _H200, _h200_plan
    mixed = np.random.default_rng(20261202).integers(1, 8192, 256)
    for kv, batch, groups in ((F16, 128, 66), (torch.float8_e4m3fn, 128, 132), (F16, 256, 128)):
        eager, _ = _h200_plan(mixed[:batch].tolist(), kv)
        plans = [_h200_plan(lens, kv, graph=True)[0]
                 for lens in (mixed[:batch].tolist(), [4096] * batch, [0] * (batch - 1) + [60000])]
        for plan in plans:
            assert (plan.line, plan.direct, plan.n_work, plan.fused_merge) == (True, True, groups, True), (kv, batch)
            assert plan.config == eager.config
            assert _layout(plan) == _layout(plans[0])
        _, equal = _h200_plan([2048] * batch, kv, graph=True)
        again = plans[0].refreshed(_H200, equal)
        assert again is not None and again.line and _layout(again) == _layout(plans[0])
        assert not _h200_plan([4096] * batch, kv)[0].line  # eager plans of equal lengths do not pack
        split, _ = _h200_plan(mixed[:batch].tolist(), kv, {"fused_merge_max_chunks": 0}, graph=True)
        assert split.line and not split.fused_merge and split._merge is not None
        assert _h200_plan(mixed[:batch].tolist(), kv, {"wave_pack_line": False}, graph=True)[0].line
        off, _ = _h200_plan(mixed[:batch].tolist(), kv, {"wave_pack_spread": 0}, graph=True)
        assert not off.line and off.direct
        assert _h200_plan(mixed[:batch].tolist(), kv, kv_heads=32)[0].line  # eager MHA too (session 29)
        host = _h200_plan(mixed[:batch].tolist(), kv, {"wave_pack_line": False}, kv_heads=32)[0]
        assert not host.line and host.items > 1
        assert _h200_plan(mixed[:batch].tolist(), kv, graph=True, kv_heads=32)[0].line
        window, _ = _h200_plan(mixed[:batch].tolist(), kv, graph=True, window_left=1000)
        assert not window.line and window.direct
    # under one wave (64 x 8 programs), d128 graph plans of more than one request take the line too
    # (graph_few_line), in one wave of pieces; eager ones of lengths that pack with few_pack_line
    # (fp8's default) or of 16 or more mixed requests (bf16's few_line_mixed); never a single request
    for kv, groups in ((F16, 66), (torch.float8_e4m3fn, 132)):
        few = _h200_plan(mixed[:64].tolist(), kv, graph=True)[0]
        assert few.line and few.n_work == groups
        assert few.refreshed(_H200, _h200_plan([4096] * 64, kv, graph=True)[1]).line
        assert not _h200_plan(mixed[:64].tolist(), kv, {"graph_few_line": False}, graph=True)[0].line
        assert not _h200_plan([60000], kv, graph=True)[0].line  # one request: nothing to pack
        assert _h200_plan(mixed[:48].tolist(), kv)[0].line
        assert _h200_plan(mixed[:48].tolist(), kv, {"few_pack_line": True, "few_line_mixed": 0})[0].line
        assert not _h200_plan(mixed[:48].tolist(), kv, {"few_pack_line": False, "few_line_mixed": 0})[0].line
        assert not _h200_plan([32768], kv, {"few_pack_line": True})[0].line


def _graph_case(lens, seed: int, heads: tuple[int, int]):
    from test_fa2_decode import _case
    return _case(lens, use_cuda_graph=True, seed=seed, num_qo_heads=heads[0], num_kv_heads=heads[1])


@pytest.mark.interpreted
@pytest.mark.parametrize("fused, heads, batch", [(True, (8, 2), 17), (False, (8, 2), 17), (True, (2, 2), 17),
                                                 (True, (8, 2), 9), (False, (2, 2), 9), (True, (8, 2), 40)],
                         ids=["fused", "merge-kernel", "mha-wave_pack_line-false", "few", "few-mha-merge-kernel",
                              "idle-groups"])
def test_graph_line_plan_replays_later_lengths(fused, heads, batch):
    """17 requests past one wave (8/2 heads d64, fp16; MHA 2/2 with wave_pack_line false), 9
    under it (graph_few_line), and 40 past two, whose grid of 32 equal pieces leaves half its
    groups idle for mixed lengths (one wave, `line_groups`): a graph plan made for mixed lengths
    and run after re-plans of equal lengths, of one request over many pieces among short and empty
    ones, and of mixed lengths again (on the wrapper's fixed buffers, as a captured graph replays
    it) gives each re-plan's own result, which matches the oracle; a refresh of it does too."""
    from test_fa2_decode import WORKSPACE_BYTES, _check, _GraphBuffers
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    iws = torch.zeros(1 << 20, dtype=torch.uint8)
    bufs = _GraphBuffers(slots=600, batch=batch)
    config = {**LINE, "fused_merge_max_chunks": 64 if fused else 0, "wave_pack_line": heads[0] != heads[1],
              "graph_few_line": batch < 17}
    rng = np.random.default_rng(90)
    most = 150 * 17 // max(batch, 17)  # (the interpreter's time goes with the tokens)
    mixed = rng.integers(1, most, batch)
    mixed[[2, 6]] = 0
    first = bufs.adopt(_graph_case(mixed.tolist(), seed=91, heads=heads))
    captured = _check(first, workspace=ws, int_workspace=iws, config=config)
    assert captured.line and captured.fused_merge == fused and captured.line_groups == 16
    assert captured.n_work == (32 if batch == 40 else 16)
    long_one = ([0, 3, 600, 7, 0, 9, 5, 3, 40, 2, 1, 6, 8, 30, 0, 11, 0] + [4, 0, 2, 9] * 6)[:max(batch, 17)][-batch:]
    for seed, lens in ((92, [most // 2] * batch), (93, long_one), (94, rng.integers(0, most, batch).tolist())):
        case = bufs.adopt(_graph_case(lens, seed=seed, heads=heads))
        plan = _check(case, workspace=ws, int_workspace=iws, config=config)
        assert plan.line and _layout(plan) == _layout(captured)
        ref = case.inputs.out.clone(), case.inputs.lse.clone()
        for replay in (captured, captured.refreshed(case.device, case.params)):
            case.inputs.out.fill_(float("nan"))
            case.inputs.lse.fill_(float("nan"))
            replay.run(case.inputs)
            assert torch.equal(case.inputs.out, ref[0]) and torch.equal(case.inputs.lse, ref[1]), seed


@pytest.mark.interpreted
def test_graph_wrapper_past_one_wave_replays_the_line():
    """The public API: a use_cuda_graph=True decode wrapper on fa2's defaults (8/2 heads d64, fp16,
    page 16; 17 requests x 2 KV heads past the interpreter's one wave of 8 SMs x 4) plans the line
    for mixed lengths; the plan a graph would have captured, run after a re-plan to equal lengths
    on other pages, gives the re-plan's attention."""
    import flashdispatch as flashinfer
    from flashdispatch.backends.base import AttentionInputs, PagedKV
    from test_api import dense_attention, paged_to_dense, rel

    torch.manual_seed(98)
    page, hq, hkv, d, batch, slots = 16, 8, 2, 64, 17, 400
    bufs = [torch.zeros(batch + 1, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32)]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(1 << 22, dtype=torch.uint8), "NHD", use_cuda_graph=True, backend="fa2",
        paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    kv = torch.randn(slots, 2, page, hkv, d).half()

    def plan(lens):
        n = [-(-x // page) for x in lens]
        table = (torch.tensor(np.cumsum([0] + n), dtype=torch.int32), torch.randperm(slots)[:sum(n)].int(),
                 torch.tensor([x - (c - 1) * page if c else 0 for x, c in zip(lens, n)], dtype=torch.int32))
        w.plan(*table, hq, hkv, d, page, data_type=torch.float16)
        return table

    def check(out, table, q):
        for b in range(batch):
            k, v = paged_to_dense(kv, table[0], table[1], table[2], page, b)
            assert rel(out[b], dense_attention(q[b:b + 1], k, v)[0][0]) < 4e-3, b

    mixed = np.random.default_rng(99).integers(1, 300, batch)
    mixed[6] = 0
    table, q = plan(mixed.tolist()), torch.randn(batch, hq, d).half()
    out = w.run(q, kv)
    captured = w._variants[1, False]
    assert captured.plan.line
    check(out, table, q)
    table = plan([200] * batch)  # re-plan: equal lengths, other pages, same batch
    out = torch.full((batch, hq, d), float("nan"), dtype=torch.float16)
    captured.backend.run(captured.plan, AttentionInputs(q, PagedKV(kv[:, 0], kv[:, 1], "NHD"), out))
    check(out, table, q)


@pytest.mark.gpu
@pytest.mark.parametrize("kv, kv_heads, batch, head_dim", [
    (torch.bfloat16, 8, 256, 128), (torch.float8_e4m3fn, 8, 256, 128), (torch.bfloat16, 32, 256, 128),
    (torch.bfloat16, 8, 48, 128), (torch.float8_e4m3fn, 8, 48, 128), (torch.bfloat16, 32, 12, 128),
    (torch.float8_e4m3fn, 32, 64, 64), (torch.float8_e4m3fn, 32, 12, 64)],
    ids=["bf16", "fp8kv", "mha", "bf16-few", "fp8kv-few", "mha-few", "fp8kv-mha-d64", "fp8kv-mha-d64-few"])
def test_gpu_graph_line_replays_later_lengths(kv, kv_heads, batch, head_dim):
    """A graph captured on a line plan of the defaults, of mixed requests past one wave (256 of
    32/8 heads d128, MHA 32/32; 64 of fp8 MHA d64; two empty) or of a batch under one wave
    (graph_few_line), replayed after re-plans to equal requests (256: cut into the line's even
    groups) and to a mix with one request of 60000 tokens: each replay gives the re-plan's
    reference result (poisoned out/lse, new q)."""
    from test_fa2_decode_gpu import _assert_replay_is_replanned, _captured, _case, _fp8_scales, _replanned
    lens = np.random.default_rng(95).integers(1, 8192, batch)
    lens[[4, batch - 3]] = 0
    case = _case(lens.tolist(), num_qo_heads=32, num_kv_heads=kv_heads, kv_dtype=kv, use_cuda_graph=True,
                 head_dim_qk=head_dim, extra_pages=12000, seed=96, **_fp8_scales(kv))
    plan, graph = _captured(case, 128 << 10)
    assert plan.line and (batch % plan.line_even_groups == 0 or batch < 256)  # (MHA: every group)
    long_one = np.random.default_rng(97).integers(1, 4096, batch)
    long_one[[0, batch - 1]] = 0
    long_one[batch // 2] = 60000
    for later in ([2048] * batch, long_one.tolist()):
        replanned, prm_b = _replanned(case, later)
        assert replanned.line and _layout(replanned) == _layout(plan)
        _assert_replay_is_replanned(case, graph, prm_b)
