"""CPU tests of the benchmark harness: parsing, work formulas, the cell loop with fake
timings, report formatting. Nothing here times anything."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types

import numpy as np
import pytest
import torch

from flashdispatch import bench
import flashdispatch as fd
from flashdispatch.bench import decode, matrix, peers, prefill, report, timing
from flashdispatch.bench.matrix import Column, NotApplicable
from flashdispatch.bench.report import Cell, Report
from flashdispatch.bench.timing import Job, Timing


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


# --- shapes -------------------------------------------------------------------------------

def test_default_decode_shapes_are_the_anchor_matrix_plus_fp8_mha_and_mixed():
    shapes = decode.parse_decode_shapes(decode.DEFAULT_SHAPES)
    anchors = [(1, 32768), (16, 8192), (64, 4096), (128, 2048), (256, 1024), (64, 16384), (256, 4096)]
    plain = [(s.batch, s.kv_len) for s in shapes if not s.mods]
    assert plain == anchors
    assert all((s.qo_heads, s.kv_heads, s.head_dim, s.page_size) == (32, 8, 128, 16) for s in shapes if not s.mods)
    assert any(s.kv_dtype == torch.float8_e4m3fn for s in shapes)
    assert any(s.kv_heads == s.qo_heads == 32 for s in shapes)
    assert [s.label for s in shapes if s.var] == ["48x4096:var", "128x4096:var", "128x4096:var:fp8"]


def test_decode_shape_modifiers_and_labels():
    a, b, c = decode.parse_decode_shapes(" 64x4096, 256X1024:fp8 ,16x8192:mha:e5m2", torch.float16, (16, 4), 64, 32)
    assert (a.batch, a.kv_len, a.qo_heads, a.kv_heads, a.head_dim, a.page_size) == (64, 4096, 16, 4, 64, 32)
    assert a.dtype == a.kv_dtype == torch.float16 and a.label == "64x4096"
    assert b.kv_dtype == torch.float8_e4m3fn and b.dtype == torch.float16 and b.label == "256x1024:fp8"
    assert c.kv_heads == 16 and c.kv_dtype == torch.float8_e5m2 and c.label == "16x8192:mha:e5m2"
    assert a.kv_lens().tolist() == [4096] * 64 and not a.var


@pytest.mark.parametrize("text", ["", "64", "64x", "x4096", "0x16", "4x-1", "64x4096:int4", "axb"])
def test_bad_decode_shapes_name_the_item(text):
    with pytest.raises(ValueError, match="decode shape|no decode shapes"):
        decode.parse_decode_shapes(text)


def test_prefill_shapes_single_paged_and_modifiers():
    s1, s2, s3, s4, s5 = prefill.parse_prefill_shapes("4096,512/8192,16x2048/2048:nc,8x512:w128,64x128/4096:mask")
    assert s1.single and (s1.qo_len, s1.kv_len, s1.causal) == (4096, 4096, True) and s1.label == "4096"
    assert s2.single and (s2.qo_len, s2.kv_len) == (512, 8192)
    assert not s3.single and (s3.batch, s3.qo_len, s3.kv_len, s3.causal) == (16, 2048, 2048, False)
    assert (s4.batch, s4.qo_len, s4.kv_len, s4.window_left) == (8, 512, 512, 128)
    assert s5.custom_mask and s5.pages_per_request == 256 and s5.label == "64x128/4096:mask"


def test_prefill_soft_cap_rows_pass_the_cap_and_skip_the_peers_without_one():
    single, paged = prefill.parse_prefill_shapes("16/40:cap30,2x8/20:nc:cap2.5")
    assert (single.soft_cap, paged.soft_cap, paged.causal) == (30.0, 2.5, False)
    for shape in (single, paged):
        d = prefill.make_prefill_data(dataclasses.replace(shape, qo_heads=4, kv_heads=2, head_dim=64), device="cpu")
        job = prefill.our_column(fd, "reference").build(d)
        if job.plan is not None:
            job.plan()
        got = job.run()
        if shape.single:
            want = fd.single_prefill_with_kv_cache(d.q, d.k, d.v, causal=True, logits_soft_cap=30.0)
            assert torch.equal(got, want)
            assert not torch.equal(got, fd.single_prefill_with_kv_cache(d.q, d.k, d.v, causal=True))
        with pytest.raises(NotApplicable):
            peers.sdpa_job("flash", d)
        with pytest.raises(NotApplicable):
            peers.flex_job(d)


def test_rope_rows_apply_rope_and_skip_the_columns_without_it():
    """``:rope`` rows plan ROPE_LLAMA (decode wrapper, prefill single and paged: the outputs equal
    the API called with it and differ from the row without it); the decode function columns and
    the SDPA / flex peers take no RoPE argument: not applicable."""
    dshape = decode.parse_decode_shapes("3x40:rope", torch.float16, (4, 2), 64)[0]
    assert dshape.rope and dshape.label == "3x40:rope"
    d = decode.make_decode_data(dshape, device="cpu")
    got = _run(decode.our_column(fd, "reference").build(d))
    plain = _run(decode.our_column(fd, "reference").build(dataclasses.replace(d, shape=dataclasses.replace(
        dshape, rope=False))))
    wrapper = fd.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), "NHD")
    wrapper.plan(d.indptr, d.indices, d.last_page_len, 4, 2, 64, 16, pos_encoding_mode="ROPE_LLAMA",
                 q_data_type=torch.float16)
    assert torch.equal(got, wrapper.run(d.q, d.cache)) and not torch.equal(got, plain)
    for name in ("cudnn-fn", "fa2-fn"):
        with pytest.raises(NotApplicable):
            decode.our_column(fd, name).build(d)
    for text in ("16/40:rope", "2x8/20:rope"):
        shape = dataclasses.replace(prefill.parse_prefill_shapes(text)[0], qo_heads=4, kv_heads=2, head_dim=64,
                                    dtype=torch.float16)
        pd = prefill.make_prefill_data(shape, device="cpu")
        got = _run(prefill.our_column(fd, "reference").build(pd))
        plain = _run(prefill.our_column(fd, "reference").build(dataclasses.replace(
            pd, shape=dataclasses.replace(shape, rope=False))))
        assert shape.rope and not torch.equal(got, plain)
        if shape.single:
            assert torch.equal(got, fd.single_prefill_with_kv_cache(pd.q, pd.k, pd.v, causal=True,
                                                                    pos_encoding_mode="ROPE_LLAMA"))
        for peer in (lambda: peers.sdpa_job("flash", pd), lambda: peers.flex_job(pd)):
            with pytest.raises(NotApplicable):
                peer()


def _run(job):
    if job.plan is not None:
        job.plan()
    return job.run()


@pytest.mark.parametrize("text", ["", "0x16", "16/8", "4x", "4096:causal", "4096:w", "4096:wx", "ax4/8", "4096:cap0",
                                  "4096:capx"])
def test_bad_prefill_shapes(text):
    with pytest.raises(ValueError, match="prefill shape|no prefill shapes"):
        prefill.parse_prefill_shapes(text)


def test_heads_parsing():
    assert decode.parse_heads("32/8") == (32, 8)
    for bad in ("32", "32/5", "0/0", "a/b"):
        with pytest.raises(ValueError, match="heads"):
            decode.parse_heads(bad)


# --- work formulas ------------------------------------------------------------------------

def test_kv_bytes_match_anchors_table():
    mb = {s.label: decode.kv_bytes(s) / 1e6 for s in decode.parse_decode_shapes(decode.DEFAULT_SHAPES)}
    assert round(mb["1x32768"]) == 134 and round(mb["16x8192"]) == 537 and round(mb["256x4096"]) == 4295
    assert mb["64x4096:fp8"] * 2 == mb["64x4096"]
    assert mb["64x4096:mha"] == 4 * mb["64x4096"]


def brute_pairs(q, k, causal, w):
    i = torch.arange(q)[:, None] + (k - q)
    j = torch.arange(k)[None, :]
    keep = torch.ones(q, k, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if w >= 0:
        keep &= j >= i - w
    return int(keep.sum())


@pytest.mark.parametrize("q,k", [(1, 1), (5, 5), (3, 17), (16, 16), (7, 40)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("w", [-1, 0, 3, 100])
def test_visible_pairs_against_brute_force(q, k, causal, w):
    assert prefill.visible_pairs(q, k, causal, w) == brute_pairs(q, k, causal, w)


def test_prefill_flops_count_visible_pairs_only():
    s = prefill.parse_prefill_shapes("4096")[0]
    assert prefill.prefill_flops(s) == 4 * 32 * 128 * 4096 * 4097 / 2
    nc = prefill.parse_prefill_shapes("4096:nc")[0]
    assert prefill.prefill_flops(nc) == 4 * 32 * 128 * 4096 * 4096
    mask = prefill.parse_prefill_shapes("8x512/8192:mask")[0]
    causal = prefill.parse_prefill_shapes("8x512/8192")[0]
    assert prefill.prefill_flops(mask) == prefill.prefill_flops(causal)
    pairs = int(prefill.causal_mask(512, 8192, "cpu").sum())
    assert prefill.prefill_flops(causal) == 4 * 32 * 128 * 8 * pairs


def test_causal_mask_is_bottom_right_and_packs_little_endian():
    m = prefill.causal_mask(3, 5, "cpu")
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    bits = torch.rand(13, 7) > 0.5
    want = np.packbits(bits.numpy().reshape(-1), bitorder="little")
    assert prefill.pack_bits_little(bits).numpy().tolist() == want.tolist()


def test_decode_data_page_table_on_cpu():
    s = decode.parse_decode_shapes("3x40:fp8")[0]
    d = decode.make_decode_data(s, device="cpu")
    assert d.cache.shape == (9, 2, 16, 8, 128) and d.cache.dtype == torch.float8_e4m3fn
    assert d.indptr.tolist() == [0, 3, 6, 9] and d.last_page_len.tolist() == [8, 8, 8]
    assert sorted(d.indices.tolist()) == list(range(9)) and d.block_tables.shape == (3, 3)
    k, v = d.hnd()
    assert k.shape == (9, 8, 16, 128) and torch.equal(k[4, 2, 5].float(), d.cache[4, 0, 5, 2].float())


def test_decode_var_lengths_page_table_on_cpu():
    """A ``:var`` row: lengths drawn in 1 .. 2 x kv_len - 1, the same in every call; the CSR table,
    the padded block table and the byte count follow them."""
    s = decode.parse_decode_shapes("12x40:var")[0]
    lens = s.kv_lens()
    assert s.var and s.label == "12x40:var" and np.array_equal(lens, s.kv_lens())
    assert lens.min() >= 1 and lens.max() <= 79 and len(set(lens.tolist())) > 3
    d = decode.make_decode_data(s, device="cpu")
    pages = -(-lens // 16)
    assert d.indptr.tolist() == [0, *pages.cumsum().tolist()]
    assert d.last_page_len.tolist() == (lens - (pages - 1) * 16).tolist() and d.seq_lens.tolist() == lens.tolist()
    assert d.block_tables.shape == (12, pages.max()) and d.max_kv_len == lens.max()
    for b in range(12):
        row = d.block_tables[b].tolist()
        assert row[:pages[b]] == d.indices[d.indptr[b]:d.indptr[b + 1]].tolist() and set(row[pages[b]:]) <= {0}
    assert decode.kv_bytes(s) == lens.sum() * 8 * 128 * 2 * 2
    assert decode.kv_bytes(decode.parse_decode_shapes("12x40")[0]) == 12 * 40 * 8 * 128 * 2 * 2


def test_prefill_data_on_cpu():
    single = prefill.make_prefill_data(prefill.parse_prefill_shapes("16/40:mask")[0], device="cpu")
    assert single.q.shape == (16, 32, 128) and single.k.shape == (40, 8, 128) and single.mask.shape == (16, 40)
    paged = prefill.make_prefill_data(prefill.parse_prefill_shapes("2x8/20")[0], device="cpu")
    assert paged.cache.shape == (4, 2, 16, 8, 128) and paged.q.shape == (16, 32, 128)
    assert paged.qo_indptr.tolist() == [0, 8, 16] and paged.last_page_len.tolist() == [4, 4]


# --- arguments ----------------------------------------------------------------------------

def test_parser_defaults_per_kind():
    d = parse(["decode"])
    assert d.bench_kind == "decode" and d.reps == 50 and d.shapes == decode.DEFAULT_SHAPES
    assert d.heads == (32, 8) and d.dtype == "bf16" and not d.no_peer and d.backends is None
    p = parse(["prefill", "--peer-fa3", "--backends", "fa2, cudnn", "--reps", "7", "--json", "x.json"])
    assert p.reps == 7 and p.peer_fa3 and p.backends == ["fa2", "cudnn"] and p.json == "x.json"
    with pytest.raises(SystemExit):
        parse(["decode", "--peer-fa3"])  # fa3 is a prefill peer
    with pytest.raises(SystemExit):
        parse(["decode", "--heads", "32/5"])
    assert d.l2_flush == "write" and parse(["prefill", "--l2-flush", "read"]).l2_flush == "read"
    with pytest.raises(SystemExit):
        parse(["decode", "--l2-flush", "none"])


def test_l2_flusher_modes_on_cpu():
    """write zeroes the buffer, read only reads it; an unknown mode is refused."""
    from flashdispatch.bench.timing import L2Flusher
    for mode, expect_zero in (("write", True), ("read", False)):
        flusher = L2Flusher(torch.device("cpu"), nbytes=64, spin_cycles=0, mode=mode)
        flusher.buffer.fill_(7)
        flusher()
        assert bool((flusher.buffer == 0).all()) == expect_zero
    with pytest.raises(ValueError, match="'none'.*write, read"):
        L2Flusher(torch.device("cpu"), nbytes=64, mode="none")
    with pytest.raises(ValueError, match="nbytes=12"):
        L2Flusher(torch.device("cpu"), nbytes=12)


def test_dry_run_lists_rows_and_columns(capsys):
    args = parse(["decode", "--shapes", "64x4096,2x16:fp8", "--backends", "fa2,cudnn-fn", "--no-peer", "--dry-run"])
    assert bench.run_bench(args) == 0
    out = capsys.readouterr().out
    assert "2 rows x 2 columns" in out and "fd:fa2, fd:cudnn-fn" in out and "1.074 GB" in out


def test_dry_run_default_columns_explain_what_is_left_out(capsys):
    assert bench.run_bench(parse(["prefill", "--dry-run", "--peers", "flex,sdpa-flash"])) == 0
    out = capsys.readouterr().out
    assert "fd:auto" in out and "torch:flex" in out and "torch:sdpa-flash" in out
    assert "torch:sdpa-cudnn" not in out


@pytest.mark.parametrize("argv", [["decode", "--backends", "nope"], ["prefill", "--backends", "cudnn-fn"],
                                  ["decode", "--peers", "fa3"], ["prefill", "--shapes", "4x"]])
def test_bad_arguments_exit_2(argv, capsys):
    assert bench.run_bench(parse(argv + ["--dry-run"])) == 2
    assert "bench:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_no_gpu_means_no_timing(capsys):
    assert bench.run_bench(parse(["decode", "--shapes", "1x16", "--no-peer", "--backends", "fa2"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# --- the cell loop with fake timings ------------------------------------------------------

class FakeShape:
    def __init__(self, label):
        self.label = label


def fake_matrix(monkeypatch, times_ms, context_ok=True):
    """run_matrix on the CPU: measure() returns ``times_ms[column]`` and an output tensor."""
    monkeypatch.setattr(matrix, "L2Flusher", lambda device, mode: None)
    monkeypatch.setattr(matrix, "cuda_context_ok", lambda: context_ok)
    monkeypatch.setattr(matrix.torch.cuda, "empty_cache", lambda: None)

    def measure(job, reps, flush):
        out = job.run()
        ms = times_ms[out[1]]
        return Timing(ms, [ms] * reps, 1.5, 100.0 if job.plan else None, 40.0, out[0])

    monkeypatch.setattr(matrix, "measure", measure)


def column(label, out=None, error=None, not_applicable=False):
    def build(data):
        if not_applicable:
            raise NotApplicable
        if error:
            raise error
        value = torch.full((4,), data) if out is None else out
        return Job(run=lambda: (value, label), plan=lambda: None, info=lambda: "selected fa2")
    return Column(label, build)


def test_run_matrix_records_times_errors_and_ratios(monkeypatch, tmp_path):
    fake_matrix(monkeypatch, {"fd:fa2": 0.5, "fi:fa2-tc": 0.25, "fi:fa2-cc": 1.0})
    rep = Report("decode", "TB/s", "copy", 4.0, {"FI best": ["fi:fa2-tc", "fi:fa2-cc"]})
    cols = [column("fd:fa2", out=torch.tensor([1.0, 2.0, 2.0, 1.0])),
            column("fd:cudnn", error=ValueError("kv dtype fp8 not in {bf16}\n  more")),
            column("torch:flex", not_applicable=True),
            column("fi:fa2-tc"), column("fi:fa2-cc")]
    path = tmp_path / "r.json"
    ok = matrix.run_matrix(rep, [FakeShape("a"), FakeShape("b")], cols, make_data=lambda s: 1.0,
                           work_of=lambda s: 1e9, reps=3, baseline_order=["fi:fa2-tc"], json_path=str(path),
                           log=lambda line: None)
    assert ok and rep.shapes == ["a", "b"] and rep.columns == ["fd:fa2", "fd:cudnn", "fi:fa2-tc", "fi:fa2-cc"]
    fa2 = rep.cell("a", "fd:fa2")
    assert fa2.rate == pytest.approx(2.0) and fa2.pct_ceiling == pytest.approx(50.0)
    assert fa2.ratios["FI best"] == pytest.approx(0.5) and fa2.plan_us == 100.0 and fa2.info == "selected fa2"
    assert fa2.rel_err == pytest.approx(float(torch.tensor([0.0, 1, 1, 0]).norm() / 2.0))
    assert rep.cell("a", "fi:fa2-tc").rel_err == 0.0 and rep.baselines["a"] == "fi:fa2-tc"
    bad = rep.cell("b", "fd:cudnn")
    assert bad.error.startswith("ValueError: kv dtype fp8") and bad.rate is None and not bad.ok
    assert rep.cell("a", "torch:flex") is None
    saved = Report.from_json(json.loads(path.read_text()))
    assert saved.cell("b", "fi:fa2-cc").rate == pytest.approx(1.0) and saved.cells[0].ms_all == [0.5] * 3


def test_run_matrix_stops_timing_after_the_cuda_context_is_lost(monkeypatch):
    fake_matrix(monkeypatch, {"fd:fa2": 0.5}, context_ok=False)
    rep = Report("decode", "TB/s", "copy", 4.0, {})
    cols = [column("fd:xqa", error=RuntimeError("CUDA error: an illegal memory access")), column("fd:fa2")]
    ok = matrix.run_matrix(rep, [FakeShape("a"), FakeShape("b")], cols, lambda s: 1.0, lambda s: 1e9, 3, [],
                           log=lambda line: None)
    assert not ok
    assert all(c.error for c in rep.cells) and len(rep.cells) == 4
    assert rep.cell("b", "fd:fa2").error.startswith("CUDA context lost after a fd:xqa")
    assert any("CUDA context lost" in n for n in rep.notes)


def test_failing_inputs_are_reported_in_every_cell(monkeypatch):
    fake_matrix(monkeypatch, {})

    def make(s):
        raise MemoryError("out of memory")

    rep = Report("prefill", "TFLOP/s", "bf16 matmul", 700.0, {})
    assert matrix.run_matrix(rep, [FakeShape("x")], [column("fd:fa2")], make, lambda s: 1.0, 3, [],
                             log=lambda line: None)
    assert rep.cell("x", "fd:fa2").error == "making inputs: MemoryError: out of memory"


# --- report formatting --------------------------------------------------------------------

def sample_report():
    rep = Report("prefill", "TFLOP/s", "bf16 matmul", 800.0, {"fi:fa2": ["fi:fa2"], "fi:fa3": ["fi:fa3"]},
                 env={"gpu": "Fake H200"}, ceilings={"bf16 matmul 8192^3 TFLOP/s": 800.0})
    rep.shapes, rep.columns = ["4096"], ["fd:fa2", "fd:cudnn", "fi:fa2"]
    rep.cells = [Cell("4096", "fd:fa2", ms=0.5, plan_us=None, run_us=55.0, first_s=3.25, rel_err=1.2e-3),
                 Cell("4096", "fd:cudnn",
                      error="Unsupported: no backend can run this\n  cudnn: feature.sliding_window"),
                 Cell("4096", "fi:fa2", ms=0.4, run_us=30.0, first_s=20.0, rel_err=0.0)]
    report.fill_derived(rep, "4096", 2e11)  # 0.2 TFLOP per call: 400 TFLOP/s at 0.5 ms
    return rep


def test_fill_derived_rates_and_ratios():
    rep = sample_report()
    fa2, fi = rep.cell("4096", "fd:fa2"), rep.cell("4096", "fi:fa2")
    assert fa2.rate == pytest.approx(400.0) and fi.rate == pytest.approx(500.0)
    assert fa2.pct_ceiling == pytest.approx(50.0)
    assert fa2.ratios == {"fi:fa2": pytest.approx(0.8)}  # no fa3 cell: no fa3 ratio


def test_detail_and_summary_tables():
    rep = sample_report()
    headers, rows = report.detail_rows(rep)
    assert headers[:5] == ["shape", "backend", "ms", "TFLOP/s", "% ceil"] and "x fi:fa3" in headers
    fa2 = dict(zip(headers, rows[0]))
    assert fa2["TFLOP/s"] == "400" and fa2["% ceil"] == "50" and fa2["x fi:fa2"] == "0.80"
    assert fa2["x fi:fa3"] == "-" and fa2["plan us"] == "-" and fa2["first s"] == "3.25" and fa2["err"] == "1.2e-03"
    cudnn = dict(zip(headers, rows[1]))
    assert cudnn["ms"] == "-" and cudnn["note"] == "Unsupported: no backend can run this cudnn: feature.sliding_window"
    sh, srows = report.summary_rows(rep)
    assert sh == ["shape (TFLOP/s)", "fd:fa2", "fd:cudnn", "fi:fa2", "best fd / fi:fa2"]
    assert srows == [["4096", "400", "x", "500", "0.80"]]


def test_geomean_lines_over_every_row_and_the_plain_rows():
    rep = Report("decode", "TB/s", "copy", 4.0, {"FI best": ["fi:fa2-tc"]})
    rep.shapes = ["1x64", "2x64", "2x64:fp8", "4x64"]
    for shape, ours, peer in (("1x64", 0.5, 1.0), ("2x64", 2.0, 1.0), ("2x64:fp8", 4.0, 1.0), ("4x64", None, 1.0)):
        rep.cells += [Cell(shape, "fd:fa2", ms=ours, error=None if ours else "Unsupported"),
                      Cell(shape, "fd:auto", ms=ours and ours * 2), Cell(shape, "fi:fa2-tc", ms=peer)]
        report.fill_derived(rep, shape, 1e9)
    # ratios of our best (fd:fa2, the faster of ours) are 2, 0.5, 0.25; 4x64 has none of ours
    assert report.geomean_lines(rep) == ["geomean best fd / FI best, every row (3): 0.630",
                                         "geomean best fd / FI best, rows without a modifier (2): 1.000"]
    rep.shapes = ["1x64", "2x64"]
    rep.cells = [c for c in rep.cells if c.shape in rep.shapes]
    assert report.geomean_lines(rep) == ["geomean best fd / FI best, every row (2): 1.000"]
    assert report.geomean_lines(Report("decode", "TB/s", "copy", 4.0, {})) == []


def test_plain_rendering_aligns_columns():
    text = report.render_plain(["name", "ms"], [["a", "1.5"], ["longer", "10.25"]])
    lines = text.splitlines()
    assert lines[0].startswith("name  ") and set(lines[1]) <= {"-", " "}
    assert lines[2].endswith(" 1.5") and lines[3].endswith("10.25") and len(lines[2]) == len(lines[3])


def test_print_report_plain_and_rich(capsys):
    rep = sample_report()
    rep.baselines = {"4096": "fi:fa2"}
    report.print_report(rep, use_rich=False)
    out = capsys.readouterr().out
    assert "gpu: Fake H200" in out and "ref = fi:fa2 on 4096" in out and "prefill summary: TFLOP/s" in out
    pytest.importorskip("rich")
    report.print_report(rep, use_rich=True)
    assert "fd:fa2" in capsys.readouterr().out


def test_one_line_cuts_long_errors():
    assert report.one_line("a\n  b\n", 10) == "a b"
    assert report.one_line("x" * 50, 10) == "xxxxxxx..."


def test_json_round_trip_and_summary_main(tmp_path, capsys):
    rep = sample_report()
    path = tmp_path / "p.json"
    rep.save_json(str(path))
    back = Report.from_json(json.loads(path.read_text()))
    assert back.cell("4096", "fd:fa2").ratios == rep.cell("4096", "fd:fa2").ratios
    assert report.main([str(path), str(tmp_path / "missing.json")]) == 2
    out, err = capsys.readouterr()
    assert "best fd / fi:fa2" in out and "cannot read report" in err


def test_plot_is_written_or_explained(tmp_path):
    why = report.save_plot(sample_report(), str(tmp_path / "p.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why.startswith("--plot skipped: matplotlib not importable")
    else:
        assert why is None and (tmp_path / "p.png").stat().st_size > 0


# --- small helpers ------------------------------------------------------------------------

def test_relative_error_and_median():
    ref = torch.tensor([3.0, 4.0])
    assert timing.relative_error(ref.clone(), ref) == 0.0
    assert timing.relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert timing.relative_error(torch.tensor([float("nan"), 4.0]), ref) == float("inf")
    assert timing.relative_error(torch.zeros(3), ref) == float("inf")
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        timing.median([])


def test_api_function_lookup():
    class Sub:
        def f(self):
            return 1

    mod = types.SimpleNamespace(__name__="m", decode=Sub())
    assert decode.api_function(mod, "decode", "f")() == 1
    with pytest.raises(NotImplementedError, match="m has no g"):
        decode.api_function(mod, "decode", "g")


def test_cuda_graph_columns_use_graph_wrappers(capsys):
    """--cuda-graph: wrapper columns get use_cuda_graph=True wrappers with their own fixed index
    buffers (not the row's tensors), and every attention column is wrapped for replay."""
    made = []

    class Wrapper:
        def __init__(self, workspace, layout, **kwargs):
            made.append(kwargs)

        def plan(self, *args, **kwargs):
            pass

        def run(self, q, cache):
            return q

    mod = types.SimpleNamespace(__name__="m", BatchDecodeWithPagedKVCacheWrapper=Wrapper)
    d = decode.make_decode_data(decode.parse_decode_shapes("3x40")[0], device="cpu")
    eager = decode.wrapper_job(mod, "fa2", d)
    eager.plan()
    assert eager.run() is d.q and made[-1] == {"backend": "fa2"}
    graph = decode.peer_column(mod, "fa2-tc", cuda_graph=True).build(d)
    kw = made[-1]
    assert kw["use_cuda_graph"] and kw["use_tensor_cores"] and kw["backend"] == "fa2"
    for name, t in (("indptr", d.indptr), ("indices", d.indices), ("last_page_len", d.last_page_len)):
        buf = kw[f"paged_kv_{name}_buffer"]
        assert buf.shape == t.shape and buf.dtype == t.dtype and buf.data_ptr() != t.data_ptr()
    assert graph.plan is not None and graph.run is not eager.run
    args = parse(["decode", "--cuda-graph", "--backends", "fa2", "--no-peer", "--dry-run", "--shapes", "2x64"])
    assert args.cuda_graph and bench.run_bench(args) == 0 and "fd:fa2" in capsys.readouterr().out
    assert not parse(["decode"]).cuda_graph


@pytest.mark.gpu
def test_cuda_graph_job_replays_what_eager_computes():
    """A --cuda-graph column's first run captures, later runs replay into the same output, equal
    to the eager wrapper's within bf16 rounding (the graph grid splits by the batch size alone, so
    its partition may differ); a re-plan between replays keeps it so (same inputs)."""
    d = decode.make_decode_data(decode.parse_decode_shapes("4x1000")[0])
    eager = decode.our_column(fd, "fa2").build(d)
    eager.plan()
    ref = eager.run().clone()
    job = decode.our_column(fd, "fa2", cuda_graph=True).build(d)
    job.plan()
    first = job.run()
    again = job.run()
    torch.cuda.synchronize()
    assert again is first and timing.relative_error(first, ref) < 1e-2
    job.plan()
    assert timing.relative_error(job.run(), ref) < 1e-2
