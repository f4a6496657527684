"""Which fa2 decode plans take the Gluon fp8 kernel (decode_gluon.py), and the kernel's sm90
compile (no GPU: Gluon has no interpreter, so its numerics are tested on the GPU, in
test_fa2_decode_gluon_gpu.py)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from flashdispatch.backends.fa2 import decode_gluon
from flashdispatch.backends.fa2.decode_config import DecodeConfig, resolve_config
from flashdispatch.backends.fa2.decode_gluon import gluon_stages, programs_per_sm
from flashdispatch.dispatch.problem import Device

from oracle import make_paged_case

H200 = Device("cuda", 0, (9, 0), "NVIDIA H200", 132, shared_per_block=232448)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "gluon_decode_compile.py")


@pytest.fixture
def compiled_gpu(monkeypatch):
    """Plans as a GPU run makes them (the interpreter's run never takes the Gluon kernel)."""
    monkeypatch.setattr(decode_gluon, "TRITON_INTERPRETED", False)


def _stages(kv_lens, device=H200, config=None, params=None, problem=None, **case):
    case.setdefault("num_qo_heads", 32)
    case.setdefault("num_kv_heads", 8)
    case.setdefault("kv_dtype", E4M3)
    c = make_paged_case("decode", kv_lens=kv_lens, head_dim_qk=128, q_dtype=torch.bfloat16, extra_pages=0, **case)
    for name, value in (params or {}).items():
        setattr(c.params, name, value)
    p = dataclasses.replace(c.problem, **(problem or {}))
    return gluon_stages(p, device, c.params, resolve_config(p, config, device.shared_per_block))


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


def test_kernel_compiles_for_sm90_without_spills():
    res = subprocess.run([sys.executable, SCRIPT, "--stages", "2", "--e5m2", "--no-shared-kv"], capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r"sm90, 2 stages: (\d+) registers, (\d+) B spilled, (\d+) B shared", res.stdout)
    assert found, res.stdout
    regs, spilled, shared = map(int, found.groups())
    assert 0 < regs <= 255 and spilled == 0 and shared == 2 * 8192, res.stdout
    assert re.search(r"loop of \d+ instructions: .*HMMA 32", res.stdout), res.stdout  # two dots' 32 mma a tile


def test_compile_script_usage_errors():
    res = subprocess.run([sys.executable, SCRIPT, "--stages", "1"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 2 and "--stages 1" in res.stderr
