"""Page arithmetic of token indices, shared by the fa2 kernels, and a paged cache's strides as the
decode kernels take them (`decode_strides`).

Token indices are >= 0, so the division and remainder by the page size run on unsigned ints: no
sign fix-up per token (a shift and a mask for power-of-two pages). Offline sm90 PTX: the paged
prefill loop (128x128, causal) 3643 -> 3356 instructions, fp8 decode 3257 -> 3047.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_of(t, PAGE: tl.constexpr):
    """t // PAGE for token indices t >= 0 (int32)."""
    return (t.to(tl.uint32) // PAGE).to(tl.int32)


@triton.jit
def slot_in_page(t, PAGE: tl.constexpr):
    """t % PAGE for token indices t >= 0 (int32)."""
    return (t.to(tl.uint32) % PAGE).to(tl.int32)


def decode_strides(inputs) -> tuple:
    """(k address, v address, k strides, v strides, q strides, out strides) of a decode run()'s
    ``inputs`` (an `AttentionInputs` of paged KV), the caches' first three strides (page, token,
    head) whatever the layout; ValueError unless q, out and the caches have a contiguous head_dim."""
    kv = inputs.kv
    k_at, v_at, ks, vs = kv.addresses()  # (a 5-D cache: no views made)
    qs, os_ = inputs.q.stride(), inputs.out.stride()  # one call each: run() is host-bound
    if ks[3] != 1 or vs[3] != 1 or qs[2] != 1 or os_[2] != 1:
        strides = {"q": qs, "out": os_, "k cache": ks, "v cache": vs}
        bad = ", ".join(f"{name} (stride {st})" for name, st in strides.items() if st[2 if len(st) == 3 else 3] != 1)
        raise ValueError(f"fa2 decode needs q, out and the k/v cache with a contiguous head_dim (last stride 1): "
                         f"{bad} not")
    if kv.layout == "HND":
        ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
    return k_at, v_at, ks, vs, qs, os_
