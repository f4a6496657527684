"""fa2 default configs per GPU and problem, and GPU-dependent refusals; no GPU needed (the
shared-memory check compiles offline for sm86 with scripts/prefill_tma_compile.py)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from flashdispatch.backends.common import shared_per_block
from flashdispatch.backends.fa2 import FA2Backend
from flashdispatch.backends.fa2.decode import plan_decode
from flashdispatch.backends.fa2.decode_config import resolve_config
from flashdispatch.backends.fa2.prefill import plan_prefill
from flashdispatch.backends.fa2.prefill_config import PrefillConfig, default_config
from flashdispatch.dispatch.problem import Device
from flashdispatch.dispatch.reasons import Unsupported
from oracle import make_paged_case, make_ragged_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = Device("cuda", 0, (9, 0), "H200", 132)
A100 = Device("cuda", 0, (8, 0), "A100", 108)
L4 = Device("cuda", 0, (8, 9), "L4", 58)
A10 = Device("cuda", 0, (8, 6), "A10", 72)
SM86_SHARED = 101376  # opt-in shared memory per block on sm86/sm89/sm120 (99 KB)


def problem_128(**changes):
    """A bf16 d128 ragged prefill problem (GQA 4/2) with ``changes``."""
    problem = make_ragged_case(qo_lens=[17, 40], kv_lens=[30, 53], head_dim_qk=128, num_qo_heads=4,
                               num_kv_heads=2).problem
    return problem.with_(**{"q_dtype": torch.bfloat16, "kv_dtype": torch.bfloat16, "o_dtype": torch.bfloat16,
                            **changes})


def test_custom_mask_default_tiles_are_128_wide_on_sm90_only():
    """A custom mask takes 128x128 pointer-load tiles on sm90 (measured 10 % over 128x64 with
    TMA); other GPUs keep 128-row x 64-key tiles (the bitmaps beside 128-wide stages need sm90's
    shared memory), and RoPE keeps 64 keys everywhere (chosen for its former second K load)."""
    problem = problem_128(mask_mode="custom")
    cfg = default_config(problem, H200)
    assert (cfg.block_m, cfg.block_n, cfg.tma) == (128, 128, False)
    assert default_config(problem.with_(mask_mode="causal"), H200).tma
    assert default_config(problem.with_(pos_encoding_mode="ROPE_LLAMA"), H200).block_n == 64
    assert default_config(problem, A100).block_n == 64


@pytest.mark.parametrize("page_size,block_n", [(1, 64), (16, 64), (32, 64), (64, 128), (128, 128)])
def test_paged_default_tiles_follow_the_page_size(page_size, block_n):
    """Pages under 64 keys take 64-key tiles (measured faster at pages 1 and 16 on the H200, slower
    at 64); longer pages keep 128-key tiles, and so does a custom mask at any page size."""
    problem = problem_128(op="prefill_paged", page_size=page_size, mask_mode="causal")
    assert default_config(problem, H200).block_n == block_n
    assert default_config(problem.with_(mask_mode="custom"), H200).block_n == 128


@pytest.mark.parametrize("window,paged,expected", [
    (256, False, PrefillConfig(64, 64, 4, 3, tma=True)),
    (4096, False, PrefillConfig(64, 64, 4, 3, tma=True)),
    (4097, False, PrefillConfig(128, 128, 8, 3, tma=True)),
    (1024, True, PrefillConfig(64, 64, 4, 3)),
    (2048, True, PrefillConfig(128, 64, 8, 3, tma=True)),  # tma: ignored for paged KV
])
def test_short_windows_take_64x64_tiles_on_sm90(window, paged, expected):
    """Sliding windows up to 4096 keys (ragged, TMA) or under 2048 (paged, pages under 64 keys)
    take 64x64 tiles on 4 warps on the H200 (measured faster there); longer windows, other GPUs,
    a custom mask and ragged rows without TMA (RoPE) keep the default tiles."""
    changes = dict(op="prefill_paged", page_size=16) if paged else {}
    problem = problem_128(mask_mode="causal", window_left=window, **changes)
    assert default_config(problem, H200) == expected
    assert default_config(problem.with_(window_left=-1), H200).block_m == 128
    assert default_config(problem, A100).block_m == 128
    assert default_config(problem.with_(mask_mode="custom"), H200).block_m == 128
    if paged:
        assert default_config(problem.with_(page_size=64), H200).block_m == 128  # 64-key pages: not measured
    else:
        assert default_config(problem.with_(pos_encoding_mode="ROPE_LLAMA"), H200).block_m == 128


@pytest.mark.parametrize("qo_lens,mask_mode,expected_m", [([4096], "causal", 64), ([4096], "none", 64),
                                                          ([2048, 2048, 1], "causal", 64), ([8192], "causal", 64),
                                                          ([8192, 1], "causal", 128), ([4096] * 2 + [1], "none", 128),
                                                          ([16384], "causal", 128)])
def test_small_ragged_prefills_take_64x64_tiles_on_sm90(qo_lens, mask_mode, expected_m):
    """Ragged prefills with TMA loads and at most 2048 query tiles of 128 rows (x query heads)
    take 64x64 tiles on the H200; more tiles, CUDA graphs (lengths change after capture), other
    GPUs and a plan without lengths keep 128x128."""
    problem = problem_128(mask_mode=mask_mode, num_qo_heads=32, num_kv_heads=8)
    cfg = default_config(problem, H200, qo_lens)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.tma) == \
        ((64, 64, 4, True) if expected_m == 64 else (128, 128, 8, True))
    assert default_config(problem.with_(use_cuda_graph=True), H200, qo_lens).block_m == 128
    assert default_config(problem, A100, qo_lens).block_m == 128
    assert default_config(problem, H200).block_m == 128
    # TMA-less ragged (RoPE), paged KV and custom masks keep their tiles
    assert default_config(problem.with_(pos_encoding_mode="ROPE_LLAMA"), H200, qo_lens).block_m == 128
    assert default_config(problem.with_(op="prefill_paged", page_size=16), H200, qo_lens).block_m == 128
    assert default_config(problem.with_(mask_mode="custom"), H200, qo_lens).block_m == 128


def test_plan_prefill_passes_the_query_lengths_to_the_default():
    """plan_prefill picks the tiles from the request lengths: a small ragged problem planned for a
    described H200 (CPU tensors) gets the 64x64 TMA tiles, a large one 128x128."""
    for qo_lens, block_m in (([300, 77], 64), ([8192, 8192], 128)):
        case = make_ragged_case(qo_lens=qo_lens, kv_lens=qo_lens, head_dim_qk=128, num_qo_heads=32,
                                num_kv_heads=8, q_dtype=torch.float16, mask_mode="causal")
        plan = plan_prefill(case.problem, H200, case.params)
        assert (plan.config.block_m, plan.config.tma) == (block_m, True)


@pytest.mark.parametrize("cc", [(8, 6), (8, 9), (12, 0)])
@pytest.mark.parametrize("head_dim,changes,expected", [
    (128, {"mask_mode": "causal"}, PrefillConfig(128, 64, 8, 3)),
    (128, {"mask_mode": "custom"}, PrefillConfig(128, 64, 8, 3)),
    (128, {"pos_encoding_mode": "ROPE_LLAMA"}, PrefillConfig(128, 64, 8, 2)),
    (192, {"pos_encoding_mode": "ROPE_LLAMA"}, PrefillConfig(128, 32, 8, 2)),
    (192, {}, PrefillConfig(128, 64, 8, 2)),
    (256, {"pos_encoding_mode": "ROPE_LLAMA"}, PrefillConfig(64, 32, 4, 2)),
])
def test_small_shared_memory_gpus_get_smaller_tiles(cc, head_dim, changes, expected):
    """GPUs with 99 KB of shared memory per block (sm86, sm89, sm120) get tiles that fit there;
    the H200 defaults need 160 KB at d128 on those GPUs' pipeliner. The device's own figure
    decides where it gives one, the compute capability where not."""
    problem = problem_128(head_dim_qk=head_dim, head_dim_vo=128 if head_dim == 192 else head_dim, **changes)
    assert default_config(problem, Device("cuda", 0, cc, "gpu", 60)) == expected
    assert default_config(problem, Device("cuda", 0, cc, "gpu", 60, shared_per_block=SM86_SHARED)) == expected
    assert default_config(problem, Device("cuda", 0, (8, 0), "A100", 108, shared_per_block=166912)) == \
        default_config(problem, A100)
    assert default_config(problem, Device("cuda", 0, (8, 0), "sm80 with less", 108,
                                          shared_per_block=SM86_SHARED)) == expected


@pytest.mark.parametrize("head_dim,tiles,rope,mask", [(128, "128,64,8,3", False, "custom"),
                                                      (128, "128,64,8,2", True, "custom"),
                                                      (192, "128,32,8,2", True, "causal"),
                                                      (256, "64,32,4,2", True, "causal")])
def test_small_shared_memory_tiles_fit_in_99_kb(head_dim, tiles, rope, mask):
    """The configs above compiled offline for sm86 (no GPU needed) use at most 99 KB of shared
    memory, the largest variant of each (a custom mask's bitmaps, RoPE's rotation of K)."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "prefill_tma_compile.py"), "--cc", "86",
           "--head-dim", str(head_dim), "--tiles", tiles, "--masks", mask, "--no-ptxas"] + (["--rope"] if rope else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(mask)]
    assert len(rows) == 1 and rows[0][1] == "False"
    assert 0 < int(rows[0][2]) <= SM86_SHARED


def test_e4m3_kv_is_refused_before_sm89():
    """Triton converts float8_e4m3fn from sm89 on only: fa2 says so on sm80/sm86 (e5m2 runs), in
    the dispatcher's checks and when planned directly."""
    for op in ("decode", "prefill_ragged"):
        problem = problem_128(op=op, kv_dtype=torch.float8_e4m3fn)
        reasons = FA2Backend.extra_checks(problem, A100)
        assert [r.code for r in reasons] == ["dtype.fp8"] and "sm_80" in reasons[0].detail
        assert not FA2Backend.extra_checks(problem, L4)
        assert not FA2Backend.extra_checks(problem, H200)
        assert not FA2Backend.extra_checks(problem.with_(kv_dtype=torch.float8_e5m2), A100)
    case = make_paged_case("decode", kv_lens=[40, 7], kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16)
    with pytest.raises(Unsupported, match="float8_e4m3fn KV on sm_86"):
        plan_decode(case.problem, A10, case.params)


def test_fp8_decode_tiles_follow_the_shared_memory():
    """The sm90 fp8 decode tiles (50-52 KB) fit 1-3 programs per SM on GPUs with less shared
    memory: those take 32 x 3 tiles (d <= 128) or 2 warps of 16 x 3 (d256), split for the
    programs that fit (at most 8 per SM), V staged before sm89 too (e5m2 by byte permutes)."""
    def config(device, head_dim=128, kv_dtype=torch.float8_e5m2):
        case = make_paged_case("decode", kv_lens=[40, 7], kv_dtype=kv_dtype, q_dtype=torch.float16,
                               head_dim_qk=head_dim, num_qo_heads=4, num_kv_heads=2)
        return resolve_config(case.problem, None, shared_per_block(device))

    sm90 = config(H200)
    assert (sm90.block_n, sm90.num_stages, sm90.ctas_per_sm) == (64, 3, 4)
    for device, fits in ((A10, 3), (A100, 6), (L4, 3)):
        cfg = config(device, kv_dtype=torch.float8_e4m3fn if device is L4 else torch.float8_e5m2)
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.ctas_per_sm) == (32, 1, 3, fits), device
        assert cfg.fp8_v_convert == "staged" and cfg.direct_table and not cfg.wave_tiles
    d256 = config(L4, head_dim=256)
    assert (d256.block_n, d256.num_warps, d256.num_stages, d256.ctas_per_sm) == (16, 2, 3, 3)
    assert config(A100, head_dim=64).ctas_per_sm == 8 and not config(A100, head_dim=64).direct_table
    # the device's own figure wins over its compute capability; 16-bit KV keeps its tiles
    assert config(dataclasses.replace(A10, shared_per_block=232448)) == sm90
    case = make_paged_case("decode", kv_lens=[40, 7], q_dtype=torch.float16)
    assert resolve_config(case.problem, None, shared_per_block(A10)) == resolve_config(case.problem)
    # plans take the device's tiles
    case = make_paged_case("decode", kv_lens=[40, 7], kv_dtype=torch.float8_e5m2, q_dtype=torch.float16,
                           head_dim_qk=128)
    a10 = plan_decode(case.problem, A10, case.params).config
    assert a10.ctas_per_sm == 3 and a10.fp8_v_convert == "staged"
    assert plan_decode(case.problem, H200, case.params).config.ctas_per_sm == 4


@pytest.mark.parametrize("cc, head_dim", [(89, 64), (89, 128), (89, 256), (80, 128)])
def test_small_shared_fp8_tiles_compile_and_fit(cc, head_dim):
    """Offline compile (scripts/decode_registers.py --cc, no GPU) of the small-shared fp8 decode
    defaults: no spills, and at least the programs per SM the config's split aims for fit in the
    shared memory (the config estimates its tile's bytes)."""
    script = os.path.join(ROOT, "scripts", "decode_registers.py")
    res = subprocess.run([sys.executable, script, "--cc", str(cc), "--kv", "e5m2", "--head-dim", str(head_dim)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    ctas = int(re.search(r"ctas_per_sm=(\d+)", res.stdout).group(1))
    rows = [line[24:].split() for line in res.stdout.splitlines()[2:]]
    assert len(rows) == 3 and ctas >= 3, res.stdout
    for _, spill, _, per_sm in rows:
        assert int(spill) == 0 and int(per_sm) >= ctas, res.stdout


def test_sass_loop_mix_finds_the_token_loop():
    """scripts/decode_registers.py --sass (offline sm90 compile and the bundled nvdisasm, no GPU):
    each variant's line is followed by its longest loop's instruction mix, and that loop is the
    token loop: fp8 d64's 64-token step converts 64 x 64 K values and as many V values to fp16,
    two values an instruction over its one warp's 32 threads (at least 128 F2FP a thread), and
    runs its dots' HMMAs."""
    script = os.path.join(ROOT, "scripts", "decode_registers.py")
    res = subprocess.run([sys.executable, script, "--kv", "e4m3", "--head-dim", "64", "--sass"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()[2:]
    loops = [dict((op, int(n)) for op, n in (item.split() for item in line.split(": ", 2)[2].split(", ")))
             for line in lines[1::2]]
    assert len(lines) == 2 * len(loops) >= 6 and all(line.startswith("  loop: ") for line in lines[1::2]), res.stdout
    for mix in loops:
        assert mix["F2FP"] >= 64 * 64 * 2 // 32 // 2 and mix["HMMA"] > 0, res.stdout


def test_rope_plans_run_the_rope_tile():
    """16-bit d128 GQA RoPE decode plans (described H200, no launch) run DecodeConfig.rope_block_n,
    capped at rope_max_registers, past one wave of programs, and rope_split_block_n, capped at
    rope_split_max_registers, under it, split or not; plain plans are unchanged."""
    from test_fa2_decode_waves import _h200_plan
    from flashdispatch.backends.fa2.decode_variant import register_cap

    def tile(lens, config=None, **problem):
        plan, _ = _h200_plan(lens, torch.bfloat16, config=config, **problem)
        return plan.config.block_n, register_cap(plan.problem, plan.config, plan.block_m, plan.fused_merge)

    rope = dict(pos_encoding_mode="ROPE_LLAMA")
    for lens in ([1024] * 256, [2048] * 128, [4096] * 256):  # past one wave
        assert tile(lens, **rope) == (64, 128), lens
    for lens in ([4096] * 64, [300] * 4, [32768]):  # under it: unsplit, too short to split, split
        assert tile(lens, **rope) == (32, 88), lens
    assert tile([32768], {"rope_split_max_registers": 0}, **rope) == (32, 0)
    assert tile([1024] * 256, {"rope_max_registers": 0}, **rope) == (64, 0)
    assert tile([1024] * 256, {"rope_block_n": 0}, **rope) == (32, 0)  # the config's block, its cap reset
    assert tile([1024] * 256, {"rope_block_n": 32, "rope_max_registers": 96}, **rope) == (32, 96)
    assert tile([32768], {"rope_split_block_n": 16, "rope_split_max_registers": 80}, **rope) == (16, 80)
    assert tile([32768], {"rope_split_block_n": 0}, **rope) == (64, 0)  # likewise the split block
    capped = {"max_registers": 64}
    assert tile([4096] * 64, capped) == (64, 0) and tile([1024] * 256, capped) == (32, 64)
    # a fused merge, a soft cap and speculative rows are other variants: uncapped
    assert tile([8192] * 16, **rope) == (32, 0)
    assert tile([32768], logits_soft_cap=30.0, **rope)[1] == 0
    assert tile([32768], q_len_per_req=2, mask_mode="causal", **rope)[1] == 0
    # other head dims and fp8 KV keep their own tiles under RoPE
    assert resolve_config(_problem(torch.bfloat16, 256), None).rope_block_n == 0
    assert resolve_config(_problem(torch.float8_e4m3fn, 128), None).rope_block_n == 0


def _problem(kv_dtype, head_dim):
    from flashdispatch.dispatch.problem import Problem
    return Problem("decode", torch.bfloat16, kv_dtype, torch.bfloat16, 32, 8, head_dim, head_dim, page_size=16,
                   pos_encoding_mode="ROPE_LLAMA")


def test_rope_register_cap_compiles_without_spills():
    """Offline sm90 compile (scripts/decode_registers.py --rope, no GPU) of the RoPE decode default:
    the split block capped at 88 fits 5 programs per SM (3 uncapped), spilling at most 16 bytes in
    the direct split; the 64-key block capped at 128 fits 4 (3 uncapped), spilling at most 48."""
    script = os.path.join(ROOT, "scripts", "decode_registers.py")
    res = subprocess.run([sys.executable, script, "--rope"], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line[:24].strip(): [int(v) for v in line[24:].split()] for line in res.stdout.splitlines()[2:]}
    regs, spill, _, per_sm = rows["direct split, cap 88"]
    assert regs <= 88 and spill <= 16 and per_sm == 5, res.stdout
    assert rows["direct split"][3] == 3 and rows["work array"][3] == 3, res.stdout
    for variant in ("work array, cap 128", "direct table, cap 128"):
        regs, spill, _, per_sm = rows[variant]
        assert regs <= 128 and spill <= 48 and per_sm == 4, res.stdout
    assert "work array, cap 88" not in rows and "direct table, cap 88" not in rows, res.stdout
