"""Custom-mask bit packing on the GPU: `segment_packbits` of CUDA tensors in one Triton kernel
(imported lazily by quantization.py, so ``import flashdispatch`` needs no Triton).

The torch formulation it replaces built [bytes, 8] int64 index tensors: ~1.5 GB of temporaries
for an 8 x 512/8192 mask (33.5M bits), 2.2-2.7 ms of a paged prefill plan() on the H200, and an
out-of-memory for masks a few times larger. Here every output byte reads its 8 inputs once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backends.fa2.launch import bind

_BLOCK = 1024  # output bytes per program


@triton.jit(do_not_specialize=["n_segments", "total_bytes", "search_steps"])
def segment_pack_kernel(x_ptr, bit_indptr_ptr, byte_indptr_ptr, n_segments, out_ptr, total_bytes, search_steps,
                        LITTLE: tl.constexpr, BLOCK: tl.constexpr):
    """Output byte ``b`` of segment ``s`` (``byte_indptr[s] <= b < byte_indptr[s + 1]``, found by
    binary search in ``search_steps`` >= log2(n_segments + 1) steps) packs inputs
    ``bit_indptr[s] + 8 (b - byte_indptr[s]) + j``, j < 8, that fall inside the segment (the
    rest count as 0); bit j (LITTLE) or 7 - j of the byte is input j != 0."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = byte < total_bytes
    lo = tl.zeros([BLOCK], tl.int32)  # upper bound: the first s with byte_indptr[s] > byte
    hi = tl.zeros([BLOCK], tl.int32) + n_segments + 1
    for _ in range(search_steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(byte_indptr_ptr + mid, mask=ok & open_, other=0) <= byte
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    seg = tl.maximum(lo - 1, 0)
    first_byte = tl.load(byte_indptr_ptr + seg, mask=ok, other=0)
    first_bit = tl.load(bit_indptr_ptr + seg, mask=ok, other=0) + 8 * (byte - first_byte)
    end_bit = tl.load(bit_indptr_ptr + seg + 1, mask=ok, other=0)
    j = tl.arange(0, 8)
    bit = first_bit[:, None] + j[None, :]
    inside = ok[:, None] & (bit < end_bit[:, None])
    on = (tl.load(x_ptr + bit, mask=inside, other=0) != 0) & inside
    shift = j if LITTLE else 7 - j
    packed = tl.sum(on.to(tl.int32) << shift[None, :], 1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=ok)


def pack_segments(x: torch.Tensor, bit_indptr: torch.Tensor, byte_indptr: torch.Tensor, total_bytes: int,
                  bitorder: str) -> torch.Tensor:
    """uint8 [total_bytes]: each segment ``x[bit_indptr[s]:bit_indptr[s + 1]]`` packed into bytes
    ``byte_indptr[s]:byte_indptr[s + 1]`` (both int64 on x's device, already checked)."""
    flat = x.reshape(-1)
    if flat.dtype == torch.bool and flat.is_contiguous():
        flat = flat.view(torch.uint8)  # same bytes; a Triton pointer of 8-bit ints
    else:  # strided or expanded views (the kernel reads dense memory) and every other dtype: 0/1 bytes
        flat = (flat != 0).view(torch.uint8)
    out = torch.empty(total_bytes, dtype=torch.uint8, device=x.device)
    if total_bytes == 0:
        return out
    n_segments = bit_indptr.numel() - 1
    launch = bind(segment_pack_kernel, LITTLE=bitorder == "little", BLOCK=_BLOCK, num_warps=4)
    launch((-(-total_bytes // _BLOCK),), flat, bit_indptr, byte_indptr, n_segments, out, total_bytes,
           (n_segments + 1).bit_length())
    return out
