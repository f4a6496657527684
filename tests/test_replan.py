"""A wrapper's next plan() with the same batch size and scalar arguments refreshes the last plan
(`Backend.replan`) where the backend can: fa2 decode swaps in the new page table when it reads the
table directly and still splits no request. Every refreshed run is checked against a float64
dense computation on new lengths and pages; anything else must plan afresh."""
import pytest
import torch

import flashdispatch as flashinfer
from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.dispatch.registry import backend_class

from test_api import dense_attention, paged_to_dense, rel

interpreted = pytest.mark.skipif(not TRITON_INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU run of the Triton kernels)")

PAGE, HQ, HKV, D, PAGES = 16, 4, 2, 64, 96


@pytest.fixture
def fresh_plans(monkeypatch):
    """Counts the fa2 plans made afresh (not refreshed)."""
    fa2 = backend_class("fa2")
    made = []
    original = fa2.plan

    def counting(self, problem, device, params):
        made.append(problem)
        return original(self, problem, device, params)

    monkeypatch.setattr(fa2, "plan", counting)
    return made


def _table(lens, seed, pages=PAGES, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = [(x + PAGE - 1) // PAGE for x in lens]
    indptr = torch.tensor([0] + [sum(n[:i + 1]) for i in range(len(n))], dtype=torch.int32)
    last = torch.tensor([x - (c - 1) * PAGE if c else 0 for x, c in zip(lens, n)], dtype=torch.int32)
    return tuple(t.to(device) for t in (indptr, torch.randperm(pages, generator=g)[:sum(n)].int(), last))


def _check(wrapper, kv, table, sm_scale=None, return_lse=False):
    q = torch.randn(len(table[2]), HQ, D).half()
    got = wrapper.run(q, kv, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    for b in range(len(table[2])):
        k, v = paged_to_dense(kv, *table, PAGE, b)
        ref, ref_lse = dense_attention(q[b:b + 1], k, v, sm_scale=sm_scale)
        assert rel(out[b:b + 1], ref) < 4e-3
        if return_lse and k.shape[0]:
            assert torch.allclose(lse[b].double(), ref_lse[0], atol=2e-3)


@interpreted
@pytest.mark.parametrize("repeat", [1, 4], ids=["partitioned", "never-split"])
def test_replan_refreshes_the_table_and_stays_exact(fresh_plans, repeat):
    """4 requests x 2 KV heads: the refresh works the partition out (under the 8-SM CPU target);
    16 x 2 fill it, so no length can split a request (the refresh's shortcut)."""
    torch.manual_seed(0)
    kv = torch.randn(PAGES * repeat, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    w.plan(*_table([40, 0, 130, 17] * repeat, 0, PAGES * repeat), HQ, HKV, D, PAGE, data_type=torch.float16)
    assert w._planned.plan.direct, "the case must plan the direct-table kernel, the one a re-plan refreshes"
    assert len(fresh_plans) == 1
    for seed, lens in enumerate(([16, 77, 3, 200], [1, 1, 0, 48], [250, 9, 64, 33]), 1):
        lens = lens * repeat
        table = _table(lens, seed, PAGES * repeat)
        w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)
        _check(w, kv, table)
        _check(w, kv, table, return_lse=True)  # a variant first asked for after the re-plan
    assert len(fresh_plans) == 2  # the plan, and the lse variant at its first run


@interpreted
def test_replan_plans_afresh_when_the_scalars_batch_or_workspace_change(fresh_plans):
    torch.manual_seed(1)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    w.plan(*_table([40, 90, 130], 0), HQ, HKV, D, PAGE, data_type=torch.float16)
    table = _table([41, 89, 100], 1)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    _check(w, kv, table, sm_scale=0.3)
    table = _table([41, 89], 2)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    _check(w, kv, table, sm_scale=0.3)
    w.reset_workspace_buffer(torch.zeros(1 << 22, dtype=torch.uint8))
    w.plan(*_table([5, 6], 3), HQ, HKV, D, PAGE, data_type=torch.float16, sm_scale=0.3)
    assert len(fresh_plans) == 4


@interpreted
def test_replan_that_needs_a_split_plans_afresh(fresh_plans):
    """One short request plans the direct kernel; a long one must be split (partials, merge)."""
    torch.manual_seed(2)
    kv = torch.randn(PAGES, 2, PAGE, HKV, D).half()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 22, dtype=torch.uint8), backend="fa2")
    w.plan(*_table([20], 0), HQ, HKV, D, PAGE, data_type=torch.float16)
    assert w._planned.plan.direct
    table = _table([1500], 1)
    w.plan(*table, HQ, HKV, D, PAGE, data_type=torch.float16)
    assert not w._planned.plan.direct and w._planned.plan.n_work > 1
    _check(w, kv, table)
    assert len(fresh_plans) == 2


@pytest.mark.gpu
def test_replan_on_the_gpu_matches_the_reference(fresh_plans):
    """bf16, batch 128 x 8 KV heads (no split on a GPU of up to 256 SMs): re-plans with new lengths
    and pages, on device tables, each run against the reference backend's."""
    torch.manual_seed(3)
    batch, hq, hkv, d, pages = 128, 32, 8, 128, 128 * 40
    kv = torch.randn(pages, 2, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, backend="fa2")
    ref = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(ws), backend="reference")
    g = torch.Generator().manual_seed(4)
    for seed in range(4):
        lens = torch.randint(0, 40 * PAGE + 1, (batch,), generator=g).tolist()
        table = _table(lens, seed, pages, "cuda")
        for wrapper in (w, ref):
            wrapper.plan(*table, hq, hkv, d, PAGE, data_type=torch.bfloat16)
        assert w._planned.plan.direct
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        out, lse = w.run(q, kv, return_lse=True)
        ref_out, ref_lse = ref.run(q, kv, return_lse=True)
        assert rel(out, ref_out) < 2e-2
        full = torch.tensor(lens, device="cuda") > 0
        assert torch.allclose(lse[full], ref_lse[full], atol=2e-2)
        assert torch.equal(out[~full], torch.zeros_like(out[~full])) and bool(torch.isneginf(lse[~full]).all())
    assert len(fresh_plans) == 2  # the first plan, and its lse variant at the first run
