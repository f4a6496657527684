"""scripts/paged_read_probe.py on the CPU (Triton interpreter): the static and the work-stealing
bare reads sum exactly the pages each (chunk, head) owns (the script checks against torch and
exits non-zero on a mismatch); the inline-PTX modes refuse to run there."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "paged_read_probe.py")


@pytest.mark.parametrize("mode, extra", [("ptr", ["--group", "1,2"]), ("steal", ["--unit-pages", "2,4"])])
def test_probe_sums_match_torch(mode, extra):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, SCRIPT, mode, "--check-small", "--block-pages", "1,2", *extra],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if "max rel err" in line]
    assert len(lines) == 4, res.stdout


@pytest.mark.parametrize("mode", ["ptr+pf", "ptr+pfpage", "ptr+touch"])
def test_prefetch_modes_say_they_need_a_gpu(mode):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, SCRIPT, mode, "--check-small"], capture_output=True, text=True,
                         timeout=600, check=False, env=env)
    assert res.returncode != 0 and "needs a GPU" in res.stderr, (res.returncode, res.stderr[-2000:])
