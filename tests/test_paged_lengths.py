"""A paged table's lengths read and checked by the device read's kernel (`device_read.read_paged_lengths`,
`checks.paged_lengths`): the same lengths, sums and index range as the host checks, and every entry
they refuse flagged, so that the host checks run and name it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flashdispatch as fi
from flashdispatch import checks, device_read
from test_api_host import table

WS = torch.empty(1 << 20, dtype=torch.uint8)


def host_lengths(indptr, last, indices, page_size):
    """(lengths, (sum, max), index range) as the host checks work them out."""
    (indptr_h, last_h), index_range = checks.host_arrays([indptr, last], indices)
    lens = checks.paged_kv_lengths(checks.check_indptr(indptr_h, "indptr"), last_h, page_size, int(indptr_h[-1]))
    return lens, (int(lens.sum()), int(lens.max(initial=0))), index_range


@pytest.mark.parametrize("lens", [[5, 17, 0, 33], [0, 0], [], [1], list(range(0, 3000, 7))])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("garbage", [(), (-1, 10 ** 6)])
def test_kernel_lengths_match_the_host_checks(lens, page_size, garbage):
    torch.manual_seed(len(lens) + page_size)
    indptr, indices, last = table(lens, page_size, garbage)
    want_lens, want_stats, want_range = host_lengths(indptr, last, indices, page_size)
    indptr_h, last_h, got_lens, stats, index_range = device_read.read_paged_lengths(indptr, last, indices, page_size)
    assert np.array_equal(indptr_h, indptr.numpy()) and np.array_equal(last_h, last.numpy())
    assert got_lens.dtype == np.int64 and np.array_equal(got_lens, want_lens)
    assert stats == want_stats and index_range == want_range
    assert want_lens.tolist() == lens  # (the table holds what it was made of)


def test_kernel_sum_of_lengths_past_int32_is_exact():
    page_size, pages = 16, [1 << 26, 1 << 26, 1 << 26]  # 3 x 2^30 tokens
    indptr = torch.tensor(np.cumsum([0] + pages), dtype=torch.int32)
    last = torch.full((3,), page_size, dtype=torch.int32)
    *_, stats, index_range = device_read.read_paged_lengths(indptr, last, None, page_size)
    assert stats == (3 << 30, 1 << 30) and index_range is None


@pytest.mark.parametrize("indptr, last", [
    ([1, 2, 3], [1, 1]),  # indptr[0] != 0
    ([0, 2, 1], [1, 1]),  # decreasing
    ([0, 2, 3], [0, 1]),  # last_page_len 0 on a request with pages
    ([0, 2, 3], [17, 1]),  # past page_size
    ([0, 2, 3], [1, -4]),
    ([0, 2, 2], [1, 3]),  # not 0 on a request without pages
    ([0, (1 << 27) + 5], [16]),  # a length past int32
])
def test_kernel_flags_what_the_host_checks_refuse(indptr, last):
    indptr, last = torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32)
    with pytest.raises(ValueError):
        host_lengths(indptr, last, None, 16)
    assert device_read.read_paged_lengths(indptr, last, None, 16)[3] is None


@pytest.mark.gpu
@pytest.mark.parametrize("indptr, last, match", [
    ([1, 2, 5], [3, 8], r"indptr\[0\]=1"),
    ([0, 4, 3], [3, 8], "non-decreasing"),
    ([0, 2, 5], [0, 8], r"last_page_len\[0\]=0"),
    ([0, 2, 5], [3, 9], r"last_page_len\[1\]=9"),
    ([0, 0, 5], [2, 8], r"last_page_len\[0\]=2"),
])
def test_cuda_plan_names_the_entry_the_kernel_flagged(indptr, last, match):
    """Lengths on the GPU: the kernel's flag sends plan() to the host checks, which raise as with
    host tensors."""
    dev = torch.device("cuda")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS.to(dev), "NHD", backend="fa2")
    indices = torch.arange(5, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=match):
        w.plan(torch.tensor(indptr, dtype=torch.int32, device=dev), indices,
               torch.tensor(last, dtype=torch.int32, device=dev), 4, 2, 32, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["1", "0"])
@pytest.mark.parametrize("where", ["all", "indptr_on_host", "indices_on_host"])
def test_cuda_paged_lengths_match_the_host_path(monkeypatch, check, where):
    """The kernel's lengths where the table is on one GPU, the host's (one copy per device)
    where it is spread: the same values, types and index range either way."""
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, check)
    torch.manual_seed(1)
    lens = torch.randint(0, 3000, (300,)).tolist()
    indptr, indices, last = table(lens, 16, garbage=(-1,))
    want = checks.paged_lengths(indptr, last, indices, 16)
    got = checks.paged_lengths(indptr if where == "indptr_on_host" else indptr.cuda(), last.cuda(),
                               indices if where == "indices_on_host" else indices.cuda(), 16)
    for g, w in zip(got, want):
        assert (np.array_equal(g, w) and g.dtype == w.dtype) if isinstance(w, np.ndarray) else g == w
    assert (got.index_range is None) == (check == "0") and got.kv_lens.tolist() == lens


@pytest.mark.gpu
def test_cuda_paged_lengths_of_no_request():
    indptr, last = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda")
    got = checks.paged_lengths(indptr, last, torch.arange(4, dtype=torch.int32, device="cuda"), 16)
    assert got.kv_lens.size == 0 and (got.used_pages, got.kv_total, got.kv_max, got.index_range) == (0, 0, 0, None)
