"""fa2 ragged RoPE prefill: K rotated before the kernel (prefill_rope.py) or inside it, each against
the float64 oracle; which path a plan takes."""
from __future__ import annotations

import pytest
import torch

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.fa2 import prefill_rope
from flashdispatch.backends.fa2.prefill import PrefillPlan, plan_prefill
from flashdispatch.backends.fa2.prefill_rope import PrerotatedPrefill
from flashdispatch.backends.fa2.prefill_config import default_config
from flashdispatch.backends.fa2.prefill_tma import tma_unused_reason
from flashdispatch.dispatch.problem import Device
from oracle import assert_close, make_paged_case, make_ragged_case, reference_plan_result

F16, BF16 = torch.float16, torch.bfloat16
ROPE = dict(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA")
H200 = Device("cuda", 0, (9, 0), "H200", 132)


def run_checked(case, rotated_first: bool, tol=None, expected=None):
    """Plan and run ``case`` on the path asked for; compare with ``expected(case)`` (out, lse),
    by default the float64 oracle."""
    plan = plan_prefill(case.problem, case.device, case.params)
    assert isinstance(plan, PrerotatedPrefill) == rotated_first
    plan.run(case.inputs)
    want = expected(case) if expected else case.oracle()
    assert_close(case.inputs.out, case.inputs.lse, *want, tol or DEFAULT_TOLERANCE[case.problem.q_dtype])
    return plan


@pytest.mark.interpreted
@pytest.mark.parametrize("first", [True, False], ids=["rotated_first", "in_kernel"])
@pytest.mark.parametrize("opts", [
    dict(rope_scale=2.0, rope_theta=5e3),
    dict(rope_scale=0.5, head_dim_qk=128),  # rope_scale < 1: the guarded (WIDE) sincos
    dict(window_left=20, logits_soft_cap=4.0, sinks=True, k_scale=0.8, v_scale=2.0, num_qo_heads=6),
    dict(mask_mode="none", q_dtype=torch.float32),
], ids=["scaled", "wide", "features", "fp32_no_mask"])
def test_rotated_first_and_in_kernel_match_the_oracle(monkeypatch, first, opts):
    monkeypatch.setattr(prefill_rope, "MIN_QUERY_ROWS", 1 if first else 10 ** 9)
    opts = {"head_dim_qk": 64, "num_qo_heads": 4, "num_kv_heads": 2, "q_dtype": F16, **ROPE, **opts}
    case = make_ragged_case(qo_lens=[1, 30, 0, 45, 70], kv_lens=[1, 61, 0, 45, 90], seed=9, **opts)
    run_checked(case, first)


@pytest.mark.interpreted
@pytest.mark.parametrize("first", [True, False], ids=["rotated_first", "in_kernel"])
def test_empty_requests_and_more_queries_than_keys(monkeypatch, first):
    """Empty requests first and last (the row search over kv_indptr), a request with more query
    rows than keys (its first rows see no key: 0 and -inf)."""
    monkeypatch.setattr(prefill_rope, "MIN_QUERY_ROWS", 1 if first else 10 ** 9)
    case = make_ragged_case(qo_lens=[0, 70, 3, 0], kv_lens=[0, 40, 50, 0], head_dim_qk=64, num_qo_heads=4,
                            num_kv_heads=2, q_dtype=F16, seed=11, **ROPE)
    run_checked(case, first)
    assert torch.isinf(case.inputs.lse[:30]).all() and (case.inputs.out[:30] == 0).all()


@pytest.mark.interpreted
def test_strided_k_and_custom_mask_rotated_first(monkeypatch):
    """A k view with its heads outermost and a head_dim stride of 2 is read through its strides; a
    custom mask reaches the inner plan (and its refresh after a new mask)."""
    monkeypatch.setattr(prefill_rope, "MIN_QUERY_ROWS", 1)
    case = make_ragged_case(qo_lens=[21, 40], kv_lens=[30, 40], head_dim_qk=64, num_qo_heads=4, num_kv_heads=2,
                            q_dtype=F16, mask_mode="custom", pos_encoding_mode="ROPE_LLAMA", seed=3)
    k = case.inputs.kv.k
    big = torch.full((k.shape[1], k.shape[0], 2 * k.shape[2]), float("nan"), dtype=F16)
    view = big.permute(1, 0, 2)[..., ::2]
    view.copy_(k)
    case.inputs.kv.k = view
    assert view.stride() == (128, 70 * 128, 2)
    plan = run_checked(case, True)
    plan.refresh_tile_lists()
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[F16])


@pytest.mark.interpreted
def test_which_plans_rotate_first():
    """From MIN_QUERY_ROWS query rows in a request, ragged, 16-bit or fp32 KV of q's dtype, head
    dims 64/128/256, not under CUDA graphs; the inner plan is the problem without RoPE (so it may
    use TMA) whose kernel rotates Q."""
    rows = prefill_rope.MIN_QUERY_ROWS
    long_q = dict(qo_lens=[rows, 3], kv_lens=[rows, 9], num_qo_heads=2, num_kv_heads=1, q_dtype=F16, **ROPE)
    case = make_ragged_case(head_dim_qk=64, **long_q)
    plan = run_checked(case, True)
    assert isinstance(plan.inner, PrefillPlan) and plan.inner.rope_kind == 0
    assert plan.inner.q_rope == plan.rope_kind == 1 and plan.n_merge == plan.inner.n_merge
    # d128 on an H200: the kernel's config is the RoPE-free one, with TMA loads; RoPE in the kernel has none
    d128 = make_ragged_case(head_dim_qk=128, **long_q)
    inner = plan_prefill(d128.problem, d128.device, d128.params).inner
    cfg = default_config(inner.problem, H200, long_q["qo_lens"])
    assert cfg.tma and tma_unused_reason(inner.problem, H200, cfg.num_stages, False) is None
    assert "ROPE" in tma_unused_reason(d128.problem, H200, cfg.num_stages, False)
    short_q = dict(long_q, qo_lens=[rows - 1, 3])
    run_checked(make_ragged_case(head_dim_qk=64, **short_q), False)
    run_checked(make_ragged_case(head_dim_qk=192, head_dim_vo=128, **long_q), False)
    run_checked(make_paged_case(page_size=16, head_dim_qk=64, **long_q), False)
    graph = make_ragged_case(head_dim_qk=64, use_cuda_graph=True, **long_q)
    assert not prefill_rope.prerotation_applies(graph.problem, graph.params)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("lens", [dict(qo_lens=[2048], kv_lens=[2048]),
                                  dict(qo_lens=[1, 333, 0, 600, 64], kv_lens=[5, 333, 2, 900, 4000])],
                         ids=["single", "ragged"])
def test_gpu_rotated_first_matches_in_kernel_and_the_reference(monkeypatch, dim, lens):
    """bf16 on the GPU: both paths against the reference backend (the Python oracle would take
    hours at 2048 rows), and against each other (the same rotated values in bf16: only the
    kernels' accumulation orders differ)."""
    outs = []
    for first in (True, False):
        monkeypatch.setattr(prefill_rope, "MIN_QUERY_ROWS", 64 if first else 10 ** 9)
        case = make_ragged_case(head_dim_qk=dim, num_qo_heads=8, num_kv_heads=2, q_dtype=BF16, device="cuda",
                                rope_theta=5e5, seed=dim, **lens, **ROPE)
        run_checked(case, first, expected=reference_plan_result)
        outs.append(case.inputs.out.float())
    assert (outs[0] - outs[1]).abs().max().item() <= 2e-2
