"""Device helpers of the decode kernel (decode_kernel.py) that read every request's length: the
block table's total for its split (TOTAL_SPLIT) and the requests an item group's piece of the
line touches (LINE), from kv_indptr or, with TABLE, from seq_lens (its pages counted in place)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _table_pages(lens_ptr, offs, live, table_tokens, PAGE: tl.constexpr):
    """The pages of the requests ``offs`` (0 where not ``live``): their lengths clamped as TABLE
    reads them (to [0, table_tokens])."""
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + offs, mask=live, other=0), 0), table_tokens)
    return (n + PAGE - 1) // PAGE


@triton.jit
def total_split_tokens(lens_ptr, n_requests, table_tokens, window_left, min_tokens, target,
                       QLEN: tl.constexpr, WINDOW: tl.constexpr, UNITS: tl.constexpr, BLOCK: tl.constexpr):
    """TOTAL_SPLIT's chunk length: the sum of the requests' KV tokens from their window starts
    (lengths clamped as TABLE reads them) x UNITS over ``target`` programs, at least ``min_tokens``."""
    total = tl.zeros([BLOCK], tl.int64)
    for b in range(0, n_requests, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        n = tl.minimum(tl.maximum(tl.load(lens_ptr + offs, mask=offs < n_requests, other=0), 0), table_tokens)
        if WINDOW:
            n = tl.minimum(n, QLEN + window_left)
        total += n.to(tl.int64)
    return tl.maximum(tl.sum(total) * UNITS // target, min_tokens).to(tl.int32)


@triton.jit
def table_line_pages(lens_ptr, n_requests, table_tokens, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """(the requests' pages, the first request's) of a block table's line (LINE with TABLE)."""
    total = tl.zeros([BLOCK], tl.int32)
    for b in range(0, n_requests, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        total += _table_pages(lens_ptr, offs, offs < n_requests, table_tokens, PAGE)
    first = _table_pages(lens_ptr, 0, n_requests > 0, table_tokens, PAGE)
    return tl.sum(total), first


@triton.jit
def line_requests(indptr_ptr, n_requests, line_gap, piece_start, piece_end, BLOCK: tl.constexpr):
    """The requests [first, end) that the line's piece of positions [piece_start, piece_end)
    touches (LINE): the one begun before it whose pages run into it, and every request starting
    in it (an empty one too), by counting the requests' first positions below each bound, BLOCK
    at a time."""
    base = tl.load(indptr_ptr)
    before = 0
    upto = 0
    for b in range(0, n_requests, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        live = offs < n_requests
        at = tl.load(indptr_ptr + offs, mask=live, other=0) - base + line_gap * (offs + 1)
        before += tl.sum((live & (at < piece_start)).to(tl.int32))
        upto += tl.sum((live & (at < piece_end)).to(tl.int32))
    # the request before the piece ends at its successor's position less the gap
    runs_in = (before > 0) & (tl.load(indptr_ptr + before) - base + line_gap * before > piece_start)
    return before - runs_in.to(tl.int32), upto


@triton.jit
def table_line_requests(lens_ptr, n_requests, table_tokens, line_gap, piece_start, piece_end,
                        PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """`line_requests` of a block table's line (LINE with TABLE), whose positions are the running
    sum of the requests' pages (`_table_pages`) plus the gaps: (first, end, the first one's
    position)."""
    before = 0
    upto = 0
    pages_before = 0  # the pages of the requests before the piece
    last_at = 0  # the position of the last request before the piece, and where it ends
    last_end = 0
    carry = 0
    for b in range(0, n_requests, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        live = offs < n_requests
        pages = _table_pages(lens_ptr, offs, live, table_tokens, PAGE)
        at = carry + tl.cumsum(pages, 0) - pages + line_gap * (offs + 1)
        lo = live & (at < piece_start)
        before += tl.sum(lo.to(tl.int32))
        upto += tl.sum((live & (at < piece_end)).to(tl.int32))
        pages_before += tl.sum(tl.where(lo, pages, 0))
        last_at = tl.maximum(last_at, tl.max(tl.where(lo, at, 0)))
        last_end = tl.maximum(last_end, tl.max(tl.where(lo, at + pages, 0)))
        carry += tl.sum(pages)
    runs_in = (before > 0) & (last_end > piece_start)
    first_at = tl.where(runs_in, last_at, pages_before + line_gap * (before + 1))
    return before - runs_in.to(tl.int32), upto, first_at
