"""Block-table decode calls planned without reading the lengths (FlashInfer's
``trtllm_batch_decode_with_kv_cache`` and ``xqa``).

A backend whose decode kernel reads the block table and seq_lens on the device
(`Backend.reads_block_tables`: fa2) gets them as they are. Its plan is sized from the batch size
and a bound on the lengths (`planning_bound`: the caller's max_seq_len, or the table's row,
rounded up to a power of two pages), so a call reads nothing back from the GPU, and once a call
of its shapes ran eagerly the next ones can be captured in a CUDA graph. The plan is kept in
`planned.block_table_plans` per problem, device, batch size, sm_scale, workspace, backend request
and bound; a call with other table or seq_lens tensors refreshes it (`Backend.replan`).

The values are not checked on the device: the kernel clamps each length to its table row and each
page index to the cache (a bad entry reads the wrong page, never outside the cache). They are read
and checked on the host when they are there anyway (CPU tensors) and with
FLASHDISPATCH_CHECK_INPUTS=1 (`checks.device_values_checked`; a host sync, skipped while a CUDA
graph is being captured), as the cuDNN entry points do.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .backends.base import AttentionParams, PagedKV
from .dispatch.problem import Problem, device_of
from .dispatch.registry import get_backend
from .dispatch.select import select
from .page import SEQ_LENS_DTYPES, block_table_to_indptr
from .planned import PlannedAttention, block_table_plans, host_workload


def planning_bound(max_seq_len: int | None, width: int, page_size: int) -> int:
    """The KV tokens per request a block-table plan assumes: ``max_seq_len`` (None: the table's
    whole row of ``width`` pages) rounded up to a power of two pages, at most the row."""
    pages = width if max_seq_len is None else -(-max_seq_len // page_size)
    pages = min(1 << max(pages - 1, 0).bit_length(), width)
    return pages * page_size


def table_tensors(block_tables, seq_lens, batch: int, device: torch.device):
    """(block_tables, int32 seq_lens) when both are tensors on ``device`` that a kernel can read as
    they are (a ``[batch, width]`` int32 table, ``batch`` integer lengths), else None (the caller
    converts the table on the host)."""
    if not (isinstance(block_tables, torch.Tensor) and isinstance(seq_lens, torch.Tensor)):
        return None
    if block_tables.device != device or seq_lens.device != device or block_tables.dtype != torch.int32:
        return None
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        return None
    if seq_lens.dtype not in SEQ_LENS_DTYPES or seq_lens.numel() != batch:
        return None
    lens = seq_lens.reshape(-1)
    if lens.dtype != torch.int32 or lens.stride(0) != 1:
        lens = lens.to(torch.int32).contiguous()  # (on the device: no host read)
    return block_tables, lens


def check_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, kv: PagedKV, page_size: int,
                       q_len: int, table_name: str = "block_tables") -> None:
    """Read the lengths and used pages and refuse what the kernel would clamp or the request
    cannot be: a length that its row cannot hold, a request of fewer KV tokens than query rows
    (an empty one gets 0 and lse -inf), a page outside the cache (see the module docstring for
    when this runs)."""
    tables = block_table_to_indptr(block_tables, seq_lens, page_size)
    check_queries_fit(np.full(len(tables.kv_lens), q_len), tables.kv_lens.numpy())
    check_table_pages(tables.max_page, kv, table_name)


def check_table_pages(max_page: int, kv: PagedKV, table_name: str = "block_tables") -> None:
    """The largest page a block table uses must be a page of the cache."""
    if max_page >= kv.num_pages:
        raise ValueError(f"{table_name} references page {max_page}, but the cache has only {kv.num_pages} pages")


def check_queries_fit(qo_lens: np.ndarray, kv_lens: np.ndarray) -> None:
    """Refuse a request of fewer KV tokens than query rows (its KV holds its own new tokens); an
    empty request is accepted (0 and lse -inf)."""
    short = np.nonzero((qo_lens > kv_lens) & (kv_lens > 0))[0]
    if short.size:
        b = int(short[0])
        raise ValueError(f"request {b} has {int(qo_lens[b])} query tokens but only {int(kv_lens[b])} KV tokens")


def plan_block_table(problem: Problem, torch_device: torch.device, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, bound: int, *, sm_scale: float, workspace: torch.Tensor,
                     requested: str, total_q: int) -> PlannedAttention | None:
    """The kept plan of a block-table decode call (module docstring), refreshed for these tensors,
    or a new one; None when the selected backend does not read block tables (the caller converts
    the table and plans as before)."""
    batch = block_tables.shape[0]
    key = (problem, torch_device, batch, sm_scale, workspace.data_ptr(), workspace.numel(), requested, bound)
    planned = block_table_plans.lookup(key)
    if planned is not None:
        old = planned.params
        if (old.block_tables.data_ptr() == block_tables.data_ptr() and old.block_tables.shape == block_tables.shape
                and old.block_tables.stride() == block_tables.stride()
                and old.kv_lens.data_ptr() == seq_lens.data_ptr()):
            return planned  # the same tensors (a serving engine's persistent buffers): nothing to refresh
        params = _table_params(block_tables, seq_lens, bound, problem.q_len_per_req, sm_scale, workspace)
        plan = planned.backend.replan(planned.plan, problem, planned.device, params)
        if plan is not None:
            return block_table_plans.keep(key, dataclasses.replace(planned, params=params, plan=plan))
    device = device_of(torch_device)
    params = _table_params(block_tables, seq_lens, bound, problem.q_len_per_req, sm_scale, workspace)
    decision = select(problem, device, host_workload(params.qo_lens_host, params.kv_lens_host), requested)
    backend = get_backend(decision.backend)
    if not backend.reads_block_tables(problem):
        return None
    plan = backend.plan(problem, device, params)
    return block_table_plans.keep(key, PlannedAttention(problem, device, torch_device, decision, params, plan,
                                                        backend, total_q))


def _table_params(block_tables: torch.Tensor, seq_lens: torch.Tensor, bound: int, q_len: int, sm_scale: float,
                  workspace: torch.Tensor) -> AttentionParams:
    """`AttentionParams` in block-table form (`AttentionParams.block_tables`)."""
    batch = block_tables.shape[0]
    params = AttentionParams(qo_indptr=None, kv_indptr=None, kv_lens=seq_lens, qo_lens_host=[q_len] * batch,
                             kv_lens_host=np.full(batch, bound, np.int64), sm_scale=sm_scale,
                             workspace=workspace, block_tables=block_tables)
    params.set_kv_lens_stats(batch * bound, bound if batch else 0)
    return params
