"""fa2 decode's work array: the rows a plan builds on the host and uploads when the kernel does
not read the page table itself (decode.py plans; the work and merge rows' columns are
decode_kernel.py's, the merge kernel is merge.py's)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .decode_kernel import WORK_COLS
from .decode_split import PackedSplit, chunk_counts
from .merge import MERGE_INFO_COLS


class WorkArray(NamedTuple):
    """`work_array`'s result: the int32 plan arrays (work rows, then merge rows) and their counts,
    the partial slots they use, the most chunks of a request and the rows per program."""

    meta: np.ndarray
    n_work: int
    n_merge: int
    n_partial: int
    max_chunks: int
    items: int


def work_array(lens: np.ndarray, lo: np.ndarray, eff: np.ndarray, page_size: int, q_len: int, splits: int,
               chunk: np.ndarray | None, packed: PackedSplit | None, fixed_split_size: int | None) -> WorkArray:
    """The work rows of requests with kv lengths ``lens`` read from token ``lo`` (``eff`` tokens):
    one per request (``chunk`` None, ``splits`` <= 1, no ``packed``), ``chunk`` tokens a row, the
    CUDA-graph grid's ``splits`` rows per request (request b's rows and partials b x splits ...,
    idle ones marked), or ``packed``'s segments. A request of more than one row has a merge row."""
    batch = len(lens)
    pages = -(-lens // page_size)
    page_base = pages.cumsum() - pages
    if chunk is None and splits <= 1 and packed is None:
        meta = np.zeros((batch, WORK_COLS), dtype=np.int32)
        meta[:, 0] = np.arange(batch)
        meta[:, 1] = page_base
        meta[:, 2] = lo
        meta[:, 3] = lens
        meta[:, 4] = lens
        meta[:, 5] = -1
        meta[:, 6] = 1
        return WorkArray(meta.ravel(), batch, 0, 0, 1, 1)
    line, items_per_program = None, 1  # the requests in the order of their segments (None: their own)
    if packed is not None:  # segments (position in line, first and end token from lo, work row), the rows
        line, pos, seg_lo, seg_hi, items, n_work, items_per_program, nsplit = packed
    else:
        nsplit = chunk_counts(eff, chunk)
        pos = np.arange(batch).repeat(nsplit)
    req = pos if line is None else line[pos]  # nsplit is by position in line, the tables by request
    if splits:  # CUDA graph: request b owns work items and partial slots b*splits .. +splits-1
        if nsplit.max() > splits:
            raise ValueError(f"use_cuda_graph: a request needs {int(nsplit.max())} chunks of "
                             f"fixed_split_size={fixed_split_size} pages, the graph grid holds "
                             f"{splits}; raise fixed_split_size")
        n_work, n_partial = batch * splits, (batch * splits if splits > 1 else 0)
        items = np.arange(len(req)) - (nsplit.cumsum() - nsplit).repeat(nsplit) + req * splits
        sidx = items - req * splits
        slot_of = np.where(nsplit[req] > 1, items, -1)
        merge_rows = np.arange(batch if splits > 1 else 0)
        merge_row_of = np.where(nsplit[req] > 1, req, -1)
        merge_first = merge_rows * splits
    else:  # items in order (a slice below, not an index array: plan() is host-time bound), or packed
        if packed is None:
            n_work, items = len(req), slice(None)
        first_item = nsplit.cumsum() - nsplit
        sidx = np.arange(len(pos)) - first_item[pos]
        merge_rows = np.flatnonzero(nsplit > 1)
        if merge_rows.size == batch:  # every request split (the usual case): every item a partial
            slot_of, merge_row_of, n_partial, merge_first = np.arange(len(pos)), pos, len(pos), first_item
        else:
            split_item = nsplit[pos] > 1
            slot_of = np.where(split_item, split_item.cumsum() - 1, -1)
            merge_row_of = np.where(split_item, ((nsplit > 1).cumsum() - 1)[pos], -1)
            n_partial = int(split_item.sum())
            merge_first = nsplit[merge_rows].cumsum() - nsplit[merge_rows]
    n_merge = len(merge_rows)
    meta = np.zeros(n_work * WORK_COLS + n_merge * MERGE_INFO_COLS, dtype=np.int32)
    work = meta[:n_work * WORK_COLS].reshape(n_work, WORK_COLS)
    info = meta[n_work * WORK_COLS:].reshape(n_merge, MERGE_INFO_COLS)
    if splits or packed is not None:  # the graph grid's or the packed rows' idle items
        work[:, 0] = -1
        work[:, 7] = -1
    lens_req = lens[req]
    if packed is not None:
        start, end = lo[req] + seg_lo, lo[req] + seg_hi
    else:
        req_chunk = chunk[req] if chunk is not None else 0
        start = lo[req] + sidx * req_chunk
        end = np.minimum(start + req_chunk, lens_req) if chunk is not None else lens_req
    work[items, 0] = req
    work[items, 1] = page_base[req]
    work[items, 2] = start
    work[items, 3] = end
    work[items, 4] = lens_req
    work[items, 5] = slot_of
    work[items, 6] = sidx == 0
    work[items, 7] = merge_row_of
    info[:, 0] = (merge_rows if line is None else line[merge_rows]) * q_len
    info[:, 1] = merge_first
    info[:, 2] = nsplit[merge_rows]
    # CUDA graphs: the most chunks a request can get (fixed by the batch size, as the kernel
    # variant a captured graph replays must be)
    max_chunks = splits if splits else int(nsplit.max())
    return WorkArray(meta, n_work, n_merge, n_partial, max_chunks, items_per_program)
