"""RoPE before a ragged prefill: K rotated once into scratch, then attention that rotates Q only.

Rotating inside the prefill kernel (prefill_kernels._load_k_halves) repeats the work of a K tile in
every program that reads it: once per query tile and per query head, so a 4096-token causal
prefill with 32 query heads (32 query tiles) rotates a key ~500 times on average, and that kernel
loads K through pointers, not TMA. `rotate_rows_kernel` rotates each key row once, its sines and
cosines shared by the heads of a program, into a buffer of k's dtype; the rounding to that dtype
is the one the kernel applies to its rotated tiles, so both paths compute the same attention. The
prefill kernel then runs the problem as without RoPE (its config, TMA loads on sm90) but rotates
each Q tile as it loads it (``K_ROTATED``: once a program, a small part of the K work above). The
cost is the scratch (k's size, from torch's caching allocator at each run, outside the float
workspace) and one extra read and write of K, which pays once a request has a tile of queries
(`MIN_QUERY_ROWS`); shorter queries, paged KV (its rows sit in the shared cache), fp8 or split
head dims (192/128), and CUDA-graph plans (their kernels are fixed at capture, while the choice
depends on the lengths) keep the rotation in the kernel.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ...dispatch.problem import Problem
from ..base import AttentionInputs, AttentionParams, RaggedKV
from .launch import bind
from .trig import rope_halves, rope_scalars, rope_sincos

MIN_QUERY_ROWS = 64  # the longest request's query rows from which K is rotated before the kernel
_POW2_HEAD_DIMS = (64, 128, 256)
_ROWS_PER_PROGRAM = 32
_HEADS_PER_PROGRAM = 2  # 4096 rows x 8 heads: 512 programs (one per 32 rows: 128, too few to read at speed)


def prerotation_applies(problem: Problem, params: AttentionParams) -> bool:
    """Whether this prefill rotates K before the kernel (see the module docstring)."""
    return (problem.op == "prefill_ragged" and problem.pos_encoding_mode == "ROPE_LLAMA"
            and not problem.use_cuda_graph and problem.kv_dtype == problem.q_dtype
            and problem.head_dim_qk in _POW2_HEAD_DIMS
            and max(params.qo_lens_host, default=0) >= MIN_QUERY_ROWS)


@triton.jit
def rotate_rows_kernel(X, Y, indptr_ptr, num_rows, batch, search_steps, rope_inv_scale, rope_log2_theta,
                       stride_xt, stride_xh, stride_xd, stride_yt, stride_yh,
                       HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr, ROPE: tl.constexpr):
    """Rotate-half RoPE of rows [num_rows, HEADS, HEAD_DIM] of X into Y, BLOCK_R rows x BLOCK_H
    heads a program. Row r of request b (the last b < batch with indptr[b] <= r) sits at position
    r - indptr[b]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    lo = tl.zeros([BLOCK_R], tl.int32)
    hi = lo + batch
    for _ in range(search_steps):  # binary search; idempotent once hi = lo + 1
        mid = (lo + hi) // 2
        below = tl.load(indptr_ptr + mid) <= rows
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    pos = rows - tl.load(indptr_ptr + lo)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    s, c = rope_sincos(pos, offs, rope_inv_scale, rope_log2_theta, HEAD_DIM, ROPE)
    head = tl.program_id(1) * BLOCK_H
    x = X + rows.to(tl.int64)[:, None] * stride_xt + head.to(tl.int64) * stride_xh + offs[None, :] * stride_xd
    y = Y + rows.to(tl.int64)[:, None] * stride_yt + head.to(tl.int64) * stride_yh + offs[None, :]
    for _ in tl.static_range(BLOCK_H):  # pointers step by a head: no int32 product of head and stride
        keep = (ok & (head < HEADS))[:, None]
        x1 = tl.load(x, mask=keep).to(tl.float32)
        x2 = tl.load(x + HALF * stride_xd, mask=keep).to(tl.float32)
        y1, y2 = rope_halves(x1, x2, s, c)
        tl.store(y, y1.to(Y.dtype.element_ty), mask=keep)
        tl.store(y + HALF, y2.to(Y.dtype.element_ty), mask=keep)
        x += stride_xh
        y += stride_yh
        head += 1


class PrerotatedPrefill:
    """A ragged RoPE prefill as K rotation, then ``inner``: the plan of the same problem without
    RoPE whose kernel rotates Q (`prerotation_applies`)."""

    def __init__(self, inner, problem: Problem, params: AttentionParams, rope_kind: int):
        self.inner, self.params, self.rope_kind = inner, params, rope_kind
        self.kv_indptr = params.kv_indptr  # uploaded now, not in run()
        self.batch = len(params.qo_lens_host)
        self.kv_rows, _ = params.kv_lens_stats()
        self.heads = problem.num_kv_heads
        self._rotate = bind(rotate_rows_kernel, HEADS=self.heads, HEAD_DIM=problem.head_dim_qk,
                            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_H=_HEADS_PER_PROGRAM, ROPE=rope_kind)

    def __getattr__(self, name: str):
        """What the kernel's plan knows (config, tma, n_merge, ...) is the inner plan's."""
        if name == "inner":  # not set yet (an object made without __init__, e.g. by copy)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def refresh_tile_lists(self) -> None:
        """A new custom mask: the inner plan's tile lists."""
        self.inner.refresh_tile_lists()

    def rotated_keys(self, k: torch.Tensor) -> torch.Tensor:
        """K rotated at each row's position in its request, in new memory of k's shape and dtype."""
        prm = self.params
        y = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        if self.kv_rows == 0:
            return y
        grid = (triton.cdiv(self.kv_rows, _ROWS_PER_PROGRAM), triton.cdiv(self.heads, _HEADS_PER_PROGRAM))
        self._rotate(grid, k, y, self.kv_indptr, self.kv_rows, self.batch, self.batch.bit_length(),
                     *rope_scalars(prm.rope_scale, prm.rope_theta), k.stride(0), k.stride(1), k.stride(2),
                     y.stride(0), y.stride(1))
        return y

    def run(self, inputs: AttentionInputs) -> None:
        kv = inputs.kv
        if not isinstance(kv, RaggedKV):
            raise TypeError("fa2 prefill_ragged plan run with paged KV")
        self.inner.run(replace(inputs, kv=RaggedKV(self.rotated_keys(kv.k), kv.v)))


def without_rope(problem: Problem) -> Problem:
    """The problem planned once K is rotated (its config, TMA); the kernel still rotates Q."""
    return problem.with_(pos_encoding_mode="NONE")
