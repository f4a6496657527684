"""fa2 prefill TMA path (``PrefillConfig.tma``) on the CPU: the config knob and its env syntax, when
the knob applies, the per-launch fallback to pointer loads, the scratch allocator, the kernel's
descriptor loads under the Triton interpreter (which emulates tensor descriptors, their alignment
checks and their zero fill) against the float64 oracle, and an offline sm90 compile that must emit
TMA loads. Speed and the real hardware path are in test_fa2_prefill_tma_gpu.py (``-m gpu``)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from triton.runtime import _allocation

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.fa2 import prefill as fa2_prefill
from flashdispatch.backends.fa2.prefill import plan_prefill
from flashdispatch.backends.fa2.prefill_config import CONFIG_ENV, PrefillConfig, config_from_env, default_config
from flashdispatch.backends.fa2.prefill_tma import launch_with_scratch, tma_layout_ok, tma_unused_reason
from flashdispatch.dispatch.problem import Device
from oracle import assert_close, make_paged_case, make_ragged_case

F16 = torch.float16
TMA_CFG = PrefillConfig(32, 16, 4, 1, tma=True)  # the interpreter's tiles, TMA on
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ragged(**kw):
    """fp16 d64 GQA 4/2, uneven lengths: an empty request, an empty KV, kv_len not a multiple of 16."""
    opts = dict(qo_lens=[17, 0, 40, 5, 1], kv_lens=[30, 7, 53, 0, 1], head_dim_qk=64, q_dtype=F16,
                num_qo_heads=4, num_kv_heads=2, seed=11)
    return make_ragged_case(**{**opts, **kw})


def run_checked(case, config=TMA_CFG, expect_tma=True):
    """Plan with ``config``, run on the NaN-poisoned case, compare with the oracle; the launch must
    have taken the TMA variant exactly when ``expect_tma``."""
    plan = plan_prefill(case.problem, case.device, case.params, config)
    plan.run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, *case.oracle(), DEFAULT_TOLERANCE[case.problem.q_dtype])
    assert [variant.tma for variant in plan._launchers] == [expect_tma]
    return plan


# --- the knob ---------------------------------------------------------------------------------
def test_config_env_bool(monkeypatch):
    base = PrefillConfig(128, 64, 8, 3)
    for text, value in [("tma=1", True), ("tma=0", False), ("tma=true", True), ("tma=Off", False),
                        ("tma=yes", True)]:
        monkeypatch.setenv(CONFIG_ENV, text)
        assert config_from_env(base) == replace(base, tma=value)
    monkeypatch.setenv(CONFIG_ENV, "block_m=128,block_n=128,num_warps=8,num_stages=3,tma=1")
    assert config_from_env(base) == PrefillConfig(128, 128, 8, 3, tma=True)
    monkeypatch.setenv(CONFIG_ENV, "64,32,4,3")
    assert config_from_env(replace(base, tma=True)).tma is False  # the four numbers: a fresh config
    for bad in ("tma=2", "tma=", "tma=maybe"):
        monkeypatch.setenv(CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=f"{CONFIG_ENV}.*tma"):
            config_from_env(base)
    with pytest.raises(ValueError, match="tma=1: must be a bool"):
        PrefillConfig(128, 64, 8, 3, tma=1).validate()


def test_env_tma_reaches_the_plan(monkeypatch):
    case = ragged(mask_mode="causal")
    monkeypatch.setenv(CONFIG_ENV, "tma=1")
    plan = plan_prefill(case.problem, case.device, case.params)
    assert plan.config.tma and plan.tma and plan.tma_reason is None
    monkeypatch.delenv(CONFIG_ENV)
    plan = plan_prefill(case.problem, case.device, case.params)
    assert not plan.tma and plan.tma_reason == "tma=0"


def test_where_tma_applies():
    problem = ragged().problem
    h200, a100 = Device("cuda", 0, (9, 0), "H200", 132), Device("cuda", 0, (8, 0), "A100", 108)
    assert tma_unused_reason(problem, h200, 3, False) is None
    assert tma_unused_reason(problem.with_(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                           o_dtype=torch.bfloat16, head_dim_qk=256, head_dim_vo=256),
                             h200, 1, False) is None
    unused = {
        "ragged": (problem.with_(op="prefill_paged", page_size=16), h200, 3, False),
        "sm90": (problem, a100, 3, False),
        "sm90 ": (problem, Device("cpu"), 3, False),
        "16-bit": (problem.with_(kv_dtype=torch.float8_e4m3fn), h200, 3, False),
        "16-bit ": (problem.with_(q_dtype=torch.float32, kv_dtype=torch.float32, o_dtype=torch.float32), h200, 3,
                    False),
        "equal qk and vo": (problem.with_(head_dim_qk=192, head_dim_vo=128), h200, 3, False),
        "ROPE_LLAMA": (problem.with_(pos_encoding_mode="ROPE_LLAMA"), h200, 3, False),
        "num_stages=2": (problem, h200, 2, False),
    }
    for words, args in unused.items():
        reason = tma_unused_reason(*args)
        assert reason is not None and words.strip() in reason, (words, reason)
    assert tma_unused_reason(problem, Device("cpu"), 1, True) is None  # the interpreter emulates descriptors


def test_layout_rules():
    k = torch.zeros(10, 2, 64, dtype=F16)
    assert tma_layout_ok(k, k)
    wide = torch.zeros(10, 2, 72, dtype=F16)  # 144-byte head stride: a multiple of 16
    assert tma_layout_ok(wide[..., :64])
    assert not tma_layout_ok(torch.zeros(10, 2, 68, dtype=F16)[..., :64])  # 136-byte head stride
    assert not tma_layout_ok(torch.zeros(10, 2, 128, dtype=F16)[..., ::2])  # inner stride 2
    assert not tma_layout_ok(k, torch.zeros(10 * 2 * 64 + 1, dtype=F16)[1:].view(10, 2, 64))  # base + 2 bytes
    assert not tma_layout_ok(torch.zeros(10, 2, 8, dtype=F16)[:, :, :4])  # 8-byte rows
    assert not tma_layout_ok(torch.zeros(1, 2, 64, dtype=F16).expand(10, 2, 64))  # token stride 0
    assert tma_layout_ok(torch.zeros(10, 1, 64, dtype=F16).expand(10, 2, 64))  # head stride 0: one base


# --- the kernel's descriptor loads under the interpreter ------------------------------------
FEATURES = {
    "none": dict(),
    "causal": dict(mask_mode="causal"),
    "window_causal": dict(mask_mode="causal", window_left=9),
    "window_only": dict(window_left=20),
    "custom": dict(mask_mode="custom"),
    "custom_window": dict(mask_mode="custom", window_left=12),
    "soft_cap_alibi": dict(mask_mode="causal", logits_soft_cap=2.5, sm_scale=0.6, pos_encoding_mode="ALIBI"),
    "sinks_scales": dict(mask_mode="causal", sinks=True, k_scale=torch.tensor([0.7]), v_scale=1.3),
    "no_lse": dict(mask_mode="causal", return_lse=False),
}


@pytest.mark.interpreted
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_tma_features(name):
    run_checked(ragged(**FEATURES[name]))


@pytest.mark.interpreted
def test_tma_gqa_8_to_1_long_request():
    run_checked(ragged(qo_lens=[70], kv_lens=[101], num_qo_heads=8, num_kv_heads=1, mask_mode="causal"))


@pytest.mark.interpreted
def test_tma_split_kv():
    """fixed_split_size=23 tokens: chunk edges inside KV tiles; the descriptor spans the request."""
    case = ragged(mask_mode="causal", qo_lens=[3, 20, 0, 9], kv_lens=[150, 97, 5, 61])
    case.params.fixed_split_size = 23
    case.params.workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    assert run_checked(case).n_merge > 0


@pytest.mark.interpreted
def test_tma_graph_mode():
    """Persistent grid (CUDA-graph mode): descriptors are made per (item, head) inside the loop."""
    case = ragged(mask_mode="causal", use_cuda_graph=True)
    case.params.int_workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    run_checked(case)


@pytest.mark.interpreted
def test_descriptor_path_is_what_runs(monkeypatch):
    """Forcing the TMA variant onto a K view whose token stride is not a multiple of 16 bytes trips
    the interpreter's descriptor check: the TMA variant really builds descriptors."""
    case = ragged(mask_mode="causal", num_kv_heads=1, num_qo_heads=2)
    k = case.inputs.kv.k
    wide = torch.zeros(k.shape[0], 1, 68, dtype=F16)
    wide[..., :64] = k
    case.inputs.kv = replace(case.inputs.kv, k=wide[..., :64])  # token stride 136 bytes
    monkeypatch.setattr(fa2_prefill, "tma_layout_ok", lambda *views: True)
    plan = plan_prefill(case.problem, case.device, case.params, TMA_CFG)
    with pytest.raises(Exception, match="16-byte aligned"):
        plan.run(case.inputs)


@pytest.mark.interpreted
@pytest.mark.parametrize("view", ["base_offset", "head_stride", "inner_stride"])
def test_unaligned_views_run_the_pointer_path(view):
    """K/V views that break the descriptor rules launch the pointer variant, with the same result."""
    case = ragged(mask_mode="causal", qo_lens=[9, 20], kv_lens=[33, 20])
    kv = case.inputs.kv
    if view == "base_offset":
        views = [torch.zeros(x.numel() + 1, dtype=F16)[1:].view(x.shape) for x in (kv.k, kv.v)]
    elif view == "head_stride":
        views = [torch.zeros(*x.shape[:2], 68, dtype=F16)[..., :64] for x in (kv.k, kv.v)]
    else:
        views = [torch.zeros(*x.shape[:2], 128, dtype=F16)[..., ::2] for x in (kv.k, kv.v)]
    for new, old in zip(views, (kv.k, kv.v)):
        new.copy_(old)
    case.inputs.kv = replace(kv, k=views[0], v=views[1])
    plan = run_checked(case, expect_tma=False)
    assert plan.tma  # planned with TMA; this launch fell back


@pytest.mark.interpreted
def test_tma_ignored_where_it_does_not_apply():
    paged = make_paged_case(qo_lens=[17, 40], kv_lens=[30, 53], page_size=16, head_dim_qk=64, q_dtype=F16,
                            mask_mode="causal")
    plan = run_checked(paged, expect_tma=False)
    assert not plan.tma and "ragged" in plan.tma_reason
    rope = ragged(mask_mode="causal", pos_encoding_mode="ROPE_LLAMA")
    assert "ROPE" in run_checked(rope, expect_tma=False).tma_reason
    fp32 = ragged(mask_mode="causal", q_dtype=torch.float32)
    assert "16-bit" in run_checked(fp32, expect_tma=False).tma_reason
    split_dims = ragged(mask_mode="causal", head_dim_qk=192, head_dim_vo=128)
    assert "head dims" in run_checked(split_dims, expect_tma=False).tma_reason


# --- scratch allocator ------------------------------------------------------------------------
def test_scratch_allocator_is_ours_only_during_the_launch():
    seen = []

    def launch(grid, *args):
        seen.append(_allocation._allocator.get())

    assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    launch_with_scratch(launch, (1,), 0)
    assert seen[-1] is fa2_prefill.launch_with_scratch.__globals__["_torch_scratch"]
    assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)

    def users(size, alignment, stream):
        raise AssertionError("not called on the CPU")

    token = _allocation._allocator.set(users)
    try:
        launch_with_scratch(launch, (1,), 0)
        assert seen[-1] is users and _allocation._allocator.get() is users
    finally:
        _allocation._allocator.reset(token)


# --- offline sm90 compile -----------------------------------------------------------------------
def test_sm90_compile_emits_tma_loads():
    """The TMA variant compiles for sm90 (ptxas included) with TMA loads and no cp.async, the
    pointer variant with cp.async; needs no GPU (scripts/prefill_tma_compile.py)."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prefill_tma_compile.py"), "--head-dim", "64",
                          "--tiles", "64,32,4,3", "--masks", "causal", "--no-ptxas"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split()[1]: line.split() for line in res.stdout.splitlines() if line.startswith("causal")}
    _, _, shared, scratch, tma_loads, cp_async, _ = rows["True"]
    assert int(tma_loads) > 0 and int(cp_async) == 0 and int(scratch) > 0
    _, _, _, scratch, tma_loads, cp_async, _ = rows["False"]
    assert int(tma_loads) == 0 and int(cp_async) > 0 and int(scratch) == 0


def test_default_config_asks_for_tma_at_d128_only():
    """The H200 default (measured: the window row gained 7 %) turns TMA on for 16-bit d128 on sm90;
    d64 and d256 (not measured; d256 is 2-stage) and other GPUs keep the pointer path."""
    problem = ragged().problem.with_(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16)
    h200 = Device("cuda", 0, (9, 0), "H200", 132)
    d128 = default_config(problem.with_(head_dim_qk=128, head_dim_vo=128), h200)
    assert d128.tma and tma_unused_reason(problem.with_(head_dim_qk=128, head_dim_vo=128), h200,
                                          d128.num_stages, False) is None
    for d in (64, 256):
        assert not default_config(problem.with_(head_dim_qk=d, head_dim_vo=d), h200).tma
    sm100 = Device("cuda", 0, (10, 0), "B200", 148)  # not measured there: pointers unless asked
    assert not default_config(problem.with_(head_dim_qk=128, head_dim_vo=128), sm100).tma

