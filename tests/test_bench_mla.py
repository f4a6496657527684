"""CPU tests of `bench mla`: shapes, the FLOP count, options, the data and one job run on the CPU."""
from __future__ import annotations

import argparse

import pytest
import torch

import flashdispatch as fd
from flashdispatch import bench
from flashdispatch.bench import mla


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "mla", *argv])


def test_default_shapes_are_the_anchor_rows():
    shapes = mla.parse_mla_shapes(mla.DEFAULT_SHAPES)
    assert [(s.batch, s.kv_len, s.page_size) for s in shapes] == [(64, 4096, 64), (128, 8192, 64),
                                                                    (16, 32768, 64), (128, 2048, 1)]
    assert all((s.heads, s.head_dim_ckv, s.head_dim_kpe, s.dtype) == (128, 512, 64, torch.bfloat16) for s in shapes)


def test_flops_are_anchors_count():
    """ANCHORS.md: TFLOP/s = 2 x batch x heads x kv_len x (576 + 512) / time."""
    s = mla.parse_mla_shapes("64x4096")[0]
    assert mla.mla_flops(s) == 2 * 64 * 128 * 4096 * (576 + 512)


def test_page_modifier_heads_and_dims():
    s = mla.parse_mla_shapes("3x100:p7", torch.float16, (16, 1), 256, 32)[0]
    assert (s.batch, s.kv_len, s.page_size, s.heads, s.head_dim_ckv, s.dtype) == (3, 100, 7, 16, 256, torch.float16)
    assert s.pages_per_request == 15 and s.label == "3x100:p7"


@pytest.mark.parametrize("text, match", [("4x", "expected BxK"), ("0x10", "batch > 0"), ("2x10:fp8", "modifier"),
                                         ("2x10:p0", "modifier"), ("", "no mla shapes"),
                                         ("2000000x16", "batch 2000000")])
def test_bad_shapes_name_the_item(text, match):
    with pytest.raises(ValueError, match=match):
        mla.parse_mla_shapes(text)


def test_parser_defaults_and_one_kv_head():
    args = parse([])
    assert (args.heads, args.head_dim, args.page_size, args.reps) == ((128, 1), 512, 64, 20)
    assert parse(["--peer-fa3"]).peer_fa3
    assert bench.run_bench(parse(["--heads", "32/8", "--dry-run"])) == 2


def test_dry_run_lists_rows_and_columns(capsys):
    assert bench.run_bench(parse(["--shapes", "64x4096,2x16:p1", "--backends", "fa2,reference", "--no-peer",
                                  "--dry-run"])) == 0
    out = capsys.readouterr().out
    assert "2 rows x 2 columns" in out and "fd:fa2, fd:reference" in out and "0.073 TFLOP" in out


@pytest.mark.parametrize("argv", [["--backends", "cudnn-fn"], ["--peers", "fa2-tc"], ["--shapes", "2x"]])
def test_bad_arguments_exit_2(argv, capsys):
    assert bench.run_bench(parse(argv + ["--dry-run"])) == 2
    assert "bench:" in capsys.readouterr().err


def test_data_and_a_job_on_the_cpu():
    """The row's tensors, and our wrapper's job (plan, then run) on the CPU reference."""
    s = mla.parse_mla_shapes("2x40:p16", torch.float16, (4, 1), 64)[0]
    d = mla.make_mla_data(s, device="cpu")
    assert d.q_nope.shape == (2, 4, 64) and d.q_pe.shape == (2, 4, mla.KPE_DIM)
    assert d.ckv_cache.shape == (6, 16, 64) and d.kpe_cache.shape == (6, 16, mla.KPE_DIM)
    assert d.kv_indptr.tolist() == [0, 3, 6] and sorted(d.kv_indices.tolist()) == list(range(6))
    job = mla.wrapper_job(fd, "reference", d)
    job.plan()
    out = job.run()
    assert out.shape == (2, 4, 64) and torch.isfinite(out).all() and job.info() == "selected reference"
