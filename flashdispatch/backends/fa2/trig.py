"""sin and cos of fp32 RoPE angles, and the soft cap's tanh (shared by the fa2 kernels).

``sincos`` takes the hardware's fast sine and cosine of the fp32 angle as it is (``sin.approx`` /
``cos.approx``: an FMUL by 1/2pi rounded toward zero, then one MUFU instruction each), as
FlashInfer's ``__sincosf`` does; under TRITON_INTERPRET=1, where no PTX runs, numpy's float32
sin/cos. ``tl.sin``/``tl.cos`` would lower to libdevice's precise sinf/cosf, whose large-argument
path (Payne-Hanek) is inlined at every use: in the unrolled RoPE tiles that made a first compile
take tens of seconds. Until session 57 the kernels took ~22 polynomial operations per element
(RoPE decode 0.73x, prefill 0.67x FlashInfer: perf-notes, session 56); session 57 reduced the
angle by 2pi exactly (Cody-Waite, 5 operations a pair) before the MUFU; session 58 dropped that:
the RoPE decode loop went from 570 to 489 instructions (offline sm90 SASS; perf-notes, session 58).

Accuracy against float64 (tests/test_fa2_trig.py): the MUFU's error on the reduced angle is within
2^-21.41 (sine) and 2^-21.19 (cosine), and the product x / 2pi, truncated to fp32, moves the angle by
at most ~1.25 x 2^-23 |x|: |error| <= 1e-6 + 2^-22 |x| on the GPU (a GPU test measures it), as
FlashInfer's. The fp32 angle itself is only 2^-24 |x| accurate; at position 32768 and frequency 1
the bound is 8e-3 radians, about one bf16 step of a rotated key. Under the interpreter: <= 2e-7.
Past 2^31 radians (rope_scale or rope_theta near 0), and for inf or NaN angles, ``WIDE`` takes the
angle as 0 (a point of the unit circle, never NaN: fp32 angles keep no phase there). The guard
costs a compare and a select per element, so only plans whose angles can leave the range compile it
(`rope_kernel_variant`).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..common import TRITON_INTERPRETED

WIDE_BOUND = tl.constexpr(2.0 ** 31)  # past it (or inf, NaN) the fp32 angle keeps no phase
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


def rope_scalars(rope_scale: float, rope_theta: float) -> tuple[float, float]:
    """The kernels' RoPE arguments (rope_inv_scale, rope_log2_theta) for `rope_sincos`."""
    return 1.0 / rope_scale, math.log2(rope_theta)


@triton.jit
def sincos(x, WIDE: tl.constexpr):
    """(sin x, cos x) of an fp32 tensor (accuracy: see the module docstring); ``WIDE``: |x| may
    exceed 2^31 or be inf / NaN (taken as 0 there: never NaN)."""
    if WIDE:
        x = tl.where(tl.abs(x) <= WIDE_BOUND, x, 0.0)
    if HARDWARE_TRIG:
        return libdevice.fast_sinf(x), libdevice.fast_cosf(x)
    else:
        return tl.sin(x), tl.cos(x)


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
