"""Argument checks shared by the public API: each raises ValueError/TypeError naming the
argument, the value found and what is accepted, before anything is launched."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .backends.base import PagedKV
from .dispatch.problem import DTYPE_BY_NAME, LAYOUTS, POS_ENCODINGS, SCALAR_LIMIT
from .environ import env_get

ATTENTION_DTYPES = frozenset(DTYPE_BY_NAME.values())


def as_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """Turn a dtype or its name ('float16', 'bfloat16', ...) into a torch.dtype."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = DTYPE_BY_NAME.get(value.replace("torch.", ""))
        if dtype is None:
            raise ValueError(f"{name}={value!r} is not a dtype name; accepted: {sorted(DTYPE_BY_NAME)}")
    else:
        raise TypeError(f"{name} must be a torch.dtype or a str, got {type(value).__name__}")
    if dtype not in ATTENTION_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; accepted: float16, bfloat16, float32, "
                         "float8_e4m3fn, float8_e5m2")
    return dtype


def attention_dtypes(q_data_type, kv_data_type, o_data_type) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(q, kv, o) dtypes of a plan: kv defaults to q, o to q (fp16 for an fp8 q), as in FlashInfer."""
    q_dtype = as_dtype(q_data_type, "q_data_type")
    kv_dtype = as_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q_dtype
    o_dtype = as_dtype(o_data_type, "o_data_type") if o_data_type is not None else (
        q_dtype if q_dtype.itemsize > 1 else torch.float16)
    return q_dtype, kv_dtype, o_dtype


def check_rope(rope_scale, rope_theta) -> dict:
    """The RoPE scalars of a plan with their defaults (scale 1, theta 1e4), both finite and > 0."""
    return dict(rope_scale=check_scale(rope_scale, "rope_scale", 1.0),
                rope_theta=check_scale(rope_theta, "rope_theta", 1e4))


def check_tensor(t, name: str, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, shape: Sequence[int | None] | None = None,
                 contiguous: bool = False) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape (None: any size),
    and contiguous when asked (a buffer read or written as flat memory)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is None and t.is_meta:  # (with a device, the check below names both)
        raise ValueError(f"{name} is on the meta device (it holds no data)")
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
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {list(t.shape)} and stride {t.stride()}")
    return t


def check_positive_int(value, name: str, allowed: Sequence[int] | None = None, high: int | None = None) -> int:
    """``value`` as a positive int (at most ``high`` when given, one of ``allowed`` when given)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={value} not in {sorted(allowed)}")
    if high is not None and value > high:
        raise ValueError(f"{name}={_shown(value)} is above {high}")
    return value


MAX_KV_TOKENS = (1 << 31) - 1  # the kernels count a request's tokens (and a page's) in int32


def check_page_size(page_size) -> int:
    """A positive int page size the kernels can count in int32."""
    check_positive_int(page_size, "page_size")
    if page_size > MAX_KV_TOKENS:
        raise ValueError(f"page_size={page_size} is above 2^31 - 1 (the kernels count tokens in int32)")
    return page_size


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
    if (isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1
            or window_left > MAX_KV_TOKENS):
        raise ValueError(f"window_left={window_left!r} must be an int in [-1, 2^31 - 1] (-1 disables the window)")
    return window_left


def _shown(value) -> str:
    """repr(value) for an error, a long one (an int of hundreds of digits) cut to its start."""
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:32]}... ({len(text)} characters)"


def _float_in(value, name: str, accepted: str, low: float, high: float) -> float:
    """``value`` (a real number, or a 1-element tensor: read on the host) as a float in
    [low, high], else TypeError/ValueError naming ``name`` with ``accepted``."""
    if isinstance(value, (str, bytes, bool, np.bool_, complex, np.complexfloating)) or (
            isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_complex())):
        raise TypeError(f"{name}={_shown(value)} must be {accepted}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={_shown(value)} must be {accepted}") from None
    except OverflowError:  # an int past float's range
        x = math.inf
    if not low <= x <= high:  # (NaN fails it)
        raise ValueError(f"{name}={_shown(value)} must be {accepted}")
    return x


def check_soft_cap(logits_soft_cap) -> float:
    if logits_soft_cap is None:
        return 0.0
    return _float_in(logits_soft_cap, "logits_soft_cap", "None or a float in [0, 1e30]", 0.0, SCALAR_LIMIT)


def check_scale(value, name: str, default: float) -> float:
    if value is None:
        return default
    return _float_in(value, name, "a float in [1e-30, 1e30]", 1.0 / SCALAR_LIMIT, SCALAR_LIMIT)


def check_run_scale(value, name: str, device: torch.device):
    """A run-time q/k/v scale: None, a float of magnitude <= 1e30 (negative scales are computed as
    given), or a 1-element tensor on the run device (its value is not read: no host sync)."""
    if value is None or (type(value) is float and -SCALAR_LIMIT <= value <= SCALAR_LIMIT):
        return value
    if not isinstance(value, torch.Tensor):
        return _float_in(value, name, "a float in [-1e30, 1e30] or a 1-element tensor", -SCALAR_LIMIT, SCALAR_LIMIT)
    if value.numel() != 1:
        raise ValueError(f"{name} must hold one element, got shape {list(value.shape)}")
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name}.dtype={value.dtype}: a scale tensor must be real")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, but the planned device is {device}")
    return value


def scale_product(a, b, names: str):
    """a x b of two scales (floats or 1-element tensors); two floats must multiply to [1e-30, 1e30]."""
    if isinstance(a, float) and isinstance(b, float) and not 1.0 / SCALAR_LIMIT <= a * b <= SCALAR_LIMIT:
        raise ValueError(f"{names} = {a} x {b} = {a * b:.3g} must be in [1e-30, 1e30]")
    return a * b


def check_score_scale(sm_scale: float, q_scale, k_scale) -> None:
    """The scores' scale, the product of the float factors given (a tensor's value is not read),
    within 1e30 in magnitude: past it a score overflows float32 and the softmax gives NaN."""
    product = sm_scale
    for factor in (q_scale, k_scale):
        if factor is not None and not isinstance(factor, torch.Tensor):
            product *= factor
    if abs(product) > SCALAR_LIMIT:
        raise ValueError(f"sm_scale x q_scale x k_scale = {product:.3g}: the scores' scale must stay within 1e30 "
                         "in magnitude (float32 scores would overflow)")


# numpy's reductions without ndarray.min/max's Python wrapper (~1 us a call, several per plan())
_min, _max = np.minimum.reduce, np.maximum.reduce
_MAX_INDEX_ENTRIES = (1 << 31) - 1  # the kernels address index tensors with int32 offsets


def check_index_tensor(t, name: str) -> torch.Tensor:
    """A 1-D int32 index tensor (indptr, page indices, lengths) of fewer than 2^31 entries, with
    values (not on the meta device)."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1):
        check_tensor(t, name, ndim=1, dtypes=(torch.int32,))
    if t.is_meta:
        raise ValueError(f"{name} is on meta: index tensors must hold values (cpu or cuda)")
    if t.numel() > _MAX_INDEX_ENTRIES:
        raise ValueError(f"{name} has {t.numel()} entries; at most 2^31 - 1 are supported (int32 offsets)")
    return t


def check_indptr_length(t: torch.Tensor, name: str, length: int | None = None) -> int:
    """An indptr's entry count (batch_size + 1): at least one, ``length`` when given."""
    n = t.numel()
    if length is not None and n != length:
        raise ValueError(f"{name} has {n} entries, expected {length} (batch_size + 1)")
    if n < 1:
        raise ValueError(f"{name} must have at least one entry (batch_size + 1)")
    return n


CHECK_INPUTS_ENV = "FLASHDISPATCH_CHECK_INPUTS"
"""The one switch for the input checks that need device values, read by the two functions below:

- unset (or any value but "0"/"1"): the wrappers' plan() checks the page indices it uses
  (`page_indices_checked`: their (min, max), one reduction on the device, read with the lengths
  plan() reads anyway); the plan-less cuDNN entry points check no device value (no host sync).
  A decode or paged prefill plan() whose lengths are on the host, with a backend that clamps
  page indices (fa2), does not wait for that reduction: the check ends at a later run() or
  plan() (`deferred_check.DeferredPageCheck._finish_page_check`).
- "0": no check at all: plan() skips the page-index check too, and an index outside the cache
  is read as it is, as in FlashInfer (for callers who guarantee valid indices), except by
  kernels that clamp page indices (fa2 decode and paged prefill read the last page instead).
- "1": the page-index check, and the plan-less cuDNN entry points read back their lengths, block
  table and offsets at every call and check them (`device_values_checked`; a host sync, skipped
  while a CUDA graph is being captured)."""


def page_indices_checked() -> bool:
    """Whether plan() checks the used page indices (on unless FLASHDISPATCH_CHECK_INPUTS=0; see
    `CHECK_INPUTS_ENV`)."""
    return env_get(CHECK_INPUTS_ENV) != "0"


def device_values_checked() -> bool:
    """Whether the plan-less cuDNN entry points read back and check their device values (only with
    FLASHDISPATCH_CHECK_INPUTS=1; see `CHECK_INPUTS_ENV`)."""
    return env_get(CHECK_INPUTS_ENV) == "1"


def host_arrays(tensors: Sequence[torch.Tensor],
                indices: torch.Tensor | None = None) -> tuple[list[np.ndarray], tuple[int, int] | None]:
    """Host int64 copies of small 1-D int32 ``tensors`` and, with ``indices``, the (min, max) of
    ``indices[:tensors[0][-1]]`` (the first tensor is their indptr; None when that is empty, or
    when FLASHDISPATCH_CHECK_INPUTS=0 turned the page-index check off), with one device read
    (`read_in_one_copy`: the table itself never travels)."""
    if indices is not None and not page_indices_checked():
        indices = None
    on_host = [t.is_cpu for t in tensors]
    if all(on_host) and (indices is None or indices.is_cpu):
        arrays = [t.numpy().astype(np.int64) for t in tensors]
        if indices is None:
            return arrays, None
        window = indices.numpy()[: max(int(arrays[0][-1]), 0)]
        return arrays, ((int(window.min()), int(window.max())) if window.size else None)
    devices = {t.device for t, host in zip(tensors, on_host) if not host}
    if indices is not None and not indices.is_cpu:
        devices.add(indices.device)
    if len(devices) > 1 or (indices is not None and indices.is_cpu):
        # spread over several devices: one copy each (correct, only slower)
        return host_arrays([t.cpu() for t in tensors], None if indices is None else indices.cpu())
    return read_in_one_copy(tensors, on_host, indices)


@functools.cache
def _device_read():
    """The `device_read` module, imported at the first device read (Triton: only where device
    values are read; a function-level import costs plan() ~4 us at each call)."""
    from . import device_read
    return device_read


def read_in_one_copy(tensors: Sequence[torch.Tensor], on_host: Sequence[bool],
                     indices: torch.Tensor | None) -> tuple[list[np.ndarray], tuple[int, int] | None]:
    """`host_arrays` for tensors on one device: those not ``on_host`` and the (min, max) of the
    used ``indices`` (counted by indptr = ``tensors[0]``, on the host or the device) come back
    from one kernel and one wait (`device_read.read_index_tensors`). Works on any device (the
    CPU tests run it, the kernel in Triton's interpreter)."""
    read_index_tensors = _device_read().read_index_tensors
    parts = [t for t, host in zip(tensors, on_host) if not host]
    used_host = int(tensors[0].numpy()[-1]) if on_host[0] else None
    if indices is not None and indices.numel() == 0:
        indices = None
    if parts or indices is not None:
        flat, minmax = read_index_tensors(parts, indices, used_host)
    else:
        flat, minmax = None, None
    arrays, offset = [], 0
    for t, host in zip(tensors, on_host):
        if host:
            arrays.append(t.numpy().astype(np.int64))
        else:
            n = t.numel()
            arrays.append(flat[offset:offset + n])  # (int64 already: the read's own copy)
            offset += n
    return arrays, minmax


class PagedTable(NamedTuple):
    """A paged table's checked host values (`paged_lengths`); the arrays are int64."""

    indptr: np.ndarray
    last_page_len: np.ndarray
    kv_lens: np.ndarray
    used_pages: int  # indptr[-1]
    kv_total: int
    kv_max: int  # 0 with no request
    index_range: tuple[int, int] | None  # (min, max) of the used page indices, as `host_arrays` reads it


def paged_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor | None, page_size: int,
                  names: tuple[str, str] = ("indptr", "last_page_len")) -> PagedTable:
    """Read and check a paged table's indptr (`check_indptr`) and last_page_len (`paged_kv_lengths`),
    both int32 of checked sizes, and work out its lengths; with ``indices``, the (min, max) of the
    used ones too (`host_arrays`). With indptr, last_page_len and the indices on one GPU, the
    device read's kernel works the lengths out and checks them (`device_read.read_paged_lengths`):
    the host checks then run only where it found an entry breaking their rules, to name it."""
    if indices is not None and not page_indices_checked():
        indices = None
    device = indptr.device
    if not indptr.is_cpu and last_page_len.device == device and (indices is None or indices.device == device):
        read = _device_read().read_paged_lengths
        indptr_h, last_h, lens, stats, minmax = read(indptr, last_page_len, indices, page_size)
        if stats is not None:
            return PagedTable(indptr_h, last_h, lens, int(indptr_h[-1]), *stats, minmax)
    else:
        (indptr_h, last_h), minmax = host_arrays([indptr, last_page_len], indices)
    pages = check_indptr(indptr_h, names[0])
    used = int(indptr_h[-1])
    lens = paged_kv_lengths(pages, last_h, page_size, used, names[1])
    return PagedTable(indptr_h, last_h, lens, used, int(np.add.reduce(lens)), int(_max(lens, initial=0)), minmax)


def check_indptr(h: np.ndarray, name: str) -> np.ndarray:
    """Check an indptr's host values (starts at 0, non-decreasing); return the per-request
    counts ``h[1:] - h[:-1]``."""
    if h[0] != 0:
        raise ValueError(f"{name}[0]={int(h[0])}, must be 0")
    counts = h[1:] - h[:-1]
    if _min(counts, initial=0) < 0:
        i = int(np.argmax(counts < 0)) + 1
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={int(h[i])} < {name}[{i - 1}]={int(h[i - 1])}")
    return counts


def host_indptr(t, name: str, length: int | None = None) -> torch.Tensor:
    """Check an int32 indptr and return it on the host as int64: starts at 0, non-decreasing."""
    check_index_tensor(t, name)
    check_indptr_length(t, name, length)
    h = host_arrays([t])[0][0]
    check_indptr(h, name)
    return torch.from_numpy(h)


def check_lengths_count(t: torch.Tensor, name: str, batch: int) -> None:
    """A per-request tensor (last_page_len, kv_len_arr) has batch_size entries."""
    if t.numel() != batch:
        raise ValueError(f"{name} has {t.numel()} entries, expected batch_size={batch}")


def paged_kv_lengths(pages: np.ndarray, last: np.ndarray, page_size: int, used_pages: int,
                     name: str = "last_page_len") -> np.ndarray:
    """kv_len of each request from its page count and last_page_len (host arrays), checking
    last_page_len's range ([1, page_size], 0 only for a request with no pages) and that each
    length fits int32 (``used_pages``, the pages of all requests, spares that check mostly)."""
    if _min(pages, initial=1) > 0 and _min(last, initial=1) >= 1 and _max(last, initial=0) <= page_size:
        lens = (pages - 1) * page_size + last  # every request has pages, every last_page_len in range
    else:
        empty = pages == 0
        bad = np.where(empty, last != 0, (last < 1) | (last > page_size))
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"{name}[{b}]={int(last[b])} is outside [1, page_size={page_size}] "
                             f"(0 only for a request with no pages; request {b} has {int(pages[b])} pages)")
        lens = (pages - 1) * page_size + last
        lens[empty] = 0
    if used_pages * page_size > MAX_KV_TOKENS and lens.max() > MAX_KV_TOKENS:
        b = int(np.argmax(lens > MAX_KV_TOKENS))
        raise ValueError(f"request {b} holds {int(lens[b])} KV tokens ({int(pages[b])} pages of "
                         f"page_size={page_size}); at most 2^31 - 1 are supported (int32 token counts)")
    return lens


def check_page_indices(num_indices: int, used: int, minmax: tuple[int, int] | None, name: str = "indices",
                       indptr_name: str = "indptr") -> int:
    """Check the page indices against the ``used`` = indptr[-1] pages (enough of them, >= 0) from
    their host (min, max) over the used entries (see `host_arrays`); return the largest index
    used: what run() checks against the cache's pages (-1 if none is used, or if ``minmax`` is
    None because FLASHDISPATCH_CHECK_INPUTS=0 turned the range check off)."""
    if num_indices < used:
        raise ValueError(f"{name} has {num_indices} entries, but {indptr_name}[-1]={used} pages are referenced")
    if used == 0 or minmax is None:
        return -1
    low, high = minmax
    if low < 0:
        raise ValueError(f"{name} holds a negative page index {low}")
    return high


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str, name: str = "paged_kv_cache") -> PagedKV:
    """Split a 5-D [pages, 2, ...] cache or a (k, v) tuple of 4-D tensors into a `PagedKV`."""
    if isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
        return PagedKV.of_combined(paged_kv_cache, kv_layout)
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
    raise ValueError(f"{name} must be 5-D [pages, 2, ...] or a (k, v) tuple of 4-D tensors, "
                     f"got shape {list(paged_kv_cache.shape)}")


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
    """Check a user-provided output buffer exactly (shape, dtype, device, no shared elements)."""
    check_tensor(out, name, dtypes=(dtype,), device=device, shape=list(shape))
    check_distinct_elements(out, name)
    return out


def check_distinct_elements(t: torch.Tensor, name: str) -> None:
    """An output buffer with no stride 0 on a dimension of more than one element (an expanded
    view, whose rows would be written over one another; other overlaps are not looked for)."""
    if not t.is_contiguous() and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} has elements that share memory (shape {list(t.shape)}, stride {t.stride()}: an "
                         f"expanded view?); an output must hold each element once")


def check_in_place(t: torch.Tensor, name: str) -> None:
    """A tensor written in place (no host sync): each element held once, by `check_distinct_elements`
    and then by its strides (its dims of more than one element, by increasing stride, each step past
    the span of the ones before; an interleaved layout this cannot show disjoint is refused too),
    and, with grad mode on, not an autograd leaf that requires grad, nor a view of one."""
    check_distinct_elements(t, name)
    span = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1) if t.numel() else ():
        if stride < span:
            raise ValueError(f"{name} has elements that may share memory (shape {list(t.shape)}, stride "
                             f"{t.stride()}); a tensor written in place must hold each element once")
        span += (n - 1) * stride
    root = t if t._base is None else t._base
    if t.requires_grad and root.is_leaf and torch.is_grad_enabled():
        raise ValueError(f"{name} is a leaf tensor that requires grad (or a view of one): it cannot be written in "
                         f"place; pass {name}.detach() or call under torch.no_grad()")


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, end) of the bytes ``t``'s elements occupy; None when it has none (or no memory: meta)."""
    if t.numel() == 0 or t.is_meta:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_disjoint(tensors: Sequence, names: Sequence[str]) -> None:
    """Buffers that a plan() or run() writes beside one another (a CUDA-graph wrapper's index
    buffers, its workspace) must not share memory; arguments that are not tensors are left to
    their own checks."""
    spans = [(name, t.device, _byte_span(t)) for t, name in zip(tensors, names) if isinstance(t, torch.Tensor)]
    for i, (a, dev_a, span_a) in enumerate(spans):
        for b, dev_b, span_b in spans[i + 1:]:
            if span_a and span_b and dev_a == dev_b and span_a[0] < span_b[1] and span_b[0] < span_a[1]:
                raise ValueError(f"{a} and {b} share memory (bytes {span_a[0]:#x}-{span_a[1]:#x} and "
                                 f"{span_b[0]:#x}-{span_b[1]:#x}): each buffer needs its own storage")


def reject_extra_args(args: tuple, method: str) -> None:
    if args:
        raise TypeError(f"{method}() got {len(args)} extra positional argument(s): *args feed custom JIT "
                        "kernels, which flashdispatch does not have")
