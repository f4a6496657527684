"""fa2 merge_states (Triton) against the float64 oracle: random states, -inf states, dtypes.

Runs under the Triton interpreter on the CPU, and on the GPU when one is present.
"""
from __future__ import annotations

import pytest
import torch

from flashdispatch.backends.base import MergeInputs
from flashdispatch.backends.common import TRITON_INTERPRETED

from oracle import oracle_merge, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not TRITON_INTERPRETED,
                                reason="needs a CUDA GPU or TRITON_INTERPRET=1")

if TRITON_INTERPRETED or torch.cuda.is_available():
    from flashdispatch.backends.fa2.merge import MERGE_CAPS, merge_states

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _states(seq, n, heads, dim, dtype, seed, neg_inf_frac=0.0):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(seq, n, heads, dim, generator=gen)
    s = 4 * torch.randn(seq, n, heads, generator=gen)
    if neg_inf_frac:
        s[torch.rand(seq, n, heads, generator=gen) < neg_inf_frac] = float("-inf")
    return v.to(dtype), s


def _merge(v, s, out_dtype=None):
    seq, _, heads, dim = v.shape
    v_out = torch.full((seq, heads, dim), float("nan"), dtype=out_dtype or v.dtype, device=DEVICE)
    s_out = torch.full((seq, heads), float("nan"), device=DEVICE)
    merge_states(MergeInputs(v.to(DEVICE), s.to(DEVICE), v_out, s_out))
    return v_out.cpu(), s_out.cpu()


def _dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("shape", [(5, 2, 4, 64), (3, 7, 3, 128), (2, 1, 2, 48), (4, 3, 33, 8)])
def test_merge_random(shape, dtype):
    v, s = _states(*shape, dtype, seed=sum(shape))
    ref_v, ref_s = oracle_merge(v.float(), s)
    out_v, out_s = _merge(v, s)
    assert not torch.isnan(out_v).any() and not torch.isnan(out_s).any()
    assert rel_err(out_v, ref_v) <= TOL[dtype]
    assert (out_s.double() - ref_s).abs().max().item() <= 1e-5


def test_merge_neg_inf_states():
    """States with s = -inf count for nothing (even with NaN values); all -inf gives 0 / -inf."""
    v, s = _states(6, 4, 4, 32, torch.float32, seed=1, neg_inf_frac=0.5)
    s[0] = float("-inf")
    v[s == float("-inf")] = float("nan")
    ref_v, ref_s = oracle_merge(torch.nan_to_num(v), s)
    out_v, out_s = _merge(v, s)
    assert torch.equal(out_v[0], torch.zeros_like(out_v[0]))
    assert (out_s[0] == float("-inf")).all()
    assert torch.equal(out_s == float("-inf"), ref_s == float("-inf"))
    assert rel_err(out_v, ref_v) <= 1e-5


def test_merge_strided_inputs_and_out_dtype():
    v, s = _states(4, 6, 2, 64, torch.float32, seed=2)
    v_view, s_view = v[:, ::2], s[:, ::2]  # non-contiguous state axis
    ref_v, ref_s = oracle_merge(v_view, s_view)
    out_v, out_s = _merge(v_view, s_view, out_dtype=torch.float16)
    assert out_v.dtype == torch.float16
    assert rel_err(out_v, ref_v) <= TOL[torch.float16]
    assert (out_s.double() - ref_s).abs().max().item() <= 1e-5


def test_merge_caps():
    assert MERGE_CAPS.ops == frozenset({"merge"})
    assert MERGE_CAPS.q_dtypes == frozenset({torch.float16, torch.bfloat16, torch.float32})
