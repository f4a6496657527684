"""fa2 RoPE trig (flashdispatch/backends/fa2/trig.py) against float64 sin/cos.

The budget is |error| <= 2e-7 under the interpreter (numpy's float32 sin/cos of the fp32 angle) and
1e-6 + 2^-22 |x| with the GPU's fast sine and cosine, over the angles RoPE can reach (positions up to
2^21, rope_scale >= 1, theta 1e4..1e6: |x| <= 2^21). The helper runs under the Triton interpreter
here; the GPU tests run the same kernel on the device.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashdispatch.backends.fa2 import trig
from flashdispatch.backends.fa2.trig import sincos

F32 = np.float32


@triton.jit
def _sincos_kernel(X, S, C, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    s, c = sincos(x, WIDE)
    tl.store(S + offs, s, mask=offs < n)
    tl.store(C + offs, c, mask=offs < n)


def triton_sincos(x: np.ndarray, wide: bool = True, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).to(device)
    s, c = torch.full_like(xt, float("nan")), torch.full_like(xt, float("nan"))
    block = 1 << 16 if device == "cpu" else 1024
    _sincos_kernel[(triton.cdiv(xt.numel(), block),)](xt, s, c, xt.numel(), BLOCK=block, WIDE=wide)
    return s.cpu().numpy(), c.cpu().numpy()


def rope_angles(rng: np.random.Generator, n: int) -> np.ndarray:
    """fp32 angles as the kernels form them: (pos / rope_scale) * theta^(-2t/d)."""
    pos = rng.integers(0, 1 << 21, n).astype(F32)
    scale = rng.choice(np.array([1.0, 2.0, 8.0, 32.0], F32), n)
    d = rng.choice(np.array([64, 128, 256]), n)
    t = (rng.integers(0, 1 << 20, n) % (d // 2)).astype(F32)
    log2_theta = np.log2(rng.choice(np.array([1e4, 5e5, 1e6]), n)).astype(F32)
    inv_freq = np.exp2(-(F32(2.0) * t / d.astype(F32)) * log2_theta)
    return (pos * (F32(1.0) / scale)) * inv_freq


def sample_angles(seed: int = 0) -> np.ndarray:
    """~1.75e6 random and edge angles (near multiples of pi/4) in [-2^21, 2^21], and 3e6."""
    rng = np.random.default_rng(seed)
    near_quadrants = F32(np.arange(1, 1 << 21, 7) * (np.pi / 4))  # every 7th multiple of pi/4
    edges = np.concatenate([
        near_quadrants, np.nextafter(near_quadrants, F32(np.inf)), np.nextafter(near_quadrants, F32(0)),
        np.array([0.0, 1e-30, 1e-7, 0.5, np.pi / 4, np.pi / 2, np.pi, 100.0, 1e4, 1e5,
                  2 ** 21 - 0.25, 2 ** 21, 3e6], F32)])
    parts = [rng.uniform(0, 2 ** 21, 300_000), np.exp(rng.uniform(np.log(1e-6), np.log(2 ** 21), 200_000)),
             rng.uniform(0, 64, 100_000), -rng.uniform(0, 2 ** 21, 50_000), rope_angles(rng, 200_000), edges]
    return np.concatenate([np.asarray(p).astype(F32) for p in parts])


def errors(x: np.ndarray, s: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xd = x.astype(np.float64)
    return np.abs(s - np.sin(xd)), np.abs(c - np.cos(xd))


def within_budget(x: np.ndarray, s: np.ndarray, c: np.ndarray, budget: np.ndarray) -> None:
    err_s, err_c = errors(x, s, c)
    assert (err_s <= budget).all(), f"sin: worst {err_s.max():.3g} at x={x[np.argmax(err_s / budget)]}"
    assert (err_c <= budget).all(), f"cos: worst {err_c.max():.3g} at x={x[np.argmax(err_c / budget)]}"


@pytest.mark.parametrize("wide", [False, True])
def test_triton_sincos_within_budget(wide):
    x = sample_angles()
    s, c = triton_sincos(x, wide)
    assert np.isfinite(s).all() and np.isfinite(c).all()
    within_budget(x, s, c, np.full(x.shape, 2e-7))


def test_huge_angles_stay_on_the_unit_circle():
    """Past 2^24 (rope_scale < 1 or tens of millions of tokens) the angle's own fp32 rounding is
    radians wide, so only sanity is asked: |sin|, |cos| <= 1 and sin^2 + cos^2 = 1."""
    rng = np.random.default_rng(5)
    x = (np.exp2(rng.uniform(24, 31, 200_000)) * rng.choice([-1.0, 1.0], 200_000)).astype(F32)
    s, c = triton_sincos(x)
    assert np.abs(s).max() <= 1 + 1e-6 and np.abs(c).max() <= 1 + 1e-6
    assert np.abs(s.astype(np.float64) ** 2 + c.astype(np.float64) ** 2 - 1).max() < 1e-5


def test_the_narrow_variant_is_the_wide_one_up_to_2_pow_31():
    """Plans whose angles stay within 2^31 radians compile sincos without its guard (WIDE=False):
    bit for bit the guarded results there, 2^31 itself included."""
    rng = np.random.default_rng(7)
    wide = np.exp2(rng.uniform(21, 31, 100_000)) * rng.choice([-1.0, 1.0], 100_000)
    x = np.concatenate([sample_angles(seed=2)[::8], wide,
                        [2.0 ** 31, -2.0 ** 31, np.nextafter(F32(2 ** 31), F32(0))]]).astype(F32)
    for got, want in zip(triton_sincos(x, wide=False), triton_sincos(x, wide=True)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode, scale, theta, head_dim, kind", [
    ("NONE", 0.001, 1e4, 128, 0), ("ALIBI", 1.0, 1e4, 128, 0), ("ROPE_LLAMA", 1.0, 1e4, 128, 1),
    ("ROPE_LLAMA", 8.0, 5e5, 64, 1), ("ROPE_LLAMA", 1.0, 1.0, 256, 1), ("ROPE_LLAMA", 0.999, 1e4, 128, 2),
    ("ROPE_LLAMA", 1e-30, 1e4, 128, 2), ("ROPE_LLAMA", 1.0, 0.5, 128, 2), ("ROPE_LLAMA", 2.0, 0.5, 128, 1),
    ("ROPE_LLAMA", 1.0, 1e-300, 128, 2), ("ROPE_LLAMA", 1e300, 5e-324, 64, 2)])
def test_rope_kernel_variant(mode, scale, theta, head_dim, kind):
    """1 exactly where (2^31 / scale) * theta^(-2t/d) <= 2^31 for every t < d/2, else 2; 0 without RoPE."""
    assert trig.rope_kernel_variant(mode, scale, theta, head_dim) == kind


def test_angles_without_a_phase_give_a_unit_vector():
    """From 2^31 on (rope_scale or rope_theta near 0), and for inf and NaN angles, fp32 keeps no
    phase: the kernels answer a point of the unit circle, never NaN."""
    rng = np.random.default_rng(6)
    x = np.concatenate([np.exp2(rng.uniform(31, 127, 10_000)) * rng.choice([-1.0, 1.0], 10_000),
                        [np.inf, -np.inf, np.nan, np.finfo(F32).max]]).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        s, c = triton_sincos(x)
    assert np.isfinite(s).all() and np.isfinite(c).all()
    assert np.abs(s.astype(np.float64) ** 2 + c.astype(np.float64) ** 2 - 1).max() < 1e-5


@pytest.mark.gpu
def test_gpu_sincos_within_budget():
    """The GPU's fast sine and cosine: within 1e-6 + 2^-22 |x| (trig.py)."""
    x = sample_angles()
    s, c = triton_sincos(x, device="cuda")
    within_budget(x, s, c, 1e-6 + 2.0 ** -22 * np.abs(x.astype(np.float64)))


@pytest.mark.gpu
def test_gpu_sincos_narrow_is_wide_below_2_pow_31_and_phaseless_angles_are_unit_vectors():
    rng = np.random.default_rng(8)
    below = np.concatenate([sample_angles(seed=3)[::8], np.exp2(rng.uniform(21, 31, 100_000)), [2.0 ** 31]])
    below = (below * rng.choice([-1.0, 1.0], below.size)).astype(F32)
    for got, want in zip(triton_sincos(below, wide=False, device="cuda"),
                         triton_sincos(below, wide=True, device="cuda")):
        np.testing.assert_array_equal(got, want)
    x = np.concatenate([np.exp2(rng.uniform(24, 127, 10_000)) * rng.choice([-1.0, 1.0], 10_000),
                        [np.inf, -np.inf, np.nan, np.finfo(F32).max]]).astype(F32)
    s, c = triton_sincos(x, device="cuda")
    assert np.isfinite(s).all() and np.isfinite(c).all()
    assert np.abs(s.astype(np.float64) ** 2 + c.astype(np.float64) ** 2 - 1).max() < 1e-5


@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, trig.tanh(x), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x^2, e^2x of |x| = 1e30
def test_tanh_relative_error_near_zero_and_saturation():
    """The soft cap's tanh: relative error <= 2e-6 from 1e-30 to 20 (a cap far above the logits
    divides them down to ~1e-6, where the exp2 form alone was off by ~10 %), +-1 beyond, odd."""
    mag = np.concatenate([np.logspace(-30, 1.3, 4000), np.linspace(0.05, 0.08, 500)])
    x = np.concatenate([mag, -mag, [0.0, 1e30, -1e30, np.inf, -np.inf]]).astype(F32)
    xt = torch.from_numpy(x)
    y = torch.full_like(xt, float("nan"))
    _tanh_kernel[(1,)](xt, y, xt.numel(), BLOCK=triton.next_power_of_2(xt.numel()))
    got, want = y.numpy().astype(np.float64), np.tanh(x.astype(np.float64))
    finite = np.abs(x) < 1e29
    rel = np.abs(got[finite] - want[finite]) / np.maximum(np.abs(want[finite]), 1e-300)
    assert rel.max() <= 2e-6, (rel.max(), x[finite][rel.argmax()])
    near = np.abs(x[finite]) < 0.0625  # the series: float32 rounding only (a wrong term fails here)
    assert rel[near].max() <= 3e-7, (rel[near].max(), x[finite][near][rel[near].argmax()])
    assert np.array_equal(got[~finite], np.sign(x[~finite]))
    nan = torch.tensor([float("nan")])
    _tanh_kernel[(1,)](nan, y, 1, BLOCK=1)
    assert torch.isnan(y[0])
