"""Which fa2 decode plans take the Gluon fp8 kernel (decode_gluon.py) and how they split, a split
plan's partials and merge, and the kernel's sm90 compile (no GPU: Gluon has no interpreter, so
its numerics are tested on the GPU, in test_fa2_decode_gluon_gpu.py)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from flashdispatch.backends.fa2 import decode_gluon
from flashdispatch.backends.fa2.decode_config import DecodeConfig, resolve_config
from flashdispatch.backends.fa2.decode_gluon import GluonDecodePlan, GluonLayout, gluon_layout, programs_per_sm
from flashdispatch.dispatch.problem import Device

from oracle import assert_close, make_paged_case, reference_backend_result

H200 = Device("cuda", 0, (9, 0), "NVIDIA H200", 132, shared_per_block=232448)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "gluon_decode_compile.py")


@pytest.fixture
def compiled_gpu(monkeypatch):
    """Plans as a GPU run makes them (the interpreter's run never takes the Gluon kernel)."""
    monkeypatch.setattr(decode_gluon, "TRITON_INTERPRETED", False)


def _layout(kv_lens, device=H200, config=None, params=None, problem=None, workspace=128 << 20, **case):
    case.setdefault("num_qo_heads", 32)
    case.setdefault("num_kv_heads", 8)
    case.setdefault("kv_dtype", E4M3)
    c = make_paged_case("decode", kv_lens=kv_lens, head_dim_qk=128, q_dtype=torch.bfloat16, extra_pages=0, **case)
    c.params.workspace = torch.empty(workspace, dtype=torch.uint8)
    for name, value in (params or {}).items():
        setattr(c.params, name, value)
    p = dataclasses.replace(c.problem, **(problem or {}))
    return gluon_layout(p, device, c.params, resolve_config(p, config, device.shared_per_block))


def _stages(kv_lens, **kw):
    """The stages of an unsplit Gluon layout; 0 where the Triton kernel plans."""
    layout = _layout(kv_lens, **kw)
    assert layout is None or layout.splits == 1, layout
    return layout.stages if layout else 0


def test_programs_per_sm_by_shared_memory():
    # 227 KB a block + 1 KB reserved a block: 16 KB + 1 KB, 24 + 1, 32 + 1 a program
    assert [programs_per_sm(s, 232448) for s in (2, 3, 4)] == [13, 9, 6]


@pytest.mark.usefixtures("compiled_gpu")
@pytest.mark.parametrize("batch,stages", [(48, 4), (99, 4), (100, 3), (148, 3), (149, 2), (214, 2), (215, 0),
                                          (41, 0)])
def test_stages_are_the_most_whose_programs_fit_at_once(batch, stages):
    # 8 KV heads: 6 x 132 programs fit at 4 stages, 9 x 132 at 3, 13 x 132 at 2; under 2.5 a SM: none
    assert _stages([33] * batch) == stages


@pytest.mark.usefixtures("compiled_gpu")
def test_lengths_within_the_fill_of_the_longest():
    assert _stages([96] * 47 + [105]) == 4  # mean / longest 0.914
    assert _stages([64, 128] * 24) == 0  # 0.75: mixed lengths keep the Triton plans' balancing
    assert _stages([0] * 48) == 4  # no tokens: each program writes its zeros and -inf


@pytest.mark.usefixtures("compiled_gpu")
@pytest.mark.parametrize("change", [
    dict(kv_dtype=torch.bfloat16), dict(device=Device("cuda", 0, (8, 9), "NVIDIA L40S", 142)),
    dict(device=Device("cuda", 0, (10, 0), "NVIDIA B200", 148)), dict(num_qo_heads=8),
    dict(num_qo_heads=128), dict(page_size=32), dict(config={"gluon_fp8_stages": 0}),
    dict(params={"fixed_split_size": 64}), dict(params={"disable_split_kv": True}),
    dict(problem={"use_cuda_graph": True}), dict(problem={"window_left": 10}),
    dict(problem={"logits_soft_cap": 30.0}), dict(problem={"pos_encoding_mode": "ALIBI"}),
    dict(problem={"sinks": True}), dict(problem={"q_len_per_req": 2}),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_what_keeps_the_triton_kernel(change):
    assert _stages([33] * 48, **change) == 0


@pytest.mark.usefixtures("compiled_gpu")
def test_e5m2_and_a_configured_stage_count():
    assert _stages([33] * 48, kv_dtype=E5M2) == 4
    assert _stages([33] * 48, config={"gluon_fp8_stages": 3}) == 3
    assert _stages([33] * 214, config={"gluon_fp8_stages": 2}) == 2
    assert _stages([33] * 48, num_qo_heads=16) == 4  # group 2


@pytest.mark.usefixtures("compiled_gpu")
def test_a_triton_without_the_kernel_keeps_the_triton_kernel(monkeypatch):
    assert decode_gluon._kernel_importable()  # Triton 3.6 here
    monkeypatch.setattr(decode_gluon, "_kernel_importable", lambda: False)
    assert _stages([33] * 48) == 0


def test_the_interpreter_never_takes_it():
    assert _stages([33] * 48) == 0


@pytest.mark.parametrize("value", [1, -2, 9, 2.0, True])
def test_config_stages_checked(value):
    with pytest.raises(ValueError, match="gluon_fp8_stages must be -1, 0 or 2-8"):
        DecodeConfig(gluon_fp8_stages=value)


@pytest.mark.parametrize("value", [-1, 2.0, True, None])
def test_config_split_tokens_checked(value):
    with pytest.raises(ValueError, match="gluon_fp8_split_tokens must be an int >= 0"):
        DecodeConfig(gluon_fp8_split_tokens=value)


SPLIT = {"gluon_fp8_split_tokens": 256}


@pytest.mark.usefixtures("compiled_gpu")
def test_split_is_off_by_default():
    assert _layout([4096] * 16) is None
    assert _layout([2048, 4096] * 24) is None


@pytest.mark.usefixtures("compiled_gpu")
@pytest.mark.parametrize("lens,layout", [
    ([4096] * 48, (4, 2, 64)),       # 384 programs, 792 fit at 4 stages: 2 chunks of 2048 tokens
    ([8192] * 16, (4, 6, 43)),       # 128 programs: 6 chunks of 43 tiles (the last 41)
    ([32768], (4, 94, 11)),          # 8 programs: 99 fit, chunks of 11 tiles: 94 of them
    ([1024] * 16, (4, 4, 8)),        # chunks no shorter than 256 tokens
    ([2048, 4096] * 24, (4, 2, 64)),  # mixed lengths: chunks of the longest
    ([4000, 4096] * 32, (4, 1, 0)),  # over half a wave (512 of 792), equal enough: the whole requests
])
def test_split_layouts(lens, layout):
    assert _layout(lens, config=SPLIT) == GluonLayout(*layout)


@pytest.mark.usefixtures("compiled_gpu")
def test_split_configured_stages_fill_their_wave():
    # 2 stages: 13 x 132 programs fit, 1716 // 128 = 13 chunks of ceil(256 / 13) = 20 tiles
    assert _layout([8192] * 16, config={**SPLIT, "gluon_fp8_stages": 2}) == GluonLayout(2, 13, 20)


@pytest.mark.usefixtures("compiled_gpu")
@pytest.mark.parametrize("lens,kw", [
    ([200] * 16, {}),                              # under two chunks of 256 tokens
    ([32768] + [32] * 15, {}),                     # chunks of the longest idle most of the grid
    ([8192] * 16, {"workspace": 1 << 20}),         # the partials (6 x 16 x 32 x 129 x 4 B) do not fit
    ([8192] * 16, {"config": {**SPLIT, "gluon_fp8_stages": 0}}),
    ([8192] * 16, {"params": {"fixed_split_size": 64}}),
])
def test_what_keeps_a_split_on_the_triton_kernel(lens, kw):
    kw.setdefault("config", SPLIT)
    assert _layout(lens, **kw) is None


def _split_plan(kv_lens, layout, seed=0):
    """An fp16-KV case and a GluonDecodePlan of ``layout`` on it (CPU: its run() cannot launch the
    kernel, but its partials and merge are real)."""
    case = make_paged_case("decode", kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                           q_dtype=torch.float16, seed=seed)
    case.params.workspace = torch.zeros(1 << 22, dtype=torch.uint8)
    return case, GluonDecodePlan(case.problem, case.device, case.params, resolve_config(case.problem), layout)


def _write_partials(case, plan) -> None:
    """Fill the plan's partials as the split kernel writes them: row request x splits + chunk, the
    chunk's softmax-normalised output over its tokens and their base-2 lse (0 and -inf past the
    request's end), from the case's cache in float64."""
    p, prm, kv = case.problem, case.params, case.inputs.kv
    splits, chunk = plan.layout.splits, plan.layout.chunk_tiles * 32
    group, heads = p.num_qo_heads // p.num_kv_heads, p.num_qo_heads
    po = plan._po.view(-1, heads, 128)
    plse = plan._plse.view(-1, heads)
    for b, n in enumerate(prm.kv_lens_host):
        pages = prm.kv_indices[prm.kv_indptr[b]:prm.kv_indptr[b + 1]].long()
        k = kv.k[pages].reshape(-1, p.num_kv_heads, 128)[:n].double()
        v = kv.v[pages].reshape(-1, p.num_kv_heads, 128)[:n].double()
        for c in range(splits):
            row = b * splits + c
            kc, vc = k[c * chunk:(c + 1) * chunk], v[c * chunk:(c + 1) * chunk]
            if not len(kc):
                po[row], plse[row] = 0.0, float("-inf")
                continue
            q = case.inputs.q[b].double()
            s = torch.einsum("hd,thd->ht", q, kc.repeat_interleave(group, 1)) * prm.sm_scale * math.log2(math.e)
            m = s.amax(1, keepdim=True)
            w = torch.exp2(s - m)
            po[row] = (torch.einsum("ht,thd->hd", w, vc.repeat_interleave(group, 1)) / w.sum(1, keepdim=True)).float()
            plse[row] = (m[:, 0] + torch.log2(w.sum(1))).float()


def test_split_partials_merge_into_the_reference():
    """The merge of the split plan's partials (laid out as the kernel writes them) is the
    reference's out and lse, empty requests and chunks past a request's end included."""
    case, plan = _split_plan([0, 100, 700, 33, 640], GluonLayout(4, 3, 8), seed=21)
    assert plan._grid == (5 * 3 * 2,) and plan.workspace_bytes > 0
    ref_out, ref_lse = reference_backend_result(case)
    _write_partials(case, plan)
    case.inputs.out.fill_(float("nan"))
    case.inputs.lse.fill_(float("nan"))
    plan._merge(case.inputs.out, case.inputs.lse)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, 1e-3)


SMALL_GPU = Device("cuda", 0, (9, 0), "an sm90 of 8 SMs", 8, shared_per_block=232448)  # 48 programs at 4 stages


def _fp8_params(kv_lens, seed):
    case = make_paged_case("decode", kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                           q_dtype=torch.bfloat16, kv_dtype=E4M3, seed=seed)
    case.params.workspace = torch.zeros(1 << 22, dtype=torch.uint8)
    return case


@pytest.mark.usefixtures("compiled_gpu")
def test_split_plan_and_refresh():
    """plan_decode takes the split layout; a re-plan into the same workspace keeps the plan's
    partials and merge while the new lengths keep its chunk count (only the chunk length and the
    tables change)."""
    from flashdispatch.backends.fa2.decode import plan_decode
    case = _fp8_params([4096, 4096], seed=1)
    plan = plan_decode(case.problem, SMALL_GPU, case.params, SPLIT)
    assert isinstance(plan, GluonDecodePlan) and plan.layout == GluonLayout(4, 12, 11)  # 4 programs x 12 <= 48
    assert plan._grid == (2 * 12 * 2,) and plan._merge.pdl  # the merge launches as the kernel's dependent
    shorter = _fp8_params([3600, 3000], seed=2)  # 113 tiles: still 12 chunks, of 10 tiles
    assert plan.refreshed(SMALL_GPU, shorter.params) is None  # another workspace: the partials are planned afresh
    shorter.params.workspace = None
    assert plan.refreshed(SMALL_GPU, shorter.params) is None
    shorter.params.workspace = case.params.workspace
    again = plan.refreshed(SMALL_GPU, shorter.params)
    assert again is not None and again.layout == GluonLayout(4, 12, 10)
    assert again._merge is plan._merge and again._tables[1] is shorter.params.kv_indices
    assert plan.layout == GluonLayout(4, 12, 11) and plan._tables[1] is case.params.kv_indices
    for lens in ([1024, 1024], [4096] * 3):  # 4 chunks; another batch size
        other = _fp8_params(lens, seed=3)
        other.params.workspace = case.params.workspace
        assert plan.refreshed(SMALL_GPU, other.params) is None


def test_kernel_not_specialised_on_the_cache_or_the_split():
    """run() keeps a call kind's specialisation while the cache (num_pages) may change: the
    kernel must not be compiled for one page count (a one-page cache would make it a constant)."""
    from flashdispatch.backends.fa2.decode_gluon_kernel import fp8_decode_gluon_kernel as kernel
    names = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    assert {"num_pages", "splits", "chunk_tiles"} <= names


def test_kernel_compiles_for_sm90_without_spills():
    res = subprocess.run([sys.executable, SCRIPT, "--stages", "2", "--e5m2", "--no-shared-kv"], capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r"sm90, 2 stages: (\d+) registers, (\d+) B spilled, (\d+) B shared", res.stdout)
    assert found, res.stdout
    regs, spilled, shared = map(int, found.groups())
    assert 0 < regs <= 255 and spilled == 0 and shared == 2 * 8192, res.stdout
    assert re.search(r"loop of \d+ instructions: .*HMMA 32", res.stdout), res.stdout  # two dots' 32 mma a tile


def test_split_kernel_compiles_for_sm90_without_spills():
    res = subprocess.run([sys.executable, SCRIPT, "--stages", "4", "--split"], capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r"sm90, 4 stages: (\d+) registers, (\d+) B spilled", res.stdout)
    assert found and int(found.group(2)) == 0 and 0 < int(found.group(1)) <= 255, res.stdout


def test_compile_script_usage_errors():
    res = subprocess.run([sys.executable, SCRIPT, "--stages", "1"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 2 and "--stages 1" in res.stderr
