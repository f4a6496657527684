"""The differential fuzzers under scripts/ (fa2 against the reference on random sessions) still
run: fixed seeds of each on the CPU, every compared case within tolerance, nothing refused that
the spec did not ask for; the seeds of each hold compared rounds of sessions whose KV cache grows
between rounds (prefill's 91-95: paged, ragged and single sessions, a ragged graph session and
every mask kind too), the decode seeds graph sessions, replayed after re-plans."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script, start, sessions", [("fuzz_decode.py", 14, 5), ("fuzz_prefill.py", 91, 5)])
def test_fuzzer_runs_and_finds_nothing(script, start, sessions, tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPTS / script), "--start", str(start), "--sessions", str(sessions),
                          "--out", str(tmp_path / "failures.jsonl")], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failures"] == 0 and summary["sessions"] == sessions and summary["compared"] > sessions, summary
    if script == "fuzz_decode.py":
        assert summary.get("growth_compared", 0) > 0 and summary.get("graph_replays", 0) > 0, summary
    else:
        assert summary["features"].get("cache_growth", 0) > 0, summary


def test_decode_fuzzer_config_under_every_session():
    """--config's knobs reach every session's spec (a session's own knobs sit on top); bad JSON is
    refused by argparse."""
    def dry(config):
        return subprocess.run([sys.executable, str(SCRIPTS / "fuzz_decode.py"), "--dry-run", "4", "--config", config],
                              capture_output=True, text=True, timeout=120, check=False)
    res = dry('{"gluon_fp8_split_tokens": 256}')
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4 and all("'gluon_fp8_split_tokens': 256" in line for line in lines), lines
    for bad in ("[1]", "{nope"):
        res = dry(bad)
        assert res.returncode == 2 and "--config" in res.stderr, res.stderr


def test_refusal_key_names_each_backends_reasons(monkeypatch):
    """The summary's refusal counts carry the codes of an Unsupported's reasons (why fa2 refused),
    numbers as N; other refusals keep their normalised first line."""
    from flashdispatch import Reason, Unsupported
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import fuzz_common

    e = Unsupported("backend 'fa2' cannot run decode d=32", {
        "fa2": [Reason("head_dim", "(32, 32) not in {(64, 64)}")],
        "cudnn": [Reason("package", "not installed"), Reason("head_dim", "32"), Reason("package", "x")]})
    assert fuzz_common.refusal_key(e) == ("Unsupported: backend 'fa2' cannot run decode d=N"
                                          " | fa2: head_dim; cudnn: head_dim,package")
    plain = ValueError("float_workspace_buffer too small: 12 bytes\nmore")
    assert fuzz_common.refusal_key(plain) == fuzz_common.norm_msg(plain)
    assert fuzz_common.norm_msg(plain) == "ValueError: float_workspace_buffer too small: N bytes"
