"""The reference backend against the float64 oracle (tests/oracle.py) and hand-checked cases."""
from __future__ import annotations

import math
import time

import pytest
import torch

from flashdispatch.backends.base import MergeInputs
from flashdispatch.backends.common import alibi_slopes
from flashdispatch.backends.reference import ReferenceBackend
from flashdispatch.backends.reference import layout as ref_layout
from flashdispatch.dispatch.caps import ALL_FEATURES
from flashdispatch.dispatch.problem import Device
from oracle import (assert_close, make_mla_case, make_paged_case, make_ragged_case, oracle_alibi_slopes,
                    oracle_merge, rel_err, run_case)

TOL = 1e-5  # float32 math against float64, fp32 (or fp8) inputs
BACKEND = ReferenceBackend()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def check(case, tol=TOL):
    out, lse = run_case(BACKEND, case)
    ref_out, ref_lse = case.oracle()
    assert_close(out, lse, ref_out, ref_lse, tol)
    return out, lse, ref_out, ref_lse


# --- capabilities ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["decode", "prefill_paged", "prefill_ragged", "mla", "merge"])
def test_caps_accept_every_declared_feature(op):
    if op == "mla":
        problem = make_mla_case(qo_lens=[2], kv_lens=[3], causal=True, kv_dtype=E4M3).problem
    elif op == "merge":
        problem = make_paged_case(kv_lens=[3], qo_lens=[1]).problem.with_(op="merge")
    else:
        problem = make_paged_case(kv_lens=[3], qo_lens=[1]).problem.with_(
            op=op, mask_mode="causal", window_left=3, logits_soft_cap=5.0, pos_encoding_mode="ALIBI",
            kv_dtype=E5M2, use_cuda_graph=True, sinks=True, spec_decode_mask=True, q_len_per_req=4)
    h200 = Device("cuda", cc=(9, 0), name="H200")
    assert BACKEND.supports(problem, Device("cpu")) == []
    assert BACKEND.supports(problem.with_(use_cuda_graph=False), h200) == []
    if problem.use_cuda_graph:  # on a GPU a re-plan would leave a captured graph with stale gathers
        assert [r.code for r in BACKEND.supports(problem, h200)] == ["feature.cuda_graph"]
    if op != "mla":
        assert BACKEND.caps_for(op).features == ALL_FEATURES


def test_caps_reject_what_cannot_run():
    problem = make_paged_case(kv_lens=[3], qo_lens=[1]).problem
    codes = lambda p: [r.code for r in BACKEND.supports(p, Device("cpu"))]  # noqa: E731
    assert codes(problem.with_(pos_encoding_mode="ROPE_LLAMA", head_dim_qk=33, head_dim_vo=33)) == ["head_dim"]
    assert codes(problem.with_(num_qo_heads=6, num_kv_heads=4)) == ["heads"]
    assert codes(problem.with_(q_dtype=E4M3)) == ["dtype"]
    assert codes(problem.with_(op="mla", sinks=True)) == ["feature.sinks"]
    assert codes(problem) == [] and codes(problem.with_(op="decode", q_dtype=E4M3)) == []
    assert [r.code for r in BACKEND.supports(problem, Device("mps"))] == ["device"]


# --- hand-checked ---------------------------------------------------------------------------
def test_alibi_slopes_by_hand():
    assert oracle_alibi_slopes(8) == [2.0 ** -i for i in range(1, 9)]
    assert oracle_alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    for n in (1, 3, 6, 8, 12, 40):
        assert alibi_slopes(n).tolist() == pytest.approx(oracle_alibi_slopes(n), rel=1e-7)


def test_one_key_gives_its_value():
    case = make_ragged_case(qo_lens=[1], kv_lens=[1], num_qo_heads=2, num_kv_heads=1, head_dim_qk=8)
    out, lse = run_case(BACKEND, case)
    q, k, v = case.inputs.q, case.inputs.kv.k, case.inputs.kv.v
    assert torch.equal(out[0, 0], v[0, 0]) and torch.equal(out[0, 1], v[0, 0])
    s = (q[0].double() @ k[0, 0].double()) * case.params.sm_scale
    assert lse[0].double().tolist() == pytest.approx((s * math.log2(math.e)).tolist(), abs=1e-5)


def test_two_equal_keys_average_values():
    case = make_ragged_case(qo_lens=[1], kv_lens=[2], num_qo_heads=1, num_kv_heads=1, head_dim_qk=8)
    case.inputs.kv.k[1] = case.inputs.kv.k[0]
    out, lse = run_case(BACKEND, case)
    q, k, v = case.inputs.q, case.inputs.kv.k, case.inputs.kv.v
    assert torch.allclose(out[0, 0], (v[0, 0] + v[1, 0]) / 2, atol=1e-6)
    s = float(q[0, 0].double() @ k[0, 0].double()) * case.params.sm_scale
    assert float(lse[0, 0]) == pytest.approx(1.0 + s * math.log2(math.e), abs=1e-5)


def test_rope_at_position_zero_is_identity():
    # one query over one key, both at position 0: RoPE changes nothing
    plain = make_ragged_case(qo_lens=[1], kv_lens=[1], seed=3)
    roped = make_ragged_case(qo_lens=[1], kv_lens=[1], seed=3, pos_encoding_mode="ROPE_LLAMA")
    assert torch.allclose(run_case(BACKEND, plain)[1], run_case(BACKEND, roped)[1], atol=1e-6)


def test_merge_two_equal_states_by_hand():
    v = torch.randn(3, 2, 4, 8)
    s = torch.full((3, 2, 4), 1.5)
    s[2] = float("-inf")
    v_out, s_out = torch.full((3, 4, 8), float("nan")), torch.full((3, 4), float("nan"))
    BACKEND.merge_states(MergeInputs(v, s, v_out, s_out))
    assert torch.allclose(v_out[:2], v[:2].mean(1), atol=1e-6)
    assert torch.allclose(s_out[:2], torch.full((2, 4), 2.5))
    assert (v_out[2] == 0).all() and (s_out[2] == float("-inf")).all()


# --- decode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_storage", ["5d", "tuple"])
@pytest.mark.parametrize("group", [1, 4])
def test_decode(page_size, kv_layout, kv_storage, group):
    # an empty request, a full last page, a partial one, a long one
    kv_lens = [0, 2 * page_size, 2 * page_size + 1, 37]
    check(make_paged_case("decode", kv_lens=kv_lens, page_size=page_size, kv_layout=kv_layout,
                          kv_storage=kv_storage, num_qo_heads=2 * group, num_kv_heads=2, seed=page_size))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_decode_q_len_per_req_causal(kv_layout):
    # kv_len 2 < 3 query rows: the first row of that request sees nothing
    out, lse, _, ref_lse = check(make_paged_case(
        "decode", kv_lens=[2, 9, 16, 0], q_len_per_req=3, page_size=4, kv_layout=kv_layout,
        num_qo_heads=8, num_kv_heads=2, mask_mode="causal"))
    assert (ref_lse[0] == float("-inf")).all() and (ref_lse[1] > float("-inf")).all()


@pytest.mark.parametrize("q_dtype", [E4M3, torch.float16])
def test_decode_low_precision_q(q_dtype):
    check(make_paged_case("decode", kv_lens=[5, 17], page_size=4, q_dtype=q_dtype, kv_dtype=torch.float32,
                          o_dtype=torch.float32))


def test_decode_matches_per_request_prefill():
    # decode is prefill with one row per request: same plan data, same answer
    dec = make_paged_case("decode", kv_lens=[7, 20], page_size=4, seed=5)
    pre = make_paged_case("prefill_paged", kv_lens=[7, 20], qo_lens=[1, 1], page_size=4, seed=5)
    assert torch.equal(run_case(BACKEND, dec)[0], run_case(BACKEND, pre)[0])


# --- prefill: every feature, paged and ragged --------------------------------------------------
FEATURES = {
    "none": {},
    "causal": dict(mask_mode="causal"),
    "custom_mask": dict(mask_mode="custom"),
    "window": dict(window_left=3),
    "causal_window": dict(mask_mode="causal", window_left=2),
    "custom_window": dict(mask_mode="custom", window_left=4),
    "soft_cap": dict(logits_soft_cap=2.0, sm_scale=1.0),
    "alibi": dict(pos_encoding_mode="ALIBI", num_qo_heads=6, num_kv_heads=3, mask_mode="causal"),
    "rope": dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.5, rope_theta=5e5, mask_mode="causal"),
    "sm_scale": dict(sm_scale=0.37),
    "sinks": dict(sinks=True, mask_mode="causal"),
    "head_dims_192_128": dict(head_dim_qk=192, head_dim_vo=128, num_qo_heads=2, num_kv_heads=1),
    "fp8_e4m3_scales": dict(kv_dtype=E4M3, q_scale=0.8, k_scale=1.7, v_scale=0.6, o_dtype=torch.float32),
    "fp8_e5m2_tensor_scales": dict(kv_dtype=E5M2, k_scale=torch.tensor([1.3]), v_scale=torch.tensor(0.5),
                                   o_dtype=torch.float32),
    "gqa_8": dict(num_qo_heads=8, num_kv_heads=1, mask_mode="causal"),
    "no_lse": dict(return_lse=False, mask_mode="causal"),
    "all_at_once": dict(mask_mode="causal", window_left=5, logits_soft_cap=3.0, pos_encoding_mode="ALIBI",
                        sinks=True, kv_dtype=E4M3, k_scale=1.1, v_scale=0.9, o_dtype=torch.float32),
}
QO_LENS, KV_LENS = [3, 0, 7, 1, 5], [10, 4, 7, 0, 3]  # q > kv in the last request: rows with no key


@pytest.mark.parametrize("name", FEATURES)
def test_prefill_paged(name):
    f = FEATURES[name]
    storage = "tuple" if "head_dim_vo" in f else "5d"
    check(make_paged_case(qo_lens=QO_LENS, kv_lens=KV_LENS, page_size=3, kv_storage=storage,
                          kv_layout="HND" if len(name) % 2 else "NHD", **f))


@pytest.mark.parametrize("name", FEATURES)
def test_prefill_ragged(name):
    check(make_ragged_case(qo_lens=QO_LENS, kv_lens=KV_LENS, seed=1, **FEATURES[name]))


def test_half_precision_in_and_out():
    for dtype in (torch.float16, torch.bfloat16):
        check(make_ragged_case(qo_lens=[4, 6], kv_lens=[9, 6], q_dtype=dtype, mask_mode="causal"),
              tol=4e-3 if dtype == torch.float16 else 8e-3)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    masks = [torch.ones(3, 5, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)]
    masks[0][1] = False            # row 1 of request 0 keeps nothing
    masks[1][:, :] = False         # request 1 keeps nothing
    case = make_ragged_case(qo_lens=[3, 2], kv_lens=[5, 4], mask_mode="custom", custom_masks=masks)
    out, lse, _, _ = check(case)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert (out[3:] == 0).all() and (lse[3:] == float("-inf")).all()
    # with a sink a row that sees no key still has a finite lse (log2 of exp(sink)) and output 0
    case = make_ragged_case(qo_lens=[3, 2], kv_lens=[5, 4], mask_mode="custom", custom_masks=masks, sinks=True)
    out, lse, _, _ = check(case)
    assert (out[3:] == 0).all()
    assert torch.allclose(lse[3], case.inputs.sinks * math.log2(math.e))


def test_custom_mask_overrides_causal_bits():
    # a mask that keeps only keys after the query position (what causal would drop)
    q_len, kv_len = 4, 6
    mask = torch.tensor([[j > i + kv_len - q_len for j in range(kv_len)] for i in range(q_len)])
    out, lse, _, _ = check(make_ragged_case(qo_lens=[q_len], kv_lens=[kv_len], mask_mode="custom",
                                            custom_masks=[mask]))
    assert (lse[-1] == float("-inf")).all() and (lse[:-1] > float("-inf")).all()


def test_non_contiguous_views_and_outputs():
    case = make_paged_case(qo_lens=[2, 3], kv_lens=[6, 11], page_size=4, kv_layout="HND")
    big = torch.full((case.inputs.out.shape[0], 4, 2 * case.inputs.out.shape[2]), float("nan"))
    case.inputs.out = big[:, :, ::2]
    case.inputs.q = torch.cat([case.inputs.q, case.inputs.q], -1)[..., :case.inputs.q.shape[-1]]
    assert not case.inputs.out.is_contiguous() and not case.inputs.q.is_contiguous()
    check(case)


# --- chunking ---------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [256, 4096])
def test_small_budget_splits_groups_and_rows(monkeypatch, budget):
    monkeypatch.setitem(ref_layout.ELEMENT_BUDGET, "cpu", budget)
    case = make_paged_case(qo_lens=[9, 1, 4, 0, 12, 1], kv_lens=[15, 30, 4, 8, 12, 9], page_size=4,
                           mask_mode="custom", window_left=6, pos_encoding_mode="ROPE_LLAMA", sinks=True)
    plan = BACKEND.plan(case.problem, case.device, case.params)
    assert len(plan.groups) > 1
    if budget == 256:   # every request alone, long ones in several row blocks
        assert max(len(list(g.row_blocks())) for g in plan.groups) > 1
    else:               # several requests share one K/V gather
        assert max(g.kv_len.numel() for g in plan.groups) > 1
    check(case)


def test_long_prefill_plans_within_memory_budget():
    heads, kv_heads, dim, n = 64, 8, 128, 4096
    case = make_ragged_case(qo_lens=[1], kv_lens=[1], num_qo_heads=heads, num_kv_heads=kv_heads,
                            head_dim_qk=dim, mask_mode="causal")
    params = case.params
    params.qo_lens_host, params.kv_lens_host = [n], [n]
    params.qo_indptr, params.kv_indptr = (torch.tensor([0, n], dtype=torch.int32),
                                          torch.tensor([0, n], dtype=torch.int32))
    plan = BACKEND.plan(case.problem, case.device, params)
    budget = ref_layout.ELEMENT_BUDGET["cpu"]
    (group,) = plan.groups
    assert group.kc * kv_heads * 2 * dim <= budget
    blocks = list(group.row_blocks())
    assert sum(b.rows.shape[1] for b in blocks) == n and len(blocks) > 1
    assert all(b.rows.numel() * heads * group.kc <= budget for b in blocks)


def test_decode_speed_on_cpu():
    case = make_paged_case("decode", kv_lens=[300, 17, 512, 256, 90, 600, 225], page_size=16,
                           num_qo_heads=64, num_kv_heads=8, head_dim_qk=128, poison_unused=False)
    run_case(BACKEND, case)
    start = time.perf_counter()
    out, lse = run_case(BACKEND, case)
    assert time.perf_counter() - start < 1.0
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


# --- MLA and merge ----------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_mla(page_size, causal):
    check(make_mla_case(qo_lens=[1, 3, 0, 2], kv_lens=[20, 35, 5, 0], page_size=page_size, causal=causal,
                        seed=page_size))


def test_mla_fp8_and_v_scale():
    check(make_mla_case(qo_lens=[2, 1], kv_lens=[17, 4], page_size=16, kv_dtype=E4M3, q_dtype=E4M3,
                        o_dtype=torch.float32, v_scale=torch.tensor(0.7), sm_scale=0.05))


def test_merge_against_oracle():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(6, 3, 4, 16, generator=gen)
    s = 4 * torch.randn(6, 3, 4, generator=gen)
    s[0, 1] = float("-inf")
    s[1] = float("-inf")
    v_out, s_out = torch.full((6, 4, 16), float("nan")), torch.full((6, 4), float("nan"))
    BACKEND.merge_states(MergeInputs(v, s, v_out, s_out))
    ref_v, ref_s = oracle_merge(v, s)
    assert_close(v_out, s_out, ref_v, ref_s, TOL)
    assert rel_err(v_out, ref_v) < TOL


def test_plan_rejects_mismatched_kv_and_missing_mask():
    paged = make_paged_case(kv_lens=[4], qo_lens=[2])
    ragged = make_ragged_case(kv_lens=[4], qo_lens=[2])
    plan = BACKEND.plan(paged.problem, paged.device, paged.params)
    with pytest.raises(TypeError, match="plan is for NHD KV"):
        BACKEND.run(plan, ragged.inputs)
    with pytest.raises(ValueError, match="packed_mask"):
        BACKEND.plan(ragged.problem.with_(mask_mode="custom"), ragged.device, ragged.params)


@pytest.mark.gpu
def test_cuda_tensors():
    for case in (make_paged_case("decode", kv_lens=[0, 33, 16], page_size=16, kv_layout="HND", device="cuda",
                                 sinks=True, k_scale=torch.tensor(1.5, device="cuda")),
                 make_ragged_case(qo_lens=[5, 2], kv_lens=[9, 2], device="cuda", mask_mode="custom",
                                  pos_encoding_mode="ROPE_LLAMA", kv_dtype=E4M3, o_dtype=torch.float32),
                 make_mla_case(qo_lens=[2, 1], kv_lens=[40, 3], page_size=16, causal=True, device="cuda")):
        check(case, tol=2e-5)
