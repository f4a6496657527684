"""fa2's Gluon fp8 decode kernel (decode_gluon.py) on an sm90 GPU (``pytest -m gpu``), against the
reference backend: the kernel on any lengths, whole requests or split into chunks and merged (its
plan made directly), the plans that take it, re-plans, and caches off 16-byte multiples (the
Triton kernel's plan runs them)."""
from __future__ import annotations

import math

import pytest
import torch

from oracle import assert_close, make_paged_case, reference_backend_result, run_fa2_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm90 GPU (the plans take the Gluon kernel there only)")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {E4M3: 8e-2, E5M2: 1.5e-1}
LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 64, 95, 300, 2000]


def _case(kv_lens, **kw):
    kw.setdefault("num_qo_heads", 16)
    kw.setdefault("num_kv_heads", 4)
    kw.setdefault("q_dtype", torch.bfloat16)
    kw.setdefault("kv_dtype", E4M3)
    kw.setdefault("k_scale", 0.8)
    kw.setdefault("v_scale", 1.5)
    return make_paged_case("decode", kv_lens=list(kv_lens), head_dim_qk=128, device="cuda", **kw)


def _gluon_plan(case, stages: int, splits: int = 1, chunk_tiles: int = 0):
    """The Gluon kernel's plan of the case whatever its lengths (`gluon_layout` not asked): whole
    requests, or ``splits`` chunks of ``chunk_tiles`` 32-token tiles a request (a 128 MiB workspace)."""
    from flashdispatch.backends.fa2.decode_config import resolve_config
    from flashdispatch.backends.fa2.decode_gluon import GluonDecodePlan, GluonLayout
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    return GluonDecodePlan(case.problem, case.device, case.params, resolve_config(case.problem),
                           GluonLayout(stages, splits, chunk_tiles))


def _run_into_poison(plan, case):
    """Run into a NaN-poisoned out that is a view of a wider buffer (whose other heads must stay
    NaN) and a poisoned lse; returns the buffer's untouched part. A split plan's partials are
    poisoned too (out NaN, lse 1e4: a row the kernel leaves unwritten outweighs the others)."""
    q = case.inputs.q
    wide = torch.full((q.shape[0], 2 * q.shape[1], 128), float("nan"), dtype=case.inputs.out.dtype, device="cuda")
    case.inputs.out = wide[:, :q.shape[1]]
    if case.inputs.lse is not None:
        case.inputs.lse.fill_(float("nan"))
    if plan.layout.splits > 1:
        plan._po.fill_(float("nan"))
        plan._plse.fill_(1e4)
    plan.run(case.inputs)
    torch.cuda.synchronize()
    return wide[:, q.shape[1]:]


def _check(case, plan):
    ref_out, ref_lse = reference_backend_result(case)
    rest = _run_into_poison(plan, case)
    assert torch.isnan(rest).all(), "the kernel wrote outside out's heads"
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_kernel_grid(kv_dtype, layout, group, stages):
    case = _case(LENGTHS, kv_dtype=kv_dtype, kv_layout=layout, num_qo_heads=4 * group, seed=stages + 10 * group,
                 q_dtype=torch.float16 if group == 2 else torch.bfloat16)
    _check(case, _gluon_plan(case, stages))


# (stages, chunks a request, tiles a chunk), each covering LENGTHS' longest request (2000 tokens, 63
# tiles) as a plan's layout does (the shorter requests leave chunks empty), and 2 x 4, whose last
# chunk reads the rest of each request (the kernel's guard against a plan's short lengths)
SPLITS = [(2, 3, 21), (3, 2, 32), (4, 63, 1), (4, 7, 9), (2, 2, 4)]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_split_kernel_grid(kv_dtype, layout, group, split):
    case = _case(LENGTHS, kv_dtype=kv_dtype, kv_layout=layout, num_qo_heads=4 * group, seed=split[1] + 10 * group,
                 q_dtype=torch.float16 if group == 2 else torch.bfloat16)
    _check(case, _gluon_plan(case, *split))


@pytest.mark.parametrize("feature", [
    dict(return_lse=False), dict(kv_storage="tuple"), dict(o_dtype=torch.float32),
    dict(tensor_scales=(1.2, 0.5, 2.0)), dict(q_far=True),
], ids=lambda f: ",".join(sorted(f)))
def test_split_features(feature):
    feature = dict(feature)
    scales, q_far = feature.pop("tensor_scales", None), feature.pop("q_far", False)
    if scales:
        feature.update(zip(("q_scale", "k_scale", "v_scale"), (torch.tensor([x], device="cuda") for x in scales)))
    case = _case([0, 33, 700, 3000], seed=4, **feature)
    if q_far:
        case.inputs.q[1].mul_(1e-30)
        case.inputs.q[2].mul_(1e30)
    _check(case, _gluon_plan(case, 4, 12, 8))


@pytest.mark.parametrize("feature", [
    dict(return_lse=False), dict(kv_storage="tuple"), dict(o_dtype=torch.float32), dict(sm_scale=0.05),
    dict(q_scale=0.5, k_scale=None, v_scale=None), dict(page_size=16, shuffle_pages=False),
    dict(tensor_scales=(1.2, 0.5, 2.0)),
], ids=lambda f: ",".join(sorted(f)))
def test_kernel_features(feature):
    feature = dict(feature)
    scales = feature.pop("tensor_scales", None)
    if scales:  # 1-element device tensors, read by the kernel
        feature.update(zip(("q_scale", "k_scale", "v_scale"), (torch.tensor([x], device="cuda") for x in scales)))
    case = _case([0, 33, 700, 3000], seed=3, **feature)
    _check(case, _gluon_plan(case, 2))


def test_q_far_from_one():
    """q scaled per head by a power of two before its fp16 rounding: tiny and huge bf16 rows."""
    case = _case([40, 500, 77], seed=5)
    q = case.inputs.q
    q[0].mul_(1e-30)
    q[1].mul_(1e30)
    q[2, :4].zero_()  # a zero head
    _check(case, _gluon_plan(case, 2))


def test_page_indices_clamped_to_the_cache():
    """Page indices past the cache (or negative) read its last page, never outside it."""
    case = _case([64, 64], seed=7)
    ref_case = _case([64, 64], seed=7)
    pages = case.inputs.kv.num_pages
    case.params.kv_indices[1] = pages + 1000
    case.params.kv_indices[5] = -3
    ref_case.params.kv_indices[1] = pages - 1
    ref_case.params.kv_indices[5] = pages - 1
    ref_out, ref_lse = reference_backend_result(ref_case)
    _run_into_poison(_gluon_plan(case, 2), case)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[E4M3])


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_plans_take_it_where_programs_fill_the_gpu(kv_dtype):
    """Equal lengths over >= 2.5 programs a SM: the Gluon plan; mixed lengths: the Triton one."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = math.ceil(2.5 * sms / 8)
    case = _case([200] * batch, kv_dtype=kv_dtype, num_qo_heads=32, num_kv_heads=8, seed=11)
    ref = reference_backend_result(case)
    plan = run_fa2_decode(case)
    assert type(plan).__name__ == "GluonDecodePlan"
    assert_close(case.inputs.out, case.inputs.lse, *ref, TOL[kv_dtype])
    mixed = _case([50, 400] * (batch // 2), kv_dtype=kv_dtype, num_qo_heads=32, num_kv_heads=8, seed=12)
    assert type(run_fa2_decode(mixed)).__name__ == "DecodePlan"
    assert type(run_fa2_decode(case, config={"gluon_fp8_stages": 0})).__name__ == "DecodePlan"


@pytest.mark.parametrize("lens", [[8192], [2048] * 16, [300, 4000] * 20], ids=["1x8192", "16x2048", "40x_var"])
def test_split_plans(lens):
    """With gluon_fp8_split_tokens the plans of few programs split on the Gluon kernel, and a re-plan
    with new lengths and tables keeps its chunks where the layout policy gives as many (only the
    chunk length changes) or plans afresh: each against the reference."""
    from flashdispatch.backends.common import shared_per_block
    from flashdispatch.backends.fa2.decode_config import resolve_config
    from flashdispatch.backends.fa2.decode_gluon import gluon_layout
    config = {"gluon_fp8_split_tokens": 256}
    case = _case(lens, num_qo_heads=32, num_kv_heads=8, seed=len(lens))
    cfg = resolve_config(case.problem, config, shared_per_block(case.device))
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    layout = gluon_layout(case.problem, case.device, case.params, cfg)
    if layout is None or layout.splits == 1:
        pytest.skip(f"this GPU's {case.device.sm_count} SMs do not split these lengths ({layout})")
    ref = reference_backend_result(case)
    plan = run_fa2_decode(case, config=config)
    assert type(plan).__name__ == "GluonDecodePlan" and plan.layout == layout, plan
    assert_close(case.inputs.out, case.inputs.lse, *ref, TOL[E4M3])
    second = _case([n * 9 // 10 for n in lens], num_qo_heads=32, num_kv_heads=8, seed=len(lens) + 1)
    second.params.workspace = case.params.workspace
    expected = gluon_layout(second.problem, second.device, second.params, cfg)
    again = plan.refreshed(second.device, second.params)
    if expected is None or expected[:2] != layout[:2]:
        assert again is None
        return
    assert again is not None and again.layout == expected and again.layout.chunk_tiles != layout.chunk_tiles
    _check(second, again)


def test_refresh_keeps_the_kernel_for_new_tables():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = math.ceil(2.5 * sms / 8)
    first = _case([300] * batch, num_qo_heads=32, num_kv_heads=8, seed=13)
    plan = run_fa2_decode(first)
    second = _case([310] * batch, num_qo_heads=32, num_kv_heads=8, seed=14)
    again = plan.refreshed(second.device, second.params)
    assert again is not None and again.stages == plan.stages
    _check(second, again)
    mixed = _case([30, 600] * (batch // 2), num_qo_heads=32, num_kv_heads=8, seed=15)
    assert plan.refreshed(mixed.device, mixed.params) is None  # planned afresh on the Triton kernel


@pytest.mark.parametrize("split", [(2, 1, 0), (2, 4, 4)], ids=["whole", "split"])
def test_one_plan_over_caches_of_other_sizes(split):
    """The kernel is not specialised on the cache's page count: a run on a one-page cache (every
    index clamped to page 0), then on the whole cache, reads the whole cache."""
    from flashdispatch.backends.base import PagedKV
    case = _case([40, 500, 77], kv_storage="tuple", seed=19)
    plan = _gluon_plan(case, *split)
    whole = case.inputs.kv
    case.inputs.kv = PagedKV(whole.k[:1], whole.v[:1], whole.layout)
    plan.run(case.inputs)
    case.inputs.kv = whole
    _check(case, plan)


def test_cache_off_16_byte_multiples_runs_the_triton_plan():
    """cp.async copies 16 bytes: a (k, v) pair one byte off runs decode.py's plan instead."""
    case = _case([40, 500, 77], kv_storage="tuple", seed=17)
    kv = case.inputs.kv
    for name in ("k", "v"):
        t = getattr(kv, name)
        shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape)
        shifted.copy_(t)
        setattr(kv, name, shifted)
    plan = _gluon_plan(case, 2)
    _check(case, plan)
    assert type(plan._fallback_plan).__name__ == "DecodePlan"
