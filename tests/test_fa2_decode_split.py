"""The fa2 decode kernel's own split (direct table): each program works its request's chunk out
from kv_indptr / last_page_len. It must split exactly as plan()'s host partition would (the plan
sizes the grid and the partials from that), over the features that change the arithmetic: query
rows per request, the window, several row blocks, the max_splits cap, program order. Checked
against the oracle, and, with the merge kernel, the info rows the kernel writes (chunks per
request) against the host's count; CUDA-graph plans split into their grid's slots evenly."""
from __future__ import annotations

import numpy as np
import pytest

from test_fa2_decode import _case, _check

pytestmark = pytest.mark.interpreted

UNFUSED = {"direct_table": True, "fused_merge_max_chunks": 0}
FEATURES = {
    "plain": {},
    "q_len2-causal": dict(q_len_per_req=2, mask_mode="causal"),
    "window": dict(window_left=900),
    "q_len3-window": dict(q_len_per_req=3, mask_mode="causal", window_left=700),
    "two-row-blocks": dict(q_len_per_req=8, mask_mode="causal", num_qo_heads=16, num_kv_heads=1),
}


@pytest.mark.parametrize("config", [UNFUSED, {**UNFUSED, "heads_fastest": False}, {**UNFUSED, "max_splits": 3}],
                         ids=["merge-kernel", "units-slowest", "max-splits-3"])
@pytest.mark.parametrize("feature", FEATURES)
def test_kernel_split_matches_the_host_partition(feature, config):
    # two row blocks (8 x 16 rows a request) on fewer requests: the interpreter's time goes with the merge's rows
    lens = (1200, 0, 870) if feature == "two-row-blocks" else (1200, 1000, 0, 1320, 870)
    case = _case(lens, seed=60, **FEATURES[feature])
    plan = _check(case, config=config)
    assert plan.direct and plan.split_slots > 1, "the case must take the kernel's own split"
    from flashdispatch.backends.fa2.decode_split import effective_lengths
    lengths = effective_lengths(case.params, plan.problem, plan.q_len)
    lens, _, eff, _, chunk = plan._partition(case.device, case.params, lengths)
    nsplit = np.maximum(1, -(-eff // chunk))
    info = plan.info.view(-1, 4)
    assert plan.split_slots == nsplit.max()
    assert info[:, 2].tolist() == nsplit.tolist()
    assert info[:, 0].tolist() == [r * plan.q_len for r in range(len(lens))]
    assert info[:, 1].tolist() == [r * plan.split_slots for r in range(len(lens))]


@pytest.mark.parametrize("feature", ["plain", "q_len3-window"])
def test_kernel_split_with_the_fused_merge(feature):
    case = _case((1200, 1000, 0, 1320, 870), seed=61, **FEATURES[feature])
    plan = _check(case, config={"direct_table": True, "fused_merge_max_chunks": 64})
    assert plan.direct and plan.split_slots > 1 and plan.fused_merge
    assert not plan.counters.any(), "each merging program resets its counter"


@pytest.mark.parametrize("feature", ["plain", "window"])
def test_graph_plan_splits_into_its_slots_evenly(feature):
    """CUDA graphs with the direct table: the kernel splits each request into at most the graph
    grid's chunk slots (a function of the batch size) of at least min_chunk_tokens, evenly: its
    chunk length covers the request in that many chunks (a cap of the config's max_splits instead
    would leave the last slot the rest), as the info rows it writes count."""
    case = _case((1200, 1000, 0, 1320, 870), seed=62, use_cuda_graph=True, **FEATURES[feature])
    plan = _check(case, config={**UNFUSED, "graph_few_line": False})  # each request split on its own
    slots = plan._graph_splits(plan.batch, plan.units, case.device.sm_count or 8, case.params)
    assert plan.direct and plan.split_slots == slots == plan.kernel_max_splits > 1
    assert plan.split_tokens == plan.config.min_chunk_tokens
    from flashdispatch.backends.fa2.decode_split import effective_lengths
    eff = effective_lengths(case.params, plan.problem, plan.q_len)[2]
    # the kernel's arithmetic (decode_kernel.py, DIRECT_SPLIT) with the plan's arguments
    n = np.minimum(np.maximum(eff // plan.split_tokens, 1), plan.kernel_max_splits)
    block = plan.config.block_n
    chunk = np.maximum(block, -(-(-(-eff // n)) // block) * block)
    count = np.minimum(np.maximum(-(-eff // chunk), 1), slots)
    assert (count * chunk >= eff).all(), "no slot takes a remainder"
    assert plan.info.view(-1, 4)[:, 2].tolist() == count.tolist()
    assert (count == slots).any() and (count < slots).any()


@pytest.mark.parametrize("kv_len", [40, 100])
def test_a_policy_split_of_one_chunk_a_request_runs_unsplit(kv_len):
    """Short chunks allowed (min_chunk_tokens 16): the policy asks for chunks, but every request
    fits one (slots 1), so the direct table runs unsplit (plan() once failed with no work count)."""
    case = _case((kv_len,), page_size=64, seed=61)
    plan = _check(case, config={"min_chunk_tokens": 16, "split_chunk_tokens": 0})
    assert plan.direct and plan.split_slots == 1 and plan.split_tokens == 0 and plan.n_merge == 0


def test_balanced_chunks_round_each_share_up_to_whole_blocks():
    """One division (ceil(eff / (n x block))) gives the kernel's two roundings (decode_kernel.py,
    DIRECT_SPLIT: a share ceil(eff / n), then whole blocks): lengths 0..2999, n 0..69."""
    from flashdispatch.backends.fa2.decode_split import balanced_chunks
    eff = np.arange(3000)
    for block in (16, 64, 128):
        for n in range(70):
            share = -(-eff // max(n, 1))
            expected = np.maximum(block, -(-share // block) * block)
            assert (balanced_chunks(eff, np.full_like(eff, n), block) == expected).all(), (block, n)


def test_the_decode_wrappers_kv_stats_are_those_of_the_planned_lengths():
    """`tokens_sum` takes a windowless plan's token sum from the kv_lens_stats the decode wrapper
    gives its params (worked out once in plan()): they must be the sum and max of the planned
    lengths, at the first plan() and at a re-plan of other lengths (the refresh's)."""
    import torch

    import flashdispatch as fd
    wrapper = fd.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD",
                                                    backend="reference")
    page = 16
    for lens in ([1200, 0, 870, 33], [5, 1600, 17, 900]):
        pages = [-(-n // page) for n in lens]
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
        last = torch.tensor([n - (k - 1) * page if k else 0 for n, k in zip(lens, pages)], dtype=torch.int32)
        wrapper.plan(indptr, torch.arange(sum(pages), dtype=torch.int32), last, 8, 2, 64, page)
        params = wrapper._planned.params
        assert params.kv_lens_array().tolist() == lens
        assert params.kv_lens_stats() == (sum(lens), max(lens))


@pytest.mark.parametrize("feature", ["plain", "q_len3-window"])
def test_tokens_sum_is_the_sum_of_the_effective_lengths(feature):
    """The split policy's tokens (`tokens_sum`: the wrapper's kv_lens_stats without a window)
    are those of the requests from their window starts."""
    from flashdispatch.backends.fa2.decode_split import effective_lengths, tokens_sum
    case = _case((1200, 1000, 0, 1320, 870), seed=63, **FEATURES[feature])
    problem = case.problem
    eff = effective_lengths(case.params, problem, problem.q_len_per_req)[2]
    assert tokens_sum(eff, case.params, problem) == int(eff.sum())
    assert (problem.window_left >= 0) == (int(eff.sum()) < 1200 + 1000 + 1320 + 870), "the window must cut"
