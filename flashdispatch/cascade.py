"""Combine partial attention results by their lse: ``merge_state``, ``merge_states``,
``merge_state_in_place`` (FlashInfer's ``flashinfer.cascade``). lse values are base 2."""
from __future__ import annotations

import torch

from .backends.base import MergeInputs
from .checks import check_distinct_elements, check_tensor
from .dispatch.problem import Problem, device_of
from .dispatch.registry import get_backend
from .dispatch.select import select

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _merge(v: torch.Tensor, s: torch.Tensor, v_out=None, s_out=None):
    """v [seq, states, heads, dim], s [seq, states, heads] -> merged (v_out, s_out)."""
    check_tensor(v, "v", ndim=4, dtypes=_V_DTYPES)
    check_tensor(s, "s", dtypes=(torch.float32,), device=v.device, shape=list(v.shape[:3]))
    seq, states, heads, dim = v.shape
    if heads < 1 or dim < 1:
        raise ValueError(f"v has shape {list(v.shape)}: num_heads and head_dim must be at least 1")
    if v_out is None:
        v_out = torch.empty(seq, heads, dim, dtype=v.dtype, device=v.device)
    if s_out is None:
        s_out = torch.empty(seq, heads, dtype=torch.float32, device=v.device)
    if states == 0:  # nothing merged: the empty state
        v_out.zero_()
        s_out.fill_(float("-inf"))
        return v_out, s_out
    problem = Problem("merge", v.dtype, v.dtype, v.dtype, heads, heads, dim, dim, return_lse=False)
    decision = select(problem, device_of(v.device), requested="auto")
    get_backend(decision.backend).merge_states(MergeInputs(v, s, v_out, s_out))
    return v_out, s_out


def _check_states(v_a, s_a, v_b, s_b, names: tuple[str, str, str, str]) -> None:
    """Two states of the same [seq_len, num_heads, head_dim] shape, with float32 lse [seq_len, num_heads]."""
    check_tensor(v_a, names[0], ndim=3, dtypes=_V_DTYPES)
    if v_a.shape[1] < 1 or v_a.shape[2] < 1:
        raise ValueError(f"{names[0]} has shape {list(v_a.shape)}: num_heads and head_dim must be at least 1")
    check_tensor(v_b, names[2], dtypes=(v_a.dtype,), device=v_a.device, shape=list(v_a.shape))
    for name, lse in ((names[1], s_a), (names[3], s_b)):
        check_tensor(lse, name, dtypes=(torch.float32,), device=v_a.device, shape=list(v_a.shape[:2]))


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two attention states.

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        Attention outputs of two KV segments, shape ``[seq_len, num_heads, head_dim]``.
    s_a, s_b : torch.Tensor
        Their base-2 logsumexp, float32, shape ``[seq_len, num_heads]``.

    Returns
    -------
    (V, S) : the merged output ``[seq_len, num_heads, head_dim]`` and lse ``[seq_len, num_heads]``.
    """
    _check_states(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    return _merge(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v, v_other : ``[seq_len, num_heads, head_dim]``; s, s_other : float32 ``[seq_len, num_heads]``.
    mask : optional bool ``[seq_len]``; rows where it is False are left unchanged.
    """
    _check_states(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    check_distinct_elements(v, "v")
    check_distinct_elements(s, "s")
    if mask is not None:
        check_tensor(mask, "mask", dtypes=(torch.bool,), device=v.device, shape=[v.shape[0]])
    v_new, s_new = _merge(torch.stack([v, v_other], 1), torch.stack([s, s_other], 1))
    if mask is not None:
        v_new = torch.where(mask[:, None, None], v_new, v)
        s_new = torch.where(mask[:, None], s_new, s)
    v.copy_(v_new)
    s.copy_(s_new)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Merge several attention states.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``.
    s : torch.Tensor
        float32 base-2 lse, ``[seq_len, num_states, num_heads]``.

    Returns
    -------
    (V, S) : ``[seq_len, num_heads, head_dim]`` and ``[seq_len, num_heads]``.
    """
    return _merge(v, s)
