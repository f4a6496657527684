"""fa2 decode's handling of GPU waves (CPU, TRITON_INTERPRET=1): plans of many programs pick
their tile (`DecodeConfig.wave_tiles`) or split their requests (`DecodeConfig.wave_split_ctas`)
by the wave model of decode_config.py (`wave_choice`), and match the oracle either way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdispatch.dispatch.problem import Device

from test_fa2_decode import F16, _case, _check

pytestmark = pytest.mark.interpreted


@pytest.mark.parametrize("heads, tile", [(8, (32, 3)), (16, (16, 2))])  # 4 requests x 2 / 4 KV heads
def test_wave_tiles_pick_by_programs(heads, tile):
    """A plan of at least ctas_per_sm x SMs programs (the interpreter's 8 SMs) runs the wave tile
    with the least predicted time: 8 programs fill one wave of [32, 3] (1 per SM) and half of one
    of [16, 2] (2 per SM); 16 programs two waves of [32, 3], one of [16, 2] (the faster per wave
    here); both match the oracle. fixed_split_size and disable_split_kv keep the config's tile
    (batch-invariant results)."""
    case = _case(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.3, num_qo_heads=heads * 2,
                 num_kv_heads=heads // 4, seed=41)
    config = {"ctas_per_sm": 1, "wave_tiles": [[32, 3, 1, 0.9], [16, 2, 2, 1.0]]}
    plan = _check(case, config=config)
    assert (plan.config.block_n, plan.config.num_stages) == tile
    for fixed in ({"disable_split_kv": True}, {"fixed_split_size": 2}):
        plan = _check(case, config=config, **fixed)
        assert (plan.config.block_n, plan.config.num_stages) == (64, 3), fixed


@pytest.mark.parametrize("features", [{}, {"pos_encoding_mode": "ROPE_LLAMA"}, {"pos_encoding_mode": "ALIBI"},
                                      {"logits_soft_cap": 30.0}, {"q_len_per_req": 3, "mask_mode": "causal"}],
                         ids=["plain", "rope", "alibi", "soft_cap", "24_rows"])
def test_waves_only_for_the_measured_variant(features):
    """RoPE, ALiBi, soft cap and more than 16 rows per program (3 query rows x a group of 8)
    use other registers than the variant the programs per SM were measured on: those plans
    keep the config's tile where the plain variant takes [16, 2], and stay whole where it
    splits for waves."""
    plain = not features
    config = {"ctas_per_sm": 1, "wave_tiles": [[32, 3, 1, 0.9], [16, 2, 2, 1.0]]}
    case = _case(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.3, num_qo_heads=32, num_kv_heads=4,
                 seed=42, **features)
    plan = _check(case, config=config)
    assert (plan.config.block_n, plan.config.num_stages) == ((16, 2) if plain else (64, 3))
    case = _case([40, 300, 37, 200, 120], num_qo_heads=16, num_kv_heads=2, seed=12, **features)
    plan = _check(case, config=SPLIT_AT_ONE_SLOT)
    assert (plan.max_chunks > 1, plan.wave_split) == (plain, plain)


def test_wave_tile_choice_and_config():
    """`wave_choice` against the H200 sweeps its figures were fitted to (fp8, session 15: 1536
    programs read 3.84 TB/s with 32 x 2, 3.11 with 32 x 3; 2048: 4.00 with 32 x 3; bf16, session
    16: 1280 programs 4.32 with 64 x 2 against 3.28 with 32 x 2, 1584 4.47 with 64 x 3, 2112 4.53
    with 32 x 2); the fp8 and bf16 d128 defaults carry tiles, d64 and explicit tiles do not; bad
    tiles are refused."""
    from flashdispatch.backends.fa2.decode_config import DecodeConfig, apply_overrides, default_config
    from flashdispatch.backends.fa2.decode_waves import wave_choice
    from flashdispatch.dispatch.problem import Problem

    def config(heads, d=128, kv=torch.float8_e4m3fn):
        return default_config(Problem("decode", F16, kv, F16, heads, 8, d, d, page_size=16))
    fp8 = config(32)
    assert fp8.swap_ab and config(8).wave_tiles == fp8.wave_tiles and config(32, 64).wave_tiles == ()
    assert [wave_choice(fp8, n, 132)[0] for n in (1536, 2048, 1024)] == [(32, 2), (32, 3), (32, 3)]
    bf16 = config(32, kv=F16)
    assert config(64, kv=F16).wave_tiles == bf16.wave_tiles and config(32, 64, kv=F16).wave_tiles == ()
    assert [wave_choice(bf16, n, 132)[0] for n in (1280, 1584, 2112)] == [(64, 2), (64, 3), (32, 2)]
    for explicit in ({"block_n": 32}, {"num_stages": 2}, {"num_warps": 2}, {"max_registers": 0}):  # kept at any batch
        assert apply_overrides(fp8, explicit).wave_tiles == () == apply_overrides(bf16, explicit).wave_tiles
    assert wave_choice(apply_overrides(bf16, {"block_n": 64}), 1280, 132) is None
    assert wave_choice(bf16, 0, 132)[1] == 1.0  # no programs (an empty batch): nothing to split
    for bad in ([[32, 3, 8]], [[32, 0, 8, 1.0]], [[32, 3, 8, 0]], [[24, 3, 8, 1.0]], [[8, 3, 8, 1.0]], 5):
        with pytest.raises(ValueError, match="wave_tiles"):
            DecodeConfig(wave_tiles=bad)


_H200 = Device("cpu", 0, (9, 0), "NVIDIA H200", 132)  # plans only: their tables stay on the CPU


def _h200_plan(lens, kv_dtype=F16, config=None, graph=False, head_dim=128, kv_heads=8, **problem):
    """A plan (no launch) of bf16 / fp8 32/8 heads (``kv_heads``) d128 (``head_dim``) page 16 for
    these KV lengths on a described 132-SM sm90 device (``config``: `DecodeConfig` overrides;
    ``graph``: use_cuda_graph, with an int workspace; ``problem``: other `Problem` fields); page
    tables on the CPU."""
    from flashdispatch.backends.base import AttentionParams
    from flashdispatch.backends.fa2.decode import plan_decode
    from flashdispatch.dispatch.problem import Problem
    pages = [-(-n // 16) for n in lens]
    indptr = np.cumsum([0] + pages)
    i32 = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.int32)  # noqa: E731
    params = AttentionParams(
        qo_indptr=i32(np.arange(len(lens) + 1)), kv_indptr=i32(indptr), kv_lens=i32(lens),
        qo_lens_host=[1] * len(lens), kv_lens_host=list(lens), sm_scale=0.1,
        kv_indices=torch.randperm(int(indptr[-1])).to(torch.int32),
        kv_last_page_len=i32([n - 16 * (p - 1) if n else 0 for n, p in zip(lens, pages)]),
        workspace=torch.empty(128 << 20, dtype=torch.uint8),
        int_workspace=torch.zeros(1 << 20, dtype=torch.uint8) if graph else None)
    problem = Problem("decode", F16, kv_dtype, F16, 32, kv_heads, head_dim, head_dim, page_size=16,
                      use_cuda_graph=graph, **problem)
    return plan_decode(problem, _H200, params, config), params


def test_wave_plans_on_the_h200():
    """Plans of the bf16 and fp8 d128 defaults on 132 SMs for ~4096-token requests: the tile or
    wave split of each batch (the 32 x 2 tile under its register cap, the others uncapped), as the
    H200 sweeps rank them (bf16 176x4096 4.28 TB/s in 3 chunks against 4.18 whole; fp8 80x4096
    3.49 in 3 against 3.02, 160x4096 3.86 in 4 against 3.66, 128x4096 3.90 whole against 3.91 in
    2); a bf16 re-plan with other lengths through `DecodePlan.refreshed` equals a fresh plan of
    them."""
    from flashdispatch.backends.fa2.decode_variant import register_cap
    gen = np.random.default_rng(7)
    expect = {70: ((64, 2), 1, 0), 96: ((32, 2), 1, 64), 133: ((64, 2), 5, 0), 160: ((64, 2), 1, 0),
              176: ((64, 2), 3, 0), 256: ((32, 2), 1, 64)}
    refreshed = 0
    for batch, (tile, chunks, cap) in expect.items():
        lens = gen.integers(3500, 4700, batch).tolist()
        plan, _ = _h200_plan(lens)
        cfg = plan.config
        assert ((cfg.block_n, cfg.num_stages), plan.wave_split, plan.max_chunks) == (tile, chunks > 1, chunks), batch
        assert register_cap(plan.problem, cfg, plan.block_m, plan.fused_merge) == cap, batch
        new_lens = gen.integers(3500, 4700, batch).tolist()
        fresh, params = _h200_plan(new_lens)
        again = plan.refreshed(_H200, params)
        if again is not None:
            refreshed += 1
            for name in ("config", "wave_split", "split_target", "split_tokens", "split_slots", "max_chunks",
                         "n_work", "fused_merge"):
                assert getattr(again, name) == getattr(fresh, name), (batch, name)
    assert refreshed == len(expect)
    # fp8 (no split block; one-warp programs: a partly filled single wave splits too): the split
    # runs the fastest tile, 32 x 3 (wave_pack_below off: by default a last wave partly filled packs
    # on the line instead, test_equal_lengths_pack_where_a_wave_is_partly_filled)
    fp8 = {80: 3, 128: 1, 160: 4, 198: 2, 256: 1, 270: 3}
    for batch, chunks in fp8.items():
        plan, _ = _h200_plan(gen.integers(3500, 4700, batch).tolist(), torch.float8_e4m3fn, {"wave_pack_below": 0})
        assert ((plan.config.block_n, plan.config.num_stages), plan.max_chunks) == ((32, 3), chunks), batch


def test_refresh_plans_afresh_where_the_split_changes():
    """The wave split depends on the mean length (`DecodeConfig.split_chunk_tokens`): a re-plan of
    a bf16 133-request plan with 2048-token requests (whole on the 64 x 2 tile) plans afresh when
    the requests reach 4096 tokens (split in 5), and the other way."""
    short, _ = _h200_plan([2048] * 133)
    long, params = _h200_plan([4096] * 133)
    assert (short.wave_split, long.wave_split, long.max_chunks) == (False, True, 5)
    assert short.refreshed(_H200, params) is None
    assert long.refreshed(_H200, _h200_plan([2048] * 133)[1]) is None
    assert long.refreshed(_H200, _h200_plan([4000] * 133)[1]) is not None


# the wave split alone: mixed lengths past one wave would pack (`DecodeConfig.wave_pack_spread`)
SPLIT_AT_ONE_SLOT = {"wave_slots": 1, "wave_split_ctas": 8, "ctas_per_sm": 1, "min_chunk_tokens": 16, "block_n": 16,
                     "split_chunk_tokens": 0, "wave_pack_spread": 0}


@pytest.mark.parametrize("batch, split", [(4, False), (5, True)])  # x 2 KV heads: 8 or 10 programs
def test_wave_split_of_a_partial_last_wave(batch, split):
    """DecodeConfig.wave_split_ctas at wave_slots 1: 8 programs fill the interpreter's 8 SMs x 1
    slot exactly and stay whole; 10 leave a last wave of 2 (predicted 0.77 of the GPU) and split
    toward 8 per SM."""
    case = _case([40, 300, 37, 200, 120][:batch], seed=12)
    config = SPLIT_AT_ONE_SLOT
    plan = _check(case, config=config)
    assert (plan.max_chunks > 1) == split
    # a workspace too small for the split's partials: the plan runs whole instead of refusing
    plan = _check(case, config=config, workspace=torch.zeros(256, dtype=torch.uint8))
    assert plan.max_chunks == 1


@pytest.mark.parametrize("lens, block_n", [((40, 300, 37, 200, 120), 32), ((9, 12, 3, 15, 7), 16)],
                         ids=["split", "short"])
def test_split_block_only_where_requests_split(lens, block_n):
    """A plan the wave split targets runs split_block_n only when its partition splits a request:
    requests shorter than the policy's chunk keep the base block (and its register cap)."""
    # figures for both blocks (3 stages: the d64 default's), or the split is not predicted
    config = {**SPLIT_AT_ONE_SLOT, "split_block_n": 32, "wave_tiles": [[16, 3, 1, 1.0], [32, 3, 1, 1.0]]}
    plan = _check(_case(lens, seed=13), config=config)
    assert (plan.config.block_n, plan.max_chunks > 1) == (block_n, block_n == 32)


@pytest.mark.parametrize("window_left", [-1, 0, 100])
def test_mean_tokens_match_the_partition(window_left):
    """The wave split's mean length (`mean_tokens`, plain Python for plan()'s host time) is the
    mean of the tokens the partition works on (`effective_lengths`), with and without a window;
    no requests: 0."""
    from flashdispatch.backends.fa2.decode_split import effective_lengths, mean_tokens
    lens = [0, 1, 17, 99, 101, 102, 5000, 333]
    _, params = _h200_plan(lens)
    problem = _h200_plan([1])[0].problem.with_(window_left=window_left)
    for q_len in (1, 3):
        eff = effective_lengths(params, problem, q_len)[2]
        assert mean_tokens(params, problem, q_len) == pytest.approx(eff.mean()), q_len
    params.kv_lens_host = []
    assert mean_tokens(params, problem, 1) == 0.0


def test_wave_split_targets_on_the_h200():
    """`split_target` for the bf16 GQA d128 default on 132 SMs (8 KV heads; wave tiles of 8, 5
    and 4 programs per SM) against the H200 sweeps of session 18 (TB/s split / whole): 170x4096
    in 3 chunks (4.28 / 4.08), 140x8192 in 5 (4.36 / 4.32), 266x2048 in 2 (4.12 / 4.04);
    133x2048 (3.93 / 4.07) and 200x1024 (3.80 / 3.88) whole. One partial wave and the ANCHORS
    batches are not split for waves; fewer than 4 per SM aim at 4."""
    from flashdispatch.backends.fa2.decode_split import split_target
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.dispatch.problem import Problem
    cfg = default_config(Problem("decode", F16, F16, F16, 32, 8, 128, 128, page_size=16))
    for batch, tokens, chunks in ((170, 4096, 3), (140, 8192, 5), (266, 2048, 2)):
        assert split_target(batch, cfg, 8, 132, tokens) == batch * 8 * chunks, batch
    for batch, tokens in ((133, 2048), (200, 1024), (96, 4096), (128, 2048), (256, 1024), (256, 4096)):
        assert split_target(batch, cfg, 8, 132, tokens) is None, batch
    assert split_target(64, cfg, 8, 132, 4096) == 132 * 4
    assert split_target(200, cfg, 8, 132, 0.0) is None  # empty requests


def test_wave_split_choice_on_the_h200():
    """`wave_split_choice` on 132 SMs against the H200 sweeps (TB/s of the chunk count it picks;
    others in brackets): fp8 d128 on the 32 x 3 tile (8 per SM), session 17: 270x4096 3 chunks
    3.82 (2: 3.72), 300x4096 3 (3.95; 2: 3.83), 420x4096 2 (3.96; whole: 3.72), 300x2048 3 (3.43-
    3.53; 2: 3.34); session 18: 80x4096 3 (3.49), 100x4096 5 (3.58), 160x4096 4 (3.86), 160x8192
    4 (4.11); bf16 group 4 on the fused split kernel (4 per SM) 200x4096 3; d256 (4 per SM)
    85x4096 3 (4.29; 4: 4.05), 90x4096 2 (4.24; 4: 4.15); page 1 (3 per SM) 70x4096 2 (4.08; 5:
    4.01). Fewer than 2 chunks within the cap, empty requests, a split kernel without a
    programs-per-SM figure, and one partly filled wave of shorter requests than
    lone_wave_split_tokens (fp8 160x2048: 3.46 whole, 3.26 in 4; 160x3072 3.58 whole, 3.69 in
    4): no split."""
    from flashdispatch.backends.fa2.decode_config import apply_overrides, default_config
    from flashdispatch.backends.fa2.decode_waves import wave_split_choice
    from flashdispatch.dispatch.problem import Problem

    def chunks(batch, tokens=4096, d=128, page=16, kv=F16, heads=(32, 8), overrides=None):
        cfg = default_config(Problem("decode", F16, kv, F16, heads[0], heads[1], d, d, page_size=page))
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
        return wave_split_choice(cfg, batch * heads[1], 132, tokens)[0]
    fp8 = torch.float8_e4m3fn
    assert [chunks(b, kv=fp8) for b in (270, 300, 420, 80, 100, 160)] == [3, 3, 2, 3, 5, 4]
    assert chunks(300, 2048, kv=fp8) == 3 and chunks(160, 8192, kv=fp8) == 4
    # one partly filled wave (fp8: within 12 per SM): split from lone_wave_split_tokens (3072) on
    assert [chunks(160, n, kv=fp8) for n in (2048, 3071, 3072)] == [1, 1, 4] and chunks(100, 8192) == 1  # bf16: never
    assert chunks(1100, kv=fp8) == 1  # 64 per SM hold fewer than 2 chunks of 8800 programs
    assert chunks(200) == 3 and chunks(85, d=256) == 3 and chunks(90, d=256) == 2 and chunks(70, page=1) == 2
    assert chunks(200, 0) == 1
    assert chunks(133, overrides={"wave_tiles": [[32, 2, 8, 1.0]], "split_block_n": 128}) == 1


def test_wave_split_ceiling():
    """`wave_split_ceiling` bounds `wave_split_choice`'s prediction at every mean length, and a plan
    whose best tile reads at least that much (bf16 256 requests: 2048 programs) neither splits
    nor reads the mean length, at plan() or at its refresh."""
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.backends.fa2.decode_waves import wave_choice, wave_split_ceiling, wave_split_choice
    from flashdispatch.dispatch.problem import Problem
    for kv in (F16, torch.float8_e4m3fn):
        cfg = default_config(Problem("decode", F16, kv, F16, 32, 8, 128, 128, page_size=16))
        for batch in (80, 133, 170, 200, 256, 300):
            ceiling = wave_split_ceiling(cfg, batch * 8, 132)
            assert all(wave_split_choice(cfg, batch * 8, 132, t)[1] <= ceiling for t in (512, 4096, 1 << 20))
    cfg = default_config(Problem("decode", F16, F16, F16, 32, 8, 128, 128, page_size=16))
    assert wave_split_ceiling(cfg, 2048, 132) <= wave_choice(cfg, 2048, 132)[1]
    plan, _ = _h200_plan([4096] * 256)
    assert plan._wave_policy is None and not plan.wave_split and plan.split_target is None


def test_wave_split_defaults_by_config():
    """The defaults carry the sm90 programs per SM where the wave split was measured (bf16 d128
    GQA as wave tiles; MHA 4, page-1 GQA 3, d256 GQA 4) or the wave model packs (GQA d64 5, no
    split) and none where neither was (fp8 d64, MHA d64 and d256, page-1 MHA and d256; fp8 d128
    has wave tiles); overriding the kernel's tile or registers drops them."""
    from flashdispatch.backends.fa2.decode_config import apply_overrides, default_config
    from flashdispatch.dispatch.problem import Problem

    def waves(heads, d, page=16, kv=F16):
        cfg = default_config(Problem("decode", F16, kv, F16, heads[0], heads[1], d, d, page_size=page))
        return cfg.wave_slots, bool(cfg.wave_tiles), cfg.wave_split_ctas
    assert waves((32, 8), 128) == (0, True, 48)
    gqa = default_config(Problem("decode", F16, F16, F16, 32, 8, 128, 128, page_size=16))
    assert gqa.wave_split_slots == 4  # group 4's fused split kernel; other groups: the 64 x 2 tile's
    for override in ({"split_block_n": 128}, {"fused_merge_values": 4096}, {"block_n": 64}):
        assert apply_overrides(gqa, override).wave_split_slots == 0, override
    assert waves((32, 8), 128, kv=torch.float8_e4m3fn) == (0, True, 64)
    assert waves((32, 32), 128) == (4, False, 24) and waves((32, 8), 128, page=1) == (3, False, 24)
    assert waves((32, 8), 256) == (4, False, 24)
    mha = default_config(Problem("decode", F16, F16, F16, 32, 32, 128, 128, page_size=16))
    for override in ({"block_n": 64}, {"num_stages": 3}, {"num_warps": 2}, {"max_registers": 0}):
        assert apply_overrides(mha, override).wave_slots == 0, override
    assert apply_overrides(mha, {"ctas_per_sm": 8}).wave_slots == 4
    assert waves((32, 8), 64) == (5, False, 0)
    for no in (waves((32, 32), 64), waves((32, 32), 128, page=1), waves((32, 32), 256),
               waves((32, 8), 256, page=1), waves((32, 8), 64, kv=torch.float8_e4m3fn)):
        assert no[:2] == (0, False), no


def test_mixed_lengths_past_a_wave_pack_on_the_h200():
    """Past one wave, lengths drawn as the bench's ``:var`` rows (1 .. 8191: the longest about
    twice the mean) pack (`DecodeConfig.wave_pack_spread`) into whole waves of the few-programs
    target's pieces, on the split block: 128 requests bf16 in 66 pieces (4 to a program), fp8 in
    132 (3), 256 bf16 in 132. Equal lengths, and mixed ones too short for min_chunk_tokens pieces,
    keep the direct table; a direct plan re-planned for mixed lengths plans afresh, for equal ones
    it refreshes. Laid out by the host (wave_pack_line false; test_fa2_decode_line.py: by the
    kernel)."""
    lens = np.random.default_rng(20261201).integers(1, 8192, 256).tolist()
    host = {"wave_pack_line": False}
    for kv, batch, (block_n, groups, items) in ((F16, 128, (64, 66, 4)), (torch.float8_e4m3fn, 128, (32, 132, 3)),
                                                (F16, 256, (64, 132, 4))):
        plan, _ = _h200_plan(lens[:batch], kv, host)
        got = (plan.config.block_n, plan.split_target // plan.units, plan.items, plan.direct)
        assert got == (block_n, groups, items, False), (kv, batch)
        equal, _ = _h200_plan([4096] * batch, kv)
        assert equal.direct and equal.items == 1
        assert equal.refreshed(_H200, _h200_plan(lens[:batch], kv)[1]) is None
        assert equal.refreshed(_H200, _h200_plan([4000] * batch, kv)[1]) is not None
    short, _ = _h200_plan(np.random.default_rng(1).integers(1, 128, 256).tolist())
    assert short.direct and short.items == 1 and not short.line


def test_bf16_d64_packs_up_to_four_waves():
    """bf16 d64 (`DecodeConfig.wave_pack_max_waves` 4): mixed lengths of 256 requests (3.9 waves
    of 132 SMs x 4) go on the line, eager and under CUDA graphs; 512 (7.8 waves) are not packed,
    unless the cap is off; fp8 d64 packs 512."""
    lens = np.random.default_rng(20261202).integers(1, 2048, 512).tolist()
    for graph in (False, True):
        assert _h200_plan(lens[:256], graph=graph, head_dim=64)[0].line
        many = _h200_plan(lens, graph=graph, head_dim=64)[0]
        assert not many.line and many.items == 1 and many.direct, graph
        assert _h200_plan(lens, config={"wave_pack_max_waves": 0}, graph=graph, head_dim=64)[0].line
        assert _h200_plan(lens, torch.float8_e4m3fn, graph=graph, head_dim=64)[0].line


def test_equal_lengths_pack_where_a_wave_is_partly_filled():
    """The fp8 d128 (GQA and MHA) and d256 defaults (`DecodeConfig.wave_pack_below` 0.96) on 132
    SMs: equal lengths past one wave take the kernel's line where the wave model predicts their
    best unpacked grid under 0.96 of full-wave throughput (d128 200x1024 and 400x4096 0.86-0.90,
    MHA 24x4096 0.92, d256 100x2048 0.86), not where a last wave fills (256x1024, 128x2048,
    1000x512, MHA 64x4096, d256 256x1024: 0.97-0.98); a line plan re-planned for the same lengths
    refreshes. bf16 d64, fp8 d64 with wave_pack_tokens off (`test_fp8_d64_packs_long_requests`),
    a sliding window and wave_pack_below 0 keep 200x1024 unpacked."""
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.backends.fa2.decode_waves import unpacked_fraction
    fp8 = torch.float8_e4m3fn
    for head_dim, kv_heads, batch, kv_len, line in (
            (128, 8, 200, 1024, True), (128, 8, 400, 4096, True), (128, 32, 24, 4096, True),
            (256, 8, 100, 2048, True), (128, 8, 256, 1024, False), (128, 8, 128, 2048, False),
            (128, 8, 1000, 512, False), (128, 32, 64, 4096, False), (256, 8, 256, 1024, False)):
        plan, _ = _h200_plan([kv_len] * batch, fp8, head_dim=head_dim, kv_heads=kv_heads)
        fraction = unpacked_fraction(default_config(plan.problem), batch * kv_heads, 132, kv_len)
        assert (plan.line, fraction < 0.96) == (line, line), (head_dim, kv_heads, batch, kv_len, fraction)
        if line:
            again = plan.refreshed(_H200, _h200_plan([kv_len] * batch, fp8, head_dim=head_dim, kv_heads=kv_heads)[1])
            assert again is not None and again.line
    for kv, head_dim, config, problem in ((F16, 128, None, {}), (fp8, 64, {"wave_pack_tokens": 0}, {}),
                                          (fp8, 128, None, {"window_left": 2000}),
                                          (fp8, 128, {"wave_pack_below": 0}, {})):
        plan, _ = _h200_plan([1024] * 200, kv, config, head_dim=head_dim, **problem)
        assert not plan.line and plan.items == 1, (kv, head_dim, config, problem)


def test_bf16_d64_equal_lengths_by_the_wave_model():
    """The bf16 GQA d64 default (`DecodeConfig.wave_pack_below` 0.88 on its direct table's 5
    programs per SM, from `wave_pack_below_tokens` 1024) on 132 SMs: equal lengths past one wave
    take the kernel's line where the model predicts a last wave partly filled (90x4096 0.71,
    100x2048 0.76, 128x4096 and 256x1024 0.87), not where the waves fill (80x4096 and 160x1024
    0.98, 200x1024 0.89), nor requests under 1024 tokens (256x512 0.87) unless that floor is 0."""
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.backends.fa2.decode_waves import unpacked_fraction
    for batch, kv_len, line in ((90, 4096, True), (100, 2048, True), (128, 4096, True), (256, 1024, True),
                                (80, 4096, False), (160, 1024, False), (200, 1024, False), (256, 512, False)):
        plan, _ = _h200_plan([kv_len] * batch, head_dim=64)
        fraction = unpacked_fraction(default_config(plan.problem), batch * 8, 132, kv_len)
        assert (plan.line, fraction < 0.88 and kv_len >= 1024) == (line, line), (batch, kv_len, fraction)
    assert _h200_plan([512] * 256, config={"wave_pack_below_tokens": 0}, head_dim=64)[0].line
    assert not _h200_plan([1024] * 256, config={"wave_pack_below": 0}, head_dim=64)[0].line


def test_fp8_d64_packs_long_requests():
    """The fp8 d64 defaults (`DecodeConfig.wave_pack_tokens`: GQA 512, MHA 1024) on 132 SMs: equal
    lengths past one wave take the kernel's line from that many tokens a request on average (GQA
    128x4096, 256x1024, 1000x512, MHA 64x1024), not under it (GQA 1000x256, MHA 64x512), nor with
    a sliding window, nor with the knob at 0; a line plan re-planned for other lengths of that mean
    refreshes. MHA mixed lengths pack as GQA's do: on the host under one wave
    (under CUDA graphs on the line: graph_few_line), on the line past it."""
    fp8 = torch.float8_e4m3fn
    for kv_heads, batch, kv_len, line in ((8, 128, 4096, True), (8, 256, 1024, True), (8, 1000, 512, True),
                                          (8, 1000, 256, False), (8, 2000, 300, False), (32, 64, 1024, True),
                                          (32, 64, 512, False)):
        plan, _ = _h200_plan([kv_len] * batch, fp8, head_dim=64, kv_heads=kv_heads)
        assert plan.line == line, (kv_heads, batch, kv_len)
        if line:
            lens = [kv_len] * (batch - 1) + [kv_len + 16]
            again = plan.refreshed(_H200, _h200_plan(lens, fp8, head_dim=64, kv_heads=kv_heads)[1])
            assert again is not None and again.line
    for config, problem in (({"wave_pack_tokens": 0}, {}), (None, {"window_left": 300})):
        plan, _ = _h200_plan([1024] * 256, fp8, config, head_dim=64, **problem)
        assert not plan.line, (config, problem)
    lens = np.random.default_rng(20261204).integers(1, 8192, 64).tolist()
    few = _h200_plan(lens[:16], fp8, head_dim=64, kv_heads=32)[0]
    assert few.items > 1 and not few.line and not few.direct
    assert _h200_plan(lens[:16], fp8, graph=True, head_dim=64, kv_heads=32)[0].line
    assert _h200_plan(lens, fp8, head_dim=64, kv_heads=32)[0].line


def test_may_wave_pack_and_its_pieces():
    """`wave_pack_groups`: whole waves of the few-programs target's pieces (bf16 d128 on 132 SMs:
    66, fp8: 132), about two requests to a piece, then one wave more; `line_groups`: mixed lengths
    in line_waves waves, equal ones from that (eager) or from `wave_pack_groups`' first (CUDA
    graphs) down to 0.9 x it in a count dividing the batch, so that they are not cut;
    `may_wave_pack`: the longest over the mean (from the window start) at least wave_pack_spread,
    pieces of at least min_chunk_tokens."""
    from dataclasses import replace
    from types import SimpleNamespace

    from flashdispatch.backends.base import AttentionParams
    from flashdispatch.backends.fa2.decode_config import default_config
    from flashdispatch.backends.fa2.decode_split import line_groups, may_wave_pack, wave_pack_groups
    from flashdispatch.dispatch.problem import Problem
    bf16, fp8 = (default_config(Problem("decode", F16, kv, F16, 32, 8, 128, 128, page_size=16))
                 for kv in (F16, torch.float8_e4m3fn))
    assert [wave_pack_groups(b, bf16, 132, 8) for b in (100, 132, 133, 256)] == [(66, 132)] * 2 + [(132, 198)] * 2
    assert wave_pack_groups(128, fp8, 132, 8) == (132, 264)
    for batch, even in ((100, 66), (128, 64), (160, 132), (256, 128), (300, 198), (384, 192), (512, 256)):
        assert line_groups(batch, bf16, 132, 8, any_lengths=True) == (max(66, even), 66, even), batch
        top = wave_pack_groups(batch, bf16, 132, 8)[0]
        assert line_groups(batch, replace(bf16, line_align_fill=1.0), 132, 8, any_lengths=True) == (top, 66, top)
    for batch, even in ((100, 66), (128, 64), (160, 66), (256, 64), (300, 60), (512, 64)):
        assert line_groups(batch, bf16, 132, 8, any_lengths=False) == (66, 66, even), batch
    assert line_groups(256, fp8, 132, 8, any_lengths=False) == (132, 132, 128)
    assert line_groups(100, fp8, 132, 8, any_lengths=True) == (132, 132, 132)
    assert line_groups(512, replace(bf16, line_waves=2), 132, 8, any_lengths=False) == (132, 132, 128)
    for lens, window_left, ok in (([3000, 1000] * 64, -1, True), ([2000, 1000] * 64, -1, False),
                                  ([3000, 1000] * 64, 999, False), ([150, 50] * 64, -1, False)):
        params = AttentionParams(qo_indptr=None, kv_indptr=None, kv_lens=None, qo_lens_host=[1] * len(lens),
                                 kv_lens_host=lens, sm_scale=1.0)
        problem = SimpleNamespace(window_left=window_left)
        assert may_wave_pack(params, problem, 1, bf16, 132, 8) == ok, (lens[:2], window_left)
        params.kv_lens_host = np.array(lens)  # (the decode wrapper gives an array and its (sum, max))
        params.set_kv_lens_stats(sum(lens), max(lens))
        assert may_wave_pack(params, problem, 1, bf16, 132, 8) == ok, (lens[:2], window_left)
