"""scripts/sweep_decode.py on the CPU (Triton interpreter): mixed-length rows (one with a long
request) in another order, two configs over two rounds, every result checked against its dense
reference (the script exits non-zero where one is off), out alone and with lse; --grid's configs
with and without the default row."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sweep_decode.py"


@pytest.mark.parametrize("lse", [[], ["--lse"]], ids=["out", "lse"])
def test_sweep_checks_mixed_lengths_in_rounds(lse):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--shapes", "2x32,5x40:var,3x16:long", "--heads", "4,2",
         "--head-dim", "64", "--q-dtype", "fp16", "--kv", "fp16", "--reps", "1", "--rounds", "2",
         "--order", "interleaved", "--grid", '[{"block_n": 16}]', *lse],
        capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    table = res.stdout[res.stdout.index("TB/s of KV read"):]
    assert "median of 2 round(s)" in table and "5x40:var" in table.splitlines()[1]
    rows = [line for line in table.splitlines() if line.startswith(("default", '{"block_n": 16}'))]
    assert len(rows) == 2 and not any("!" in row or "ERR" in row for row in rows), table
    assert "BEST 5x40:var:" in table and "BEST 2x32:" in table and "BEST 3x16:long:" in table


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grid_keeps_an_explicit_default_row_without_the_added_one():
    grid = _sweep_module().config_grid
    assert grid('[{}, {"block_n": 16}]', with_default=False) == [{}, {"block_n": 16}]
    assert grid('[{}, {"block_n": 16}]', with_default=True) == [{}, {"block_n": 16}]
    assert grid('{"block_n": [16, 32]}', with_default=True) == [{}, {"block_n": 16}, {"block_n": 32}]
    assert grid('{"block_n": [16, 32]}', with_default=False) == [{"block_n": 16}, {"block_n": 32}]
