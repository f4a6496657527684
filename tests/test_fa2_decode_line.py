"""fa2 decode's own packing past one wave (`DecodeConfig.wave_pack_line`, decode_kernel.py's LINE):
the kernel cuts the requests' pages, end to end as kv_indptr numbers them, into one equal piece per
item group (requests of equal length into `line_groups`' even count) and finds the requests of its
piece itself; plan() builds nothing.

CPU: the plan's choices and the pieces the kernel reads, and line plans under the Triton
interpreter (GQA and MHA, fp16 and e4m3) against the float64 oracle: empty requests anywhere, a
request over many pieces, indptr not starting at 0, a refreshed plan; plans under one wave on the
line (`DecodeConfig.few_pack_line`). GPU (``-m gpu``): line plans (bf16 and fp8, d64/d128/d256,
MHA d128) against the reference backend, past one wave beside the host-packed plans and under it,
a refreshed line plan, a long request merged in the kernel and by the merge kernel, fp8 requests of
equal length that the wave model packs (`DecodeConfig.wave_pack_below`) or their mean length does
(`DecodeConfig.wave_pack_tokens`, fp8 d64), bf16 d64 requests of equal length that the wave model
packs from 1024 tokens (`DecodeConfig.wave_pack_below_tokens`).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdispatch.backends.fa2 import decode_variant

from oracle import assert_close, reference_backend_result, run_fa2_decode
from test_fa2_decode_packed import CPU_PACK, _assert_empty_rows, _case, _gpu_mixed_plan


# past one wave on the interpreter's 8 SMs x 4 programs: 17 requests x 2 KV heads, 16 pieces
LINE = {**CPU_PACK, "pack_items": 4, "wave_pack_line": True}
ON = {"wave_pack_line": True}


def _config(fused: bool, **extra) -> dict:
    return {**LINE, "fused_merge_max_chunks": 64 if fused else 0, **extra}


def _kernel_segments(lens: list[int], page: int, groups: int, gap: int = 0, even: int = 0) -> list[list[int]]:
    """The pieces each request is read on, as the kernel assigns them (the docstring's rule, in
    Python): requests' first pages at kv_indptr + gap x (request + 1), the requests a piece touches
    by counting those positions below its bounds; ``even`` groups where the pages are the batch x
    the first request's."""
    pages = [-(-n // page) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    if even and indptr[-1] == pages[0] * len(lens):
        groups = even
    at = indptr[:-1] + gap * np.arange(1, len(lens) + 1)
    piece = max(-(-int(indptr[-1] + gap * len(lens)) // groups), 1)
    seen: list[list[int]] = [[] for _ in lens]
    for g in range(groups):
        start, end = g * piece, g * piece + piece
        before = int((at < start).sum())
        upto = len(lens) if g == groups - 1 else int((at < end).sum())
        first = before - int(before > 0 and indptr[before] + gap * before > start)
        for r in range(first, upto):
            seen[r].append(g)
    return seen


@pytest.mark.parametrize("gap_tokens", [0, 40])
@pytest.mark.parametrize("seed", range(6))
def test_every_request_is_read_once_per_piece_it_touches(seed, gap_tokens):
    """The kernel's rule gives each request its own consecutive pieces (an empty one exactly one),
    and two requests' segments never the same partial slot (piece + request); with a gap per
    request (line_segment_tokens 40:
    3 pages), pieces where more requests start hold fewer pages."""
    from test_fa2_decode_waves import _h200_plan
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 8192, 256)
    lens[rng.integers(0, 256, 5)] = 0
    lens[:3] = 0 if seed % 2 else lens[:3]  # empty requests at the start of the line
    lens[-2:] = 0 if seed % 3 == 0 else lens[-2:]  # and at its end
    plan, params = _h200_plan(lens.tolist(), config={**ON, "line_segment_tokens": gap_tokens})
    assert plan.line and plan.direct and plan.line_gap == -(-gap_tokens // 16)
    seen = _kernel_segments(lens.tolist(), 16, plan.line_groups, plan.line_gap)
    slots = set()
    for r, pieces in enumerate(seen):
        assert pieces == list(range(pieces[0], pieces[0] + len(pieces))) and len(pieces) >= 1, r
        assert len(pieces) == 1 or lens[r] > 0
        if len(pieces) > 1:
            assert not slots & {g + r for g in pieces}
            slots |= {g + r for g in pieces}
    assert max(slots) < plan.n_work + plan.batch  # the partials the plan carves
    if gap_tokens:  # the pieces' pages fall as their segments rise
        pages = np.array([-(-n // 16) for n in lens])
        at = np.cumsum(pages) - pages + plan.line_gap * np.arange(1, len(lens) + 1)  # first pages' positions
        width = max(-(-int(pages.sum() + plan.line_gap * len(lens)) // plan.line_groups), 1)
        held = [np.clip(np.minimum(at + pages, g * width + width) - np.maximum(at, g * width), 0, None).sum()
                for g in range(plan.line_groups - 1)]
        segments = [sum(g in pieces for pieces in seen) for g in range(plan.line_groups - 1)]
        assert np.corrcoef(segments, held)[0, 1] < -0.5


def test_line_plans_on_the_h200():
    """Mixed lengths past one wave on the H200 are packed by the kernel (the bf16 and fp8 d128
    defaults): in one wave of pieces, bf16 128 or 256 requests in 66, fp8 in 132 (requests of
    equal length in 64, 128 and 64: `line_groups`), on the split block with the page numbers loaded a
    step ahead (line_page_prefetch), merged in the kernel (a request over ~8 pieces too); with
    wave_pack_line false, on the host. A line plan re-planned for other mixed lengths keeps its
    pieces (only the tables change), for equal lengths plans afresh (the direct table)."""
    from test_fa2_decode_waves import F16, _H200, _h200_plan
    lens = np.random.default_rng(20261201).integers(1, 8192, 256).tolist()
    for kv, batch, block_n, groups, even in ((F16, 128, 64, 66, 64), (torch.float8_e4m3fn, 128, 32, 132, 128),
                                            (F16, 256, 64, 66, 64)):
        plan, params = _h200_plan(lens[:batch], kv)
        got = (plan.line, plan.direct, plan.config.block_n, plan.n_work, plan.items, plan.fused_merge)
        assert got == (True, True, block_n, groups, 1, True), (kv, batch)
        assert (plan.line_groups, plan.line_even_groups) == (groups, even) == plan._plan_scalars[-2:]
        assert plan.config.page_prefetch and plan.line_gap == 4  # line_segment_tokens 64, page 16
        assert plan._grid == (groups * 8,) and plan._consts["LINE"] and plan.n_merge == batch
        other = plan.refreshed(_H200, _h200_plan(lens[-batch:], kv)[1])
        assert other is not None and other.line and other.n_work == groups
        assert plan.refreshed(_H200, _h200_plan([4096] * batch, kv)[1]) is None
    long_one, _ = _h200_plan(lens[:255] + [131072])  # over ~8 of 66 pieces: still merged in the kernel
    assert long_one.line and long_one.fused_merge and long_one._merge is None and long_one.max_chunks == 66
    host, _ = _h200_plan(lens[:128], config={"wave_pack_line": False})
    assert (host.line, host.direct, host.items, host.config.page_prefetch) == (False, False, 4, False)


@pytest.mark.interpreted
@pytest.mark.parametrize("fused, features", [
    (True, {}), (False, {}), (True, dict(sinks=True)), (False, dict(q_len_per_req=2, mask_mode="causal")),
    (True, dict(page_size=1)), (False, dict(page_size=64)), (True, dict(kv_dtype=torch.float8_e4m3fn)),
    (False, dict(kv_layout="HND")), (True, dict(gap=48)), (False, dict(page_size=1, gap=5)),
    (True, dict(num_qo_heads=2)), (False, dict(num_qo_heads=2, kv_dtype=torch.float8_e4m3fn))],
    ids=["fused", "merge-kernel", "sinks", "qlen2", "page1", "page64", "e4m3", "HND", "gap", "gap-page1", "mha",
         "mha-e4m3"])
def test_line_plan_matches_the_oracle(fused, features):
    """17 requests past one wave, two empty, in 16 pieces the kernel finds, against the oracle;
    the empty rows exactly 0 and -inf. ``gap``: line_segment_tokens."""
    features = dict(features)
    gap = features.pop("gap", 0)
    lens = np.random.default_rng(74).integers(1, 300, 17)
    lens[[3, 11]] = 0
    case = _case(lens.tolist(), seed=75, **features)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, _config(fused, line_segment_tokens=gap))
    assert plan.line and plan.n_work == 16 and plan.items == 1 and (plan._merge is None) == fused
    assert plan.line_gap == -(-gap // case.problem.page_size)
    tol = 8e-2 if case.problem.kv_dtype == torch.float8_e4m3fn else 4e-3
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    if not case.problem.sinks and case.problem.q_len_per_req == 1:  # (a sink's logit is an empty row's lse)
        _assert_empty_rows(case, (3, 11))


@pytest.mark.interpreted
@pytest.mark.parametrize("gap", [0, 16], ids=["", "gap"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
def test_line_plan_edge_cases(fused, gap):
    """Empty requests first, last and side by side on a piece's boundary; one request over most
    pieces among short ones (its partials merged from 12-13 pieces); kv_indptr starting past 0;
    with and without a gap of a page per request (line_segment_tokens)."""
    lens = [0, 0, 1200, 7, 0, 0, 9, 5, 3, 40, 2, 1, 6, 8, 30, 0, 0]
    case = _case(lens, seed=76)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, _config(fused, line_segment_tokens=gap))
    spans = _kernel_segments(lens, 16, plan.line_groups, plan.line_gap)
    assert plan.line and max(map(len, spans)) == (12 if gap else 13)  # (the gaps widen the pieces)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
    _assert_empty_rows(case, [b for b, n in enumerate(lens) if n == 0])
    shifted = _case(lens, seed=76)
    prm = shifted.params
    prm.kv_indptr = prm.kv_indptr + 5
    prm.kv_indices = torch.cat([torch.full((5,), 10 ** 6, dtype=torch.int32), prm.kv_indices])  # never read
    plan = run_fa2_decode(shifted, _config(fused, line_segment_tokens=gap))
    assert plan.line
    assert_close(shifted.inputs.out, shifted.inputs.lse, ref_out, ref_lse, 4e-3)


@pytest.mark.interpreted
@pytest.mark.parametrize("block", [4, 8], ids=["block4", "block8"])
def test_line_counts_requests_over_several_blocks(monkeypatch, block):
    """The kernel counts the requests on each piece LINE_BLOCK at a time (256 by default: one block
    for the batches the CPU tests run): with 4 and 8 to a block (17 requests: 5 and 3 blocks, the
    last partly filled), a request running into a piece from an earlier block and empty ones side
    by side, against the oracle."""
    monkeypatch.setattr(decode_variant, "LINE_BLOCK", block)
    decode_variant.kernel_constants.cache_clear()
    try:
        lens = [0, 0, 1200, 7, 0, 0, 9, 5, 3, 40, 2, 1, 6, 8, 30, 0, 0]
        case = _case(lens, seed=83)
        ref_out, ref_lse = case.oracle()
        plan = run_fa2_decode(case, _config(True, line_segment_tokens=16))
        assert plan.line and plan._consts["LINE_BLOCK"] == block
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
        _assert_empty_rows(case, [b for b, n in enumerate(lens) if n == 0])
    finally:
        decode_variant.kernel_constants.cache_clear()


@pytest.mark.interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
def test_line_plan_of_equal_requests(fused):
    """24 requests past one wave whose pages are 24 x the first's (line_align_fill 0.5: 12 even
    groups of the line's 16): equal ones read on 12 pieces of two whole requests, none split; a mix
    with that sum too (the kernel cannot tell) on 12 pieces, split where they fall (the merge rows
    the merge-kernel variant's kernel writes say so; the fused one checks the results only); both
    against the oracle."""
    mixed = [100] + [1, 199, 150, 50, 120, 80] * 3 + [100] * 4 + [148]  # pages: 7, then 7 on average
    for seed, lens in ((81, [100] * 24), (82, mixed)):
        case = _case(lens, seed=seed)
        ref_out, ref_lse = case.oracle()
        plan = run_fa2_decode(case, _config(fused, wave_pack_spread=1.0, line_align_fill=0.5))
        assert plan.line and (plan.n_work, plan.line_even_groups) == (16, 12)
        spans = _kernel_segments(lens, 16, plan.line_groups, plan.line_gap, plan.line_even_groups)
        assert sorted({g for s in spans for g in s}) == list(range(12))
        assert max(map(len, spans)) == (1 if seed == 81 else 2)
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
        if not fused:  # the merge rows the kernel wrote: (out row, first slot, pieces) per request
            rows = plan.info.view(len(lens), -1)[:, :3].tolist()
            assert rows == [[r, s[0] + r, len(s)] for r, s in enumerate(spans)]


# `decode_split._any_lengths_pack`'s rules: (the knobs that pack 17 requests of 100 tokens, the
# knobs each of which keeps them off the line): the wave model (wave_slots 4: 34 programs in 1.06
# waves, predicted 0.69 of full-wave throughput), below 0.6 or under wave_pack_below_tokens; the
# mean length (wave_pack_tokens)
ANY_LENGTHS = {
    "wave_model": ({"wave_pack_below": 0.96, "wave_slots": 4, "wave_pack_below_tokens": 0},
                   [{"wave_pack_below": 0.6}, {"wave_pack_below_tokens": 101}]),
    "tokens": ({"wave_pack_tokens": 100}, [{"wave_pack_tokens": 101}]),
}


@pytest.mark.interpreted
@pytest.mark.parametrize("rule", list(ANY_LENGTHS))
def test_equal_lengths_on_the_line_whatever_their_spread(rule):
    """`DecodeConfig.wave_pack_below` (from `wave_pack_below_tokens`) and `wave_pack_tokens`: 17
    requests of equal length x 2 KV heads past one wave of the interpreter's 8 SMs take the line
    whatever their spread where the rule says so and match the oracle; with the knob that says
    otherwise they keep the direct table."""
    on, offs = ANY_LENGTHS[rule]
    lens = [100] * 17
    case = _case(lens, seed=84)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, _config(True, wave_pack_spread=100.0, **on))
    assert plan.line
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
    for off in offs:
        plain = run_fa2_decode(_case(lens, seed=84), _config(True, wave_pack_spread=100.0, **{**on, **off}))
        assert plain.direct and not plain.line, off


@pytest.mark.interpreted
def test_refreshed_line_plan_and_where_the_host_packs():
    """A line plan refreshed for other lengths of the same batch runs them right; a sliding window
    or wave_pack_line false packs on the host (work rows)."""
    rng = np.random.default_rng(77)
    first = _case(rng.integers(1, 300, 17).tolist(), seed=78)
    plan = run_fa2_decode(first, _config(True))
    lens = rng.integers(1, 300, 17)
    lens[5] = 0
    case = _case(lens.tolist(), seed=79)
    ref_out, ref_lse = case.oracle()
    case.params.workspace = torch.zeros(1 << 22, dtype=torch.uint8)
    again = plan.refreshed(case.device, case.params)
    assert again is not None and again.line
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    again.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
    window = run_fa2_decode(_case(lens.tolist(), seed=80, window_left=250), _config(True))
    assert not window.line and window.items > 1
    host = run_fa2_decode(_case(lens.tolist(), seed=81), _config(True, wave_pack_line=False))
    assert not host.line and host.items > 1


def test_eager_mixed_batches_under_one_wave_on_the_h200():
    """bf16 GQA d128 under one wave (`DecodeConfig.few_line_mixed` 16): 16 to 64 requests of mixed
    lengths take the line whatever their work fill, fewer requests and equal lengths do not (nor
    MHA, off there); a refresh for equal lengths plans afresh, for other mixed ones keeps the line, and
    an equal-length plan refreshed for mixed lengths plans afresh (the line), as a new plan would."""
    from test_fa2_decode_waves import _H200, _h200_plan
    lens = np.random.default_rng(20261204).integers(1, 16384, 64).tolist()
    for batch in (16, 32, 64):
        plan, _ = _h200_plan(lens[:batch])
        assert plan.line and plan.direct and plan._grid == (plan.n_work * 8,), batch
        assert plan.refreshed(_H200, _h200_plan(lens[-batch:])[1]).line
        assert plan.refreshed(_H200, _h200_plan([8192] * batch)[1]) is None
        equal = _h200_plan([8192] * batch)[0]
        assert not equal.line
        assert equal.refreshed(_H200, _h200_plan(lens[:batch])[1]) is None  # mixed again: afresh, on the line
    rng = np.random.default_rng(4)
    for length, low in ((200, 100), (8192, 7000)):  # mixed lengths that keep the equal plan's chunk slots
        mixed = _h200_plan(rng.integers(low, length, 16).tolist())
        assert mixed[0].line and _h200_plan([length] * 16)[0].refreshed(_H200, mixed[1]) is None, length
    assert not _h200_plan(lens[:15])[0].line
    assert not _h200_plan(lens[:16], config={"few_line_mixed": 0})[0].line
    assert not _h200_plan(lens[:16], kv_heads=32)[0].line


@pytest.mark.interpreted
@pytest.mark.parametrize("fused, features", [(True, {}), (False, {}), (True, dict(kv_dtype=torch.float8_e4m3fn)),
                                             (False, dict(page_size=1)), (True, dict(num_qo_heads=2))],
                         ids=["fused", "merge-kernel", "e4m3", "page1", "mha"])
def test_few_programs_line_plan_and_its_refresh(fused, features):
    """Under one wave (7 requests x 2 KV heads on the interpreter's 8 SMs x 4), a plan that packs
    goes on the line with few_pack_line (16 pieces, empty requests among them) and matches the
    oracle; refreshed for other lengths that pack it runs them right, for equal ones (which do not
    pack) it plans afresh; a sliding window packs on the host."""
    config = _config(fused, few_pack_line=True, pack_fill=0.8)  # (equal requests fill 0.875 of 16 pieces)
    case = _case([300, 0, 20, 23, 251, 0, 190], seed=63, **features)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, config)
    assert plan.line and plan.n_work == 16 and (plan._merge is None) == fused
    tol = 8e-2 if case.problem.kv_dtype == torch.float8_e4m3fn else 4e-3
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    _assert_empty_rows(case, (1, 5))
    later = _case([7, 280, 0, 260, 15, 30, 9], seed=64, **features)
    ref_out, ref_lse = later.oracle()
    later.params.workspace = case.params.workspace
    again = plan.refreshed(later.device, later.params)
    assert again is not None and again.line
    later.inputs.out.fill_(float("nan"))
    again.run(later.inputs)
    assert_close(later.inputs.out, later.inputs.lse, ref_out, ref_lse, tol)
    equal = _case([192] * 7, seed=65, **features)
    assert plan.refreshed(equal.device, equal.params) is None
    assert not run_fa2_decode(equal, config).line
    window = run_fa2_decode(_case([300, 0, 20, 23, 251, 0, 190], seed=66, window_left=150, **features), config)
    assert not window.line and window.items > 1


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kv_heads", [(128, 8), (64, 8), (256, 8), (128, 32)],
                         ids=["128", "64", "256", "mha-128"])
@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
@pytest.mark.parametrize("line", [True, False], ids=["line", "host"])
def test_gpu_mixed_lengths_past_a_wave_pack(kv, head_dim, kv_heads, line):
    """160 requests of a serving batch's mix (two empty) past one wave: the defaults (GQA 32/8 and
    MHA 32/32) pack them into whole waves of pieces, found by the kernel (line) or laid out by the host."""
    plan = _gpu_mixed_plan(160, [5, 100], kv, head_dim, draw=10, seed=75, config={"wave_pack_line": line},
                           kv_heads=kv_heads)
    assert plan.line == line and plan.direct == line and (plan.items > 1) != line


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kv_heads, batch", [(128, 8, 48), (64, 8, 48), (256, 8, 48), (128, 32, 14)],
                         ids=["128", "64", "256", "mha-128"])
@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
def test_gpu_few_programs_line(kv, head_dim, kv_heads, batch):
    """A serving batch's mix under one wave (48 requests, MHA 14; two empty) on the line with
    few_pack_line, against the reference backend."""
    plan = _gpu_mixed_plan(batch, [3, batch - 5], kv, head_dim, draw=12, seed=83, config={"few_pack_line": True},
                           kv_heads=kv_heads)
    assert plan.line and plan.direct


def _gpu_case(lens, kv: str, seed: int):
    """bf16 / fp8 (k_scale 0.8, v_scale 1.5) 32/8 heads d128 on the GPU for these lengths, with
    its reference backend result."""
    fp8 = kv == "e4m3"
    case = _case(lens, device="cuda", kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, num_qo_heads=32,
                 num_kv_heads=8, k_scale=0.8 if fp8 else None, v_scale=1.5 if fp8 else None, seed=seed)
    return case, reference_backend_result(case), 8e-2 if fp8 else 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
def test_gpu_line_plan_refreshed_and_a_long_request(kv):
    """A line plan refreshed for new mixed lengths of its batch (the empty requests moved) runs
    them right; one request of 60000 tokens among 255 of the mix, over about 8 pieces, merged in
    the kernel (the default) and by the merge kernel (fused_merge_max_chunks 0)."""
    plan = _gpu_mixed_plan(256, [0, 255], kv, 128, draw=11, seed=82, config=ON)
    assert plan.line and plan.fused_merge
    lens = np.random.default_rng(12).integers(1, 8192, 256)
    lens[[3, 200]] = 0
    case, (ref_out, ref_lse), tol = _gpu_case(lens.tolist(), kv, seed=83)
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    again = plan.refreshed(case.device, case.params)
    assert again is not None and again.line
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    again.run(case.inputs)
    torch.cuda.synchronize()
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    _assert_empty_rows(case, [3, 200])
    lens[7] = 60000
    case, (ref_out, ref_lse), tol = _gpu_case(lens.tolist(), kv, seed=84)
    for fused in (True, False):
        plan = run_fa2_decode(case, {**ON, "fused_merge_max_chunks": 16 if fused else 0})
        assert plan.line and plan.fused_merge == fused and (plan._merge is None) == fused
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
        _assert_empty_rows(case, [3, 200])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kv_heads, batch, kv_len", [(128, 8, 200, 1024), (256, 8, 100, 2048),
                                                               (128, 32, 24, 4096), (64, 8, 256, 1024),
                                                               (64, 32, 64, 1024)],
                         ids=["128", "256", "mha-128", "64", "mha-64"])
def test_gpu_equal_fp8_lengths_on_the_line(head_dim, kv_heads, batch, kv_len):
    """fp8 KV of equal lengths past one wave on the line by default, against the reference backend:
    d128 and d256 where the tiles would leave a last wave partly filled (`DecodeConfig.wave_pack_below`),
    d64 from 512 tokens a request, MHA d64 from 1024 (`DecodeConfig.wave_pack_tokens`). On sm90, d128
    rows whose programs fit at once take the Gluon kernel by default (test_fa2_decode_gluon_gpu.py): off here."""
    case = _case([kv_len] * batch, device="cuda", kv_dtype=torch.float8_e4m3fn, num_qo_heads=32, num_kv_heads=kv_heads,
                 head_dim_qk=head_dim, k_scale=0.8, v_scale=1.5, seed=85)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, {"gluon_fp8_stages": 0})
    assert plan.line
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 8e-2)


@pytest.mark.gpu
def test_gpu_equal_bf16_d64_lengths_on_the_line():
    """bf16 d64 equal lengths past one wave whose last wave the wave model finds partly filled
    (100x2048: `DecodeConfig.wave_pack_below` from `wave_pack_below_tokens`) on the line by
    default, against the reference backend."""
    case = _case([2048] * 100, device="cuda", kv_dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=8,
                 head_dim_qk=64, seed=86)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case)
    assert plan.line
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 2e-2)
