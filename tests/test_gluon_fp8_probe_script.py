"""scripts/gluon_fp8_decode_probe.py --offline: the Gluon fp8 decode compiles for sm90 (no GPU
needed) into a token loop without spills, as the script reports it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "gluon_fp8_decode_probe.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          check=False)


def test_offline_compile_reports_registers_and_loops():
    res = _run("--offline", "--stages", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r"sm90, 3 stages: (\d+) registers, (\d+) B spilled, (\d+) B shared", res.stdout)
    assert found, res.stdout
    regs, spilled, shared = map(int, found.groups())
    assert 0 < regs <= 255 and spilled == 0, res.stdout
    assert shared >= 3 * 8192, res.stdout  # three stages of a K and a V tile, 4 KB each
    loops = [int(n) for n in re.findall(r"loop of (\d+) instructions: .*HMMA 32", res.stdout)]
    assert loops, res.stdout  # each token loop issues the two dots' 32 mma.sync a tile


def test_one_stage_is_a_usage_error():
    res = _run("--offline", "--stages", "1")
    assert res.returncode == 2 and "--stages 1" in res.stderr
