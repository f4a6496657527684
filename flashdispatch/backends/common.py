"""Small pieces every backend shares: ALiBi slopes, scale arguments, the Triton-interpreter switch."""
from __future__ import annotations

import functools
import math
import os

import torch

# Triton kernels run on CPU tensors only when this is set before they are defined (tests).
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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


_KERNEL_WINDOW_MAX = 1 << 30


def kernel_window(window_left: int) -> int:
    """The window_left a Triton kernel gets: -1, or at most 2**30. A window wider than every
    position is no window either way, and the kernels' int32 ``position - window_left`` (positions
    reach -qo_len) must not wrap for windows near 2**31."""
    return min(window_left, _KERNEL_WINDOW_MAX)
