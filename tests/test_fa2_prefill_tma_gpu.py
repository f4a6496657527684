"""fa2 prefill with TMA K/V loads (``PrefillConfig.tma``) on an sm90+ GPU, against the reference
backend with the fa2 prefill GPU tests' tolerance: bf16/fp16, d64/d128/d256, every mask feature
the TMA path takes, uneven ragged batches, split-KV, CUDA-graph replay, per-launch fallback,
the scratch allocator, and single_prefill_with_kv_cache with ``FLASHDISPATCH_FA2_PREFILL_CONFIG=tma=1``.
Run with ``pytest -m gpu tests/test_fa2_prefill_tma_gpu.py``."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from triton.runtime import _allocation

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.fa2 import prefill as fa2_prefill
from flashdispatch.backends.fa2.prefill import plan_prefill
from flashdispatch.backends.fa2.prefill_config import CONFIG_ENV, default_config
from oracle import assert_close, make_ragged_case, reference_plan_result

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA GPU of sm90 or newer")]

BF16, F16 = torch.bfloat16, torch.float16


def tma_config(case, **changes):
    """The default config with tma on (3 stages where the default has 2: see prefill_tma.py)."""
    cfg = default_config(case.problem, case.device)
    return replace(cfg, tma=True, num_stages=3 if cfg.num_stages == 2 else cfg.num_stages, **changes)


def check(case, config=None, expect_tma=True):
    """Plan with TMA on, run, compare with the reference; the launch took TMA iff ``expect_tma``."""
    plan = plan_prefill(case.problem, case.device, case.params, config or tma_config(case))
    plan.run(case.inputs)
    torch.cuda.synchronize()
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case),
                 DEFAULT_TOLERANCE[case.problem.kv_dtype])
    assert plan.tma and [variant.tma for variant in plan._launchers] == [expect_tma], plan.tma_reason
    return plan


MIXED = dict(qo_lens=[1, 300, 0, 77, 1024], kv_lens=[1, 700, 9, 77, 1500])
FEATURES = {
    "none": dict(),
    "causal": dict(mask_mode="causal"),
    "window": dict(mask_mode="causal", window_left=255),
    "window_only": dict(window_left=100),
    "custom": dict(mask_mode="custom"),
    "soft_cap": dict(mask_mode="causal", logits_soft_cap=30.0),
    "alibi": dict(mask_mode="causal", pos_encoding_mode="ALIBI"),
    "no_lse": dict(mask_mode="causal", return_lse=False),
    "sinks_scales": dict(mask_mode="causal", sinks=True, v_scale=1.5),
    "negative_scale": dict(mask_mode="causal", sm_scale=-20.0),  # the unfolded row max (see _attn_tiles)
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_features_dims_bf16(feature, dim):
    check(make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=dim, q_dtype=BF16, device="cuda",
                           **MIXED, **FEATURES[feature]))


@pytest.mark.parametrize("feature", ["none", "causal", "window", "custom"])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_features_dims_fp16(feature, dim):
    check(make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=dim, q_dtype=F16, device="cuda",
                           **MIXED, **FEATURES[feature]))


BATCHES = {
    "long": dict(qo_lens=[4096], kv_lens=[4096]),
    "short_q_long_kv": dict(qo_lens=[16, 3, 128], kv_lens=[3000, 1999, 4096]),
    "many_uneven": dict(qo_lens=[5, 129, 1, 0, 257, 64, 1000], kv_lens=[5, 200, 999, 3, 257, 2049, 1000]),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("mask", ["none", "causal", "custom"])
def test_ragged_batches(batch, mask):
    if mask == "custom" and batch == "long":
        pytest.skip("host-side mask building of 4096 x 4096 is slow")
    check(make_ragged_case(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, q_dtype=BF16, device="cuda",
                           mask_mode=mask, **BATCHES[batch]))


@pytest.mark.parametrize("tiles", [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)])
def test_sweep_tiles(tiles):
    """The tile configs a sweep would try with tma=1 compile, fit and match the reference."""
    case = make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=BF16, device="cuda",
                            mask_mode="causal", **MIXED)
    check(case, replace(default_config(case.problem, case.device), block_m=tiles[0], block_n=tiles[1],
                        num_warps=tiles[2], num_stages=tiles[3], tma=True))


@pytest.mark.parametrize("feature", ["causal", "window", "custom"])
def test_split_kv(feature):
    """fixed_split_size=100 tokens: chunks cut inside KV tiles, partials merged."""
    case = make_ragged_case(qo_lens=[5, 70, 0], kv_lens=[2500, 3333, 4], num_qo_heads=4, num_kv_heads=2,
                            head_dim_qk=128, q_dtype=BF16, device="cuda", **FEATURES[feature])
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    case.params.fixed_split_size = 100
    assert check(case).n_merge > 0


def test_cuda_graph_replay():
    """Persistent grid with descriptors made inside the loop; the scratch is allocated at capture."""
    case = make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=BF16, device="cuda",
                            mask_mode="causal", use_cuda_graph=True, **MIXED)
    case.params.int_workspace = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    plan = plan_prefill(case.problem, case.device, case.params, tma_config(case))
    plan.run(case.inputs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.inputs)
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case), DEFAULT_TOLERANCE[BF16])
    assert [variant.tma for variant in plan._launchers] == [True]


def test_unaligned_view_falls_back():
    """K/V as views 2 bytes past an aligned base: the pointer variant runs, same result."""
    case = make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=BF16, device="cuda",
                            mask_mode="causal", **MIXED)
    kv = case.inputs.kv
    views = []
    for x in (kv.k, kv.v):
        view = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view(x.shape)
        view.copy_(x)
        views.append(view)
    case.inputs.kv = replace(kv, k=views[0], v=views[1])
    check(case, expect_tma=False)


def test_users_allocator_is_used_and_kept():
    calls = []

    def users(size, alignment, stream):
        calls.append((size, alignment))
        return torch.empty(size, dtype=torch.int8, device="cuda")

    case = make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, q_dtype=BF16, device="cuda",
                            mask_mode="causal", **MIXED)
    token = _allocation._allocator.set(users)
    try:
        check(case)
        assert calls and _allocation._allocator.get() is users
    finally:
        _allocation._allocator.reset(token)
    assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)


@pytest.mark.parametrize("mask", ["causal", "none", "window", "custom"])
def test_single_prefill_with_env(monkeypatch, mask):
    """single_prefill_with_kv_cache(backend="fa2") with FLASHDISPATCH_FA2_PREFILL_CONFIG=tma=1
    (and 3 stages) takes the TMA launch and matches the reference."""
    import flashdispatch as fd
    from flashdispatch.dispatch import select
    from flashdispatch.quantization import packbits

    launches = []
    real = fa2_prefill.launch_with_scratch

    def counting(launch, grid, *args):
        launches.append(grid)
        real(launch, grid, *args)

    monkeypatch.setattr(fa2_prefill, "launch_with_scratch", counting)
    monkeypatch.setenv(CONFIG_ENV, "num_stages=3,tma=1")
    select.clear_cache()  # and the kept single-request plans
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, 128, generator=g, device="cuda", dtype=BF16)
               for n, h in ((1000, 32), (1500, 8), (1500, 8)))
    kw = dict(causal=mask == "causal", window_left=200 if mask == "window" else -1, backend="fa2", return_lse=True)
    bits = None
    if mask == "custom":
        bits = torch.rand(1000, 1500, generator=g, device="cuda") < 0.5
        kw.update(causal=False, packed_custom_mask=packbits(bits.reshape(-1), bitorder="little"))
    out, lse = fd.single_prefill_with_kv_cache(q, k, v, **kw)
    torch.cuda.synchronize()
    assert launches, "the TMA launch did not run"
    ref_kw = dict(kw, backend="reference")
    ref_out, ref_lse = fd.single_prefill_with_kv_cache(q, k, v, **ref_kw)
    assert_close(out, lse, ref_out.float(), ref_lse, DEFAULT_TOLERANCE[BF16])


def test_default_config_takes_tma_at_d128_on_sm90():
    """No config given: a 16-bit d128 ragged plan on sm90 loads K/V through descriptors."""
    case = make_ragged_case(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=BF16, device="cuda",
                            **MIXED, **FEATURES["causal"])
    if case.device.cc[0] != 9:
        pytest.skip(f"the TMA default is for sm90, this GPU is sm{case.device.cc[0]}{case.device.cc[1]}")
    plan = plan_prefill(case.problem, case.device, case.params)
    plan.run(case.inputs)
    torch.cuda.synchronize()
    assert_close(case.inputs.out, case.inputs.lse, *reference_plan_result(case),
                 DEFAULT_TOLERANCE[case.problem.kv_dtype])
    assert plan.tma and [variant.tma for variant in plan._launchers] == [True], plan.tma_reason
