"""fa2 prefill kernel under the Triton interpreter (CPU): every feature against the float64 oracle.

Tiny shapes (the interpreter is slow); the CPU config uses 32x16 tiles so lengths up to 200
still cross many query and KV tiles, pages and the causal diagonal. Split-KV tests use 16x32
tiles, two query heads and small forced chunks (fixed_split_size, or the policy on a device
described with a few SMs) so a few hundred keys make several chunks per query tile.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest
import torch

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.fa2 import prefill as fa2_prefill
from flashdispatch.backends.fa2.prefill import (PREFILL_CAPS, balanced_chunks, fixed_chunks, plan_prefill,
                                                policy_splits, prefill_extra_checks, tile_ranges)
from flashdispatch.backends.fa2.prefill_config import CONFIG_ENV, PrefillConfig, config_from_env, default_config
from flashdispatch.dispatch.caps import check_caps
from flashdispatch.dispatch.reasons import Unsupported
from flashdispatch.quantization import packbits
from oracle import assert_close, make_paged_case, make_ragged_case

pytestmark = pytest.mark.interpreted

F16, F32 = torch.float16, torch.float32


def run_fa2(case, config=None):
    plan = plan_prefill(case.problem, case.device, case.params, config)
    plan.run(case.inputs)
    return case.inputs.out, case.inputs.lse


def check(case, tol=None, config=None):
    """Run fa2 on the NaN-poisoned case and compare out and lse with the oracle."""
    assert not check_caps(PREFILL_CAPS, case.problem, case.device)
    out, lse = run_fa2(case, config)
    ref_out, ref_lse = case.oracle()
    assert_close(out, lse, ref_out, ref_lse, tol or DEFAULT_TOLERANCE[case.problem.q_dtype])
    return ref_out, ref_lse


# --- shapes, layouts, page sizes ------------------------------------------------------------
@pytest.mark.parametrize("page_size,layout,dim,dtype,mask", [
    (1, "NHD", 64, F32, "causal"),
    (16, "HND", 64, F16, "causal"),
    (64, "NHD", 128, F16, "none"),
    (16, "NHD", 128, F32, "none"),
    (3, "HND", 64, F32, "causal"),
])
def test_paged_shapes(page_size, layout, dim, dtype, mask):
    check(make_paged_case(qo_lens=[1, 37, 0, 20, 5], kv_lens=[9, 70, 6, 20, 0], page_size=page_size,
                          kv_layout=layout, head_dim_qk=dim, q_dtype=dtype, mask_mode=mask, seed=page_size))


@pytest.mark.parametrize("dims,dtype", [((64, 64), F16), ((192, 128), F32), ((128, 128), F16)])
def test_ragged_shapes(dims, dtype):
    check(make_ragged_case(qo_lens=[17, 0, 33], kv_lens=[40, 3, 33], head_dim_qk=dims[0],
                           head_dim_vo=dims[1], q_dtype=dtype, mask_mode="causal", num_qo_heads=2,
                           num_kv_heads=1))


def test_paged_long_request_and_gqa():
    check(make_paged_case(qo_lens=[200], kv_lens=[200], page_size=16, mask_mode="causal",
                          num_qo_heads=8, num_kv_heads=1, head_dim_qk=64, q_dtype=F16))


def test_paged_qk_vo_192_128_tuple_cache():
    check(make_paged_case(qo_lens=[20, 9], kv_lens=[50, 9], page_size=16, kv_storage="tuple",
                          head_dim_qk=192, head_dim_vo=128, mask_mode="causal", num_qo_heads=2,
                          num_kv_heads=1))


def shared_rows_of(case):
    """Run fa2 on the case, check it against the oracle, return its launches' shared_rows flags."""
    plan = plan_prefill(case.problem, case.device, case.params)
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[case.problem.q_dtype])
    return [variant.shared_rows for variant in plan._launchers]


@pytest.mark.parametrize("padded,layout", [("v", "NHD"), ("k", "HND")])
def test_paged_kv_with_different_page_strides(padded, layout):
    """K and V with different page strides (one cache's pages padded with NaN) on tiles that cross
    pages: V rows are not at K's offsets, so the kernel computes them itself; equal strides (the
    5-D cache) share K's offsets."""
    opts = dict(qo_lens=[20, 33], kv_lens=[50, 70], page_size=4, kv_layout=layout, mask_mode="causal",
                num_qo_heads=2, num_kv_heads=1, head_dim_qk=64, q_dtype=F16)
    assert shared_rows_of(make_paged_case(**opts)) == [True]
    case = make_paged_case(kv_storage="tuple", **opts)
    kv = case.inputs.kv
    t = getattr(kv, padded)
    big = torch.full((t.shape[0], t.shape[1] + 3, *t.shape[2:]), float("nan"), dtype=t.dtype)
    big[:, :t.shape[1]] = t
    setattr(kv, padded, big[:, :t.shape[1]])
    assert kv.v.stride(0) != kv.k.stride(0)
    assert shared_rows_of(case) == [False]


def test_no_shared_rows_where_tiles_stay_in_a_page():
    """Ragged KV, and pages a multiple of the KV tile (the interpreter's tiles are 16 keys): V's
    addresses come from its own strides (the compiler derives them cheaply within a page)."""
    opts = dict(qo_lens=[20, 9], kv_lens=[50, 33], mask_mode="causal", num_qo_heads=2, num_kv_heads=1,
                head_dim_qk=64, q_dtype=F16)
    assert shared_rows_of(make_ragged_case(**opts)) == [False]
    assert shared_rows_of(make_paged_case(page_size=16, **opts)) == [False]


def test_paged_unit_page_and_token_strides():
    """A one-page, one-token cache viewed with strides of 1 (Triton makes an int argument of 1 a
    constant): the row offsets still compute."""
    case = make_paged_case(qo_lens=[1], kv_lens=[1], page_size=1, extra_pages=0, shuffle_pages=False,
                           num_qo_heads=2, num_kv_heads=1, head_dim_qk=64, q_dtype=F16)
    kv = case.inputs.kv
    kv.k = kv.k.reshape(64, 1, 1, 1).permute(1, 2, 3, 0)
    kv.v = kv.v.reshape(64, 1, 1, 1).permute(1, 2, 3, 0)
    assert kv.k.stride()[:2] == (1, 1)
    check(case)


def test_window_near_int32_max_is_no_window():
    """window_left = 2**31 - 1 with rows at negative positions (more queries than keys): no key
    is cut (the kernel's int32 position - window must not wrap)."""
    check(make_ragged_case(qo_lens=[20, 7], kv_lens=[5, 30], window_left=2**31 - 1, head_dim_qk=64,
                           num_qo_heads=2, num_kv_heads=1, q_dtype=F16))


def test_paged_page_stride_past_int32_is_refused():
    """A page stride of 2**31 elements (one page, so a small storage) would overflow the kernel's
    32-bit row products: ValueError naming the strides, before any launch."""
    case = make_paged_case(qo_lens=[5], kv_lens=[9], page_size=16, extra_pages=0, shuffle_pages=False,
                           num_qo_heads=2, num_kv_heads=1, head_dim_qk=64, q_dtype=F16)
    kv = case.inputs.kv
    assert kv.k.shape[0] == 1
    kv.k = kv.k.contiguous().as_strided(kv.k.shape, (2**31, *kv.k.stride()[1:]))
    plan = plan_prefill(case.problem, case.device, case.params)
    with pytest.raises(ValueError, match="strides must be < 2\\*\\*31"):
        plan.run(case.inputs)


def test_strided_q_out_views():
    case = make_ragged_case(qo_lens=[21, 12], kv_lens=[30, 12], mask_mode="causal", head_dim_qk=64)
    inp = case.inputs
    big_q = torch.randn(inp.q.shape[0], inp.q.shape[1], 2 * inp.q.shape[2])
    big_q[..., ::2] = inp.q
    inp.q = big_q[..., ::2]
    inp.out = torch.full((inp.out.shape[0], inp.out.shape[1] * 2, inp.out.shape[2]), float("nan"))[:, ::2]
    check(case)


# --- features -------------------------------------------------------------------------------
FEATURES = {
    "window_causal": dict(mask_mode="causal", window_left=13),
    "window_only": dict(window_left=5),
    "soft_cap": dict(mask_mode="causal", logits_soft_cap=2.5, sm_scale=0.6),
    "soft_cap_far_above_the_scores": dict(mask_mode="causal", logits_soft_cap=1e6),  # tanh's relative precision
    "alibi": dict(mask_mode="causal", pos_encoding_mode="ALIBI", num_qo_heads=6, num_kv_heads=3),
    "rope": dict(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e3),
    "sinks": dict(mask_mode="causal", sinks=True),
    "scales_float": dict(q_scale=0.5, k_scale=1.7, v_scale=0.3),
    "scales_tensor": dict(mask_mode="causal", q_scale=torch.tensor([0.5]), k_scale=torch.tensor(1.7),
                          v_scale=torch.tensor([0.3])),
    # negative score scales run the unfolded path (the row max of the scaled scores); scores this
    # large overflow exp2 if the max were taken the folded way
    "negative_scale": dict(mask_mode="causal", sm_scale=-60.0),
    "negative_scale_tensor": dict(k_scale=torch.tensor([-60.0])),
    "custom": dict(mask_mode="custom"),
    "custom_window_alibi_cap": dict(mask_mode="custom", window_left=7, pos_encoding_mode="ALIBI",
                                    logits_soft_cap=3.0),
    "no_lse": dict(mask_mode="causal", return_lse=False),
    "everything": dict(mask_mode="causal", window_left=20, logits_soft_cap=4.0, sinks=True,
                       pos_encoding_mode="ROPE_LLAMA", k_scale=0.8, v_scale=2.0),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_features(name, kind):
    feats = dict(FEATURES[name])
    lens = dict(qo_lens=[1, 30, 0, 45], kv_lens=[1, 61, 4, 45])
    if kind == "paged":
        case = make_paged_case(page_size=16, head_dim_qk=64, seed=3, **lens, **feats)
    else:
        case = make_ragged_case(head_dim_qk=64, seed=4, **lens, **feats)
    check(case)


@pytest.mark.parametrize("feats, folded", [
    (dict(), True), (dict(q_scale=0.5, k_scale=1.7), True), (dict(logits_soft_cap=2.5), True),
    (dict(sm_scale=-60.0), False), (dict(k_scale=-60.0), False), (dict(k_scale=torch.tensor([1.7])), False),
])
def test_folded_score_scale_only_with_a_scale_known_positive(feats, folded):
    """The launch folds the score scale into the exponent (LaunchVariant.scale_pos) when the float
    scales' product is > 0 and no q/k scale tensor is given (its sign is on the device); soft cap
    takes the flag but keeps its scaled scores. Every case matches the oracle."""
    case = make_ragged_case(qo_lens=[30, 45], kv_lens=[61, 45], head_dim_qk=64, mask_mode="causal", seed=5,
                            **feats)
    plan = plan_prefill(case.problem, case.device, case.params)
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[case.problem.q_dtype])
    assert [variant.scale_pos for variant in plan._launchers] == [folded]

def test_rope_192_128():
    check(make_ragged_case(qo_lens=[19], kv_lens=[40], head_dim_qk=192, head_dim_vo=128, num_qo_heads=2,
                           num_kv_heads=1, mask_mode="causal", pos_encoding_mode="ROPE_LLAMA"))


def test_rope_without_a_phase_is_finite():
    """rope_scale near 0: the fp32 angles keep no phase (see test_fa2_trig); out and lse stay finite."""
    case = make_ragged_case(qo_lens=[19], kv_lens=[40], head_dim_qk=64, num_qo_heads=2, num_kv_heads=1,
                            mask_mode="causal", pos_encoding_mode="ROPE_LLAMA", rope_scale=1e-30)
    plan_prefill(case.problem, case.device, case.params).run(case.inputs)
    assert torch.isfinite(case.inputs.out).all() and not torch.isnan(case.inputs.lse).any()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv(fp8):
    check(make_paged_case(qo_lens=[12, 30], kv_lens=[40, 30], page_size=16, head_dim_qk=64, q_dtype=F16,
                          kv_dtype=fp8, mask_mode="causal", k_scale=0.7, v_scale=torch.tensor([1.3])),
          tol=DEFAULT_TOLERANCE[F16])


def test_fully_masked_rows_and_short_kv():
    """Causal rows with qo_len > kv_len and custom-mask rows without a single key: 0 and -inf."""
    masks = [torch.rand(6, 20) < 0.5, torch.zeros(4, 9, dtype=torch.bool)]
    masks[0][2] = False
    case = make_ragged_case(qo_lens=[6, 4], kv_lens=[20, 9], mask_mode="custom", custom_masks=masks,
                            head_dim_qk=64)
    _, ref_lse = check(case)
    assert torch.isinf(ref_lse[2]).all() and torch.isinf(ref_lse[6:]).all()
    _, ref_lse = check(make_ragged_case(qo_lens=[12], kv_lens=[5], mask_mode="causal", head_dim_qk=64))
    assert torch.isinf(ref_lse[:7]).all()


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_causal_equals_tril_custom_mask(kind):
    """The FlashInfer doc example: causal == custom mask tril(ones, diagonal=kv_len - qo_len)."""
    qo_lens, kv_lens = [7, 25, 16], [33, 25, 40]
    masks = [torch.tril(torch.ones(q, k, dtype=torch.bool), diagonal=k - q) for q, k in zip(qo_lens, kv_lens)]
    make = ((lambda **kw: make_paged_case(page_size=16, **kw)) if kind == "paged" else make_ragged_case)
    common = dict(qo_lens=qo_lens, kv_lens=kv_lens, head_dim_qk=64, num_qo_heads=4, num_kv_heads=1,
                  q_dtype=F16, seed=11)
    causal = make(mask_mode="causal", **common)
    custom = make(mask_mode="custom", custom_masks=masks, **common)
    out_c, lse_c = (t.clone() for t in run_fa2(causal))
    out_m, lse_m = run_fa2(custom)
    torch.testing.assert_close(out_c, out_m, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse_c, lse_m, atol=1e-3, rtol=1e-3)


def _tile_runs(plan, row):
    """(whole runs, partial runs, visible tiles) of the work row ``row``: runs as (first, end) KV tiles."""
    n_whole, n_partial, visible, _ = plan.tiles[row[9]:row[9] + 4].tolist()
    flat = plan.tiles[row[9] + 4:row[9] + 4 + 2 * (n_whole + n_partial)].tolist()
    pairs = list(zip(flat[::2], flat[1::2]))
    return pairs[:n_whole], pairs[n_whole:], visible


def test_custom_mask_tile_runs():
    """Empty KV tiles are left out of an item's runs, whole ones are walked without mask reads,
    partial ones (a few bits, the KV end) with them; the result matches the oracle either way."""
    mask = torch.zeros(64, 75, dtype=torch.bool)  # CPU tiles: 32 query rows x 16 keys
    mask[:32, :32] = True  # rows 0-31: KV tiles 0-1 whole (one run),
    mask[:32, 40:44] = True  # tile 2 partial,
    mask[:32, 50:52] = True  # tile 3 partial (the same run)
    mask[32:, 64:] = True  # rows 32-63: tile 4 only, cut by the KV end at 75
    mask[40, 3] = True  # and one bit of tile 0
    case = make_ragged_case(qo_lens=[64], kv_lens=[75], mask_mode="custom", custom_masks=[mask],
                            head_dim_qk=64)
    plan = plan_prefill(case.problem, case.device, case.params)
    runs = {row[1]: _tile_runs(plan, row) for row in plan.work.view(-1, 10).tolist()}
    assert runs == {0: ([(0, 2)], [(2, 4)], 4), 32: ([], [(0, 1), (4, 5)], 2)}
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


def test_custom_mask_tile_runs_longer_than_a_chunk(monkeypatch):
    """The runs kernel reads the classes in chunks (16 here): 25 KV tiles, runs across chunks."""
    monkeypatch.setattr(fa2_prefill, "_LIST_CHUNK", 16)
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(40, 400, generator=gen) < 0.3
    mask[:, 224:288] = True  # whole tiles 14-17: a run across the chunk boundary at 16
    mask[:, 48:64] = True  # and tile 3
    mask[:, 96:128] = False  # empty tiles 6-7
    mask[:, 368:384] = True  # whole tile 23: the partial run 18-22 stays in the second chunk
    case = make_ragged_case(qo_lens=[40], kv_lens=[400], mask_mode="custom", custom_masks=[mask], head_dim_qk=64)
    plan = plan_prefill(case.problem, case.device, case.params)
    whole, partial, visible = _tile_runs(plan, next(r for r in plan.work.view(-1, 10).tolist() if r[1] == 0))
    assert whole == [(3, 4), (14, 18), (23, 24)] and visible == 23
    assert partial == [(0, 3), (4, 6), (8, 14), (18, 23), (24, 25)]
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])
    mask[:, 224:288] = torch.rand(40, 64, generator=gen) < 0.3  # tiles 14-17 partial: a partial run across 16
    case = make_ragged_case(qo_lens=[40], kv_lens=[400], mask_mode="custom", custom_masks=[mask], head_dim_qk=64)
    plan = plan_prefill(case.problem, case.device, case.params)
    whole, partial, visible = _tile_runs(plan, next(r for r in plan.work.view(-1, 10).tolist() if r[1] == 0))
    assert whole == [(3, 4), (23, 24)] and partial == [(0, 3), (4, 6), (8, 23), (24, 25)] and visible == 23
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


@pytest.mark.parametrize("window_left", [5, 2**31 - 1])
def test_custom_mask_with_window(window_left):
    """A window on top of a custom mask; 2^31 - 1 keeps every key (the classifier's key bounds
    must not wrap around int32)."""
    mask = torch.rand(64, 70, generator=torch.Generator().manual_seed(5)) < 0.8
    case = make_ragged_case(qo_lens=[64], kv_lens=[70], mask_mode="custom", custom_masks=[mask], head_dim_qk=32,
                            window_left=window_left)
    plan_prefill(case.problem, case.device, case.params).run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


def test_custom_mask_128_wide_tiles(monkeypatch):
    """128-key tiles, whose partial-tile loop is not pipelined (shared memory on sm90): same result."""
    monkeypatch.setenv(CONFIG_ENV, "block_m=32,block_n=128")
    mask = torch.rand(70, 300, generator=torch.Generator().manual_seed(6)) < 0.5
    mask[:, 128:256] = True  # one whole tile per query tile
    case = make_ragged_case(qo_lens=[70], kv_lens=[300], mask_mode="custom", custom_masks=[mask], head_dim_qk=32)
    plan = plan_prefill(case.problem, case.device, case.params)
    assert plan.config.block_n == 128
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


def test_heaviest_first_kernel_ranks_like_a_stable_sort():
    """150 rows over five programs and several compare steps, many ties: the rows land where a
    stable descending sort of their visible-tile counts puts them."""
    from flashdispatch.backends.fa2.prefill_mask_tiles import heaviest_first_kernel
    gen = torch.Generator().manual_seed(8)
    n = 150
    work = torch.randint(0, 1000, (n, 10), dtype=torch.int32, generator=gen)
    visible = torch.randint(0, 6, (n,), dtype=torch.int32, generator=gen)
    out = torch.full_like(work, -1)
    heaviest_first_kernel[(5,)](work, visible, out, n, BLOCK_I=32, BLOCK_J=64)
    order = np.argsort(-visible.numpy(), kind="stable")
    assert torch.equal(out, work[torch.from_numpy(order)])


def test_custom_mask_items_run_heaviest_first():
    """The host sees every masked item as the whole KV; once the lists are built the work rows
    are reordered by visible KV tiles, most first: with a causal-pattern mask the last query
    tile runs first. A new mask of a kept plan reorders them again."""
    causal = torch.ones(128, 128, dtype=torch.bool).tril()
    case = make_ragged_case(qo_lens=[128], kv_lens=[128], mask_mode="custom", custom_masks=[causal], head_dim_qk=64)
    plan = plan_prefill(case.problem, case.device, case.params)
    assert [row[1] for row in plan.work.view(-1, 10).tolist()] == [96, 64, 32, 0]
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])
    case.params.packed_mask.copy_(packbits(causal.flip(0).reshape(-1), "little"))  # rows 0-31 see the most
    plan.refresh_tile_lists()
    assert [row[1] for row in plan.work.view(-1, 10).tolist()] == [0, 32, 64, 96]


# --- CUDA-graph mode (persistent grid over a workspace list), config, caps -------------------
@pytest.mark.parametrize("mask", ["causal", "custom"])
def test_graph_mode_replans_into_same_workspace(mask):
    """Every graph plan's work list (and a custom mask's tile lists) at the same address, the
    first plan's too, though it has no query rows and so no items (an empty view's address is 0:
    a graph captured on it would replay a null pointer)."""
    ws = torch.zeros(1 << 16, dtype=torch.uint8)  # the wrapper's int workspace
    float_ws = torch.zeros(1 << 16, dtype=torch.uint8)  # and its float workspace (mask tile bitmaps)
    plans = []
    for seed, (qo, kv) in enumerate([([0, 0], [0, 9]), ([30, 5], [40, 5]), ([3, 64], [3, 80])]):
        case = make_paged_case(qo_lens=qo, kv_lens=kv, page_size=16, mask_mode=mask,
                               use_cuda_graph=True, seed=seed)
        case.params.int_workspace, case.params.workspace = ws, float_ws
        plan = plan_prefill(case.problem, case.device, case.params)
        plans.append(plan)
        assert plan.grid == plans[0].grid and plan.work.data_ptr() == plans[0].work.data_ptr()
        if mask == "custom":
            assert plan.tiles.data_ptr() == plans[0].tiles.data_ptr()
            assert plan.tile_bits.data_ptr() == float_ws.data_ptr()
        plan.run(case.inputs)
        assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


def test_graph_mode_workspace_errors():
    case = make_paged_case(qo_lens=[300], kv_lens=[300], page_size=16, use_cuda_graph=True)
    with pytest.raises(ValueError, match="int workspace"):
        plan_prefill(case.problem, case.device, case.params)
    case.params.int_workspace = torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int workspace bytes"):
        plan_prefill(case.problem, case.device, case.params)
    case = make_paged_case(qo_lens=[40], kv_lens=[40], page_size=16, mask_mode="custom", use_cuda_graph=True)
    case.params.int_workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    case.params.workspace = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float_workspace_buffer too small: 100 bytes.*bitmaps of its mask tiles"):
        plan_prefill(case.problem, case.device, case.params)


def test_config_override(monkeypatch):
    case = make_ragged_case(qo_lens=[40], kv_lens=[70], mask_mode="causal", head_dim_qk=64, window_left=9)
    base = default_config(case.problem, case.device)
    monkeypatch.setenv(CONFIG_ENV, "block_m=16,block_n=32")
    assert config_from_env(base) == PrefillConfig(16, 32, base.num_warps, base.num_stages)
    monkeypatch.setenv(CONFIG_ENV, "64,16,4,2")
    assert config_from_env(base) == PrefillConfig(64, 16, 4, 2)
    check(case)  # planned with the env config
    monkeypatch.setenv(CONFIG_ENV, "ctas_per_sm=4,min_chunk_tokens=256,max_splits=8")
    assert config_from_env(base) == replace(base, ctas_per_sm=4, min_chunk_tokens=256, max_splits=8)
    monkeypatch.setenv(CONFIG_ENV, "min_chunk_tokens=0")
    with pytest.raises(ValueError, match="min_chunk_tokens"):
        config_from_env(base)
    monkeypatch.setenv(CONFIG_ENV, "block_m=24")
    with pytest.raises(ValueError, match=CONFIG_ENV):
        config_from_env(base)
    monkeypatch.delenv(CONFIG_ENV)
    check(make_ragged_case(qo_lens=[40], kv_lens=[70], mask_mode="causal", head_dim_qk=64),
          config=PrefillConfig(16, 64, 4, 1))


def test_caps_and_extra_checks():
    case = make_ragged_case(qo_lens=[4], kv_lens=[4], q_dtype=F16, kv_dtype=torch.bfloat16, head_dim_qk=64)
    assert [r.code for r in prefill_extra_checks(case.problem, case.device)] == ["dtype"]
    with pytest.raises(Unsupported):
        plan_prefill(case.problem, case.device, case.params)
    bad = case.problem.with_(head_dim_qk=96, head_dim_vo=96, kv_dtype=F16, q_len_per_req=2)
    codes = {r.code for r in check_caps(PREFILL_CAPS, bad, case.device)}
    assert "head_dim" in codes and "q_len_per_req" in codes
    assert PREFILL_CAPS.min_cc == (8, 0) and "cpu" in PREFILL_CAPS.device_types
    assert PREFILL_CAPS.page_sizes == frozenset(range(1, 129))


# --- split-KV ---------------------------------------------------------------------------------
SPLIT_CFG = PrefillConfig(16, 32, 4, 1, min_chunk_tokens=64)
WORKSPACE_BYTES = 1 << 21


def plan_split(case, fixed=None, config=SPLIT_CFG, workspace_bytes=WORKSPACE_BYTES, device=None):
    case.params.fixed_split_size = fixed
    case.params.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8) if workspace_bytes else None
    return plan_prefill(case.problem, device or case.device, case.params, config)


def check_split(case, fixed, tol=None):
    """Run with fixed_split_size=``fixed`` (some tile must be split) and compare with the oracle."""
    plan = plan_split(case, fixed)
    assert plan.n_merge > 0
    plan.run(case.inputs)
    ref_out, ref_lse = case.oracle()
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol or DEFAULT_TOLERANCE[case.problem.q_dtype])
    return ref_out, ref_lse


SPLIT_LENS = dict(qo_lens=[3, 20, 0, 9], kv_lens=[150, 400, 5, 220])
H2 = dict(num_qo_heads=2, num_kv_heads=1)
# name: (paged page size or 0 for ragged, fixed_split_size, case options); chunk sizes are mostly
# not multiples of BLOCK_N=32, so chunk edges fall inside KV tiles
SPLIT_FEATURES = {
    "causal_hnd": (16, 5, dict(mask_mode="causal", kv_layout="HND")),
    "window_causal": (0, 100, dict(mask_mode="causal", window_left=70)),
    "window_only": (7, 9, dict(window_left=150)),
    "soft_cap_alibi": (0, 64, dict(mask_mode="causal", logits_soft_cap=2.5, sm_scale=0.6,
                                   pos_encoding_mode="ALIBI")),
    "rope": (16, 4, dict(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e3)),
    "sinks": (0, 90, dict(mask_mode="causal", sinks=True)),
    "fp8_scales": (16, 6, dict(mask_mode="causal", q_dtype=F16, kv_dtype=torch.float8_e4m3fn, q_scale=0.5,
                               k_scale=torch.tensor([0.7]), v_scale=torch.tensor(1.3))),
    "custom_window": (0, 100, dict(mask_mode="custom", window_left=120, pos_encoding_mode="ALIBI")),
    "no_lse": (16, 5, dict(return_lse=False, v_scale=0.3)),
    "everything": (0, 77, dict(mask_mode="causal", window_left=150, logits_soft_cap=4.0, sinks=True,
                               pos_encoding_mode="ROPE_LLAMA", k_scale=0.8, v_scale=torch.tensor([2.0]))),
}


@pytest.mark.parametrize("name", sorted(SPLIT_FEATURES))
def test_split_features(name):
    page, fixed, feats = SPLIT_FEATURES[name]
    if page:
        case = make_paged_case(page_size=page, seed=5, **SPLIT_LENS, **H2, **feats)
    else:
        case = make_ragged_case(seed=6, **SPLIT_LENS, **H2, **feats)
    check_split(case, fixed, tol=DEFAULT_TOLERANCE[F16] if name == "fp8_scales" else None)


def test_split_qk_vo_192_128():
    check_split(make_ragged_case(qo_lens=[5, 18], kv_lens=[300, 200], head_dim_qk=192, head_dim_vo=128,
                                 mask_mode="causal", **H2), 100)


def test_split_rows_that_see_nothing():
    """Rows masked out of some chunks get -inf partials the merge ignores; rows masked out of every
    chunk (custom mask, causal rows before the first key) stay exactly 0 with lse -inf."""
    gen = torch.Generator().manual_seed(7)
    masks = [torch.rand(6, 400, generator=gen) < 0.5, torch.zeros(4, 150, dtype=torch.bool)]
    masks[0][2] = False
    masks[0][4] = False
    masks[0][4, 300:310] = True  # one chunk only
    _, ref_lse = check_split(make_ragged_case(qo_lens=[6, 4], kv_lens=[400, 150], mask_mode="custom",
                                              custom_masks=masks, **H2), 64)
    assert torch.isinf(ref_lse[2]).all() and torch.isinf(ref_lse[6:]).all()
    _, ref_lse = check_split(make_ragged_case(qo_lens=[16], kv_lens=[10], mask_mode="causal", **H2), 3)
    assert torch.isinf(ref_lse[:6]).all()
    # with a sink (carried by chunk 0 only) those rows get out 0 and lse = the sink
    _, ref_lse = check_split(make_ragged_case(qo_lens=[16], kv_lens=[10], mask_mode="causal", sinks=True, **H2), 3)
    assert torch.isfinite(ref_lse).all()


def test_split_policy_equals_no_split():
    """The occupancy policy splits on a device with few SMs; the result matches the oracle and the
    unsplit run. CPU (no SM count), no workspace, disable_split_kv and CUDA-graph mode never split."""
    case = make_ragged_case(qo_lens=[20], kv_lens=[600], mask_mode="causal", sinks=True, seed=8, **H2)
    few_sms = dataclasses.replace(case.device, sm_count=4)
    plan = plan_split(case, device=few_sms)
    assert plan.n_merge == 20 and plan.num_items == 4  # 2 tiles x 2 chunks
    plan.run(case.inputs)
    out_split, lse_split = case.inputs.out.clone(), case.inputs.lse.clone()
    assert_close(out_split, lse_split, *case.oracle(), DEFAULT_TOLERANCE[F32])
    assert plan_split(case).n_merge == 0
    assert plan_split(case, workspace_bytes=0, device=few_sms).n_merge == 0
    case.params.disable_split_kv = True
    plan = plan_split(case, fixed=4, device=few_sms)
    assert plan.n_merge == 0
    plan.run(case.inputs)
    torch.testing.assert_close(case.inputs.out, out_split, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case.inputs.lse, lse_split, atol=1e-5, rtol=1e-5)
    case.params.disable_split_kv = False
    case.problem = case.problem.with_(use_cuda_graph=True)
    case.params.int_workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    assert plan_split(case, fixed=4, device=few_sms).n_merge == 0


def test_split_batch_invariance():
    """fixed_split_size: a request's output is bitwise the same in another batch (other requests, order)."""
    big = make_paged_case(qo_lens=[5, 12, 18], kv_lens=[150, 300, 200], page_size=16, mask_mode="causal",
                          seed=9, **H2)
    plan_split(big, fixed=5).run(big.inputs)
    prm, inp = big.params, big.inputs
    qo, pages = prm.qo_indptr.tolist(), prm.kv_indptr.tolist()
    keep = [2, 1]  # another batch: request 2, then request 1
    rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in keep])
    counts = [pages[b + 1] - pages[b] for b in keep]
    sub_prm = dataclasses.replace(
        prm, qo_lens_host=[prm.qo_lens_host[b] for b in keep], kv_lens_host=[prm.kv_lens_host[b] for b in keep],
        qo_indptr=torch.tensor([0, *torch.tensor([qo[b + 1] - qo[b] for b in keep]).cumsum(0)], dtype=torch.int32),
        kv_indptr=torch.tensor([0, *torch.tensor(counts).cumsum(0)], dtype=torch.int32),
        kv_indices=torch.cat([prm.kv_indices[pages[b]:pages[b + 1]] for b in keep]),
        kv_lens=prm.kv_lens[keep], kv_last_page_len=prm.kv_last_page_len[keep])
    sub = dataclasses.replace(big, params=sub_prm, inputs=dataclasses.replace(
        inp, q=inp.q[rows], out=torch.full_like(inp.out[rows], float("nan")),
        lse=torch.full_like(inp.lse[rows], float("nan"))))
    plan = plan_split(sub, fixed=5)
    assert plan.n_merge > 0
    plan.run(sub.inputs)
    assert torch.equal(sub.inputs.out, inp.out[rows]) and torch.equal(sub.inputs.lse, inp.lse[rows])


def test_split_workspace_and_out_errors():
    case = make_ragged_case(qo_lens=[20], kv_lens=[300], mask_mode="causal", **H2)
    with pytest.raises(ValueError, match=r"float_workspace_buffer too small: 1000 bytes.* needs \d+ bytes"):
        plan_split(case, fixed=50, workspace_bytes=1000)
    with pytest.raises(ValueError, match="float_workspace_buffer too small: 0 bytes"):
        plan_split(case, fixed=50, workspace_bytes=0)
    plan = plan_split(case, fixed=50)
    assert plan.workspace_bytes <= WORKSPACE_BYTES
    case.inputs.out = torch.zeros(20, 2, 64)[..., ::2]
    with pytest.raises(ValueError, match="contiguous head_dim"):
        plan.run(case.inputs)


def test_split_chunking_rules():
    """Chunks cover the visible range exactly, none empty; the policy splits few long tiles only."""
    for lo, hi, n in [(0, 600, 4), (37, 520, 3), (100, 133, 2), (5, 6, 3)]:
        chunks = balanced_chunks(lo, hi, n, 32)
        assert chunks[0][0] == lo and chunks[-1][1] == hi and len(chunks) <= n
        assert all(a < z for a, z in chunks) and all(z == a2 for (_, z), (a2, _) in zip(chunks, chunks[1:]))
        assert all(a % 32 == 0 for a, _ in chunks[1:])
    assert fixed_chunks(150, 330, 400, 100) == [(100, 200), (200, 300), (300, 400)]
    assert fixed_chunks(7, 7, 400, 100) == [(0, 400)]
    # causal tiles see keys up to their last row, window tiles from their first row's window start
    tiles = tile_ranges([40, 12], [300, 5], 16, True, 50)
    assert tiles[:, 4:].tolist() == [[210, 276], [226, 292], [242, 300], [0, 5]]
    cfg = PrefillConfig(128, 128, 8, 3)
    # one request of 128 new tokens over 32k (H200: 132 SMs, 32 heads): 8 chunks per tile
    assert policy_splits([32768], 32, cfg, 132) == [8]
    # 4 x 64 new tokens over 16k: 2 chunks each; a full GPU (300 tiles) or short KV: none
    assert policy_splits([16384] * 4, 32, cfg, 132) == [2] * 4
    assert policy_splits([32768] * 300, 32, cfg, 132) is None
    assert policy_splits([600], 32, cfg, 132) is None
    assert policy_splits([32768], 32, cfg, 0) is None


@pytest.mark.parametrize("causal,window", [(True, -1), (False, -1), (True, 40), (False, 7)])
def test_unsplit_work_list_matches_the_per_tile_list(causal, window):
    """The vectorised unsplit work list (plan()'s common case) equals the per-tile builder's with
    one whole-KV chunk per tile: same rows in the same (stable, heaviest-first) order."""
    from flashdispatch.backends.fa2.prefill import build_work_list
    g = np.random.default_rng(window + 2 + 2 * causal)
    qo = g.integers(0, 300, 40)
    kv = qo + g.integers(0, 500, 40)
    tiles = tile_ranges(qo.tolist(), kv.tolist(), 32, causal, window)
    starts = np.cumsum([0, *qo.tolist()]).tolist()
    fast = build_work_list(tiles, None, 32, starts)
    slow = build_work_list(tiles, lambda t: [(0, int(tiles[t, 3]))], 32, starts)
    assert np.array_equal(fast.items, slow.items) and fast.items.dtype == slow.items.dtype
    assert fast.merge.shape == slow.merge.shape == (0, 4) and fast.partial_rows == slow.partial_rows == 0
