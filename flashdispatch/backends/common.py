"""Small pieces every backend shares: ALiBi slopes, scale arguments, the Triton-interpreter switch,
and what Triton kernels need of their arguments and GPU (window bound, fp8 support, shared memory)."""
from __future__ import annotations

import functools
import math
import os

import torch

from ..dispatch.problem import Device
from ..dispatch.reasons import Reason

# Triton kernels run on CPU tensors only when this is set before they are defined (tests).
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Opt-in shared memory per block of the GPUs with 99 KB (sm86/89/120), for a described GPU
_SHARED_BY_CC = {(8, 6): 101376, (8, 9): 101376, (12, 0): 101376, (12, 1): 101376}


def shared_per_block(device: Device) -> int:
    """The device's opt-in shared memory per block in bytes, from its compute capability where it
    does not say (sm80/87 163 KB, sm86/89/120 99 KB, sm90/100 227 KB); 0 on CPU."""
    if device.shared_per_block or device.cc is None:
        return device.shared_per_block
    return _SHARED_BY_CC.get(device.cc, 166912 if device.cc < (9, 0) else 232448)


@functools.lru_cache(maxsize=None)
def _alibi_slopes_list(num_heads: int) -> tuple[float, ...]:
    m = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]
    slopes += [2.0 ** (-4.0 * (2 * k + 1) / m) for k in range(num_heads - m)]
    return tuple(slopes)


def alibi_slopes(num_heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The standard ALiBi slope of each head, float32 [num_heads] (geometric series; for a
    head count that is not a power of two, the odd terms of the next series fill the rest).

    One tensor per (heads, device), kept for the process: a CUDA graph captured on one plan reads
    it at the same address after any re-plan. Do not modify it in place."""
    return _alibi_tensor(num_heads, torch.device(device))


@functools.lru_cache(maxsize=None)
def _alibi_tensor(num_heads: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_alibi_slopes_list(num_heads), dtype=torch.float32, device=device)


def kernel_scale(scale, name: str, dummy: torch.Tensor) -> tuple[float, torch.Tensor, bool]:
    """A q/k/v scale (argument ``name``) as a kernel sees it: (factor folded on the host,
    pointer, loaded in the kernel). None -> (1, dummy, False); a float -> (it, dummy, False); a
    one-element tensor -> (1, it, True), so a device scale is read by the kernel, never by the host."""
    if scale is None:
        return 1.0, dummy, False
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape {tuple(scale.shape)}")
        return 1.0, scale, True
    return float(scale), dummy, False


def kernel_scales(inputs, dummy: torch.Tensor) -> tuple:
    """`kernel_scale` of ``inputs``' q_scale, k_scale and v_scale (an `AttentionInputs`), one after
    the other: nine values."""
    return (*kernel_scale(inputs.q_scale, "q_scale", dummy), *kernel_scale(inputs.k_scale, "k_scale", dummy),
            *kernel_scale(inputs.v_scale, "v_scale", dummy))


_KERNEL_WINDOW_MAX = 1 << 30


def kernel_window(window_left: int) -> int:
    """The window_left a Triton kernel gets: -1, or at most 2**30. The kernels' int32
    ``position - window_left`` (positions reach -qo_len) must not wrap for windows near 2**31; a
    window of 2**30 already reaches every key while positions and KV lengths stay under 2**30."""
    return min(window_left, _KERNEL_WINDOW_MAX)


def triton_fp8_kv_reasons(kv_dtype: torch.dtype, cc: tuple[int, int] | None) -> list[Reason]:
    """Triton 3.6 converts float8_e4m3fn from sm89 on only (e5m2 from sm80): the reason a Triton
    kernel cannot read such a KV cache on this GPU, if any (none on the CPU interpreter)."""
    if kv_dtype == torch.float8_e4m3fn and cc is not None and cc < (8, 9):
        return [Reason("dtype.fp8", f"float8_e4m3fn KV on sm_{cc[0]}{cc[1]}: Triton converts e4m3 from sm_89 on only",
                       "use float8_e5m2 KV or another backend")]
    return []
