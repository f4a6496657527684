"""The differential fuzzers under scripts/ (fa2 against the reference on random sessions) still
run: a few seeds of each on the CPU, every compared case within tolerance."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script", ["fuzz_decode.py", "fuzz_prefill.py"])
def test_fuzzer_runs_and_finds_nothing(script, tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPTS / script), "--minutes", "0.2", "--start", "0",
                          "--out", str(tmp_path / "failures.jsonl")], capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failures"] == 0 and summary["compared"] > 0, summary
