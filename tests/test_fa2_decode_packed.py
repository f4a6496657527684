"""fa2 decode's packed split (`DecodeConfig.pack_items`): the requests' tokens end to end, an
equal piece per program, up to ``pack_items`` segments of different requests in one program.

CPU: `decode_split.packed_segments` on its own, and packed plans under the Triton interpreter
(fp16) against the float64 oracle. GPU (``-m gpu``): the d128 defaults' packed plans (fp8 and
bf16) against the reference backend.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.backends.fa2.decode import plan_decode
from flashdispatch.backends.fa2.decode_split import packed_segments

from oracle import assert_close, make_paged_case, reference_backend_result, run_fa2_decode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreted = pytest.mark.skipif(not TRITON_INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU run of the kernels)")


def test_packed_segments_give_every_program_an_equal_piece():
    eff = np.array([4096] * 48)
    req, lo, hi, rows, n_rows = packed_segments(eff, 132, 2, 256, 64)
    assert n_rows == 132 * 2 and (hi - lo).sum() == eff.sum() and np.all(hi > lo)
    per_program = np.bincount(rows // 2, weights=hi - lo)
    assert per_program.size == 132 and per_program.max() - per_program.min() <= per_program.max() // 16
    # segments cover each request once, in order, from its first token to its last
    for r in range(48):
        mine = req == r
        assert lo[mine][0] == 0 and hi[mine][-1] == 4096 and np.array_equal(lo[mine][1:], hi[mine][:-1])
    # rows of one program hold different requests; rows are unique
    assert np.unique(rows).size == rows.size
    assert np.all(np.diff(req[rows // 2 == 7]) > 0)


@pytest.mark.parametrize("eff, groups, items, why", [
    ([100, 0, 300], 4, 2, "an empty request"),
    ([100, 100, 5000], 4, 2, "a piece over 3 requests"),
    ([4096] * 4, 128, 2, "pieces under min_chunk"),
    ([8192], 40, 2, "more segments than max_splits"),
])
def test_packed_segments_refuse(eff, groups, items, why):
    assert packed_segments(np.array(eff), groups, items, 200, 32) is None, why


def _case(kv_lens, device="cpu", **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 64 if device == "cpu" else 128)
    kw.setdefault("q_dtype", torch.float16 if device == "cpu" else torch.bfloat16)
    extra = {} if device == "cpu" else {"poison_unused": False}
    return make_paged_case("decode", kv_lens=list(kv_lens), device=device, **extra, **kw)


# small enough pieces for the interpreter: 8 SMs x 4 programs, chunks from 16 tokens
CPU_PACK = {"pack_items": 2, "min_chunk_tokens": 16, "block_n": 16}


@interpreted
@pytest.mark.parametrize("features", [{}, dict(window_left=150, sinks=True), dict(q_len_per_req=2, mask_mode="causal"),
                                      dict(page_size=1), dict(kv_dtype=torch.float8_e4m3fn)],
                         ids=["plain", "window,sinks", "qlen2", "page1", "e4m3"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "merge-kernel"])
@pytest.mark.parametrize("lens", [[300, 251, 190], [300, 20, 190]], ids=["all-cut", "one-whole"])
def test_packed_plan_matches_the_oracle(features, fused, lens):
    case = _case(lens, seed=61, **features)
    config = {**CPU_PACK, "fused_merge_max_chunks": 64 if fused else 0}
    ref_out, ref_lse = case.oracle()
    plan = run_fa2_decode(case, config)
    assert plan.items == 2 and not plan.direct
    assert (plan._merge is None) == fused
    tol = 8e-2 if case.problem.kv_dtype == torch.float8_e4m3fn else 4e-3
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)


@interpreted
def test_packing_only_where_the_split_fills_its_target_poorly():
    """Requests whose chunks fill the few-programs target keep the plain split; empty requests,
    fixed_split_size and CUDA graphs never pack."""
    case = _case([256, 256, 256, 256], seed=62)  # 4 x 2 programs x 4 chunks: the whole target of 32
    assert run_fa2_decode(case, CPU_PACK).items == 1
    assert run_fa2_decode(_case([300, 0, 251, 190], seed=63), CPU_PACK).items == 1
    assert run_fa2_decode(_case([300, 251, 190], seed=64), CPU_PACK, fixed_split_size=2).items == 1
    graph = _case([300, 251, 190], seed=65, use_cuda_graph=True)
    graph.params.int_workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    assert run_fa2_decode(graph, CPU_PACK).items == 1


@interpreted
def test_16bit_d128_defaults_pack_only_a_poorly_filled_plan():
    """The fp16 d128 defaults pack below 0.65 of the target (here 8 SMs x 4, 2 KV heads): 9 whole
    requests fill 0.56 and pack, 14 fill 0.88 and do not (GQA and MHA). A direct plan refreshed
    for lengths that pack plans afresh."""
    small = {"min_chunk_tokens": 16}
    for heads in ((8, 2), (2, 2)):
        case = _case([300] * 9, head_dim_qk=128, num_qo_heads=heads[0], num_kv_heads=heads[1], seed=66)
        ref_out, ref_lse = case.oracle()
        assert run_fa2_decode(case, small).items == 2
        assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 4e-3)
        case = _case([300] * 14, head_dim_qk=128, num_qo_heads=heads[0], num_kv_heads=heads[1], seed=67)
        assert run_fa2_decode(case, small).items == 1
    # packing is a speed-up: a workspace too small for its partials plans the whole requests
    case = _case([300] * 9, head_dim_qk=128, seed=70)
    case.params.workspace = torch.zeros(1024, dtype=torch.uint8)
    plan = plan_decode(case.problem, case.device, case.params, small)
    assert plan.items == 1 and plan.direct
    # a direct split of 2 chunk slots filling 0.75; refreshed for 2-slot lengths filling 0.75 (kept)
    # and 0.625 (they pack: afresh)
    direct = run_fa2_decode(_case([300] * 3 + [150] * 6, head_dim_qk=128, seed=68), small)
    assert direct.direct and direct.split_slots == 2 and direct.items == 1
    for lens, refreshed in (([310] * 3 + [140] * 6, True), ([250] + [150] * 8, False)):
        case = _case(lens, head_dim_qk=128, seed=69)
        case.params.workspace = torch.zeros(1 << 22, dtype=torch.uint8)
        assert (direct.refreshed(case.device, case.params) is not None) == refreshed, lens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lens, heads, kv", [
    ([4096] * 48, (32, 8), "e4m3"), ([4096] * 36, (32, 8), "e4m3"), ([3000, 9000, 2000, 4000] * 12, (32, 8), "e4m3"),
    ([4096] * 12, (32, 32), "e4m3"), ([4096] * 9, (32, 32), "e4m3"), ([4096] * 36, (32, 8), "bf16"),
    ([4096, 3800, 4300] * 12, (32, 8), "bf16"), ([4096] * 9, (32, 32), "bf16")],
    ids=["48x4096", "36x4096", "mixed48", "mha12x4096", "mha9x4096", "bf16-36x4096", "bf16-mixed36", "bf16-mha9x4096"])
def test_gpu_defaults_pack(lens, heads, kv):
    """The d128 defaults pack batches whose plain plan fills its target poorly (fp8 under 0.95,
    bf16 under 0.65)."""
    fp8 = kv == "e4m3"
    case = _case(lens, device="cuda", kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                 num_qo_heads=heads[0], num_kv_heads=heads[1], k_scale=0.8 if fp8 else None,
                 v_scale=1.5 if fp8 else None, seed=len(lens) + heads[1])
    ref_out, ref_lse = reference_backend_result(case)
    plan = run_fa2_decode(case)
    assert plan.items == 2
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 8e-2 if fp8 else 2e-2)
