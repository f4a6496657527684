"""fa2 decode's packed split (`DecodeConfig.pack_items`): the requests' tokens end to end, an
equal piece per program, up to ``pack_items`` segments of different requests in one program.

CPU: `decode_split.packed_segments` on its own, and packed plans under the Triton interpreter
(fp16) against the float64 oracle. GPU (``-m gpu``): the d128 defaults' packed plans (fp8 and
bf16) and fp8 MHA d64's against the reference backend.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdispatch.backends.fa2.decode import plan_decode
from flashdispatch.backends.fa2.decode_split import _packed_line, interleaved, packed_segments, work_fill

from oracle import assert_close, make_paged_case, reference_backend_result, run_fa2_decode


def test_packed_segments_give_every_program_an_equal_piece():
    eff = np.array([4096] * 48)
    _, req, lo, hi, rows, n_rows, used, _ = packed_segments(eff, 132, 4, 256, 64)
    assert used == 2 and n_rows == 132 * 2 and (hi - lo).sum() == eff.sum() and np.all(hi > lo)
    per_program = np.bincount(rows // 2, weights=hi - lo)
    assert per_program.size == 132 and per_program.max() - per_program.min() <= per_program.max() // 16
    # segments cover each request once, in order, from its first token to its last
    for r in range(48):
        mine = req == r
        assert lo[mine][0] == 0 and hi[mine][-1] == 4096 and np.array_equal(lo[mine][1:], hi[mine][:-1])
    # rows of one program hold different requests; rows are unique
    assert np.unique(rows).size == rows.size
    assert np.all(np.diff(req[rows // 2 == 7]) > 0)


def test_packed_segments_take_the_programs_they_need_and_empty_requests():
    """``used``: the most segments a piece holds (one where pieces fall on request boundaries);
    the empty requests go to the end of the line, a segment of no tokens each, ``used`` of them to
    a program after the pieces'."""
    line, pos, lo, hi, rows, n_rows, used, segments = packed_segments(np.array([100, 0, 300, 0]), 4, 4, 1, 64)
    assert used == 1 and n_rows == 6 and line.tolist() == [0, 2, 1, 3] and segments.tolist() == [1, 3, 1, 1]
    assert line[pos].tolist() == [0, 2, 2, 2, 1, 3] and rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert lo.tolist() == [0, 0, 100, 200, 0, 0] and hi.tolist() == [100, 100, 200, 300, 0, 0]
    line, pos, lo, hi, rows, n_rows, used, _ = packed_segments(np.array([60, 0, 60, 60, 0, 0, 60]), 2, 4, 1, 64)
    assert used == 2 and n_rows == 8  # 2 pieces of 2 requests, then the 3 empty ones: 2 programs
    assert line.tolist() == [0, 2, 3, 6, 1, 4, 5] and pos.tolist() == list(range(7))
    assert rows.tolist() == list(range(7)) and (hi - lo).tolist() == [60] * 4 + [0] * 3
    assert packed_segments(np.array([60, 0, 60, 60, 0, 0, 60]), 2, 1, 1, 64) is None  # 2 to a piece
    assert packed_segments(np.array([0, 0]), 2, 4, 1, 64) is None


def _check_segments(eff: np.ndarray, groups: int, packed) -> None:
    """What `_build` relies on: segments in the line's order (and their count per request in
    line), each request's side by side covering it once from its first token (an empty one: one
    segment of no tokens), unique rows, at most ``used`` different requests to a program and at
    most a piece of tokens."""
    line, pos, lo, hi, rows, n_rows, used, segments = packed
    req = pos if line is None else line[pos]
    piece = -(-int(eff.sum()) // groups)
    assert line is None or np.array_equal(np.sort(line), np.arange(eff.size))
    assert np.array_equal(segments, np.bincount(pos, minlength=eff.size))
    assert np.all(np.diff(pos) >= 0) and np.unique(rows).size == rows.size and rows.max() < n_rows
    for r, n in enumerate(eff):
        mine = req == r
        if n == 0:
            assert mine.sum() == 1 and lo[mine][0] == 0 == hi[mine][0]
        else:
            assert lo[mine][0] == 0 and hi[mine][-1] == n and np.array_equal(lo[mine][1:], hi[mine][:-1])
    program = rows // used
    assert np.bincount(program, weights=hi - lo).max() <= piece
    for p in np.unique(program):
        assert np.unique(req[program == p]).size == (program == p).sum() <= used


def test_packed_segments_lay_short_requests_apart_where_their_order_crowds_a_piece():
    """Requests in their own order put 6 on one piece (300, then 5, 6, 7, 8 tokens side by side):
    laid longest, shortest, second longest, ... they need 3. Skewed lengths (log-uniform, some
    empty) pack in either order, each result as `_build` needs it."""
    eff = np.array([300, 5, 6, 7, 8, 250, 190])
    assert interleaved(eff).tolist() == [0, 1, 5, 2, 6, 3, 4]
    assert _packed_line(eff, 16, 4, 16, 64) is None
    packed = packed_segments(eff, 16, 4, 16, 64)
    assert packed.used == 3 and packed.n_rows == 48
    _check_segments(eff, 16, packed)
    rng = np.random.default_rng(72)
    orders = set()
    for _ in range(60):
        eff = np.exp(rng.uniform(np.log(2), np.log(9000), int(rng.integers(3, 80)))).astype(np.int64)
        eff[rng.integers(0, eff.size, 2)] = 0
        packed = packed_segments(eff, 132, 4, 16, 64)
        if packed is not None:
            orders.add(_packed_line(eff[eff > 0], 132, 4, 16, 64) is None)
            _check_segments(eff, 132, packed)
    assert orders == {True, False}  # both orders were taken


def test_work_fill_is_the_mean_item_over_the_longest():
    """Equal requests: the count of work items over the target's (48 requests in 2 chunks of 132:
    0.73); mixed ones: the longest item (whole, or a chunk) sets the plan's time."""
    assert work_fill(np.array([4096] * 48), np.full(48, 2048), 132) == pytest.approx(48 / 66)
    eff = np.array([1900, 1000, 100])
    assert work_fill(eff, None, 3) == pytest.approx(3000 / (3 * 1900))
    assert work_fill(eff, np.array([950, 1000, 100]), 4) == pytest.approx(3000 / (4 * 1000))
    assert work_fill(np.array([0, 0]), None, 4) == 1.0


@pytest.mark.parametrize("eff, groups, items, why", [
    ([0, 0], 4, 2, "no tokens at all"),
    ([100, 100, 5000], 4, 2, "a piece over 3 requests"),
    ([4096] * 4, 128, 2, "pieces under min_chunk"),
    ([8192], 40, 2, "more segments than max_splits"),
])
def test_packed_segments_refuse(eff, groups, items, why):
    assert packed_segments(np.array(eff), groups, items, 200, 32) is None, why


def _case(kv_lens, device="cpu", **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 64 if device == "cpu" else 128)
    kw.setdefault("q_dtype", torch.float16 if device == "cpu" else torch.bfloat16)
    extra = {} if device == "cpu" else {"poison_unused": False}
    return make_paged_case("decode", kv_lens=list(kv_lens), device=device, **extra, **kw)


# small enough pieces for the interpreter: 8 SMs x 4 programs, chunks from 16 tokens
CPU_PACK = {"pack_items": 2, "pack_fill": 0.95, "min_chunk_tokens": 16, "block_n": 16}


@pytest.mark.interpreted
@pytest.mark.parametrize("features", [{}, dict(window_left=150, sinks=True), dict(q_len_per_req=2, mask_mode="causal"),
                                      dict(page_size=1), dict(kv_dtype=torch.float8_e4m3fn)],
                         ids=["plain", "window,sinks", "qlen2", "page1", "e4m3"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
@pytest.mark.parametrize("lens", [[300, 251, 190], [300, 20, 190]], ids=["all-cut", "one-whole"])
def test_packed_plan_matches_the_oracle(features, fused, lens):
    case = _case(lens, seed=61, **features)
    config = {**CPU_PACK, "fused_merge_max_chunks": 64 if fused else 0}
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, config)
    assert plan.items == 2 and not plan.direct
    assert (plan._merge is None) == fused
    tol = 8e-2 if case.problem.kv_dtype == torch.float8_e4m3fn else 4e-3
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)


@pytest.mark.interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
def test_packed_plan_with_empty_requests_and_three_to_a_program(fused):
    """Empty requests ride in programs of their own (zero output, -inf lse); pieces over three
    requests take ITEMS=3 where pack_items allows it."""
    case = _case([300, 0, 20, 23, 251, 0, 190], seed=63)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, {**CPU_PACK, "pack_items": 4, "fused_merge_max_chunks": 64 if fused else 0})
    assert plan.items == 3 and not plan.direct
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
    assert run_fa2_decode(_case([300, 0, 20, 23, 251, 0, 190], seed=63), CPU_PACK).items == 1  # 2 allowed


@pytest.mark.interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
def test_packed_plan_of_interleaved_requests_matches_the_oracle(fused):
    """Short requests side by side: the plan packs them laid apart (3 to a program), its work and
    merge rows in that order."""
    case = _case([300, 5, 6, 7, 8, 250, 190], seed=73)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, {**CPU_PACK, "pack_items": 4, "fused_merge_max_chunks": 64 if fused else 0})
    assert plan.items == 3 and not plan.direct and (plan._merge is None) == fused
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)


@pytest.mark.interpreted
@pytest.mark.parametrize("fused, features", [(True, {}), (False, {}), (True, dict(window_left=250, sinks=True)),
                                             (True, dict(q_len_per_req=2, mask_mode="causal")),
                                             (False, dict(kv_dtype=torch.float8_e4m3fn))],
                         ids=["fused", "merge-kernel", "window,sinks", "qlen2", "e4m3"])
def test_wave_packed_plan_matches_the_oracle(fused, features):
    """Past one wave (17 requests x 2 KV heads on the interpreter's 8 SMs x 4), lengths spread
    wide pack into the few-programs target's 16 pieces (`DecodeConfig.wave_pack_spread`; a window
    of 250 keeps them spread), the empty requests in a program of their own (zero output, -inf
    lse); with a window and sinks, 2 causal query rows, fp8 KV. Laid out by the host
    (wave_pack_line false; test_fa2_decode_line.py: by the kernel)."""
    lens = np.random.default_rng(74).integers(1, 300, 17)
    lens[[3, 11]] = 0
    case = _case(lens.tolist(), seed=74, **features)
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, {**CPU_PACK, "pack_items": 4, "fused_merge_max_chunks": 64 if fused else 0,
                                 "wave_pack_line": False})
    assert plan.items > 1 and not plan.direct and plan.split_target // plan.units == 16
    assert (plan._merge is None) == fused
    tol = 8e-2 if case.problem.kv_dtype == torch.float8_e4m3fn else 4e-3
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    if not case.problem.sinks and case.problem.q_len_per_req == 1:  # (a sink's logit is an empty row's lse)
        _assert_empty_rows(case, (3, 11))


@pytest.mark.interpreted
def test_packing_only_where_the_split_fills_its_target_poorly():
    """Requests whose chunks fill the few-programs target keep the plain split; fixed_split_size
    and CUDA graphs never pack."""
    case = _case([256, 256, 256, 256], seed=62)  # 4 x 2 programs x 4 chunks: the whole target of 32
    assert run_fa2_decode(case, CPU_PACK).items == 1
    assert run_fa2_decode(_case([300, 251, 190], seed=64), CPU_PACK, fixed_split_size=2).items == 1
    graph = _case([300, 251, 190], seed=65, use_cuda_graph=True)
    graph.params.int_workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    assert run_fa2_decode(graph, CPU_PACK).items == 1


@pytest.mark.interpreted
def test_16bit_d128_defaults_pack_only_a_poorly_filled_plan():
    """The fp16 d128 defaults pack below 0.65 of the target (here 8 SMs x 4, 2 KV heads): 9 whole
    requests fill 0.56 and pack, 14 fill 0.88 and do not (GQA and MHA). A direct plan refreshed
    for lengths that pack plans afresh."""
    small = {"min_chunk_tokens": 16}
    for heads in ((8, 2), (2, 2)):
        case = _case([300] * 9, head_dim_qk=128, num_qo_heads=heads[0], num_kv_heads=heads[1], seed=66)
        ref_out, ref_lse = case.oracle()
        assert run_fa2_decode(case, small).items == 2
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
        case = _case([300] * 14, head_dim_qk=128, num_qo_heads=heads[0], num_kv_heads=heads[1], seed=67)
        assert run_fa2_decode(case, small).items == 1
    # packing is a speed-up: a workspace too small for its partials plans the whole requests
    case = _case([300] * 9, head_dim_qk=128, seed=70)
    case.params.workspace = torch.zeros(1024, dtype=torch.uint8)
    plan = plan_decode(case.problem, case.device, case.params, small)
    assert plan.items == 1 and plan.direct
    # a direct split of 2 chunk slots keeping its programs 0.75 busy (`work_fill`: 16 items of its
    # longest, 128 tokens); refreshed for 2-slot lengths at 0.73 (kept) and 0.60 (they pack: afresh)
    direct = run_fa2_decode(_case([256] * 3 + [128] * 6, head_dim_qk=128, seed=68), small)
    assert direct.direct and direct.split_slots == 2 and direct.items == 1
    for lens, refreshed in (([256] * 3 + [120] * 6, True), ([250] + [150] * 8, False)):
        case = _case(lens, head_dim_qk=128, seed=69)
        case.params.workspace = torch.zeros(1 << 22, dtype=torch.uint8)
        assert (direct.refreshed(case.device, case.params) is not None) == refreshed, lens


@pytest.mark.gpu
@pytest.mark.parametrize("lens, heads, kv", [
    ([4096] * 48, (32, 8), "e4m3"), ([4096] * 36, (32, 8), "e4m3"), ([3000, 9000, 2000, 4000] * 12, (32, 8), "e4m3"),
    ([4096] * 12, (32, 32), "e4m3"), ([4096] * 9, (32, 32), "e4m3"), ([4096] * 36, (32, 8), "bf16"),
    ([4096, 3800, 4300] * 12, (32, 8), "bf16"), ([4096] * 9, (32, 32), "bf16")],
    ids=["48x4096", "36x4096", "mixed48", "mha12x4096", "mha9x4096", "bf16-36x4096", "bf16-mixed36", "bf16-mha9x4096"])
def test_gpu_defaults_pack(lens, heads, kv):
    """The d128 defaults pack batches whose plain plan fills its target poorly (fp8 under 0.95,
    bf16 under 0.65): fp8 on the kernel's line (few_pack_line), bf16 on the host, but 16 or more
    bf16 GQA requests of mixed lengths on the line (few_line_mixed). The Gluon fp8 kernel is off here
    (it takes some of these fp8 plans on sm90: test_fa2_decode_gluon_gpu.py covers it)."""
    fp8 = kv == "e4m3"
    line = fp8 or heads[1] < heads[0] and len(set(lens)) > 1
    case = _case(lens, device="cuda", kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                 num_qo_heads=heads[0], num_kv_heads=heads[1], k_scale=0.8 if fp8 else None,
                 v_scale=1.5 if fp8 else None, seed=len(lens) + heads[1])
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, {"gluon_fp8_stages": 0})
    assert plan.line if line else plan.items == 2
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 8e-2 if fp8 else 2e-2)


def _assert_empty_rows(case, rows) -> None:
    """The empty requests' output rows are exactly 0 and their lse -inf."""
    for b in rows:
        assert torch.all(case.inputs.out[b] == 0) and torch.all(case.inputs.lse[b] == float("-inf"))


def _gpu_mixed_plan(batch: int, empty: list, kv: str, head_dim: int, draw: int, seed: int, config=None,
                    kv_heads: int = 8):
    """A plan of the defaults (32/``kv_heads`` heads; ``config``: overrides) run on ``batch``
    lengths drawn from 1 .. 8191 (as the bench's ``:var`` rows; generator seed ``draw``; the
    ``empty`` requests without tokens), the case's data from ``seed``, checked against the
    reference backend."""
    fp8 = kv == "e4m3"
    lens = np.random.default_rng(draw).integers(1, 8192, batch)
    lens[empty] = 0
    case = _case(lens.tolist(), device="cuda", kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                 num_qo_heads=32, num_kv_heads=kv_heads, head_dim_qk=head_dim, k_scale=0.8 if fp8 else None,
                 v_scale=1.5 if fp8 else None, seed=seed)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, config)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 8e-2 if fp8 else 2e-2)
    _assert_empty_rows(case, empty)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64, 256])
@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
def test_gpu_mixed_lengths_pack_four_to_a_program(kv, head_dim):
    """A serving batch's mix (48 requests, two empty) under the GQA defaults that pack (pack_items
    4) on the host (few_pack_line and few_line_mixed off): pieces touching four requests, the
    empty requests in a program of their own."""
    plan = _gpu_mixed_plan(48, [7, 30], kv, head_dim, draw=9, seed=71,
                           config={"few_pack_line": False, "few_line_mixed": 0})
    assert plan.items == 4 and not plan.direct


@pytest.mark.gpu
def test_gpu_fp8_mha_d64_packs_mixed_lengths():
    """The fp8 MHA d64 default packs as GQA d64 does: 16 mixed requests (one empty) on the host
    under one wave, 64 on the kernel's line past it."""
    few = _gpu_mixed_plan(16, [5], "e4m3", 64, draw=10, seed=72, kv_heads=32)
    assert few.items > 1 and not few.direct and not few.line
    assert _gpu_mixed_plan(64, [3, 40], "e4m3", 64, draw=11, seed=73, kv_heads=32).line
