"""scripts/ncu_decode.py on the CPU (Triton interpreter, no profiler window): the column's call
matches the reference backend's output on the bench's data, as the script reports it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "ncu_decode.py")


@pytest.mark.parametrize("shape", ["2x40", "3x300:fp8"])
def test_profiled_call_matches_the_reference(shape):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, SCRIPT, "--shape", shape, "--column", "fd:fa2", "--device", "cpu",
                          "--heads", "4/2", "--head-dim", "64", "--dtype", "fp16", "--calls", "2"],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r"selected fa2; max \|out - reference\| (\S+)", res.stdout)
    assert found, res.stdout
    assert float(found.group(1)) < 1e-2, res.stdout
