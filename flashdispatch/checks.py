"""Argument checks shared by the public API: each raises ValueError/TypeError naming the
argument, the value found and what is accepted, before anything is launched."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .backends.base import PagedKV
from .dispatch.problem import LAYOUTS, POS_ENCODINGS

_DTYPE_BY_NAME = {
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2, "e5m2": torch.float8_e5m2,
}
ATTENTION_DTYPES = frozenset(_DTYPE_BY_NAME.values())


def as_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """Turn a dtype or its name ('float16', 'bfloat16', ...) into a torch.dtype."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = _DTYPE_BY_NAME.get(value.replace("torch.", ""))
        if dtype is None:
            raise ValueError(f"{name}={value!r} is not a dtype name; accepted: {sorted(_DTYPE_BY_NAME)}")
    else:
        raise TypeError(f"{name} must be a torch.dtype or a str, got {type(value).__name__}")
    if dtype not in ATTENTION_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; accepted: float16, bfloat16, float32, "
                         "float8_e4m3fn, float8_e5m2")
    return dtype


def check_tensor(t, name: str, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, shape: Sequence[int | None] | None = None) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape (None: any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        accepted = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}.dtype={str(t.dtype).replace('torch.', '')} is not accepted; expected {accepted}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but the planned device is {device}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} has shape {list(t.shape)}, expected {want}")
    return t


def check_positive_int(value, name: str, allowed: Sequence[int] | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={value} not in {sorted(allowed)}")
    return value


def check_heads(num_qo_heads, num_kv_heads) -> None:
    check_positive_int(num_qo_heads, "num_qo_heads")
    check_positive_int(num_kv_heads, "num_kv_heads")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def check_layout(kv_layout) -> str:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} not in {list(LAYOUTS)}")
    return kv_layout


def check_pos_encoding(mode) -> str:
    if mode not in POS_ENCODINGS:
        raise ValueError(f"pos_encoding_mode={mode!r} not in {list(POS_ENCODINGS)}")
    return mode


def check_window_left(window_left) -> int:
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1 disables the window)")
    return window_left


def check_soft_cap(logits_soft_cap) -> float:
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be None or a finite float >= 0")
    return cap


def check_scale(value, name: str, default: float) -> float:
    if value is None:
        return default
    scale = float(value)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}={value!r} must be a finite float > 0")
    return scale


def check_run_scale(value, name: str, device: torch.device):
    """A run-time fp8 scale: None, a float, or a 1-element float32 tensor on the run device."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value is None else float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {list(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device}, but the planned device is {device}")
        return value
    raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(value).__name__}")


def host_indptr(t, name: str, length: int | None = None) -> torch.Tensor:
    """Check an int32 indptr and return it on the host as int64: starts at 0, non-decreasing."""
    check_tensor(t, name, ndim=1, dtypes=(torch.int32,))
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} has {t.numel()} entries, expected {length} (batch_size + 1)")
    if t.numel() < 1:
        raise ValueError(f"{name} must have at least one entry (batch_size + 1)")
    h = t.detach().to("cpu", torch.int64)
    if h[0] != 0:
        raise ValueError(f"{name}[0]={int(h[0])}, must be 0")
    if h.numel() > 1 and bool((h[1:] < h[:-1]).any()):
        i = int(torch.nonzero(h[1:] < h[:-1])[0]) + 1
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={int(h[i])} < {name}[{i - 1}]={int(h[i - 1])}")
    return h


def paged_kv_lengths(kv_indptr_h: torch.Tensor, last_page_len, page_size: int) -> torch.Tensor:
    """kv_len of each request from page counts and last_page_len, checking last_page_len's range."""
    check_tensor(last_page_len, "last_page_len", ndim=1, dtypes=(torch.int32,))
    batch = kv_indptr_h.numel() - 1
    if last_page_len.numel() != batch:
        raise ValueError(f"last_page_len has {last_page_len.numel()} entries, expected batch_size={batch}")
    last = last_page_len.detach().to("cpu", torch.int64)
    pages = kv_indptr_h[1:] - kv_indptr_h[:-1]
    bad = ((pages > 0) & ((last < 1) | (last > page_size))) | ((pages == 0) & (last != 0))
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"last_page_len[{b}]={int(last[b])} is outside [1, page_size={page_size}] "
                         f"(0 only for a request with no pages; request {b} has {int(pages[b])} pages)")
    return torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))


def check_page_indices(indices, kv_indptr_h: torch.Tensor) -> int:
    """Check the page indices (int32, enough of them, >= 0); return the largest index used (-1 if none)."""
    check_tensor(indices, "indices", ndim=1, dtypes=(torch.int32,))
    used = int(kv_indptr_h[-1])
    if indices.numel() < used:
        raise ValueError(f"indices has {indices.numel()} entries, but indptr[-1]={used} pages are referenced")
    if used == 0:
        return -1
    low, high = indices[:used].aminmax()  # on the device: two numbers come back, not the table
    low, high = torch.stack([low, high]).tolist()
    if low < 0:
        raise ValueError(f"indices holds a negative page index {low}")
    return high


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str, name: str = "paged_kv_cache") -> PagedKV:
    """Split a 5-D [pages, 2, ...] cache or a (k, v) tuple of 4-D tensors into a `PagedKV`."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{name} as a tuple must be (k_cache, v_cache), got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        check_tensor(k, f"{name}[0]", ndim=4)
        check_tensor(v, f"{name}[1]", ndim=4)
        if k.device != v.device or k.dtype != v.dtype:
            raise ValueError(f"{name}: k and v caches differ in device or dtype ({k.device}/{k.dtype} vs "
                             f"{v.device}/{v.dtype})")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"{name}: k cache {list(k.shape)} and v cache {list(v.shape)} differ")
        return PagedKV(k, v, kv_layout)
    check_tensor(paged_kv_cache, name)
    if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
        raise ValueError(f"{name} must be 5-D [pages, 2, ...] or a (k, v) tuple of 4-D tensors, "
                         f"got shape {list(paged_kv_cache.shape)}")
    return PagedKV(paged_kv_cache[:, 0], paged_kv_cache[:, 1], kv_layout)


def check_paged_kv(kv: PagedKV, *, num_kv_heads: int, page_size: int, head_dim_qk: int, head_dim_vo: int,
                   dtype: torch.dtype, device: torch.device, max_page_index: int, name: str = "paged_kv_cache") -> None:
    """Check a paged cache against the plan: layout dims, dtype, device and that every planned page exists."""
    for part, t, d in (("k", kv.k, head_dim_qk), ("v", kv.v, head_dim_vo)):
        if kv.layout == "NHD":
            expected = [None, page_size, num_kv_heads, d]
        else:
            expected = [None, num_kv_heads, page_size, d]
        try:
            check_tensor(t, f"{name} ({part}, {kv.layout})", shape=expected)
        except ValueError as e:
            raise ValueError(f"{e}; is the cache in {'HND' if kv.layout == 'NHD' else 'NHD'} layout? "
                             f"kv_layout={kv.layout!r} was given") from None
        if t.dtype != dtype:
            raise TypeError(f"{name} ({part}).dtype={t.dtype} but the plan has kv_data_type={dtype}")
        if t.device != device:
            raise ValueError(f"{name} ({part}) is on {t.device}, but the planned device is {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} ({part}) must be contiguous in its last (head_dim) dimension")
    if max_page_index >= kv.num_pages:
        raise ValueError(f"indices reference page {max_page_index}, but {name} has only {kv.num_pages} pages")


def check_out(out, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Check a user-provided output buffer exactly (shape, dtype, device)."""
    check_tensor(out, name, dtypes=(dtype,), device=device, shape=list(shape))
    return out


def reject_extra_args(args: tuple, method: str) -> None:
    if args:
        raise TypeError(f"{method}() got {len(args)} extra positional argument(s): *args feed custom JIT "
                        "kernels, which flashdispatch does not have")
