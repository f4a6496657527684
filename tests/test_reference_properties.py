"""Property tests: the reference against the float64 oracle on random batches (hypothesis)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdispatch.backends.base import MergeInputs
from flashdispatch.backends.reference import ReferenceBackend
from oracle import assert_close, make_mla_case, make_paged_case, make_ragged_case, oracle_merge, run_case

TOL = 1e-5
BACKEND = ReferenceBackend()
FAST = settings(max_examples=25, deadline=None)


def _check(case):
    out, lse = run_case(BACKEND, case)
    ref_out, ref_lse = case.oracle()
    assert_close(out, lse, ref_out, ref_lse, TOL)


@st.composite
def kv_lengths(draw, page_size: int, size: int):
    """KV lengths including 0 and exact multiples of the page size."""
    one = st.one_of(st.just(0), st.integers(1, 3).map(lambda n: n * page_size), st.integers(1, 40))
    return draw(st.lists(one, min_size=size, max_size=size))


@st.composite
def paged_cases(draw):
    batch = draw(st.integers(1, 5))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    kv_lens = draw(kv_lengths(page_size, batch))
    op = draw(st.sampled_from(["decode", "prefill_paged"]))
    q_len_per_req = draw(st.integers(1, 3)) if op == "decode" else 1
    qo_lens = None if op == "decode" else draw(st.lists(st.integers(0, 8), min_size=batch, max_size=batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    return make_paged_case(
        op, kv_lens=kv_lens, qo_lens=qo_lens, q_len_per_req=q_len_per_req, page_size=page_size,
        kv_layout=draw(st.sampled_from(["NHD", "HND"])), kv_storage=draw(st.sampled_from(["5d", "tuple"])),
        extra_pages=draw(st.integers(0, 4)), num_kv_heads=num_kv_heads,
        num_qo_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])), head_dim_qk=draw(st.sampled_from([8, 16])),
        mask_mode="causal" if causal else "none", window_left=draw(st.sampled_from([-1, -1, 0, 5])),
        seed=draw(st.integers(0, 2**16)))


@FAST
@given(paged_cases())
def test_paged_matches_oracle(case):
    _check(case)


@FAST
@given(st.data())
def test_ragged_matches_oracle(data):
    batch = data.draw(st.integers(1, 5))
    lens = st.lists(st.integers(0, 12), min_size=batch, max_size=batch)
    mask_mode = data.draw(st.sampled_from(["none", "causal", "custom"]))
    group = data.draw(st.sampled_from([1, 3]))
    _check(make_ragged_case(
        qo_lens=data.draw(lens), kv_lens=data.draw(lens), mask_mode=mask_mode, num_kv_heads=2,
        num_qo_heads=2 * group, head_dim_qk=16, head_dim_vo=data.draw(st.sampled_from([8, 16])),
        logits_soft_cap=data.draw(st.sampled_from([0.0, 1.5])),
        pos_encoding_mode=data.draw(st.sampled_from(["NONE", "ALIBI", "ROPE_LLAMA"])),
        sinks=data.draw(st.booleans()), seed=data.draw(st.integers(0, 2**16))))


@FAST
@given(st.data())
def test_mla_matches_oracle(data):
    batch = data.draw(st.integers(1, 4))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    _check(make_mla_case(
        qo_lens=data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)),
        kv_lens=data.draw(kv_lengths(page_size, batch)), num_heads=data.draw(st.sampled_from([1, 4])),
        head_dim_ckv=16, head_dim_kpe=8, page_size=page_size, causal=data.draw(st.booleans()),
        seed=data.draw(st.integers(0, 2**16))))


@FAST
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16), st.floats(0.0, 0.5))
def test_merge_matches_oracle(seq, states, seed, empty_fraction):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(seq, states, 2, 8, generator=gen)
    s = 5 * torch.randn(seq, states, 2, generator=gen)
    s[torch.rand(s.shape, generator=gen) < empty_fraction] = float("-inf")
    v_out, s_out = torch.full((seq, 2, 8), float("nan")), torch.full((seq, 2), float("nan"))
    BACKEND.merge_states(MergeInputs(v, s, v_out, s_out))
    assert_close(v_out, s_out, *oracle_merge(v, s), TOL)
