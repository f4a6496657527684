"""fa2 decode's workspace regions: the split-KV partials in the float workspace (lse, then the
outputs) and, under CUDA graphs, the plan arrays and fused-merge counters in the wrapper's int
workspace (at fixed offsets, the addresses a captured graph replays)."""
from __future__ import annotations

import torch

from ..base import AttentionParams

ALIGN = 256  # byte alignment of the workspace regions


def align(n: int) -> int:
    """``n`` bytes rounded up to the next `ALIGN` boundary."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def counters_offset(n_ints: int) -> int:
    """Where the fused merge's counters start after ``n_ints`` int32 of plan arrays (work rows,
    then merge rows), in int32: the next `ALIGN`-byte boundary (under CUDA graphs the same place
    for the work array and the kernel's own split)."""
    return align(n_ints * 4) // 4


def workspace_bytes(params: AttentionParams) -> int:
    """Bytes of the plan's float workspace (0: none)."""
    ws = params.workspace
    return 0 if ws is None else ws.numel() * ws.element_size()


def partial_bytes(n_partial: int, rows: int, head_dim: int) -> int:
    """Workspace bytes of ``n_partial`` split-KV partials of ``rows`` query rows each: their lse,
    then their outputs."""
    rows *= n_partial
    return align(rows * 4) + rows * head_dim * 4


def carve_partials(params: AttentionParams, n_partial: int, q_len: int, heads: int,
                   head_dim: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(lse, out, bytes): the split-KV partials' float32 views at fixed offsets of the (possibly
    shared) float workspace, scratch of run(); (None, None, 0) for none. Raises ValueError where
    the workspace is too small."""
    if not n_partial:
        return None, None, 0
    rows = n_partial * q_len * heads
    need, have = partial_bytes(n_partial, q_len * heads, head_dim), workspace_bytes(params)
    if need > have:
        raise ValueError(f"float_workspace_buffer too small: {have} bytes, this decode plan needs {need} "
                         f"bytes ({n_partial} split-KV partials of {q_len}x{heads}x{head_dim} float32)")
    ws, lse_bytes = params.workspace, align(rows * 4)
    return (ws[:rows * 4].view(torch.float32),
            ws[lse_bytes:lse_bytes + rows * head_dim * 4].view(torch.float32), need)


def int_workspace_ints(params: AttentionParams, count: int) -> torch.Tensor:
    """The first ``count`` int32 of the wrapper's own int workspace (CUDA graphs)."""
    iws = params.int_workspace
    have = 0 if iws is None else iws.numel() * iws.element_size()
    if have < count * 4:
        raise ValueError(f"fa2 with use_cuda_graph needs {count * 4} bytes of int workspace, got {have}")
    return iws.view(torch.uint8).reshape(-1)[:count * 4].view(torch.int32)
