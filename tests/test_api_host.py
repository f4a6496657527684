"""The host side of plan()/run(): index arrays read with one device->host copy, scalar checks
reused only for equal arguments, run()'s fast checks falling back to the explaining ones."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashdispatch as fi
from flashdispatch import checks

WS = torch.empty(1 << 20, dtype=torch.uint8)


def table(lens, page_size, garbage=()):
    """indptr, indices (shuffled, plus trailing ``garbage`` entries), last_page_len for kv lengths."""
    pages = [-(-n // page_size) for n in lens]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).int()
    used = int(indptr[-1])
    indices = torch.cat([torch.randperm(used), torch.tensor(garbage, dtype=torch.long)]).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


@pytest.mark.parametrize("lens, garbage", [
    ([5, 17, 0, 33], ()), ([5, 17, 0, 33], (-1, -7, 10 ** 6)), ([0, 0], ()), ([0, 0], (-3,)), ([], ()),
])
@pytest.mark.parametrize("on_host", [(False, False), (True, False), (False, True)])
def test_one_copy_reader_matches_host_reader(lens, garbage, on_host):
    indptr, indices, last = table(lens, 8, garbage)
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    got, got_minmax = checks.read_in_one_copy([indptr, last], on_host, indices)
    assert all((g == w).all() and g.dtype == w.dtype for g, w in zip(got, want))
    assert got_minmax == want_minmax
    if int(indptr[-1]):
        used = indices[: int(indptr[-1])]
        assert want_minmax == (int(used.min()), int(used.max()))
    else:
        assert want_minmax is None


def decode_plan(w, indptr, indices, last, **kw):
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=8, q_data_type=torch.float32)
    args.update(kw)
    w.plan(indptr, indices, last, **args)


def test_indices_past_indptr_end_are_not_checked_or_counted():
    torch.manual_seed(0)
    indptr, indices, last = table([5, 17, 33], 8, garbage=(-1, 10 ** 6))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last)
    q = torch.randn(3, 4, 16)
    pages = int(indptr[-1])  # the largest used page index is pages - 1
    assert w.run(q, torch.randn(pages, 2, 8, 2, 16)).shape == (3, 4, 16)
    with pytest.raises(ValueError, match=f"reference page {pages - 1}, but paged_kv_cache has only {pages - 1}"):
        w.run(q, torch.randn(pages - 1, 2, 8, 2, 16))


def test_replan_checks_changed_scalars_again():
    indptr, indices, last = table([5, 17], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last, window_left=1)
    with pytest.raises(ValueError, match="window_left=True"):  # True == 1, but not an int window
        decode_plan(w, indptr, indices, last, window_left=True)
    with pytest.raises(ValueError, match="head_dim=16.0"):
        decode_plan(w, indptr, indices, last, head_dim=16.0)
    decode_plan(w, indptr, indices, last, sm_scale=0.5)
    assert w._planned.params.sm_scale == 0.5
    decode_plan(w, indptr, indices, last)
    assert w._planned.params.sm_scale == pytest.approx(0.25)


def test_replan_uses_the_new_page_table():
    torch.manual_seed(1)
    cache = torch.randn(16, 2, 8, 2, 16)
    q = torch.randn(3, 4, 16)
    first, second = table([5, 17, 33], 8), table([40, 1, 9], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, *first)
    w.run(q, cache)
    decode_plan(w, *second)
    fresh = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(fresh, *second)
    o, lse = w.run(q, cache, return_lse=True)
    o_ref, lse_ref = fresh.run(q, cache, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_run_fast_path_falls_back_to_the_explaining_checks():
    indptr, indices, last = table([5, 17], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last)
    cache = torch.randn(8, 2, 8, 2, 16)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="q must be contiguous"):
        w.run(torch.randn(2, 4, 32)[..., ::2], cache)
    with pytest.raises(ValueError, match="contiguous in its last"):
        w.run(q, torch.randn(8, 2, 8, 2, 32)[..., ::2])
    with pytest.raises(TypeError, match="out.dtype=float16"):
        w.run(q, cache, out=torch.empty(2, 4, 16).half())
    k, v = cache.unbind(1)
    assert torch.equal(w.run(q, (k, v)), w.run(q, cache))  # a (k, v) tuple takes the same path


def test_host_overhead_script_runs():
    script = Path(__file__).resolve().parents[1] / "scripts" / "host_overhead.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script), "--batches", "1", "4", "--calls", "2", "--reps", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "decode" in out.stdout and "prefill_paged" in out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["all", "indptr_on_host"])
def test_cuda_tables_read_in_one_copy(where):
    indptr, indices, last = table([5, 17, 0, 33], 8, garbage=(-1, 10 ** 6))
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    dev_indptr = indptr if where == "indptr_on_host" else indptr.cuda()
    got, got_minmax = checks.host_arrays([dev_indptr, last.cuda()], indices.cuda())
    assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax


def test_block_tables_plan_equals_page_table_plan():
    torch.manual_seed(2)
    lens = torch.tensor([5, 17, 0, 33], dtype=torch.int32)
    tables = torch.randperm(24).int().view(4, 6)
    cache, q = torch.randn(24, 2, 8, 2, 16), torch.randn(4, 4, 16)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, None, None, None, block_tables=tables, seq_lens=lens)
    pages = (lens + 7) // 8
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).int()])
    indices = torch.cat([tables[b, :p] for b, p in enumerate(pages.tolist())])
    last = torch.where(pages > 0, lens - (pages - 1) * 8, 0).int()
    ref = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(ref, indptr, indices, last)
    assert torch.equal(w.run(q, cache), ref.run(q, cache))
