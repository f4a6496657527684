"""fa2 prefill on a CUDA GPU: feature x shape grid in bf16/fp16 against the reference backend,
lse, fp8 KV, CUDA-graph capture replayed after re-plans, and split-KV (the occupancy policy on few
query tiles over long KV, fixed_split_size with every feature, batch invariance); run with
``pytest -m gpu``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashdispatch.backends.base import DEFAULT_TOLERANCE, AttentionParams, PagedKV
from flashdispatch.backends.fa2.prefill import PREFILL_CAPS, plan_prefill
from flashdispatch.dispatch.caps import check_caps
from oracle import assert_close, make_paged_case, make_ragged_case, reference_plan_result

pytestmark = pytest.mark.gpu

BF16, F16 = torch.bfloat16, torch.float16


def check(case, tol=None):
    assert not check_caps(PREFILL_CAPS, case.problem, case.device)
    plan_prefill(case.problem, case.device, case.params).run(case.inputs)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_plan_result(case)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse,
                 tol or DEFAULT_TOLERANCE[case.problem.kv_dtype])


SHAPES = {
    "mixed": dict(qo_lens=[1, 300, 0, 77, 1024], kv_lens=[1, 700, 9, 77, 1500]),
    "long": dict(qo_lens=[2048], kv_lens=[2048]),
    "short_q_long_kv": dict(qo_lens=[16, 3, 128], kv_lens=[3000, 1999, 4096]),
}
FEATURES = {
    "none": dict(),
    "causal": dict(mask_mode="causal"),
    "window": dict(mask_mode="causal", window_left=255),
    "soft_cap": dict(mask_mode="causal", logits_soft_cap=30.0),
    "alibi": dict(mask_mode="causal", pos_encoding_mode="ALIBI"),
    "rope": dict(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5),
    "custom": dict(mask_mode="custom"),
    "sinks_scales": dict(mask_mode="causal", sinks=True, v_scale=1.5),  # + a k_scale tensor
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_paged_grid(feature, shape, dtype):
    lens = SHAPES[shape]
    if feature == "custom" and shape != "mixed":
        pytest.skip("custom masks only on the mixed shape (host-side mask building is slow)")
    extra = dict(k_scale=torch.tensor([0.5], device="cuda")) if feature == "sinks_scales" else {}
    check(make_paged_case(page_size=16, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=dtype,
                          device="cuda", **lens, **FEATURES[feature], **extra))


@pytest.mark.parametrize("feature", ["causal", "window", "rope", "custom"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_ragged_dims(feature, dims):
    check(make_ragged_case(qo_lens=[1, 333, 0, 600], kv_lens=[5, 333, 2, 900], head_dim_qk=dims[0],
                           head_dim_vo=dims[1], num_qo_heads=4, num_kv_heads=4 if dims[0] == 192 else 1,
                           q_dtype=BF16, device="cuda", **FEATURES[feature]))


@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (5, "HND"), (16, "HND"), (64, "NHD"), (128, "HND")])
def test_page_sizes_layouts(page_size, layout):
    check(make_paged_case(qo_lens=[100, 513], kv_lens=[400, 513], page_size=page_size, kv_layout=layout,
                          num_qo_heads=8, num_kv_heads=1, head_dim_qk=128, q_dtype=F16, mask_mode="causal",
                          device="cuda"))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv(fp8):
    check(make_paged_case(qo_lens=[64, 500], kv_lens=[900, 500], page_size=16, num_qo_heads=8, num_kv_heads=2,
                          head_dim_qk=128, q_dtype=BF16, kv_dtype=fp8, mask_mode="causal",
                          k_scale=torch.tensor(0.8, device="cuda"), v_scale=1.2, device="cuda"))


def test_fp32():
    check(make_ragged_case(qo_lens=[70, 130], kv_lens=[70, 260], head_dim_qk=128, q_dtype=torch.float32,
                           mask_mode="causal", device="cuda"))


@pytest.mark.parametrize("window_left", [-1, 255])  # a window takes 64x64 persistent tiles on sm90
def test_cuda_graph_replay_after_replan(window_left):
    """Capture run() once; re-plan other lengths into the same buffers; replay equals the reference."""
    heads, dim, page, max_q, batch = 8, 128, 16, 1024, 3
    kw = dict(page_size=page, num_qo_heads=heads, num_kv_heads=2, head_dim_qk=dim, q_dtype=BF16,
              mask_mode="causal", window_left=window_left, use_cuda_graph=True, kv_storage="tuple", device="cuda")
    lens = [([200, 17, 700], [900, 17, 700]), ([5, 1000, 0], [2000, 1000, 3]), ([1, 1, 1], [64, 1, 3000])]
    first = make_paged_case(qo_lens=lens[0][0], kv_lens=lens[0][1], seed=0, **kw)
    ws = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    n_pages = 4096
    bufs = dict(q=torch.zeros(max_q, heads, dim, dtype=BF16, device="cuda"),
                out=torch.zeros(max_q, heads, dim, dtype=BF16, device="cuda"),
                lse=torch.zeros(max_q, heads, device="cuda"),
                k=torch.zeros(n_pages, page, 2, dim, dtype=BF16, device="cuda"),
                v=torch.zeros(n_pages, page, 2, dim, dtype=BF16, device="cuda"),
                qo_indptr=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                kv_indptr=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                kv_indices=torch.zeros(n_pages, dtype=torch.int32, device="cuda"))

    def load(case) -> AttentionParams:
        """Copy a case into the fixed buffers; params pointing at them."""
        prm, inp = case.params, case.inputs
        nq, npg = inp.q.shape[0], inp.kv.k.shape[0]
        bufs["q"][:nq].copy_(inp.q)
        bufs["k"][:npg].copy_(inp.kv.k)
        bufs["v"][:npg].copy_(inp.kv.v)
        for name in ("qo_indptr", "kv_indptr"):
            bufs[name].copy_(getattr(prm, name))
        bufs["kv_indices"][:prm.kv_indices.numel()].copy_(prm.kv_indices)
        bufs["out"].fill_(float("nan"))
        bufs["lse"].fill_(float("nan"))
        return dataclasses.replace(prm, qo_indptr=bufs["qo_indptr"], kv_indptr=bufs["kv_indptr"],
                                   kv_indices=bufs["kv_indices"], int_workspace=ws)

    def run_inputs():
        return dataclasses.replace(first.inputs, q=bufs["q"], out=bufs["out"], lse=bufs["lse"],
                                   kv=PagedKV(bufs["k"], bufs["v"], first.inputs.kv.layout))

    plan = plan_prefill(first.problem, first.device, load(first))
    plan.run(run_inputs())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(run_inputs())
    for seed, (qo, kv) in enumerate(lens):
        case = make_paged_case(qo_lens=qo, kv_lens=kv, seed=seed, **kw)
        plan_prefill(case.problem, case.device, load(case))
        graph.replay()
        torch.cuda.synchronize()
        nq = sum(qo)
        ref_out, ref_lse = reference_plan_result(case)
        assert_close(bufs["out"][:nq], bufs["lse"][:nq], ref_out, ref_lse, DEFAULT_TOLERANCE[BF16])


# --- split-KV ---------------------------------------------------------------------------------
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def run_split(case, fixed=None, disable=False):
    """Plan with a 128 MiB float workspace (and fixed_split_size / disable_split_kv) and run."""
    case.params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    case.params.fixed_split_size = fixed
    case.params.disable_split_kv = disable
    plan = plan_prefill(case.problem, case.device, case.params)
    plan.run(case.inputs)
    torch.cuda.synchronize()
    return plan


SPLIT_SHAPES = {
    "one_128_over_32k": dict(qo_lens=[128], kv_lens=[32768]),
    "four_64_over_16k": dict(qo_lens=[64] * 4, kv_lens=[16384] * 4),
    "mixed_short_q": dict(qo_lens=[1, 17, 200], kv_lens=[9000, 20000, 4000]),
}


@pytest.mark.parametrize("shape", sorted(SPLIT_SHAPES))
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_split_policy_shapes(shape, kind):
    """32 heads x a few query tiles leave most SMs idle: the policy splits, the result matches the
    reference and the unsplit run."""
    kw = dict(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, q_dtype=BF16, mask_mode="causal",
              device="cuda", **SPLIT_SHAPES[shape])
    case = make_paged_case(page_size=16, **kw) if kind == "paged" else make_ragged_case(**kw)
    plan = run_split(case)
    assert plan.n_merge > 0
    ref_out, ref_lse = reference_plan_result(case)
    tol = DEFAULT_TOLERANCE[BF16]
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    split_out, split_lse = case.inputs.out.clone(), case.inputs.lse.clone()
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    assert run_split(case, disable=True).n_merge == 0
    assert_close(case.inputs.out, case.inputs.lse, split_out.float(), split_lse, tol)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_split_features(feature):
    """fixed_split_size=37 pages (592 tokens: chunk edges inside KV tiles) with every feature."""
    extra = dict(k_scale=torch.tensor([0.5], device="cuda")) if feature == "sinks_scales" else {}
    case = make_paged_case(page_size=16, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=BF16,
                           device="cuda", qo_lens=[16, 3, 130, 0], kv_lens=[3000, 1999, 4096, 7],
                           **FEATURES[feature], **extra)
    assert run_split(case, fixed=37).n_merge > 0
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case), DEFAULT_TOLERANCE[BF16])


@pytest.mark.parametrize("feature", ["causal", "window", "rope", "custom"])
@pytest.mark.parametrize("dims", [(64, 64), (256, 256), (192, 128)])
def test_split_ragged_dims(feature, dims):
    case = make_ragged_case(qo_lens=[5, 70], kv_lens=[2500, 3333], head_dim_qk=dims[0], head_dim_vo=dims[1],
                            num_qo_heads=4, num_kv_heads=2, q_dtype=F16, device="cuda", **FEATURES[feature])
    assert run_split(case, fixed=100).n_merge > 0
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case), DEFAULT_TOLERANCE[F16])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_split_fp8_kv(fp8):
    case = make_paged_case(qo_lens=[64, 9], kv_lens=[9000, 5000], page_size=16, num_qo_heads=8, num_kv_heads=2,
                           head_dim_qk=128, q_dtype=BF16, kv_dtype=fp8, mask_mode="causal", sinks=True,
                           k_scale=torch.tensor(0.8, device="cuda"), v_scale=1.2, device="cuda")
    assert run_split(case).n_merge > 0
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case), DEFAULT_TOLERANCE[fp8])


def test_split_batch_invariance():
    """fixed_split_size: request 1 gives bitwise the same out/lse alone and in the batch."""
    big = make_paged_case(qo_lens=[40, 100, 700], kv_lens=[5000, 12000, 3000], page_size=16, num_qo_heads=8,
                          num_kv_heads=2, head_dim_qk=128, q_dtype=BF16, mask_mode="causal", device="cuda", seed=3)
    run_split(big, fixed=64)
    prm, inp = big.params, big.inputs
    qo, pages = prm.qo_indptr.tolist(), prm.kv_indptr.tolist()
    i32 = dict(dtype=torch.int32, device="cuda")
    sub_prm = dataclasses.replace(
        prm, qo_lens_host=[prm.qo_lens_host[1]], kv_lens_host=[prm.kv_lens_host[1]],
        qo_indptr=torch.tensor([0, qo[2] - qo[1]], **i32), kv_indptr=torch.tensor([0, pages[2] - pages[1]], **i32),
        kv_indices=prm.kv_indices[pages[1]:pages[2]], kv_lens=prm.kv_lens[1:2],
        kv_last_page_len=prm.kv_last_page_len[1:2])
    rows = slice(qo[1], qo[2])
    sub = dataclasses.replace(big, params=sub_prm, inputs=dataclasses.replace(
        inp, q=inp.q[rows], out=torch.full_like(inp.out[rows], float("nan")),
        lse=torch.full_like(inp.lse[rows], float("nan"))))
    assert run_split(sub, fixed=64).n_merge > 0
    assert torch.equal(sub.inputs.out, inp.out[rows]) and torch.equal(sub.inputs.lse, inp.lse[rows])


def test_autotune_runs_the_winner_and_keeps_it():
    """FLASHDISPATCH_FA2_AUTOTUNE's mechanism on real GPU timings: every candidate compiles and
    runs, the result is the reference's, and the bucket's next plan is the winner's config."""
    from flashdispatch.backends.fa2 import tuning
    tuning.clear()
    case = make_paged_case(qo_lens=[300, 77], kv_lens=[900, 500], page_size=16, num_qo_heads=8, num_kv_heads=2,
                           head_dim_qk=128, q_dtype=BF16, mask_mode="causal", device="cuda", seed=4)
    plan = plan_prefill(case.problem, case.device, case.params, autotune=True)
    plan.run(case.inputs)
    torch.cuda.synchronize()
    assert not plan.failures and len(plan.timings) == len(tuning.candidates(case.problem, plan.configs[0]))
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case), DEFAULT_TOLERANCE[BF16])
    assert plan_prefill(case.problem, case.device, case.params, autotune=True).config == plan.plan.config
    tuning.clear()
