"""sin and cos of fp32 RoPE angles, and the soft cap's tanh, from plain Triton arithmetic (shared
by the fa2 kernels).

``tl.sin``/``tl.cos`` lower to libdevice's precise sinf/cosf, whose large-argument path
(Payne-Hanek) is inlined at every use; in the unrolled RoPE tiles that made a first compile take
tens of seconds. ``sincos`` is about 22 mul/add/floor/bit operations per element and runs the
same way under TRITON_INTERPRET=1.

Method: k = nearest integer to x / pi, r = x - k*pi by Cody-Waite with pi = C1 + C2 + C3 (C1 has
12 significant bits, so k*C1 and x - k*C1 are exact for |k| < 2^12, i.e. |x| < 12867; above, the
rounding of k*C1 adds at most 2^-24 |x|, which is the fp32 angle's own rounding), then
sin x = (-1)^k sin r, cos x = (-1)^k cos r with
sin r = r + r^3 (s1 + s2 r^2 + s3 r^4 + s4 r^6) and cos r = 1 - r^2/2 + r^4 (c1 + ... + c4 r^6),
fitted near-minimax in absolute error on |r| <= 1.8 (fit errors 2.0e-8 and 2.0e-9; the rounded
estimate of k leaves |r| up to 1.67 at |x| = 2^21, not pi/2).

Measured against float64 sin/cos (tests/test_fa2_trig.py): |error| <= 7.5e-8 for |x| < 1,
<= 1.9e-7 for |x| < 12867, and <= 2^-24 |x| + 2e-7 above; at most 0.5 of the RoPE budget
2e-7 + 2^-23 |x| over |x| <= 4e6 (positions up to 2^21 give angles up to 2^21). Past ~2^24 the
first reduction leaves |r| beyond the fit: a second step (k2, zero below that) brings it back,
so sin and cos stay on the unit circle up to |x| <= 2^31 (the fp32 angle itself carries radians
of rounding there). Beyond, and for inf or NaN angles, ``WIDE`` takes the reduced angle as 0 (a
point of the unit circle, never NaN: FlashInfer's fp32 angles carry no phase there either). That
guard costs a compare and a select per element (+17 % on a RoPE prefill, session 56), so only
plans whose angles can leave the range compile it (`rope_kernel_variant`).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

INV_PI = tl.constexpr(0.3183098861837907)
PI_C1 = tl.constexpr(3.140625)  # 3216 / 2^10
PI_C2 = tl.constexpr(0.0009676535846665502)  # fp32(pi - C1)
PI_C3 = tl.constexpr(5.126565838509123e-12)  # fp32(pi - C1 - C2)
SIN_1 = tl.constexpr(-0.16666638851165771)
SIN_2 = tl.constexpr(0.008332626894116402)
SIN_3 = tl.constexpr(-0.00019782193703576922)
SIN_4 = tl.constexpr(2.5530280254315585e-06)
COS_1 = tl.constexpr(0.04166663438081741)
COS_2 = tl.constexpr(-0.0013888173270970583)
COS_3 = tl.constexpr(2.4746481358306482e-05)
COS_4 = tl.constexpr(-2.578025259936112e-07)


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
    k = tl.floor(x * INV_PI + 0.5)
    r = x - k * PI_C1
    r = r - k * PI_C2
    r = r - k * PI_C3
    # past |x| ~ 2^24 the roundings of x / pi and k * C1 leave |r| beyond the polynomials' range:
    # a second step brings it back (k2 is 0 below that, and r unchanged)
    k2 = tl.floor(r * INV_PI + 0.5)
    r = r - k2 * PI_C1
    r = r - k2 * PI_C2
    r = r - k2 * PI_C3
    if WIDE:
        # past 2^31 (or an inf / NaN angle: rope_scale or rope_theta near 0) no fp32 phase is left and
        # the int32 parities overflow: any point of the unit circle is as right, so r = 0 there, never NaN
        r = tl.where(tl.abs(r) <= 2.0, r, 0.0)
    u = r * r
    s = r + (r * u) * (SIN_1 + u * (SIN_2 + u * (SIN_3 + u * SIN_4)))
    c = (1.0 - 0.5 * u) + (u * u) * (COS_1 + u * (COS_2 + u * (COS_3 + u * COS_4)))
    flip = ((k.to(tl.int32) + k2.to(tl.int32)) & 1) << 31  # sign bit set for odd k + k2
    s = (s.to(tl.int32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)
    c = (c.to(tl.int32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)
    return s, c


@triton.jit
def tanh(x):
    """tanh of an fp32 tensor: 1 - 2 / (e^2x + 1) through exp2 (saturates to +-1, no inf / inf),
    its Taylor series x - x^3/3 + 2x^5/15 where |x| < 1/16, where the exp2 form keeps only an
    absolute error of ~1e-7 (a soft cap far above the logits: cap 1e6 moved outputs by 5e-2).
    Relative error <= ~2e-6 everywhere."""
    x2 = x * x
    near_zero = x * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    return tl.where(tl.abs(x) < 0.0625, near_zero, 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))
