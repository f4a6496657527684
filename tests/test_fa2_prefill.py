"""fa2 prefill kernel under the Triton interpreter (CPU): every feature against the float64 oracle.

Tiny shapes (the interpreter is slow); the CPU config uses 32x16 tiles so lengths up to 200
still cross many query and KV tiles, pages and the causal diagonal.
"""
from __future__ import annotations


import pytest
import torch

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.backends.fa2.prefill import (CONFIG_ENV, PREFILL_CAPS, PrefillConfig, config_from_env,
                                                default_config, plan_prefill, prefill_extra_checks)
from flashdispatch.dispatch.caps import check_caps
from flashdispatch.dispatch.reasons import Unsupported
from oracle import assert_close, make_paged_case, make_ragged_case

pytestmark = pytest.mark.skipif(not TRITON_INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU run of Triton)")

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
    "alibi": dict(mask_mode="causal", pos_encoding_mode="ALIBI", num_qo_heads=6, num_kv_heads=3),
    "rope": dict(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e3),
    "sinks": dict(mask_mode="causal", sinks=True),
    "scales_float": dict(q_scale=0.5, k_scale=1.7, v_scale=0.3),
    "scales_tensor": dict(mask_mode="causal", q_scale=torch.tensor([0.5]), k_scale=torch.tensor(1.7),
                          v_scale=torch.tensor([0.3])),
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


def test_rope_192_128():
    check(make_ragged_case(qo_lens=[19], kv_lens=[40], head_dim_qk=192, head_dim_vo=128, num_qo_heads=2,
                           num_kv_heads=1, mask_mode="causal", pos_encoding_mode="ROPE_LLAMA"))


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


# --- CUDA-graph mode (persistent grid over a workspace list), config, caps -------------------
def test_graph_mode_replans_into_same_workspace():
    ws = torch.zeros(1 << 16, dtype=torch.uint8)  # the wrapper's int workspace
    plans = []
    for seed, (qo, kv) in enumerate([([30, 5], [40, 5]), ([3, 64], [3, 80])]):
        case = make_paged_case(qo_lens=qo, kv_lens=kv, page_size=16, mask_mode="causal",
                               use_cuda_graph=True, seed=seed)
        case.params.int_workspace = ws
        plan = plan_prefill(case.problem, case.device, case.params)
        plans.append(plan)
        assert plan.grid == plans[0].grid and plan.work.data_ptr() == plans[0].work.data_ptr()
        plan.run(case.inputs)
        assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F32])


def test_graph_mode_workspace_errors():
    case = make_paged_case(qo_lens=[300], kv_lens=[300], page_size=16, use_cuda_graph=True)
    with pytest.raises(ValueError, match="int workspace"):
        plan_prefill(case.problem, case.device, case.params)
    case.params.int_workspace = torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int workspace bytes"):
        plan_prefill(case.problem, case.device, case.params)


def test_config_override(monkeypatch):
    case = make_ragged_case(qo_lens=[40], kv_lens=[70], mask_mode="causal", head_dim_qk=64, window_left=9)
    base = default_config(case.problem, case.device)
    monkeypatch.setenv(CONFIG_ENV, "block_m=16,block_n=32")
    assert config_from_env(base) == PrefillConfig(16, 32, base.num_warps, base.num_stages)
    monkeypatch.setenv(CONFIG_ENV, "64,16,4,2")
    assert config_from_env(base) == PrefillConfig(64, 16, 4, 2)
    check(case)  # planned with the env config
    monkeypatch.setenv(CONFIG_ENV, "block_m=24")
    with pytest.raises(ValueError, match=CONFIG_ENV):
        config_from_env(base)
    monkeypatch.delenv(CONFIG_ENV)
    check(make_ragged_case(qo_lens=[40], kv_lens=[70], mask_mode="causal", head_dim_qk=64), config=PrefillConfig(16, 64, 4, 1))


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
