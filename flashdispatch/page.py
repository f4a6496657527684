"""Paged-KV helpers: ``get_seq_lens``, ``get_batch_indices_positions``, ``append_paged_kv_cache``."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .checks import (MAX_KV_TOKENS, check_distinct_elements, check_layout, check_page_size, check_tensor,
                     unpack_paged_kv_cache)


_INT_DTYPES = (torch.int32, torch.int64)


def _check_lengths_pair(indptr, indptr_name: str, per_request, per_request_name: str) -> None:
    """A 1-D integer indptr ``[batch + 1]`` and a per-request tensor ``[batch]`` on its device (their
    values are not read: these helpers run on the device without a host sync)."""
    check_tensor(indptr, indptr_name, ndim=1, dtypes=_INT_DTYPES)
    if indptr.numel() < 1:
        raise ValueError(f"{indptr_name} is empty: it needs batch_size + 1 entries")
    check_tensor(per_request, per_request_name, dtypes=_INT_DTYPES, device=indptr.device,
                 shape=(indptr.numel() - 1,))


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of each request: ``(num_pages - 1) * page_size + last_page_len`` (0 with no pages).

    Parameters
    ----------
    kv_indptr : torch.Tensor
        Page indptr, shape ``[batch_size + 1]``.
    kv_last_page_len : torch.Tensor
        Entries in each request's last page, shape ``[batch_size]``.
    page_size : int
        Tokens per page.
    """
    _check_lengths_pair(kv_indptr, "kv_indptr", kv_last_page_len, "kv_last_page_len")
    check_page_size(page_size)
    pages = kv_indptr[1:] - kv_indptr[:-1]
    lens = (pages - 1).clamp(min=0) * page_size + kv_last_page_len
    return torch.where(pages > 0, lens, torch.zeros_like(lens))


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int):
    """For each of the ``nnz`` appended tokens: its request index and its position in the request
    (after the append: ``seq_lens`` already counts the new tokens).

    Returns ``(batch_indices, positions)``, both int32 of shape ``[nnz]``.
    """
    _check_lengths_pair(append_indptr, "append_indptr", seq_lens, "seq_lens")
    if isinstance(nnz, bool) or not isinstance(nnz, int) or not 0 <= nnz <= MAX_KV_TOKENS:
        raise ValueError(f"nnz={nnz!r} must be an int in [0, 2^31 - 1] (append_indptr[-1], the appended tokens)")
    counts = (append_indptr[1:] - append_indptr[:-1]).to(torch.int64)
    batch = torch.repeat_interleave(torch.arange(counts.numel(), device=append_indptr.device), counts, output_size=nnz)
    offset = torch.arange(nnz, device=append_indptr.device) - append_indptr[batch].to(torch.int64)
    positions = seq_lens.to(torch.int64)[batch] - counts[batch] + offset
    return batch.to(torch.int32), positions.to(torch.int32)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write new keys/values into a paged cache in place.

    Parameters
    ----------
    append_key, append_value : torch.Tensor
        ``[nnz, num_kv_heads, head_dim]`` tokens to append.
    batch_indices, positions : torch.Tensor
        Request index and position of each token (see `get_batch_indices_positions`).
    paged_kv_cache :
        5-D ``[pages, 2, ...]`` tensor or ``(k_cache, v_cache)`` tuple, layout ``kv_layout``.
    kv_indices, kv_indptr, kv_last_page_len : torch.Tensor
        The page table after the append (``kv_last_page_len`` is unused by the write itself).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.

    Index values are not read on the host (that would wait for the GPU): a request index, position
    or page index out of range is clamped into the tables and the cache, so a bad one writes to a
    wrong slot of the cache, never outside it.
    """
    check_layout(kv_layout)
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    heads, page_size = (kv.k.shape[2], kv.k.shape[1]) if kv_layout == "NHD" else kv.k.shape[1:3]
    check_tensor(append_key, "append_key", ndim=3, shape=[None, heads, kv.k.shape[3]], device=kv.k.device)
    check_tensor(append_value, "append_value", shape=[append_key.shape[0], heads, kv.v.shape[3]], device=kv.k.device)
    for t, name in ((append_key, "append_key"), (append_value, "append_value")):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}.dtype={str(t.dtype).replace('torch.', '')} is not accepted; expected a floating "
                            f"dtype (cast to the cache's {str(kv.k.dtype).replace('torch.', '')})")
    check_distinct_elements(kv.k, "paged_kv_cache (k)")
    check_distinct_elements(kv.v, "paged_kv_cache (v)")
    nnz = append_key.shape[0]
    for t, name, n in ((batch_indices, "batch_indices", nnz), (positions, "positions", nnz),
                       (kv_indices, "kv_indices", None), (kv_indptr, "kv_indptr", None)):
        check_tensor(t, name, ndim=1, dtypes=(torch.int32, torch.int64), device=kv.k.device, shape=[n])
    if kv_indptr.numel() < 2 or kv_indices.numel() < 1 or kv.k.shape[0] < 1:
        if nnz:
            raise ValueError(f"no page to append to: kv_indptr has {kv_indptr.numel()} entries, kv_indices "
                             f"{kv_indices.numel()}, the cache {kv.k.shape[0]} pages")
        return
    pos = positions.to(torch.int64).clamp(min=0)
    req = batch_indices.to(torch.int64).clamp(0, kv_indptr.numel() - 2)
    at = (kv_indptr.to(torch.int64)[req] + pos // page_size).clamp(0, kv_indices.numel() - 1)
    page = kv_indices.to(torch.int64)[at].clamp(0, kv.k.shape[0] - 1)
    slot = pos % page_size
    if kv_layout == "NHD":
        kv.k[page, slot] = append_key.to(kv.k.dtype)
        kv.v[page, slot] = append_value.to(kv.v.dtype)
    else:
        kv.k.permute(0, 2, 1, 3)[page, slot] = append_key.to(kv.k.dtype)
        kv.v.permute(0, 2, 1, 3)[page, slot] = append_value.to(kv.v.dtype)


class PageTables(NamedTuple):
    """`block_table_to_indptr`'s result."""
    indptr: torch.Tensor  # [batch + 1] int32, host
    indices: torch.Tensor  # [indptr[-1]] int32, on block_tables' device
    last_page_len: torch.Tensor  # [batch] int32, host
    kv_lens: torch.Tensor  # [batch] int64, host
    max_page: int | None  # the largest page index in use (-1: none); None where not read (check_indices=False)


SEQ_LENS_DTYPES = (torch.int32, torch.uint32, torch.int64)


def host_seq_lens(seq_lens, name: str, batch: int, rows: str) -> np.ndarray:
    """``seq_lens`` (an int32/uint32/int64 tensor of ``batch`` entries, any shape) read on the host
    as int64, each in [0, 2^31 - 1]; ``rows`` says where ``batch`` comes from in the error."""
    check_tensor(seq_lens, name, dtypes=SEQ_LENS_DTYPES)
    if seq_lens.is_meta:
        raise ValueError(f"{name} is on meta: it must hold values (cpu or cuda)")
    lens = seq_lens.detach().reshape(-1).to("cpu", torch.int64).numpy()
    if lens.size != batch:
        raise ValueError(f"{name} has {lens.size} entries, but {rows.format(batch=batch)}")
    if batch and lens.min() < 0:
        raise ValueError(f"{name} holds a negative length {int(lens.min())}")
    if batch and lens.max() > MAX_KV_TOKENS:
        raise ValueError(f"{name} holds a length {int(lens.max())} above 2^31 - 1 (int32 token counts)")
    return lens


def block_table_to_indptr(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, *,
                          seq_lens_name: str = "seq_lens", check_indices: bool = True) -> PageTables:
    """Convert a ``[batch, max_pages]`` block table and KV lengths into FlashInfer's page table:
    kv_indptr, kv_indices (each request's first ``ceil(seq_lens[b] / page_size)`` table entries,
    end to end) and kv_last_page_len, with the kv lengths. Checks that each request's pages fit
    in its row of the table and, with ``check_indices``, that no page in use is negative (and
    reads the largest).

    The lengths are read on the host (a GPU ``seq_lens`` waits for the GPU); the table is
    gathered on its own device, so from a GPU table only the pages' (min, max), with
    ``check_indices``, cross to the host, whatever the table's width."""
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32, torch.uint32))
    if block_tables.dtype == torch.uint32:  # (FlashInfer's documented dtype) an index >= 2^31 reads negative
        block_tables = block_tables.view(torch.int32)
    if block_tables.is_meta:
        raise ValueError("block_tables is on meta: it must hold values (cpu or cuda)")
    check_page_size(page_size)
    batch, max_pages = block_tables.shape
    lens = host_seq_lens(seq_lens, seq_lens_name, batch, "block_tables has {batch} rows")
    pages = (lens + page_size - 1) // page_size
    if batch and pages.max() > max_pages:
        b = int(pages.argmax())
        raise ValueError(f"{seq_lens_name}[{b}]={int(lens[b])} needs {int(pages[b])} pages of page_size={page_size}, "
                         f"but block_tables has only {max_pages} columns (is the cache layout right?)")
    indptr = np.zeros(batch + 1, np.int64)
    np.cumsum(pages, out=indptr[1:])
    total = int(indptr[-1])
    # entry i of request b is table[b, i - indptr[b]]: its row-major position, gathered on the
    # table's device (torch.take reads any strides as row-major)
    at = np.arange(total, dtype=np.int64) + np.repeat(np.arange(batch, dtype=np.int64) * max_pages - indptr[:-1],
                                                      pages)
    indices = torch.take(block_tables.detach(), torch.from_numpy(at).to(block_tables.device, non_blocking=True))
    max_page = None
    if check_indices:
        low, max_page = torch.stack(torch.aminmax(indices)).tolist() if total else (0, -1)  # one read
        if low < 0:
            raise ValueError(f"block_tables holds a negative page index {low} among the pages in use")
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
    return PageTables(torch.from_numpy(indptr.astype(np.int32)), indices, torch.from_numpy(last.astype(np.int32)),
                      torch.from_numpy(lens), max_page)
