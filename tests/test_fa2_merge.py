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
    from flashdispatch.backends.fa2.merge import MERGE_CAPS, DecodeMerge, merge_states

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


@pytest.mark.parametrize("head_dim,counts,with_lse", [(128, [70, 2, 1, 5], True), (64, [3, 65], False),
                                                      (16, [4, 1, 9], True)])
def test_decode_merge_column_blocks(head_dim, counts, with_lse):
    """The split-decode merge: each request's partials (counts; 1 = written by the decode kernel,
    left alone) merged per (row, head) in column blocks of 32 where they divide head_dim (else all
    columns at once, d16), lse
    from the first block; more partials than one load round (64) included."""
    q_len, heads = 2, 3
    total = sum(counts)
    v, s = _states(total, q_len, heads, head_dim, torch.float32, seed=head_dim)  # [P, q_len, H, D]
    s[3, 1, 2] = float("-inf")
    info, first = [], 0
    for i, n in enumerate(counts):
        info.append([i * q_len, first, n, 0])
        first += n
    rows = len(counts) * q_len
    out = torch.full((rows, heads, head_dim), float("nan"), device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE) if with_lse else None
    DecodeMerge(v.to(DEVICE), s.to(DEVICE), torch.tensor(info, dtype=torch.int32, device=DEVICE), len(counts), q_len,
                heads, head_dim)(out, lse)
    first = 0
    for i, n in enumerate(counts):
        got = out[i * q_len:(i + 1) * q_len].cpu()
        if n < 2:
            assert torch.isnan(got).all()  # not the merge's row
        else:
            ref_v, ref_s = oracle_merge(v[first:first + n].transpose(0, 1), s[first:first + n].transpose(0, 1))
            assert rel_err(got, ref_v) <= 1e-5
            if with_lse:
                assert (lse[i * q_len:(i + 1) * q_len].cpu().double() - ref_s).abs().max().item() <= 1e-5
        first += n


def test_decode_merge_keeps_one_specialisation_key_per_call_kind():
    """`DecodeMerge` fixes the grid and works Triton's specialisation key out once per kind of call
    (lse or not, out/lse strides), as `spec_key` would; a call whose key's kernel the launcher
    keeps passes the tensors as their addresses, also the first call of a kind (its key worked
    out from the tensors); a misaligned out gets no key (worked out at the launch)."""
    from flashdispatch.backends.fa2.launch import SpecKeys, spec_key
    po, plse = torch.zeros(4, 1, 2, 64), torch.zeros(4, 1, 2)
    info = torch.zeros(2, 4, dtype=torch.int32)
    merge = DecodeMerge(po, plse, info, 2, 1, 2, 64)
    assert merge.grid == (2, 2, 2)  # rows x heads x 32-column blocks of the head dim
    calls = []

    class Recorder:  # a launcher that compiles (keeps) a key's kernel at its first tensor launch
        def __init__(self):
            self.kept = set()

        def launch_with_spec(self, spec, grid, args):
            calls.append(("tensors", spec, args))
            self.kept.add(spec)

        def launch_addresses(self, spec, device, grid, args):
            if spec not in self.kept:
                return False
            calls.append(("addresses", spec, args))
            return True

    merge._launchers = {False: Recorder(), True: Recorder()}
    out, lse = torch.empty(2, 2, 64), torch.empty(2, 2)
    wide = torch.empty(2, 2, 72)[:, :, :64]  # head stride 72: not a multiple of 16, another key
    misaligned = torch.empty(2 * 2 * 64 + 1)[1:].view(2, 2, 64)
    for o, lse_arg in ((out, lse), (out, lse), (out, None), (wide, lse), (misaligned, lse)):
        merge(o, lse_arg)
    merge._specs = SpecKeys()  # the kinds are new again, their kernels kept
    merge(out, lse)
    kinds, specs, args = zip(*calls)
    assert kinds == ("tensors", "addresses", "tensors", "tensors", "tensors", "addresses")
    assert specs[0] is specs[1] and specs[0] == spec_key(args[0]) == specs[5]
    assert args[1] == (po.data_ptr(), plse.data_ptr(), out.data_ptr(), lse.data_ptr(), info.data_ptr(), 128, 64, 2, 1)
    assert args[5] == args[1]
    assert specs[2] == spec_key(args[2]) and specs[2] != specs[0]
    assert specs[3] == spec_key(args[3]) and args[3][5:7] == (144, 72) and specs[3] != specs[0]
    assert specs[4] is None


@pytest.mark.parametrize("dtype", _dtypes())
def test_merge_strided_head_dim(dtype):
    """v and v_out whose head_dim is not their contiguous dimension (a transposed view): read and
    written through their column strides, as the reference does."""
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(3, 4, 24, 2, generator=gen).to(dtype)  # [seq, states, dim, heads]
    v, s = base.transpose(2, 3), 4 * torch.randn(3, 4, 2, generator=gen)
    assert v.stride(-1) == 2
    v_out = torch.full((3, 24, 2), float("nan"), dtype=dtype, device=DEVICE).transpose(1, 2)
    s_out = torch.full((3, 2), float("nan"), device=DEVICE)
    merge_states(MergeInputs(v.to(DEVICE), s.to(DEVICE), v_out, s_out))
    ref_v, ref_s = oracle_merge(v.float(), s)
    assert rel_err(v_out.cpu(), ref_v) <= TOL[dtype]
    assert (s_out.cpu().double() - ref_s).abs().max().item() <= 1e-5


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's 0 * inf, masked out
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_merge_empty_states_match_the_reference(poison):
    """fa2 and the reference agree on states of lse -inf whose v holds NaN/inf (they add nothing)
    and on rows of only such states (v 0, lse -inf)."""
    from flashdispatch.backends.reference.merge import merge_states as reference_merge
    v, s = _states(5, 3, 2, 16, torch.float32, seed=9, neg_inf_frac=0.4)
    s[1] = float("-inf")
    v[s == float("-inf")] = poison
    out_v, out_s = _merge(v, s)
    ref_v, ref_s = torch.empty_like(out_v), torch.empty_like(out_s)
    reference_merge(MergeInputs(v, s, ref_v, ref_s))
    assert not out_v.isnan().any() and not ref_v.isnan().any()
    assert torch.equal(out_v[1], torch.zeros_like(out_v[1])) and torch.equal(ref_v[1], out_v[1])
    assert torch.equal(torch.isneginf(out_s), torch.isneginf(ref_s))
    assert rel_err(out_v, ref_v.double()) <= 1e-5


def test_public_merge_states_takes_a_transposed_v():
    """merge_states / merge_state_in_place selecting fa2, with views whose last dim is strided: the
    result of their contiguous copies (to an ulp: on a GPU the tile layout, so the order of the
    sum over states, depends on the strides)."""
    import flashdispatch as fi
    gen = torch.Generator().manual_seed(10)
    v = torch.randn(4, 3, 16, 2, generator=gen).half().to(DEVICE).transpose(2, 3)
    s = torch.randn(4, 3, 2, generator=gen).to(DEVICE)
    with fi.use_backends("fa2"):
        got_v, got_s = fi.merge_states(v, s)
        want_v, want_s = fi.merge_states(v.contiguous(), s)
        assert torch.allclose(got_v, want_v, rtol=0, atol=2e-3) and torch.allclose(got_s, want_s, rtol=0, atol=1e-6)
        dst = v[:, 0].transpose(1, 2).contiguous().transpose(1, 2)  # [4, 2, 16], column stride 2
        dst_s = s[:, 0].clone()
        fi.merge_state_in_place(dst, dst_s, v[:, 1], s[:, 1])
        want_v, want_s = fi.merge_state(v[:, 0].contiguous(), s[:, 0], v[:, 1].contiguous(), s[:, 1])
    assert torch.allclose(dst, want_v, rtol=0, atol=2e-3) and torch.allclose(dst_s, want_s, rtol=0, atol=1e-6)
