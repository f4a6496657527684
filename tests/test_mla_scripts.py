"""scripts/sweep_mla.py on the CPU (Triton interpreter: every cell checked against the reference,
exit 1 where one is off) and scripts/mla_registers.py (an offline sm90 compile: no GPU needed)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _run(script: str, *argv: str, interpret: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else {k: v for k, v in os.environ.items()
                                                                     if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPTS / script), *argv], capture_output=True, text=True,
                          timeout=300, check=False, env=env)


@pytest.mark.parametrize("tol, status", [("4e-3", 0), ("1e-9", 1)])
def test_sweep_checks_every_cell(tol, status):
    res = _run("sweep_mla.py", "--device", "cpu", "--shapes", "2x300:p16,1x40", "--heads", "4", "--head-dim", "64",
               "--dtype", "fp16", "--reps", "1", "--tol", tol, "--grid", '{"block_n": [16]}', interpret=True)
    assert res.returncode == status, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith(("default", '{"block_n": 16}'))]
    assert len(rows) == 2 and all(("!" in row) == bool(status) for row in rows), res.stdout


def test_offline_compile_reports_registers_and_the_key_loop():
    res = _run("mla_registers.py", "--heads", "16", "--ckv", "64", "--kpe", "16", interpret=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    row = res.stdout.splitlines()[-1].split()
    assert row[0] == "16" and int(row[5]) > 0 and "HMMA" in res.stdout.splitlines()[-1], res.stdout
