"""The decode bench's plain streaming read (hw:stream): the kernel, its column, its ratio."""
from __future__ import annotations

import math

import pytest
import torch

from flashdispatch import bench
from flashdispatch.bench import matrix, stream
from flashdispatch.bench.matrix import Column
from flashdispatch.bench.report import Report
from flashdispatch.bench.timing import Job, Timing
from test_bench import parse  # the bench parser as the CLI builds it (tests/ is on the path, as for oracle)


@pytest.mark.parametrize("style", stream.STYLES, ids=stream.style_label)
@pytest.mark.parametrize("words,programs", [(5 * 8192 + 77, 3), (100, 4), (0, 2)])
def test_stream_sums_each_programs_slice(style, words, programs):
    """Each program sums exactly its contiguous slice, so the whole read covers every word once:
    a kernel that skipped or repeated a load would miss its slice's sum. (Small words: the
    interpreter's int32 sum raises where the GPU's wraps.)"""
    g = torch.Generator().manual_seed(words)
    x = torch.randint(0, 1000, (words,), generator=g, dtype=torch.int32)
    sums = stream.stream_launch(x, programs, style)()
    step = stream._BLOCK * stream._UNROLL
    per = step * max(1, math.ceil(words / (programs * step)))
    for p in range(programs):
        assert int(sums[p]) == int(x[p * per:(p + 1) * per].sum()), p


def test_stream_words_views_the_cache_bytes():
    cache = torch.randn(3, 2, 16, 2, 8, dtype=torch.float16)
    words = stream.stream_words(cache)
    assert words.dtype == torch.int32 and words.numel() * 4 == cache.numel() * 2
    assert words.data_ptr() == cache.data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        stream.stream_words(cache.transpose(0, 1))
    with pytest.raises(ValueError, match="3 bytes"):
        stream.stream_words(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="programs=0"):
        stream.stream_launch(words, 0, stream.STYLES[0])


def test_stream_column_on_request():
    args = ["decode", "--shapes", "2x64", "--backends", "fa2", "--no-peer", "--dry-run"]
    assert [c.label for c in bench.select_columns(parse(args))[0]] == ["fd:fa2"]
    assert [c.label for c in bench.select_columns(parse(args + ["--stream"]))[0]] == ["fd:fa2", "hw:stream"]
    with pytest.raises(SystemExit):
        parse(["prefill", "--stream"])  # a decode column


def test_decode_ratio_refs_follow_the_columns():
    assert bench.decode_ratio_refs(["fd:fa2", "hw:stream", "fi:fa2-tc", "fi:xqa-fn"]) == {
        "FI best": ["fi:fa2-tc", "fi:xqa-fn"], "stream": ["hw:stream"]}
    assert bench.decode_ratio_refs(["fd:fa2", "hw:stream"]) == {"stream": ["hw:stream"]}
    assert bench.decode_ratio_refs(["fd:fa2"]) == {}


def test_a_column_without_output_gets_a_ratio_but_no_error_check(monkeypatch):
    """hw:stream's job returns None: it is neither the err baseline nor checked against it, and
    every other cell gets its x stream ratio."""
    monkeypatch.setattr(matrix, "L2Flusher", lambda device, mode: None)
    monkeypatch.setattr(matrix.torch.cuda, "empty_cache", lambda: None)
    times = {"hw:stream": 0.25, "fd:fa2": 0.5, "fi:fa2-tc": 1.0}

    def measure(job, reps, flush):
        label, out = job.run()
        return Timing(times[label], [times[label]] * reps, 0.1, None, 10.0, out)

    monkeypatch.setattr(matrix, "measure", measure)
    out = torch.tensor([1.0, 2.0])
    cols = [Column(label, lambda d, label=label: Job(run=lambda: (label, None if label == "hw:stream" else out)))
            for label in times]
    rep = Report("decode", "TB/s", "copy", 4.0, bench.decode_ratio_refs(list(times)))
    assert matrix.run_matrix(rep, [type("S", (), {"label": "a"})()], cols, lambda s: 0, lambda s: 1e9, 2,
                             ["hw:stream", "fi:fa2-tc"], log=lambda line: None)
    assert rep.baselines["a"] == "fi:fa2-tc" and rep.cell("a", "hw:stream").rel_err is None
    assert rep.cell("a", "fd:fa2").rel_err == 0.0
    assert rep.cell("a", "fd:fa2").ratios == pytest.approx({"FI best": 2.0, "stream": 0.5})
    assert rep.cell("a", "hw:stream").ratios["stream"] == pytest.approx(1.0)


@pytest.mark.gpu
def test_stream_column_on_the_gpu():
    """The column calibrates its styles and its job reads the whole cache (sums match)."""
    from flashdispatch.bench.decode import make_decode_data, parse_decode_shapes
    data = make_decode_data(parse_decode_shapes("4x1000")[0])
    job = stream.stream_column("write").build(data)
    assert job.run() is None and "programs" in job.info()
    words = stream.stream_words(data.cache)
    sums = stream.stream_launch(words, 7, stream.STYLES[0])()
    assert int(sums.to(torch.int64).sum()) % 2**32 == int(words.to(torch.int64).sum()) % 2**32
