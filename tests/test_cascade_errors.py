"""merge_state_in_place refuses outputs it would corrupt (v and s sharing memory, a v folding onto
itself, a leaf that requires grad); the reference merge's empty states (-inf lse) add nothing
whatever their v holds; packbits / segment_packbits take only 1-D bool or 0/1 integer input."""
from __future__ import annotations

import pytest
import torch

import flashdispatch as fi
from flashdispatch.backends.base import MergeInputs
from flashdispatch.backends.reference.merge import merge_states as reference_merge

from oracle import oracle_merge, rel_err


def _state(seq=3, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(seq, heads, dim, generator=gen), torch.randn(seq, heads, generator=gen)


def test_merge_in_place_refuses_v_and_s_sharing_memory():
    buf = torch.randn(3 * 2 * 8)
    v, s = buf.view(3, 2, 8), buf[-6:].view(3, 2)  # s: the last elements of v
    before = buf.clone()
    with pytest.raises(ValueError, match="v and s share memory"):
        fi.merge_state_in_place(v, s, *_state(seed=1))
    assert torch.equal(buf, before)


@pytest.mark.parametrize("make", [lambda: torch.randn(40).as_strided((3, 2, 8), (8, 4, 1)),
                                  lambda: torch.randn(8).as_strided((3, 2, 8), (0, 0, 1)),
                                  lambda: torch.randn(30).as_strided((3, 2, 8), (1, 8, 2))],
                         ids=["rows_overlap", "expanded", "columns_overlap"])
def test_merge_in_place_refuses_a_self_overlapping_v(make):
    v = make()
    with pytest.raises(ValueError, match="v has elements that (may )?share memory"):
        fi.merge_state_in_place(v, torch.randn(3, 2), *_state())


def test_merge_in_place_refuses_a_self_overlapping_s():
    s = torch.randn(4).as_strided((3, 2), (1, 1))
    with pytest.raises(ValueError, match="s has elements that may share memory"):
        fi.merge_state_in_place(torch.randn(3, 2, 8), s, *_state())


def test_merge_in_place_accepts_strided_disjoint_outputs():
    """Permuted and sliced (disjoint) v/s are written in place, as a contiguous copy would be."""
    v_other, s_other = _state(seed=2)
    v_base, s_base = torch.randn(8, 2, 3 * 2), torch.randn(2, 3 * 2)
    v, s = v_base.permute(2, 1, 0)[::2], s_base.t()[::2]  # [3, 2, 8] and [3, 2], strides (2, 8, 12) / (2, 6)
    expected_v, expected_s = fi.merge_state(v.clone(), s.clone(), v_other, s_other)
    fi.merge_state_in_place(v, s, v_other, s_other)
    assert torch.allclose(v, expected_v) and torch.allclose(s, expected_s)


def test_merge_in_place_refuses_a_leaf_that_requires_grad():
    v, s = _state()
    for leaf, name in ((v.clone().requires_grad_(), "v"), (s.clone().requires_grad_(), "s")):
        args = (leaf, s) if name == "v" else (v.clone(), leaf)
        with pytest.raises(ValueError, match=f"{name} is a leaf tensor that requires grad"):
            fi.merge_state_in_place(*args, *_state(seed=1))
    leaf = v.clone().requires_grad_()
    with pytest.raises(ValueError, match="v is a leaf tensor that requires grad"):  # a view of one
        fi.merge_state_in_place(leaf[:], s.clone(), *_state(seed=1))
    with torch.no_grad():  # allowed there, as any in-place write
        fi.merge_state_in_place(leaf, s.clone(), *_state(seed=1))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_reference_merge_empty_states_add_nothing(poison):
    """A state with lse -inf adds nothing even when its v holds NaN/inf (no 0 * NaN); a row of
    only empty states gives v 0 and lse -inf."""
    gen = torch.Generator().manual_seed(4)
    v, s = torch.randn(4, 3, 2, 8, generator=gen), 3 * torch.randn(4, 3, 2, generator=gen)
    s[:, 1] = float("-inf")
    s[0] = float("-inf")
    v[s == float("-inf")] = poison
    v_out, s_out = torch.full((4, 2, 8), float("nan")), torch.full((4, 2), float("nan"))
    reference_merge(MergeInputs(v, s, v_out, s_out))
    ref_v, ref_s = oracle_merge(torch.where(torch.isfinite(v), v, 0.0), s)
    assert not v_out.isnan().any() and not s_out.isnan().any()
    assert torch.equal(v_out[0], torch.zeros(2, 8)) and torch.isneginf(s_out[0]).all()
    assert rel_err(v_out, ref_v) <= 1e-5
    assert torch.equal(torch.isneginf(s_out), torch.isneginf(ref_s))
    assert (s_out[1:].double() - ref_s[1:]).abs().max().item() <= 1e-5


def test_reference_merge_positive_infinite_lse_gives_nan():
    """Documented: an lse of +inf gives NaN (not checked: that would read device values)."""
    v, s = torch.randn(2, 2, 1, 4), torch.zeros(2, 2, 1)
    s[0, 0] = float("inf")
    v_out, s_out = torch.empty(2, 1, 4), torch.empty(2, 1)
    reference_merge(MergeInputs(v, s, v_out, s_out))
    assert s_out[0].isnan().all() and v_out[0].isnan().all()
    assert not s_out[1].isnan().any() and not v_out[1].isnan().any()


def test_merge_state_with_an_empty_side_is_the_other_side():
    with fi.use_backends("reference"):
        v_a, s_a = _state(seed=5)
        v_b, s_b = torch.full_like(v_a, float("nan")), torch.full_like(s_a, float("-inf"))
        v, s = fi.merge_state(v_a, s_a, v_b, s_b)
    assert torch.allclose(v, v_a, atol=1e-6) and torch.allclose(s, s_a, atol=1e-6)


@pytest.mark.parametrize("x,error,match", [
    (torch.tensor([0.0, 1.0, 1.0]), TypeError, "x.dtype=float32 is not accepted"),
    (torch.ones(2, 8, dtype=torch.bool), ValueError, r"x must have 1 dimensions, got shape \(2, 8\)"),
    (torch.tensor(True), ValueError, "x must have 1 dimensions"),
    ([1, 0, 1], TypeError, "x must be a torch.Tensor"),
])
def test_packbits_refuses_what_flashinfer_does_not_take(x, error, match):
    with pytest.raises(error, match=match):
        fi.packbits(x)
    if isinstance(x, torch.Tensor) and x.dim() == 1:
        with pytest.raises(error, match=match):
            fi.segment_packbits(x, torch.tensor([0, x.numel()]))


@pytest.mark.parametrize("bitorder", ["middle", "Big", None, 1])
def test_packbits_refuses_other_bitorders(bitorder):
    x = torch.ones(9, dtype=torch.bool)
    with pytest.raises(ValueError, match="bitorder=.* not in"):
        fi.packbits(x, bitorder)
    with pytest.raises(ValueError, match="bitorder=.* not in"):
        fi.segment_packbits(x, torch.tensor([0, 9]), bitorder)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64])
def test_packbits_takes_bool_and_binary_integers(dtype):
    bits = torch.rand(21, generator=torch.Generator().manual_seed(6)) > 0.5
    want = fi.packbits(bits, "little")
    assert torch.equal(fi.packbits(bits.to(dtype), "little"), want)
    y, new = fi.segment_packbits(bits.to(dtype), torch.tensor([0, 5, 21]), "big")
    assert torch.equal(y, torch.cat([fi.packbits(bits[:5]), fi.packbits(bits[5:])])) and new.tolist() == [0, 1, 3]
    if dtype != torch.bool:  # numpy's rule: any nonzero element is a 1 bit
        assert torch.equal(fi.packbits(bits.to(dtype) * -3, "little"), want)
