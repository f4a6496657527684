"""CPU tests of the bench command's refusals: every bad option, shape past the row limits,
unwritable output path or unreadable summary input gives one ``bench: ...`` line on stderr
and exit 2, before any work, allocation or hang."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from flashdispatch.bench import __main__ as bench_main
from flashdispatch.bench import decode, prefill, report


def run(argv, capsys):
    """``python -m flashdispatch.bench ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        rc = bench_main.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc, err, *needles):
    assert rc == 2, err
    assert err.startswith("bench: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def cli(*argv, timeout=60):
    """``python -m flashdispatch bench ARGV`` in a child limited to 8 GiB of address space."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    return subprocess.run([sys.executable, "-m", "flashdispatch", "bench", *argv], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limit)


# --- shapes past the row limits -------------------------------------------------------------

def test_huge_prefill_shape_is_refused_not_counted_forever():
    r = cli("prefill", "--dry-run", "--shapes", "99999999999")
    assert_refused(r.returncode, r.stderr, "--shapes", "'99999999999'", "kv_len 99999999999 > 2147483647")
    assert r.stdout == ""


def test_huge_decode_batch_is_refused_before_allocating():
    r = cli("decode", "--dry-run", "--shapes", "99999999999x1")
    assert_refused(r.returncode, r.stderr, "--shapes", "batch 99999999999 > 1048576")


@pytest.mark.parametrize("kind,shape,needle", [
    ("decode", "1x99999999999999999999", "kv_len 99999999999999999999 > 2147483647"),
    ("decode", "1048577x1", "batch 1048577 > 1048576"),
    ("decode", "1048576x2048", "KV cache slots (pages x page size) 2147483648 > 2147483647"),
    ("decode", "1000x1000000:var", "KV cache bytes"),
    ("decode", "64x4096,1x2147483648:fp8", "'1x2147483648:fp8'"),
    ("prefill", "1/3000000000", "kv_len 3000000000 > 2147483647"),
    ("prefill", "2000000x1/1", "batch 2000000 > 1048576"),
    ("prefill", "65536x32768", "query tokens 2147483648 > 2147483647"),
    ("prefill", "2x1/2000000000", "KV cache slots 4000000000 > 2147483647"),
    ("prefill", "50000:mask", "mask bits 2500000000 > 2147483647"),
    ("prefill", "1000x100000", "q, k and v bytes (heads 32/8, head dim 128)"),
])
def test_shapes_past_the_limits(kind, shape, needle, capsys):
    rc, out, err = run([kind, "--dry-run", "--no-peer", "--backends", "fa2", "--shapes", shape], capsys)
    assert_refused(rc, err, f"bench: --shapes: {kind} shape", needle)
    assert out == ""


def test_the_largest_rows_inside_the_limits_still_parse():
    assert decode.parse_decode_shapes("1048576x2032,1x2147483632", heads=(1, 1), head_dim=8)[0].batch == 2**20
    rows = prefill.parse_prefill_shapes("46340:mask,1x2147483632/2147483632:nc", heads=(1, 1), head_dim=8)
    assert rows[1].qo_len == 2**31 - 16
    with pytest.raises(ValueError, match="head dim 1048576"):
        decode.parse_decode_shapes("64x4096", head_dim=2**20)


def test_visible_pairs_closed_form_and_its_domain():
    n = 10**5
    assert prefill.visible_pairs(n, n, causal=True) == n * (n + 1) // 2
    assert prefill.visible_pairs(n, n, causal=True, window_left=0) == n
    with pytest.raises(ValueError, match="kv_len=3 < qo_len=4"):
        prefill.visible_pairs(4, 3, causal=True)


# --- options ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("argv,needle", [
    (["--reps", "0"], "--reps=0: expected 1 .. 10000"),
    (["--reps", "-5"], "--reps=-5: expected 1 .. 10000"),
    (["--reps", "10001"], "--reps=10001"),
    (["--head-dim", "0"], "--head-dim=0: expected >= 1"),
    (["--head-dim", "-128"], "--head-dim=-128: expected >= 1"),
    (["--page-size", "0"], "--page-size=0: expected 1 .. 2147483647"),
    (["--page-size", "-16"], "--page-size=-16"),
    (["--page-size", "99999999999999999999999"], "--page-size=99999999999999999999999"),
    (["--seed", "-1"], "--seed=-1: expected 0 .. 18446744073709551615"),
    (["--backends", ","], "--backends: no names"),
    (["--peers", " , "], "--peers: no names"),
])
def test_bad_options_are_refused_up_front(kind, argv, needle, capsys):
    rc, out, err = run([kind, "--dry-run", *argv], capsys)
    assert_refused(rc, err, needle)
    assert out == ""


def test_bad_heads_name_the_option_and_the_rule(capsys):
    rc, _, err = run(["decode", "--dry-run", "--heads", "32/5"], capsys)
    assert rc == 2 and "argument --heads: heads='32/5': query heads must be a positive multiple" in err


def test_unwritable_output_paths_are_refused_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [("--json", tmp_path / "missing" / "r.json", "does not exist"),
             ("--plot", afile / "p.png", "does not exist"),
             ("--json", tmp_path, "expected a file path, not a directory"),
             ("--plot", f"{tmp_path}{os.sep}", "expected a file path")]
    if os.path.isdir("/proc"):
        cases.append(("--json", "/proc/r.json", "not writable"))
    for option, path, needle in cases:
        rc, out, err = run(["decode", "--dry-run", option, str(path)], capsys)
        assert_refused(rc, err, f"bench: {option}={str(path)!r}", needle)
        assert out == ""
    # without --dry-run too: the path is refused before the GPU (or its absence) is looked at
    rc, _, err = run(["prefill", "--json", str(tmp_path / "missing" / "r.json")], capsys)
    assert_refused(rc, err, "--json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc, _, err = run(["decode", "--dry-run", "--plot", str(ro / "p.png")], capsys)
    finally:
        ro.chmod(0o700)
    assert_refused(rc, err, "--plot", "not writable")


def test_writable_paths_pass_and_leave_nothing_behind(tmp_path, capsys):
    rc, out, _ = run(["decode", "--dry-run", "--no-peer", "--backends", "fa2", "--shapes", "2x16",
                      "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")], capsys)
    assert rc == 0 and "1 rows x 1 columns" in out
    assert list(tmp_path.iterdir()) == []


# --- summary ------------------------------------------------------------------------------

def test_summary_of_unreadable_or_invalid_files_fails_on_stderr(tmp_path, capsys):
    bad = {"missing.json": None, "text.json": "not json", "list.json": "[]", "partial.json": '{"kind": "decode"}',
           "shapes.json": json.dumps(dict(kind="decode", unit="TB/s", ceiling_name="copy", ceiling=None,
                                          ratio_refs={}, shapes=[1], columns=["fd:fa2"]))}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        rc, out, err = run(["summary", str(tmp_path / name)], capsys)
        assert_refused(rc, err, f"bench: summary: {tmp_path / name}: cannot read report")
        assert out == ""
    assert report.main([str(tmp_path)]) == 2 and "IsADirectoryError" in capsys.readouterr().err


def test_summary_prints_the_good_files_and_fails_for_the_bad(tmp_path, capsys):
    good = tmp_path / "good.json"
    report.Report("decode", "TB/s", "copy", 4.0, {}, shapes=["1x16"], columns=["fd:fa2"],
                  cells=[report.Cell("1x16", "fd:fa2", ms=0.01, rate=1.5)]).save_json(str(good))
    r = cli("summary", str(tmp_path / "missing.json"), str(good))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"bench: summary: {tmp_path / 'missing.json'}: cannot read report")
    assert f"== {good}" in r.stdout and "1.50" in r.stdout
    assert report.main([str(good)]) == 0
