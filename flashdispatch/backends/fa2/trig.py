"""sin and cos of fp32 RoPE angles, and the soft cap's tanh (shared by the fa2 kernels).

``sincos`` reduces the angle by 2 pi in plain arithmetic, then takes the hardware's fast sine and
cosine (``sin.approx``/``cos.approx``, one MUFU instruction each, as FlashInfer's ``__sincosf``) of
the reduced angle; under TRITON_INTERPRET=1, where no PTX runs, numpy's sin/cos of the same
reduced angle. ``tl.sin``/``tl.cos`` would lower to libdevice's precise sinf/cosf, whose
large-argument path (Payne-Hanek) is inlined at every use: in the unrolled RoPE tiles that made a
first compile take tens of seconds. Until session 57 the fa2 kernels took ~22 mul/add/floor/bit
operations of polynomial per element instead, which left RoPE decode at 0.73x and RoPE prefill at
0.67x FlashInfer (perf-notes, session 56).

Reduction: k = nearest integer to x / 2pi, r = x - k*2pi by Cody-Waite with 2pi = C1 + C2 + C3 (C1
and C2 have 8 significant bits: k*C1, k*C2 and x - k*C1 are exact for |k| < 2^16, i.e. |x| <
411774; above, the rounding of k*C1 adds at most 2^-24 |x|, the fp32 angle's own rounding). k rounds x / 2pi in
fp32, so |r| <= pi + 0.005 there and ~3.24 up to 2^21 (the GPU test measures the fast sine and
cosine on what that leaves); the estimate of k drifts past ~2^22 and leaves |r| up to ~250 at
|x| = 2^31, where the fast instructions still give a point of the unit circle (the angle carries
radians of rounding there).

Accuracy against float64 (tests/test_fa2_trig.py): the hardware's sine and cosine are within
2^-21.41 and 2^-21.19 on [-pi, pi] (CUDA's bounds for __sinf/__cosf), so |error| <= 1e-6 +
2^-23 |x| on the GPU (a GPU test measures it); <= 2e-7 + 2^-23 |x| under the interpreter. Past
2^31 radians (rope_scale or rope_theta near 0), and for inf or NaN angles, ``WIDE`` takes the
reduced angle as 0 (a point of the unit circle, never NaN: FlashInfer's fp32 angles carry no phase
there either). The guard costs a compare and a select per element, so only plans whose angles can
leave the range compile it (`rope_kernel_variant`).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..common import TRITON_INTERPRETED

INV_2PI = tl.constexpr(0.15915493667125702)
TWO_PI_C1 = tl.constexpr(6.28125)  # 201 / 32
TWO_PI_C2 = tl.constexpr(0.0019378662109375)  # 254 / 2^17
TWO_PI_C3 = tl.constexpr(-2.559031372584286e-06)  # fp32(2pi - C1 - C2)
WIDE_BOUND = tl.constexpr(512.0)  # past it the reduced angle is no phase: |x| > 2^31, inf or NaN
HARDWARE_TRIG = tl.constexpr(not TRITON_INTERPRETED)


def rope_kernel_variant(pos_encoding_mode: str, rope_scale: float, rope_theta: float, head_dim: int) -> int:
    """The kernels' ``ROPE`` constexpr: 0 without RoPE; 1 where every angle (position / rope_scale)
    * rope_theta^(-2t / head_dim), t < head_dim / 2, stays within 2^31 radians for int32 positions
    (rope_scale >= 1 and rope_theta >= 1 among others); 2 where it may not, and sincos needs WIDE."""
    if pos_encoding_mode != "ROPE_LLAMA":
        return 0
    # log2 of the largest inv_freq (t = 0 when theta >= 1, else t = head_dim / 2 - 1) over rope_scale
    log2_freq = max(0.0, -math.log2(rope_theta) * (head_dim - 2) / head_dim)
    return 1 if log2_freq <= math.log2(rope_scale) else 2


@triton.jit
def sincos(x, WIDE: tl.constexpr):
    """(sin x, cos x) of an fp32 tensor (accuracy: see the module docstring); ``WIDE``: |x| may
    exceed 2^31 or be inf / NaN (a point of the unit circle there, never NaN)."""
    k = tl.floor(x * INV_2PI + 0.5)
    r = x - k * TWO_PI_C1
    r = r - k * TWO_PI_C2
    r = r - k * TWO_PI_C3
    if WIDE:
        r = tl.where(tl.abs(r) <= WIDE_BOUND, r, 0.0)
    if HARDWARE_TRIG:
        return libdevice.fast_sinf(r), libdevice.fast_cosf(r)
    else:
        return tl.sin(r), tl.cos(r)


@triton.jit
def rope_sincos(pos, t, rope_inv_scale, rope_log2_theta, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """(sin, cos) [rows, cols] of RoPE's angles (pos / rope_scale) * rope_theta^(-2t / HEAD_DIM) for
    positions ``pos`` [rows] and frequency indices ``t`` [cols]; ``ROPE`` as `rope_kernel_variant`
    gives it (2: sincos's WIDE guard)."""
    inv_freq = tl.exp2(-(2.0 * t.to(tl.float32) / HEAD_DIM) * rope_log2_theta)
    angle = (pos.to(tl.float32) * rope_inv_scale)[:, None] * inv_freq[None, :]
    return sincos(angle, ROPE == 2)


@triton.jit
def rope_halves(x1, x2, sin_a, cos_a):
    """Rotate-half RoPE of a row's two halves (float32, [rows, HEAD_DIM / 2] each)."""
    return x1 * cos_a - x2 * sin_a, x2 * cos_a + x1 * sin_a


@triton.jit
def tanh(x):
    """tanh of an fp32 tensor: 1 - 2 / (e^2x + 1) through exp2 (saturates to +-1, no inf / inf),
    its Taylor series x - x^3/3 + 2x^5/15 where |x| < 1/16, where the exp2 form keeps only an
    absolute error of ~1e-7 (a soft cap far above the logits: cap 1e6 moved outputs by 5e-2).
    Relative error <= ~2e-6 everywhere."""
    x2 = x * x
    near_zero = x * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    return tl.where(tl.abs(x) < 0.0625, near_zero, 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))
