"""The custom-mask tile lists of the fa2 prefill kernel (prefill_kernels.py), built on the device
at plan() and for each new mask: every (work item, KV tile) classified from the mask bits, the
partial tiles' bitmaps written, each item's runs of whole and partial tiles listed, and the work
rows reordered by their visible tiles (heaviest first)."""
from __future__ import annotations

import triton
import triton.language as tl

from .prefill_kernels import RUNS_HEAD, WORK_COLS

_WORK_COLS = tl.constexpr(WORK_COLS)
_RUNS_HEAD = tl.constexpr(RUNS_HEAD)


@triton.jit
def _mask_words(mask_ptr, mask_off, offs_m, start_n, qo_len, kv_len, WORDS: tl.constexpr):
    """[BLOCK_M, WORDS] int32: bit b of word w = the packed custom-mask bit (row-major
    [qo_len, kv_len], little bit order) of row offs_m, key start_n + 16 w + b (rows past qo_len:
    0). Each word is three byte loads shifted into place (a row's bits need not start on a byte);
    a byte gather per (row, key) pair read every byte eight times, uncoalesced (87 us of a
    4096^2 mask on the H200)."""
    first_bit = offs_m.to(tl.int64) * kv_len + start_n
    n_bytes = (qo_len.to(tl.int64) * kv_len + 7) // 8
    byte = (first_bit // 8)[:, None] + 2 * tl.arange(0, WORDS)[None, :]
    row_ok = (offs_m < qo_len)[:, None]
    b0 = tl.load(mask_ptr + mask_off + byte, mask=row_ok & (byte < n_bytes), other=0).to(tl.int32)
    b1 = tl.load(mask_ptr + mask_off + byte + 1, mask=row_ok & (byte + 1 < n_bytes), other=0).to(tl.int32)
    b2 = tl.load(mask_ptr + mask_off + byte + 2, mask=row_ok & (byte + 2 < n_bytes), other=0).to(tl.int32)
    return ((b0 | (b1 << 8) | (b2 << 16)) >> (first_bit % 8).to(tl.int32)[:, None]) & 0xFFFF


@triton.jit
def _bit_range(lo, hi):
    """16-bit words with bits [lo, hi) set, lo and hi clamped to [0, 16] (empty when hi <= lo)."""
    lo = tl.minimum(tl.maximum(lo, 0), 16)
    hi = tl.minimum(tl.maximum(hi, 0), 16)
    return tl.where(hi > lo, ((1 << hi) - 1) ^ ((1 << lo) - 1), 0)


@triton.jit
def _popcount16(x):
    """Set bits of each 16-bit value of ``x`` (int32)."""
    x = x - ((x >> 1) & 0x5555)
    x = (x & 0x3333) + ((x >> 2) & 0x3333)
    x = (x + (x >> 4)) & 0x0F0F
    return (x + (x >> 8)) & 0x1F


@triton.jit
def mask_tile_classes_kernel(work_ptr, mask_ptr, mask_indptr_ptr, classes_ptr, bits_ptr, max_tiles, window_left,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """1-D grid of items x max_tiles programs: class of KV tile ``kv_lo // BLOCK_N + t`` for work
    item ``i`` at ``classes[i, t]`` (int8): 0 no visible key, 1 every in-bounds pair visible (and
    the tile inside the item's chunk), 2 partial. Rows past qo_len and keys outside [kv_lo, kv_hi)
    do not count."""
    item = tl.program_id(0) // max_tiles
    t = tl.program_id(0) % max_tiles
    row = work_ptr + item * _WORK_COLS
    req = tl.load(row)
    m0 = tl.load(row + 1)
    qo_len = tl.load(row + 2)
    kv_len = tl.load(row + 3)
    kv_lo = tl.load(row + 4)
    kv_hi = tl.load(row + 5)
    start_n = (kv_lo // BLOCK_N + t) * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    # everything in 16-key words: the in-bounds pairs (rows < qo_len, keys in [kv_lo, kv_hi)),
    # and the window's lower key bound per row, as bit ranges
    WORDS: tl.constexpr = BLOCK_N // 16
    key0 = start_n + 16 * tl.arange(0, WORDS)[None, :]  # [1, WORDS]
    row_ok = (offs_m < qo_len)[:, None]
    in_bounds = tl.where(row_ok, _bit_range(kv_lo - key0, kv_hi - key0), 0)  # [BLOCK_M, WORDS]
    words = _mask_words(mask_ptr, tl.load(mask_indptr_ptr + req).to(tl.int64), offs_m, start_n, qo_len, kv_len,
                        WORDS) & in_bounds
    if WINDOW:  # int64: pos - window_left - key0 leaves int32 for a window_left near 2^31
        first_key = (offs_m + kv_len - qo_len).to(tl.int64)[:, None] - window_left
        lo = tl.maximum(first_key - key0, -1).to(tl.int32)  # >= -1 clamps like any value <= 0
        words = words & _bit_range(lo, 16 + tl.zeros_like(key0))
    visible = tl.sum(_popcount16(words))
    whole = (visible == tl.sum(_popcount16(in_bounds))) & (start_n >= kv_lo) & (start_n + BLOCK_N <= kv_hi)
    cls = tl.where(visible == 0, 0, tl.where(whole, 1, 2))
    tl.store(classes_ptr + item.to(tl.int64) * max_tiles + t, cls.to(tl.int8), mask=start_n < kv_hi)
    # a partial tile's pairs as a bitmap (see _tile_bits) at slot (list offset) / 2 + t
    slot = (tl.load(row + 9) // 2 + t).to(tl.int64)
    offs = slot * (BLOCK_M * WORDS) + tl.arange(0, BLOCK_M)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    partial = (tl.zeros([BLOCK_M, WORDS], tl.int32) + ((cls == 2) & (start_n < kv_hi)).to(tl.int32)) != 0
    tl.store(bits_ptr + offs, words.to(tl.int16), mask=partial)


@triton.jit
def mask_tile_runs_kernel(work_ptr, classes_ptr, runs_ptr, visible_ptr, max_tiles, BLOCK_N: tl.constexpr,
                          CHUNK: tl.constexpr):
    """Grid (items,): item ``i``'s visible KV tiles (``classes[i, :]`` from
    mask_tile_classes_kernel) as runs of consecutive tiles of one class, at its tile-list offset:
    a head of `RUNS_HEAD` int32 (whole runs, partial runs, visible tiles, 0), then (first tile,
    end tile) of each whole run, then of each partial run, in KV order; the visible tiles also at
    ``visible[i]`` (for heaviest_first_kernel). An item of n KV tiles has at most n runs. The
    attention kernel walks whole runs without masks and partial ones with them (plain tile
    ranges, which pipeline). The classes are read CHUNK at a time, twice: first to count the
    whole runs (where the partial ones start), then to place every run."""
    item = tl.program_id(0)
    row = work_ptr + item * _WORK_COLS
    kv_lo = tl.load(row + 4)
    kv_hi = tl.load(row + 5)
    base = runs_ptr + tl.load(row + 9)
    first = kv_lo // BLOCK_N
    n_tiles = tl.cdiv(kv_hi, BLOCK_N) - first
    classes = classes_ptr + item.to(tl.int64) * max_tiles
    n_whole = 0
    for c0 in range(0, n_tiles, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        cls = tl.load(classes + t, mask=t < n_tiles, other=0).to(tl.int32)
        prev = tl.load(classes + t - 1, mask=(t > 0) & (t < n_tiles), other=0).to(tl.int32)
        n_whole += tl.sum(((cls == 1) & (prev != 1)).to(tl.int32))
    seen = tl.zeros([4], tl.int32)  # whole run starts, whole run ends, partial starts, partial ends
    kind = tl.arange(0, 4)
    visible = 0
    for c0 in range(0, n_tiles, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        cls = tl.load(classes + t, mask=t < n_tiles, other=0).to(tl.int32)
        prev = tl.load(classes + t - 1, mask=(t > 0) & (t < n_tiles), other=0).to(tl.int32)
        nxt = tl.load(classes + t + 1, mask=t + 1 < n_tiles, other=0).to(tl.int32)
        want = tl.where(kind < 2, 1, 2)  # the class of each kind
        on = cls[:, None] == want[None, :]
        edge = tl.where((kind % 2 == 0)[None, :], prev[:, None], nxt[:, None]) != want[None, :]
        hit = (on & edge).to(tl.int32)  # [CHUNK, 4]: tile t starts / ends a run of that kind
        index = seen[None, :] + tl.cumsum(hit, 0) - 1
        at = _RUNS_HEAD + 2 * (index + tl.where(kind < 2, 0, n_whole)[None, :]) + (kind % 2)[None, :]
        value = first + t[:, None] + (kind % 2)[None, :]  # a run's end is exclusive
        tl.store(base + at, value, mask=hit != 0)
        seen += tl.sum(hit, 0)
        visible += tl.sum((cls != 0).to(tl.int32))
    n_partial = tl.sum(tl.where(kind == 2, seen, 0))
    tl.store(base + kind, tl.where(kind == 0, n_whole, tl.where(kind == 1, n_partial, tl.where(kind == 2, visible, 0))))
    tl.store(visible_ptr + item, visible)


@triton.jit
def heaviest_first_kernel(work_ptr, visible_ptr, out_ptr, n_items, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Grid cdiv(n_items, BLOCK_I): work row i goes to ``out`` row rank(i), the rows ordered by
    their visible KV tiles (``visible``, from mask_tile_runs_kernel), most first, ties in row
    order. Each program ranks BLOCK_I rows against all rows, BLOCK_J at a time (n_items^2
    compares on independent loads: thousands of rows in a few steps, in place of a torch sort's
    several launches)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < n_items
    v_i = tl.load(visible_ptr + i, mask=ok, other=0)
    rank = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, n_items, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        v_j = tl.load(visible_ptr + j, mask=j < n_items, other=-1)  # -1: never ahead of a count >= 0
        ahead = (v_j[None, :] > v_i[:, None]) | ((v_j[None, :] == v_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(ahead.to(tl.int32), 1)
    cols = tl.arange(0, 16)
    keep = ok[:, None] & (cols < _WORK_COLS)[None, :]
    rows = tl.load(work_ptr + i[:, None] * _WORK_COLS + cols[None, :], mask=keep)
    tl.store(out_ptr + rank[:, None] * _WORK_COLS + cols[None, :], rows, mask=keep)
