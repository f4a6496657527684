"""The host side of plan()/run(): scalar checks reused only for equal arguments, the params'
host lengths and deferred uploads, run()'s fast checks falling back to the explaining ones, and
the single-request functions' kept plans (the device reads: test_device_read.py)."""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flashdispatch as fi
from flashdispatch import checks
from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.dispatch.registry import get_backend
from flashdispatch.dispatch.select import clear_cache
from flashdispatch.planned import SINGLE_PLANS, single_plans

WS = torch.empty(1 << 20, dtype=torch.uint8)


def table(lens, page_size, garbage=()):
    """indptr, indices (shuffled, plus trailing ``garbage`` entries), last_page_len for kv lengths."""
    pages = [-(-n // page_size) for n in lens]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).int()
    used = int(indptr[-1])
    indices = torch.cat([torch.randperm(used), torch.tensor(garbage, dtype=torch.long)]).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


def decode_plan(w, indptr, indices, last, **kw):
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=8, q_data_type=torch.float32)
    args.update(kw)
    w.plan(indptr, indices, last, **args)


def test_indices_past_indptr_end_are_not_checked_or_counted():
    torch.manual_seed(0)
    indptr, indices, last = table([5, 17, 33], 8, garbage=(-1, 10 ** 6))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last)
    q = torch.randn(3, 4, 16)
    pages = int(indptr[-1])  # the largest used page index is pages - 1
    assert w.run(q, torch.randn(pages, 2, 8, 2, 16)).shape == (3, 4, 16)
    with pytest.raises(ValueError, match=f"reference page {pages - 1}, but paged_kv_cache has only {pages - 1}"):
        w.run(q, torch.randn(pages - 1, 2, 8, 2, 16))


def test_replan_checks_changed_scalars_again():
    indptr, indices, last = table([5, 17], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last, window_left=1)
    with pytest.raises(ValueError, match="window_left=True"):  # True == 1, but not an int window
        decode_plan(w, indptr, indices, last, window_left=True)
    with pytest.raises(ValueError, match="head_dim=16.0"):
        decode_plan(w, indptr, indices, last, head_dim=16.0)
    decode_plan(w, indptr, indices, last, sm_scale=0.5)
    assert w._planned.params.sm_scale == 0.5
    decode_plan(w, indptr, indices, last)
    assert w._planned.params.sm_scale == pytest.approx(0.25)


def test_replan_uses_the_new_page_table():
    torch.manual_seed(1)
    cache = torch.randn(16, 2, 8, 2, 16)
    q = torch.randn(3, 4, 16)
    first, second = table([5, 17, 33], 8), table([40, 1, 9], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, *first)
    w.run(q, cache)
    decode_plan(w, *second)
    fresh = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(fresh, *second)
    o, lse = w.run(q, cache, return_lse=True)
    o_ref, lse_ref = fresh.run(q, cache, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_run_fast_path_falls_back_to_the_explaining_checks():
    indptr, indices, last = table([5, 17], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last)
    cache = torch.randn(8, 2, 8, 2, 16)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="q must be contiguous"):
        w.run(torch.randn(2, 4, 32)[..., ::2], cache)
    with pytest.raises(ValueError, match="contiguous in its last"):
        w.run(q, torch.randn(8, 2, 8, 2, 32)[..., ::2])
    with pytest.raises(TypeError, match="out.dtype=float16"):
        w.run(q, cache, out=torch.empty(2, 4, 16).half())
    k, v = cache.unbind(1)
    assert torch.equal(w.run(q, (k, v)), w.run(q, cache))  # a (k, v) tuple takes the same path


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_combined_cache_reads_as_its_two_views(layout, dtype):
    """A 5-D cache (here every other page of a larger one, HND as a transposed view) unpacks
    without views made: k and v read as cache[:, 0] and cache[:, 1], and `PagedKV.addresses`
    gives their addresses and strides from the 5-D tensor; once v is replaced, the pair's own."""
    from flashdispatch.backends.base import PagedKV
    big = torch.randn(12, 2, 16, 2, 8).to(dtype)
    cache = (big.transpose(2, 3) if layout == "HND" else big)[::2]
    kv = checks.unpack_paged_kv_cache(cache, layout)
    assert isinstance(kv, PagedKV) and kv.combined is cache
    assert (kv.num_pages, kv.dtype, kv.layout) == (6, dtype, layout)
    want = cache[:, 0], cache[:, 1]
    assert kv.addresses() == (want[0].data_ptr(), want[1].data_ptr(), want[0].stride(), want[1].stride())
    for got, view in zip((kv.k, kv.v), want):
        assert got.shape == view.shape and got.stride() == view.stride()
        assert torch.equal(got.view(torch.uint8), view.view(torch.uint8))
    two = PagedKV(*want, layout)
    assert two.combined is None and two.addresses() == kv.addresses() and two.num_pages == 6
    other = want[1].clone()
    kv.v = other  # a replaced view: no longer one tensor
    assert kv.combined is None and kv.addresses() == (want[0].data_ptr(), other.data_ptr(), want[0].stride(),
                                                      other.stride())


def test_host_overhead_script_runs():
    script = Path(__file__).resolve().parents[1] / "scripts" / "host_overhead.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script), "--batches", "1", "4", "--calls", "2", "--reps", "1",
                          "--single-len", "64", "--profile", "3"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split()[:2] for line in out.stdout.splitlines()[2:8]]
    assert rows == [["decode", "1"], ["decode", "4"], ["prefill_paged", "1"], ["prefill_paged", "4"],
                    ["single_prefill", "1"], ["single_decode", "1"]], out.stdout
    assert "cProfile" in out.stdout


def test_plan_line_times_script_times_each_statement():
    """scripts/plan_line_times.py (a subprocess: it rewrites the library's functions) times
    plan()'s statements: the plan() line that plans is there, once per call, and the lines it
    calls are inside its time."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "plan_line_times.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script), "--shape", "3x40", "--calls", "4",
                          "--extra", "flashdispatch.checks:check_indptr"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split(maxsplit=3) for line in out.stdout.splitlines()[3:]]  # us, passes, where, source
    outer = [(float(us), passes) for us, passes, where, source in rows
             if where.startswith("decode.BatchDecodeWithPagedKVCacheWrapper.plan:") and "_plan_variants" in source]
    inner = [float(us) for us, _, where, _ in rows if where.startswith("backends.fa2.decode.DecodePlan.")]
    assert len(outer) == 1 and outer[0][1] == "1.0x", out.stdout
    assert inner and max(inner) < outer[0][0], out.stdout
    assert any(where.startswith("checks.check_indptr:") for _, _, where, _ in rows), out.stdout


def test_check_inputs_0_skips_the_page_index_range_check(monkeypatch):
    indptr, indices, last = table([5, 17], 8)
    indices[1] = -3
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    with pytest.raises(ValueError, match="negative page index -3"):
        decode_plan(w, indptr, indices, last)
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "0")
    decode_plan(w, indptr, indices, last)
    assert w._planned.max_page_index == -1  # run() then compares nothing against the cache
    with pytest.raises(ValueError, match="3 entries, but indptr"):  # what needs no device read stays
        decode_plan(w, indptr, indices[:3], last)
    p = fi.BatchPrefillWithPagedKVCacheWrapper(WS, backend="reference")
    p.plan(torch.tensor([0, 1, 2], dtype=torch.int32), indptr, indices, last, 4, 2, 16, 8)
    assert p._planned.max_page_index == -1
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "1")
    with pytest.raises(ValueError, match="paged_kv_indices holds a negative page index -3"):
        p.plan(torch.tensor([0, 1, 2], dtype=torch.int32), indptr, indices, last, 4, 2, 16, 8)


def test_block_tables_plan_equals_page_table_plan():
    torch.manual_seed(2)
    lens = torch.tensor([5, 17, 0, 33], dtype=torch.int32)
    tables = torch.randperm(24).int().view(4, 6)
    cache, q = torch.randn(24, 2, 8, 2, 16), torch.randn(4, 4, 16)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, None, None, None, block_tables=tables, seq_lens=lens)
    pages = (lens + 7) // 8
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).int()])
    indices = torch.cat([tables[b, :p] for b, p in enumerate(pages.tolist())])
    last = torch.where(pages > 0, lens - (pages - 1) * 8, 0).int()
    ref = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(ref, indptr, indices, last)
    assert torch.equal(w.run(q, cache), ref.run(q, cache))


# --- the single-request functions keep their plans ------------------------------------------------
def dense(q, k, v, causal=False, mask=None):
    """float64 attention of one request (q [Lq, Hq, D], k/v [Lk, Hkv, D]; mask [Lq, Lk] True
    keeps) -> out, base-2 lse."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        pos = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out, (torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.fixture
def plans_made(monkeypatch):
    """Counts of backend.plan() calls per backend name (the calls still plan). The class is
    patched, not the shared instance: older pytest versions undo an instance patch by setting the
    bound method on the instance, which then hides later class patches (test_replan's)."""
    counts = {}
    for name in ("reference", "fa2"):
        cls = type(get_backend(name))
        real = cls.plan

        def counting(self, problem, device, params, _name=name, _real=real):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(self, problem, device, params)

        monkeypatch.setattr(cls, "plan", counting)
    return counts


def qkv(seed, q_len=7, kv_len=19, d=16, dtype=torch.float32, layout="NHD"):
    """Random q [q_len, 4, d], k/v [kv_len, 2, d] (HND: [2, kv_len, d])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, 4, d, generator=g).to(dtype)
    k, v = (torch.randn(kv_len, 2, d, generator=g).to(dtype) for _ in range(2))
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    return q, k, v


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill_runs_its_kept_plan_on_new_data(layout, plans_made):
    outs = []
    for seed in range(3):
        q, k, v = qkv(seed, layout=layout)
        o, lse = fi.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout=layout, return_lse=True,
                                                 backend="reference")
        outs.append(o)
        kn, vn = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
        ref, ref_lse = dense(q, kn, vn, causal=True)
        assert rel(o, ref) < 1e-5 and torch.allclose(lse.double(), ref_lse, atol=1e-4)
    assert plans_made == {"reference": 1}
    assert outs[0].data_ptr() != outs[1].data_ptr() != outs[2].data_ptr()  # out is the call's own
    o = fi.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout=layout, backend="reference")
    assert torch.equal(o, outs[2]) and plans_made == {"reference": 2}  # without lse: another plan, once
    fi.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout=layout, backend="reference")
    fi.single_prefill_with_kv_cache(q, k, v, causal=False, kv_layout=layout, backend="reference")
    fi.single_prefill_with_kv_cache(q[:5], k, v, causal=True, kv_layout=layout, backend="reference")
    assert plans_made == {"reference": 4}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_runs_its_kept_plan_on_new_data(layout, plans_made):
    for seed in range(3):
        q, k, v = qkv(seed, d=64, dtype=torch.float16, layout=layout)
        o, lse = fi.single_decode_with_kv_cache(q[0], k, v, kv_layout=layout, return_lse=True, backend="fa2")
        kn, vn = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
        ref, ref_lse = dense(q[:1], kn, vn)
        assert o.shape == (4, 64) and rel(o, ref[0]) < 4e-3 and torch.allclose(lse.double(), ref_lse[0], atol=1e-2)
    assert plans_made == {"fa2": 1}


def test_kept_plans_are_bounded_and_dropped_by_clear_cache():
    single_plans.clear()
    q, k, v = qkv(0, q_len=1, kv_len=SINGLE_PLANS + 8)
    for n in range(1, SINGLE_PLANS + 6):
        fi.single_prefill_with_kv_cache(q, k[:n], v[:n], backend="reference")
    assert len(single_plans) == SINGLE_PLANS
    clear_cache()
    assert len(single_plans) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "reference"])
def test_masked_calls_keep_their_plan_and_take_each_new_mask(backend, packed, device, plans_made):
    """A kept masked plan takes the mask of every call: fa2 plans once and rebuilds its tile lists
    from each mask on the device; the reference plans again (its plan holds the mask)."""
    if backend == "fa2" and device == "cpu" and not TRITON_INTERPRETED:
        pytest.skip("fa2 on CPU tensors needs TRITON_INTERPRET=1")
    single_plans.clear()
    q, k, v = (t.to(device) for t in qkv(1, q_len=40, kv_len=70, d=64, dtype=torch.float16))
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(40, 70, generator=g) > 0.3
    for step in range(3):
        if step == 1:
            mask[:, :40] = False  # in place: a plan that kept the old tile lists would see keys here
        if step == 2:
            mask = torch.rand(40, 70, generator=g) > 0.8
        mask[:, -1] = True  # every row sees a key
        mask = mask.to(device)
        arg = dict(packed_custom_mask=fi.packbits(mask.reshape(-1), "little")) if packed else dict(custom_mask=mask)
        o, lse = fi.single_prefill_with_kv_cache(q, k, v, return_lse=True, backend=backend, **arg)
        ref, ref_lse = dense(q.cpu(), k.cpu(), v.cpu(), mask=mask.cpu())
        o, lse = o.cpu(), lse.cpu()
        assert rel(o, ref) < 4e-3 and torch.allclose(lse.double(), ref_lse, atol=1e-2), step
    assert plans_made == {backend: 1 if backend == "fa2" else 3} and len(single_plans) == 1


def test_calls_with_a_tensor_scalar_are_planned_each_time(plans_made):
    q, k, v = qkv(1)
    scale = torch.tensor(0.5)
    fi.single_prefill_with_kv_cache(q, k, v, sm_scale=scale, backend="reference")
    fi.single_prefill_with_kv_cache(q, k, v, sm_scale=scale, backend="reference")
    assert plans_made == {"reference": 2} and len(single_plans) == 0


def test_kept_plans_still_check_every_call():
    q, k, v = qkv(3)
    fi.single_prefill_with_kv_cache(q, k, v, window_left=1, backend="reference")
    with pytest.raises(ValueError, match="window_left=True"):  # equal to 1, but not an int window
        fi.single_prefill_with_kv_cache(q, k, v, window_left=True, backend="reference")
    with pytest.raises(ValueError, match="q must be contiguous"):
        fi.single_prefill_with_kv_cache(torch.randn(7, 4, 32)[..., ::2], k, v, window_left=1, backend="reference")
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fi.single_prefill_with_kv_cache(q.tolist(), k, v, window_left=1, backend="reference")
    with pytest.raises(ValueError, match="v is on meta"):
        fi.single_prefill_with_kv_cache(q, k, v.to("meta"), window_left=1, backend="reference")
    fi.single_decode_with_kv_cache(q[0], k, v, backend="reference")
    with pytest.raises(TypeError, match="v.dtype=float16"):
        fi.single_decode_with_kv_cache(q[0], k, v.half(), backend="reference")
    with pytest.raises(ValueError, match="kv_layout='XHD'"):
        fi.single_decode_with_kv_cache(q[0], k, v, kv_layout="XHD", backend="reference")


def test_kept_plans_follow_the_backend_selection(plans_made, monkeypatch):
    q, k, v = qkv(4, d=64, dtype=torch.float16)
    with fi.use_backends(["reference"]):
        fi.single_prefill_with_kv_cache(q, k, v)
    with fi.use_backends(["fa2"]):
        fi.single_prefill_with_kv_cache(q, k, v)
        fi.single_prefill_with_kv_cache(q, k, v)
    assert plans_made == {"reference": 1, "fa2": 1}
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "reference")
    fi.single_prefill_with_kv_cache(q, k, v)
    fi.single_prefill_with_kv_cache(q, k, v)
    assert plans_made == {"reference": 2, "fa2": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "fa2", "cudnn"])
def test_cuda_single_calls_run_their_kept_plans_on_new_data(backend):
    if backend != "auto" and get_backend(backend).availability():
        pytest.skip(f"{backend} unavailable: {get_backend(backend).availability()[0]}")
    single_plans.clear()
    for seed in range(3):
        q, k, v = qkv(seed, q_len=300, kv_len=700, d=128, dtype=torch.bfloat16)
        o, lse = fi.single_prefill_with_kv_cache(q.cuda(), k.cuda(), v.cuda(), causal=True, return_lse=True,
                                                 backend=backend)
        ref, ref_lse = dense(q, k, v, causal=True)
        assert rel(o.cpu(), ref) < 2e-2 and torch.allclose(lse.cpu().double(), ref_lse, atol=5e-2)
        od = fi.single_decode_with_kv_cache(q[0].cuda(), k.cuda(), v.cuda(), backend=backend)
        assert rel(od.cpu(), dense(q[:1], k, v)[0][0]) < 2e-2
    assert len(single_plans) == 2


def test_paged_params_on_the_cpu_keeps_tensors_and_converts_host_arrays():
    from flashdispatch.planned import paged_params
    indptr, indices, last = table([5, 17, 0], 8)
    kv_lens = np.array([5, 17, 0], dtype=np.int64)
    qo_indptr = np.array([0, 1, 3, 4], dtype=np.int64)
    params = paged_params(qo_indptr, kv_lens, indptr, indices, last, torch.device("cpu"), [1, 2, 1], sm_scale=0.5)
    assert params.qo_indptr.dtype == torch.int32 and params.qo_indptr.tolist() == [0, 1, 3, 4]
    assert params.kv_lens.dtype == torch.int32 and params.kv_lens.tolist() == [5, 17, 0]
    assert params.kv_lens_host == [5, 17, 0] and params.qo_lens_host == [1, 2, 1]
    assert params.kv_indptr is indptr and params.kv_indices is indices and params.kv_last_page_len is last


def test_paged_params_uploads_host_arrays_once_when_first_read(monkeypatch):
    """Host arrays stay PENDING until a backend reads one; the first read fills every one of
    them with one copy, and a plan that never reads them (fa2 decode) makes no copy."""
    import flashdispatch.planned as planned
    from flashdispatch.backends.base import PENDING
    copies = []
    upload = planned._upload_int32
    monkeypatch.setattr(planned, "_upload_int32", lambda dev, arrays: copies.append(len(arrays)) or upload(dev, arrays))
    indptr, indices, last = table([5, 17, 0], 8)
    kv_lens = np.array([5, 17, 0], dtype=np.int64)
    qo_indptr = np.array([0, 1, 3, 4], dtype=np.int64)
    params = planned.paged_params(qo_indptr, kv_lens, indptr, indices, last, torch.device("meta"), [1, 2, 1],
                                  sm_scale=0.5)
    assert params.__dict__["_kv_lens"] is PENDING and params.__dict__["_kv_indptr"] is PENDING and copies == []
    assert params.kv_last_page_len.device.type == "meta" and copies == [4]  # kv_lens + the three host arrays
    assert params.qo_indptr.shape == (4,) and params.kv_indptr.shape == (4,) and params.kv_lens.shape == (3,)
    assert copies == [4] and params.kv_indices.device.type == "meta"


def test_a_cached_decision_takes_each_plans_workload():
    """A decision cached for a workload bucket is shown with each plan's exact workload; the
    cached one keeps its own."""
    from flashdispatch.dispatch.explain import describe_device, describe_problem
    from flashdispatch.dispatch.problem import Workload
    from flashdispatch.dispatch.select import decide
    base = describe_problem("decode", heads=(4, 2), head_dim=16, page_size=8)
    dev = describe_device("cpu")
    small, other = Workload(3, 3, 1, 40, 20), Workload(3, 3, 1, 38, 17)
    first = decide(base, dev, small, "reference")
    second = decide(base, dev, other, "reference")
    assert (first.workload, second.workload) == (small, other) and first.backend == second.backend == "reference"
    assert second == dataclasses.replace(first, workload=other) and decide(base, dev, small, "reference") == first


def test_host_lengths_given_as_an_array_read_as_a_list():
    """kv_lens_host given as an int64 array (paged_params) keeps it until read, then reads as a
    list of ints; batch_size and kv_lens_stats need no list; given stats hold until the lengths
    are set again."""
    from flashdispatch.planned import paged_params
    indptr, indices, last = table([5, 17, 0], 8)
    kv_lens = np.array([5, 17, 0], dtype=np.int64)
    params = paged_params(np.array([0, 1, 2, 3]), kv_lens, indptr, indices, last, torch.device("cpu"), [1, 1, 1],
                          sm_scale=0.5)
    assert params.batch_size == 3 and params.kv_lens_stats() == (22, 17)
    assert params.kv_lens_array() is kv_lens and params.__dict__["_kv_lens_host"] is kv_lens
    assert params.kv_lens_host == [5, 17, 0] and all(type(n) is int for n in params.kv_lens_host)
    assert params.kv_lens_array().tolist() == [5, 17, 0] and params.kv_lens_array().dtype == np.int64
    given = paged_params(np.array([0, 1, 2, 3]), kv_lens, indptr, indices, last, torch.device("cpu"), [1, 1, 1],
                         kv_stats=(99, 98), sm_scale=0.5)
    assert given.kv_lens_stats() == (99, 98)  # trusted as given: worked out by the caller
    given.kv_lens_host = [1, 2]
    assert given.kv_lens_stats() == (3, 2) and given.batch_size == 2


def test_decode_variants_get_their_own_problem():
    indptr, indices, last = table([5, 17], 8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    decode_plan(w, indptr, indices, last)
    cache = torch.randn(8, 2, 8, 2, 16)
    w.run(torch.randn(2, 4, 16), cache)
    plain = w._planned.problem
    w.run(torch.randn(4, 4, 16), cache, q_len_per_req=2, return_lse=True)
    spec = w._planned.problem
    assert (plain.q_len_per_req, plain.mask_mode, plain.return_lse) == (1, "none", False)
    assert (spec.q_len_per_req, spec.mask_mode, spec.return_lse) == (2, "causal", True)
    w.run(torch.randn(2, 4, 16), cache)
    assert w._planned.problem is plain


def _upload_kv_lens(params):
    params.kv_lens = torch.tensor([3], dtype=torch.int32)


def _failing_upload(params):
    raise RuntimeError("no memory")


def test_pending_params_fields_survive_a_failed_upload_copies_and_pickles():
    import copy
    import pickle
    from flashdispatch.backends.base import PENDING, AttentionParams

    def make(fn):
        p = AttentionParams(qo_indptr=torch.zeros(2), kv_indptr=torch.zeros(2), kv_lens=PENDING, qo_lens_host=[1],
                            kv_lens_host=[3], sm_scale=1.0)
        p.defer_upload(fn)
        return p

    bad = make(_failing_upload)
    for _ in range(2):  # the real error each time, not a missing uploader
        with pytest.raises(RuntimeError, match="no memory"):
            bad.kv_lens
    for clone in (copy.deepcopy(make(_upload_kv_lens)), pickle.loads(pickle.dumps(make(_upload_kv_lens)))):
        assert clone.kv_lens.tolist() == [3]


def test_import_and_reference_decode_without_triton():
    """flashdispatch imports and runs the reference backend where Triton is not installed
    (the device read is the only Triton user on the API path, imported where it runs)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, flashdispatch as fi\n"
            "w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend='reference')\n"
            "i32 = lambda x: torch.tensor(x, dtype=torch.int32)\n"
            "w.plan(i32([0, 2]), i32([1, 0]), i32([3]), 4, 2, 16, 4)\n"
            "out = w.run(torch.randn(1, 4, 16, dtype=torch.float16), "
            "torch.randn(2, 2, 4, 2, 16, dtype=torch.float16))\n"
            "assert out.shape == (1, 4, 16) and not out.isnan().any()\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("backend", ["fa2", "reference"])
def test_strided_page_tables_plan_like_contiguous_ones(backend):
    """A plan from strided index views (every other page id, a column of a table) runs exactly
    like one from their contiguous copies: the kernels read index tensors as flat memory."""
    indptr, indices, last = table([5, 17, 0, 33], 8)
    spread = torch.full((2 * indices.numel(),), -7, dtype=torch.int32)
    spread[::2] = indices
    columns = torch.stack([torch.cat([last, last[:1]]), indptr], 1)  # [batch + 1, 2]
    cache = torch.randn(int(indices.max()) + 1, 2, 8, 2, 64, dtype=torch.float16)
    q = torch.randn(4, 4, 64, dtype=torch.float16)
    outs = []
    for args in ((indptr, indices, last), (columns[:, 1], spread[::2], columns[:-1, 0])):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend=backend)
        decode_plan(w, *args, q_data_type=torch.float16, head_dim=64)
        outs.append(w.run(q, cache))
    assert torch.equal(outs[0], outs[1])


def test_strided_sinks_read_like_contiguous_ones():
    """A strided sinks view (a column of a [heads, n] table) gives the contiguous copy's result:
    the fa2 kernels read sinks as flat memory."""
    torch.manual_seed(3)
    hq, hkv, d, page = 4, 2, 64, 8
    tables = torch.tensor([[2, 0, 4], [1, 3, 3]], dtype=torch.int32)
    cache = torch.randn(5, 2, hkv, page, d, dtype=torch.float16)
    q = torch.randn(2, hq, d, dtype=torch.float16)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    table_ = torch.randn(hq, 3)
    outs = [fi.trtllm_batch_decode_with_kv_cache(q, cache, WS, tables, lens, 24, bmm1_scale=d ** -0.5,
                                                 sinks=s, backend="fa2")
            for s in (table_[:, 1].contiguous(), table_[:, 1])]
    assert torch.equal(outs[0], outs[1])
