"""fa2 decode with fp8 KV and both dots in fp16 (``DecodeConfig.fp8_dot_dtype="fp16"``).

CPU (TRITON_INTERPRET=1), against the float64 oracle: fp16 and bf16 q (the fp16 path takes bf16
q through fp32, which the interpreter computes right; bf16 dots it does not), e4m3 and e5m2 KV,
float and tensor scales, the features, and the range cases the fp16 path must survive: q far
above the fp16 range or down in its subnormals, rotated e5m2 K above the fp16 max, and dot sums
above 65504 that only the fp32 accumulators hold.
GPU (``-m gpu``): bf16 q with e4m3/e5m2 KV against the reference backend, both fp8_dot_dtype
values, and the same range cases.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from oracle import assert_close, make_paged_case, reference_backend_result, run_fa2_decode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP16 = {"fp8_dot_dtype": "fp16"}
# the oracle sees the same fp8 values: only q/P rounding and the output dtype remain
CPU_TOL = {torch.float32: 3e-3, torch.float16: 3e-3, torch.bfloat16: 1e-2}
GPU_TOL = {E4M3: 8e-2, E5M2: 1.5e-1}  # as tests/test_fa2_decode_gpu.py


def _case(kv_lens, device="cpu", **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 64 if device == "cpu" else 128)
    kw.setdefault("kv_dtype", E4M3)
    extra = {} if device == "cpu" else {"poison_unused": False}
    return make_paged_case("decode", kv_lens=list(kv_lens), device=device, **extra, **kw)


def _reshape(case, q=None, k=None, v=None):
    """Rewrite q and the K/V caches in place through float32 functions (range cases)."""
    for tensor, fn in ((case.inputs.q, q), (case.inputs.kv.k, k), (case.inputs.kv.v, v)):
        if fn is not None:
            tensor.copy_(fn(tensor.float()).to(tensor.dtype))
    return case


def _check_cpu(case, config=FP16, tol=None, **params):
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, config, **params)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol or CPU_TOL[case.problem.o_dtype])
    return plan


# --- CPU ------------------------------------------------------------------------------------
@pytest.mark.interpreted
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scales", ["none", "float", "tensor"])
def test_cpu_dtypes_and_scales(q_dtype, kv_dtype, scales):
    vals = {"none": (None,) * 3, "float": (1.3, 0.7, 1.9),
            "tensor": tuple(torch.tensor([s]) for s in (1.3, 0.7, 1.9))}[scales]
    case = _case((0, 1, 37, 300), q_dtype=q_dtype, kv_dtype=kv_dtype, q_scale=vals[0], k_scale=vals[1],
                 v_scale=vals[2], seed=21)
    plan = _check_cpu(case, fixed_split_size=2)
    assert plan._consts["FP16_DOTS"]


@pytest.mark.interpreted
@pytest.mark.parametrize("feature", [
    dict(pos_encoding_mode="ROPE_LLAMA"), dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
    dict(pos_encoding_mode="ALIBI", kv_dtype=E5M2), dict(logits_soft_cap=5.0), dict(window_left=20), dict(sinks=True),
    dict(q_len_per_req=3, mask_mode="causal"), dict(kv_layout="HND", page_size=1), dict(o_dtype=torch.float32),
    dict(head_dim_qk=128, num_qo_heads=4, num_kv_heads=4), dict(return_lse=False),
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_cpu_features(feature, q_dtype):
    case = _case((0, 5, 37, 150), q_dtype=q_dtype, k_scale=0.8, v_scale=1.5, seed=22, **feature)
    _check_cpu(case)
    _check_cpu(case, fixed_split_size=3)


@pytest.mark.interpreted
def test_cpu_block_configs():
    case = _case((3, 129), q_dtype=torch.bfloat16, seed=23)
    for config in ({"block_n": 16}, {"block_n": 32, "k_rows": True}, {"block_n": 64, "num_stages": 3},
                   {"swap_ab": False}, {"block_n": 32, "swap_ab": False, "max_block_m": 16}):
        _check_cpu(case, config={**FP16, **config}, fixed_split_size=4)


# The range cases, each with a (q, k, v) rewrite and its scales; shared with the GPU tests.
RANGE_CASES = {
    # |q| ~ 1e6: q * sm_scale alone would overflow fp16; k_scale brings the scores back to O(1)
    "q_huge": dict(rewrite=dict(q=lambda x: x * 1e6), k_scale=1e-6),
    # |q| ~ 1e-7: fp16 subnormals (1-2 significant bits) without the row scaling
    "q_tiny": dict(rewrite=dict(q=lambda x: x * 1e-7), k_scale=1e7),
    # one q row of zeros (the row scale's clamp) next to normal rows
    "q_zero_row": dict(rewrite=dict(q=lambda x: x * (torch.arange(x.shape[1], device=x.device) != 3)[None, :, None])),
    # q . k of 64-128 same-sign terms x 2^14: > 65504, so the QK accumulator must be fp32
    "qk_sum_over_fp16": dict(rewrite=dict(q=lambda x: x.abs() + 0.5, k=lambda x: x.abs() + 0.5), sm_scale=1e-3),
    # e5m2 V ~ 1e4: sum_j p_j v_j > 65504, so the PV accumulator must be fp32
    "pv_sum_over_fp16": dict(rewrite=dict(v=lambda x: (x.abs() * 1e4).clamp(max=57344)), kv_dtype=E5M2),
    # e5m2 K up to 57344 rotated by RoPE: up to 81k, over the fp16 max (the path halves it)
    "rope_k_over_fp16": dict(rewrite=dict(k=lambda x: (x * 3e4).clamp(-57344, 57344)), kv_dtype=E5M2,
                             k_scale=1e-4, pos_encoding_mode="ROPE_LLAMA"),
}


def _range_case(name, q_dtype, device="cpu"):
    spec = dict(RANGE_CASES[name])
    rewrite = spec.pop("rewrite")
    return _reshape(_case((1, 40, 200), device=device, q_dtype=q_dtype, seed=24, **spec), **rewrite)


@pytest.mark.interpreted
@pytest.mark.parametrize("name", list(RANGE_CASES))
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_cpu_range(name, q_dtype):
    if name == "q_huge" and q_dtype == torch.float16:
        pytest.skip("fp16 q cannot hold 1e6")
    case = _range_case(name, q_dtype)
    assert torch.isfinite(case.inputs.q.float()).all()
    _check_cpu(case, tol=CPU_TOL[case.problem.o_dtype])


@pytest.mark.interpreted
def test_cpu_knob_off_for_half_kv_and_validated():
    case = _case((50,), q_dtype=torch.float16, kv_dtype=torch.float16, seed=25)
    plan = _check_cpu(case, tol=4e-3)
    assert not plan._consts["FP16_DOTS"], "fp8_dot_dtype only applies to fp8 KV"
    with pytest.raises(ValueError, match="fp8_dot_dtype"):
        run_fa2_decode(case, {"fp8_dot_dtype": "bf16"})


# --- GPU ------------------------------------------------------------------------------------
def _check_gpu(case, config, **params):
    ref_out, ref_lse = reference_backend_result(case)
    run_fa2_decode(case, config, **params)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, GPU_TOL[case.problem.kv_dtype])


def _scales(kind, device):
    vals = (1.2, 0.5, 2.0)
    if kind == "tensor":  # 1-element device tensors, read by the kernel
        return tuple(torch.tensor([x], device=device) for x in vals)
    return vals


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["q", "fp16"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim,layout,page_size,scales", [(128, "NHD", 16, "float"), (128, "HND", 1, "tensor"),
                                                              (64, "NHD", 64, "tensor"), (256, "HND", 16, "float")])
@pytest.mark.parametrize("split", [{}, {"fixed_split_size": 8}, {"disable_split_kv": True}],
                         ids=["auto", "fixed8", "nosplit"])
def test_gpu_bf16_q_fp8_kv(mode, kv_dtype, head_dim, layout, page_size, scales, split):
    qs, ks, vs = _scales(scales, "cuda")
    case = _case([0, 1, 33, 700, 4097], device="cuda", q_dtype=torch.bfloat16, kv_dtype=kv_dtype,
                 head_dim_qk=head_dim, kv_layout=layout, page_size=page_size, q_scale=qs, k_scale=ks,
                 v_scale=vs, seed=head_dim + page_size)
    _check_gpu(case, {"fp8_dot_dtype": mode}, **split)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim, heads, block_n", [(64, (8, 2), 32), (128, (32, 8), 32), (128, (8, 8), 32),
                                                      (256, (16, 8), 16)])
@pytest.mark.parametrize("split", [{}, {"fixed_split_size": 8}], ids=["auto", "fixed8"])
def test_gpu_small_shared_memory_defaults(kv_dtype, head_dim, heads, block_n, split):
    """The fp8 defaults of GPUs with 99 KB of shared memory per block (sm86/89/120), planned for
    this GPU with that figure: its tiles against the reference."""
    case = _case([0, 1, 33, 700, 4097], device="cuda", q_dtype=torch.bfloat16, kv_dtype=kv_dtype,
                 head_dim_qk=head_dim, num_qo_heads=heads[0], num_kv_heads=heads[1], k_scale=0.8, v_scale=1.5,
                 seed=head_dim + heads[1])
    case.device = dataclasses.replace(case.device, shared_per_block=101376)
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case, None, **split)
    assert plan.config.block_n == block_n and plan.config.fp8_v_convert == "staged"
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, GPU_TOL[kv_dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("feature", [
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5), dict(pos_encoding_mode="ALIBI"),
    dict(logits_soft_cap=30.0), dict(window_left=100), dict(sinks=True), dict(q_len_per_req=4, mask_mode="causal"),
    dict(num_qo_heads=32, num_kv_heads=4, o_dtype=torch.float32), dict(return_lse=False),
    dict(kv_storage="tuple", kv_dtype=E5M2), dict(pos_encoding_mode="ROPE_LLAMA", kv_dtype=E5M2),
], ids=lambda f: ",".join(sorted(f)))
def test_gpu_features(feature):
    case = _case([0, 33, 700, 3000], device="cuda", q_dtype=torch.bfloat16, k_scale=0.8, v_scale=1.5, seed=3,
                 **feature)
    _check_gpu(case, FP16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(block_n=64, num_warps=8, num_stages=3), dict(block_n=32, k_rows=True),
                                    dict(block_n=128, num_warps=8, num_stages=2), dict(swap_ab=False),
                                    dict(block_n=32, num_stages=2), dict(num_warps=2, block_n=64)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gpu_block_configs(config):
    case = _case([1, 129, 2000], device="cuda", q_dtype=torch.bfloat16, k_scale=0.8, v_scale=1.5, seed=5)
    _check_gpu(case, {**FP16, **config}, fixed_split_size=4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RANGE_CASES))
def test_gpu_range(name):
    case = _range_case(name, torch.bfloat16, device="cuda")
    _check_gpu(case, FP16)
