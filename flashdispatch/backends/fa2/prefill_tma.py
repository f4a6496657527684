"""TMA (tensor-descriptor) K/V loads of the fa2 prefill kernel: when they apply, and their scratch.

``PrefillConfig(tma=True)`` (or ``tma=1`` in FLASHDISPATCH_FA2_PREFILL_CONFIG) asks the prefill
kernel to load K and V tiles through device-side tensor descriptors, one per (request, KV head):
base at the request's first KV row and the head, shape [kv_len, head_dim], strides [row stride, 1],
block [BLOCK_N, head_dim]. Rows past kv_len come back as zeros, so no tile needs a load mask (the
score mask for keys >= kv_len stays).

When it applies. At plan time (`tma_unused_reason`): ragged KV, CUDA sm90+ (or the Triton
interpreter, which emulates descriptors: CPU tests), 16-bit q with KV of q's dtype, equal qk/vo
head dims (not the 192/128 pair), no RoPE of K in the kernel (it rotates K tiles from pointer
loads; a plan whose K is rotated first, prefill_rope.py, rotates only Q and keeps TMA), and
num_stages != 2: the ptxas that Triton 3.6 bundles (12.8) crashes (SIGSEGV) compiling the TMA loop
pipelined in two stages (seen offline for d64/d128/d256 at 64x64 to 128x128 tiles; 1, 3 and 4
stages compile, scripts/prefill_tma_compile.py). Anything else plans the pointer path: the knob
is ignored, not an error, so one config string can sweep paged and ragged rows alike;
``PrefillPlan.tma`` and ``tma_reason`` say what was planned. At run time (`tma_layout_ok`) the
descriptor rules are checked on that call's K/V views: base 16-byte aligned, unit inner stride,
token and head strides multiples of 16 bytes; views that fail them run the pointer path for that
launch (not an error).

Scratch. A device-side descriptor is 128 bytes of global memory per program, which Triton 3.6
asks at each launch from the allocator set with ``triton.set_allocator`` (a ContextVar:
``CudaLauncher.__call__`` calls it with grid x scratch bytes, the alignment and the stream).
`launch_with_scratch` uses the caller's allocator when one is set and otherwise sets a
torch-backed one for the duration of the launch only (``ContextVar.set``/``reset``), so a user's
allocator is never replaced and nothing global is left changed. The torch block comes from the
caching allocator on the current stream (the launch's stream): freed after the launch returns,
it is reused only by work ordered after the kernel; under CUDA-graph capture it comes from the
graph's pool, so replays keep their address.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from ...dispatch.problem import Device, Problem

_TMA_DTYPES = (torch.float16, torch.bfloat16)


def tma_unused_reason(problem: Problem, device: Device, num_stages: int, interpreted: bool) -> str | None:
    """Why a ``tma=True`` config plans the pointer path for this problem, or None when TMA applies."""
    if problem.op != "prefill_ragged":
        return f"op {problem.op}: TMA loads are for ragged KV only (paged KV is gathered per token)"
    if not interpreted and not (device.is_cuda and device.cc is not None and device.cc >= (9, 0)):
        return f"{device.describe()}: TMA needs CUDA sm90 or newer"
    if problem.q_dtype not in _TMA_DTYPES or problem.kv_dtype != problem.q_dtype:
        return (f"q {problem.q_dtype} / kv {problem.kv_dtype}: TMA loads need 16-bit q and KV of q's dtype "
                "(fp8 KV and fp32 use the pointer path)")
    if problem.head_dim_qk != problem.head_dim_vo:
        return f"head dims {problem.head_dim_qk}/{problem.head_dim_vo}: TMA needs equal qk and vo head dims"
    if problem.pos_encoding_mode == "ROPE_LLAMA":
        return "ROPE_LLAMA of K in the kernel: it rotates K tiles from pointer loads"
    if num_stages == 2:
        return "num_stages=2: Triton 3.6's ptxas 12.8 crashes compiling 2-stage TMA loops (use 1, 3 or 4)"
    return None


def tma_layout_ok(*views: torch.Tensor) -> bool:
    """Whether ragged K/V views ``[tokens, kv_heads, dim]`` meet the descriptor rules: base 16-byte
    aligned, unit inner stride, token and head strides (and the head dim) multiples of 16 bytes,
    a positive token stride (an expanded view repeats one token: pointers)."""
    for x in views:
        size = x.element_size()
        if (x.data_ptr() % 16 or x.stride(2) != 1 or x.stride(0) * size % 16 or x.stride(1) * size % 16
                or x.shape[2] * size % 16 or x.stride(0) <= 0 or x.stride(1) < 0):
            return False
    return True


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator protocol: ``size`` bytes at an ``alignment`` multiple on the current CUDA
    device (the launch's device and stream)."""
    buf = torch.empty(size + alignment, dtype=torch.int8, device="cuda")
    skip = -buf.data_ptr() % alignment
    return buf[skip:skip + size]


def launch_with_scratch(launch, grid: tuple, *args) -> None:
    """``launch(grid, *args)`` with an allocator for the descriptors' scratch: the caller's when
    set, else ours for this launch only (see the module docstring)."""
    var = _allocation._allocator
    current = var.get()
    if current is not None and not isinstance(current, _allocation.NullAllocator):
        launch(grid, *args)
        return
    token = var.set(_torch_scratch)
    try:
        launch(grid, *args)
    finally:
        var.reset(token)


@triton.jit
def kv_descriptor(X, kv_start, kvh, kv_len, stride_t, stride_h, BLOCK_N: tl.constexpr, HEAD: tl.constexpr):
    """The [kv_len, HEAD] rows of one request and KV head of a ragged ``X [tokens, heads, HEAD]``
    as a descriptor of [BLOCK_N, HEAD] blocks (rows past kv_len load as zeros; shape >= 1 so an
    empty request, which loads nothing, still describes a valid tensor)."""
    base = X + kv_start.to(tl.int64) * stride_t + kvh.to(tl.int64) * stride_h
    return tl.make_tensor_descriptor(base, shape=[tl.maximum(kv_len, 1), HEAD], strides=[stride_t, 1],
                                     block_shape=[BLOCK_N, HEAD])
