"""fa2 MLA under the Triton interpreter (CPU), against the float64 oracle.

fp16 q (the interpreter computes bf16 wrongly), fp16 and fp8 KV, split and unsplit plans, causal
rows that see no key, empty requests, strided inputs, and the wrapper with backend="fa2".
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import flashdispatch as flashinfer
from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.dispatch.caps import check_caps
from flashdispatch.dispatch.problem import Device

from oracle import assert_close, make_mla_case

pytestmark = pytest.mark.interpreted

if TRITON_INTERPRETED:
    from flashdispatch.backends.fa2.mla import MLA_CAPS, plan_mla

F16 = torch.float16
TOL = {F16: 4e-3, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.5e-1}
WORKSPACE_BYTES = 16 << 20


def _run(case, workspace_bytes: int | None = WORKSPACE_BYTES):
    case.params.workspace = None if workspace_bytes is None else torch.zeros(workspace_bytes, dtype=torch.uint8)
    case.inputs.out.fill_(float("nan"))
    if case.inputs.lse is not None:
        case.inputs.lse.fill_(float("nan"))
    plan = plan_mla(case.problem, case.device, case.params)
    plan.run(case.inputs)
    return plan


def _check(case, **run_kw):
    ref_out, ref_lse = case.oracle()
    plan = _run(case, **run_kw)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])
    return plan


def _case(**kw):
    kw.setdefault("q_dtype", F16)
    return make_mla_case(**kw)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_rows_match_the_oracle(page_size, causal):
    case = _case(qo_lens=[1, 1, 1, 1], kv_lens=[0, 1, 37, 300], page_size=page_size, causal=causal,
                 seed=page_size)
    _check(case)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("heads", [1, 24])
def test_incremental_prefill_rows_blocks_across_tokens(heads, block_m, monkeypatch):
    """Several query tokens a request, causal: row blocks span tokens (24 heads: blocks end inside
    a token); queries beyond their keys see nothing (0, lse -inf). Every block size, set through
    FLASHDISPATCH_FA2_MLA_TILES (the default is 16 or 32)."""
    from flashdispatch.backends.fa2.mla import TILES_ENV
    monkeypatch.setenv(TILES_ENV, json.dumps({"block_m": block_m}))
    case = _case(qo_lens=[3, 0, 5, 2], kv_lens=[40, 7, 3, 130], num_heads=heads, page_size=16, causal=True,
                 seed=heads + block_m)
    assert _check(case).tiles.block_m == block_m


def test_default_row_blocks_by_rows():
    """16 or 32 rows a program: the least that holds a request's rows (64 only when asked for)."""
    from flashdispatch.backends.fa2.mla import mla_tiles
    problem = _case(qo_lens=[1], kv_lens=[8], num_heads=128, head_dim_ckv=512, head_dim_kpe=64).problem
    assert [mla_tiles(problem, rows).block_m for rows in (1, 16, 17, 32, 33, 128)] == [16, 16, 32, 32, 32, 32]
    assert [mla_tiles(problem, rows).num_warps for rows in (16, 128)] == [4, 8]


def test_long_requests_split_and_merge():
    case = _case(qo_lens=[1, 2], kv_lens=[1500, 900], num_heads=4, page_size=16, causal=True, seed=5)
    plan = _check(case)
    assert plan.grid[0] > 2 and plan._merge is not None  # the keys were cut into chunks


def test_without_workspace_or_with_a_small_one_the_plan_splits_less():
    """No float workspace: no split; one too small for the finest split: coarser chunks."""
    case = _case(qo_lens=[1], kv_lens=[2000], num_heads=4, page_size=16, seed=6)
    assert _check(case, workspace_bytes=None)._merge is None
    fine = _run(case).grid[0]
    coarse = _check(case, workspace_bytes=5_000)
    assert 1 < coarse.grid[0] < fine


@pytest.mark.parametrize("mode", ["chunk", "graph"])
def test_work_rows_cover_every_row_and_key_once(mode):
    """Random plans: each (token, head) row of a request is in one row block a chunk, the chunks
    of a request tile [0, kv_len) in whole key tiles, and split requests' partials are distinct,
    in range, and named by one merge row per token."""
    from flashdispatch.backends.fa2.mla import MLATiles, _work_rows
    rng = np.random.default_rng(15)
    for _ in range(200):
        batch, heads = int(rng.integers(0, 6)), int(rng.choice([1, 4, 24, 128]))
        qo, kv = rng.integers(0, 4, batch), rng.integers(0, 3000, batch)
        tiles = MLATiles(int(rng.choice([16, 32])), int(rng.choice([16, 64])), 4, 2)
        chunk, chunks = (int(rng.choice([0, 300, 1024])), 0) if mode == "chunk" else (0, int(rng.integers(1, 17)))
        work, merge, partials = _work_rows(qo, kv, heads, tiles, chunk, chunks)
        seen_parts = []
        for b in range(batch):
            rows = work[work[:, 0] == b]
            if qo[b] == 0:
                assert len(rows) == 0
                continue
            n, ranges = int(rows[0, 5]), []
            assert n == (chunks or n)
            for c in range(n):
                blocks = rows[rows[:, 6] == c]
                assert sorted(blocks[:, 1]) == list(range(0, qo[b] * heads, tiles.block_m))
                assert len(set(map(tuple, blocks[:, 2:4]))) == 1  # one key range per chunk
                ranges.append((int(blocks[0, 2]), int(blocks[0, 3])))
            assert ranges[0][0] == 0 and ranges[-1][1] == kv[b]
            assert all(a[1] == b_[0] for a, b_ in zip(ranges, ranges[1:]))  # contiguous, no overlap
            assert all(lo % tiles.block_n == 0 or lo == kv[b] for lo, _ in ranges)
            empty = [lo == hi for lo, hi in ranges]
            assert not any(empty) or (chunks and empty == sorted(empty)) or kv[b] == 0  # graphs: empty ones last
            if n > 1:
                seen_parts += [int(rows[0, 4]) + t * n + c for t in range(qo[b]) for c in range(n)]
            else:
                assert (rows[:, 4] == -1).all()
        assert sorted(seen_parts) == list(range(partials))
        assert len(merge) == sum(int(q) for q, r in zip(qo, range(batch)) if (work[work[:, 0] == r][:, 5] > 1).any())
        assert sorted(int(m[1]) + k for m in merge for k in range(m[2])) == list(range(partials))


@pytest.mark.parametrize("seed", range(6))
def test_random_problems_match_the_oracle(seed):
    """Random batches (empty requests, queries beyond their keys), heads, dims, page sizes, masks,
    KV dtypes, lse, workspaces, eager or graph plans."""
    rng = np.random.default_rng(1000 + seed)
    batch = int(rng.integers(1, 5))
    causal = bool(rng.integers(2))
    qo_lens = rng.integers(0 if causal else 1, 4 if causal else 2, batch).tolist()
    kw = dict(num_heads=int(rng.choice([1, 3, 16, 20])), head_dim_ckv=int(rng.choice([64, 128, 256, 512])),
              head_dim_kpe=int(rng.choice([16, 32, 64])), page_size=int(rng.choice([1, 5, 16, 64])),
              kv_dtype=[F16, torch.float8_e4m3fn, torch.float8_e5m2][int(rng.integers(3))],
              return_lse=bool(rng.integers(2)), use_cuda_graph=bool(rng.integers(2)))
    case = _case(qo_lens=qo_lens, kv_lens=rng.integers(0, 900, batch).tolist(), causal=causal, seed=seed, **kw)
    if case.problem.use_cuda_graph:
        case.params.int_workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    _check(case, workspace_bytes=int(rng.choice([0, 5_000, WORKSPACE_BYTES])) or None)


def _ramp_keys(case, request: int, step: float) -> None:
    """Add ``step`` x (the key's position) to column 0 of request ``request``'s kpe entries and
    set column 0 of its queries' q_pe to 1: its logits drift by ``step`` a key."""
    prm, inp = case.params, case.inputs
    page_size = inp.kpe_cache.shape[1]
    first = int(prm.kv_indptr[request])
    for j in range(prm.kv_lens_host[request]):
        inp.kpe_cache[int(prm.kv_indices[first + j // page_size]), j % page_size, 0] += step * j
    q0 = sum(prm.qo_lens_host[:request])
    inp.q_pe[q0:q0 + prm.qo_lens_host[request], :, 0] = 1.0


@pytest.mark.parametrize("split", [False, True])
def test_lazy_rescale_matches_the_oracle(split):
    """The lazy rescale (`MLATiles.lazy_rescale`): logits that climb fast (a rescale every tile),
    climb slowly (growths below the bound, no rescale), fall, or are noise (q scaled up)."""
    from flashdispatch.backends.fa2.mla import mla_tiles
    case = _case(qo_lens=[1, 2, 1, 1], kv_lens=[300, 700, 500, 90], num_heads=16, page_size=16, causal=True,
                 seed=21)
    for request, step in ((0, 0.5), (1, 0.01), (2, -0.3)):
        _ramp_keys(case, request, step)
    case.inputs.q_nope *= 3
    ref_out, ref_lse = case.oracle()
    case.params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8) if split else None
    tiles = dataclasses.replace(mla_tiles(case.problem, 32), lazy_rescale=True)
    plan = plan_mla(case.problem, case.device, case.params, tiles)
    plan.run(case.inputs)
    assert (plan._merge is not None) == split
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[F16])


def test_tiles_from_the_environment(monkeypatch):
    """FLASHDISPATCH_FA2_MLA_TILES replaces fields of the default tiles (and the result stays
    right); bad values name the variable, the field and what is accepted."""
    from flashdispatch.backends.fa2.mla import TILES_ENV, mla_tiles
    case = _case(qo_lens=[1, 1], kv_lens=[40, 300], num_heads=16, page_size=16, seed=22)
    monkeypatch.setenv(TILES_ENV, '{"block_n": 16, "lazy_rescale": true}')
    plan = _check(case)
    assert plan.tiles == dataclasses.replace(mla_tiles(case.problem, 16), block_n=16, lazy_rescale=True)
    for value, message in (('{"block_m": 24}', r"block_m=24: expected one of \[16, 32, 64, 128\]"),
                           ('{"lazy_rescale": 1}', r"lazy_rescale=1: expected one of \[False, True\]"),
                           ('{"num_warps": true}', "num_warps=True"),
                           ('{"blockn": 64}', r"unknown fa2 MLA tile fields \['blockn'\]"),
                           ("block_n=64", "not JSON")):
        monkeypatch.setenv(TILES_ENV, value)
        with pytest.raises(ValueError, match=f"^{TILES_ENV}=.*{message}"):
            plan_mla(case.problem, case.device, case.params)
    monkeypatch.setenv(TILES_ENV, " ")
    assert plan_mla(case.problem, case.device, case.params).tiles == mla_tiles(case.problem, 16)


@pytest.mark.parametrize("ckv, kpe", [(512, 64), (256, 32)])
def test_wide_latent_dims(ckv, kpe):
    """DeepSeek's ckv 512 and kpe 64 (and 256 / 32), with 16 heads of one token in one block."""
    case = _case(qo_lens=[1, 1], kv_lens=[70, 257], num_heads=16, head_dim_ckv=ckv, head_dim_kpe=kpe,
                 page_size=64, seed=7)
    _check(case)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_with_a_v_scale(kv_dtype):
    case = _case(qo_lens=[1, 1, 2], kv_lens=[5, 300, 64], kv_dtype=kv_dtype, v_scale=1.5, page_size=16,
                 causal=True, seed=8)
    _check(case)


def test_tensor_v_scale_and_no_lse():
    case = _case(qo_lens=[1, 1], kv_lens=[33, 1000], v_scale=torch.tensor([0.75]), return_lse=False,
                 page_size=16, seed=9)
    _check(case)


def test_strided_queries_and_one_combined_cache():
    """q_nope/q_pe as slices of one query tensor and ckv/kpe of one cache (TensorRT-LLM's layout)."""
    case = _case(qo_lens=[1, 3], kv_lens=[50, 200], page_size=16, causal=True, seed=10)
    inp = case.inputs
    q = torch.cat([inp.q_nope, inp.q_pe], -1)
    cache = torch.cat([inp.ckv_cache, inp.kpe_cache], -1)
    ckv = inp.q_nope.shape[-1]
    case.inputs = dataclasses.replace(inp, q_nope=q[..., :ckv], q_pe=q[..., ckv:], ckv_cache=cache[..., :ckv],
                                      kpe_cache=cache[..., ckv:])
    _check(case)


def _every_other_column(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose last dim has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("split", [False, True])
def test_column_strided_inputs_and_output(split):
    """Queries, caches and out whose columns are not contiguous (out through a copy, the split's
    merge included)."""
    case = _case(qo_lens=[1, 2], kv_lens=[50, 1200], page_size=16, causal=True, seed=16)
    inp = case.inputs
    case.inputs = dataclasses.replace(
        inp, q_nope=_every_other_column(inp.q_nope), q_pe=_every_other_column(inp.q_pe),
        ckv_cache=_every_other_column(inp.ckv_cache), kpe_cache=_every_other_column(inp.kpe_cache),
        out=_every_other_column(inp.out))
    assert case.inputs.out.stride(-1) == 2
    plan = _check(case, workspace_bytes=WORKSPACE_BYTES if split else None)
    assert (plan._merge is not None) == split


def test_caps_name_what_fa2_mla_does_not_run():
    case = _case(qo_lens=[1], kv_lens=[8], head_dim_ckv=96, head_dim_kpe=32)
    device = Device("cuda", cc=(9, 0), name="H200", sm_count=132)
    codes = {r.code for r in check_caps(MLA_CAPS, case.problem, device)}
    assert "head_dim" in codes
    fp32 = _case(qo_lens=[1], kv_lens=[8], q_dtype=torch.float32).problem
    assert "dtype" in {r.code for r in check_caps(MLA_CAPS, fp32, device)}
    assert not check_caps(MLA_CAPS, _case(qo_lens=[1], kv_lens=[8], head_dim_ckv=512, head_dim_kpe=64).problem,
                          device)


def test_wrapper_with_backend_fa2_matches_the_reference_wrapper():
    """The FlashInfer example's call sequence (16 heads, ckv 512, kpe 64, page 1) on fa2 and on
    the reference, out and lse."""
    torch.manual_seed(11)
    batch, heads, ckv, kpe, kv_len = 3, 16, 512, 64, 37
    q_indptr = torch.arange(0, batch + 1).int()
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    kv_indptr = torch.arange(0, batch + 1).int() * kv_len
    kv_indices = torch.randperm(batch * kv_len).int()
    q_nope, q_pe = torch.randn(batch, heads, ckv).half(), torch.randn(batch, heads, kpe).half()
    ckv_c, kpe_c = torch.randn(batch * kv_len, 1, ckv).half(), torch.randn(batch * kv_len, 1, kpe).half()
    results = []
    for backend in ("fa2", "reference"):
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(1 << 24, dtype=torch.int8), backend=backend)
        w.plan(q_indptr, kv_indptr, kv_indices, kv_lens, heads, ckv, kpe, 1, False, 1.0 / (192 ** 0.5), F16, F16)
        results.append(w.run(q_nope, q_pe, ckv_c, kpe_c, return_lse=True))
    (o, lse), (ref_o, ref_lse) = results
    assert_close(o, lse, ref_o.double(), ref_lse.double(), TOL[F16])


def _into(buf: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` written into the front of the fixed buffer ``buf``; that view."""
    view = buf.reshape(-1)[: data.numel()].view(data.shape)
    view.copy_(data)
    return view


def test_cuda_graph_plan_replays_a_later_plan():
    """Under a CUDA graph the grid and every table and partial address stay put across plans with
    other lengths (same batch, same query tokens), so the first plan's launch (what a graph
    captured) computes the second plan's result once the fixed buffers hold its inputs."""
    cases = [_case(qo_lens=[1, 2, 1], kv_lens=lens, page_size=16, causal=True, use_cuda_graph=True, seed=seed)
             for seed, lens in ((12, [5, 700, 40]), (13, [1500, 0, 333]))]
    ints, floats = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    pages = max(c.inputs.ckv_cache.shape[0] for c in cases)
    bufs = {name: torch.zeros(n, dtype=torch.int32) for name, n in (("kv_indptr", 4), ("kv_indices", pages))}
    inp = cases[0].inputs
    fixed = dict(q_nope=torch.zeros_like(inp.q_nope), q_pe=torch.zeros_like(inp.q_pe),
                 ckv=torch.zeros(pages, 16, 64, dtype=F16), kpe=torch.zeros(pages, 16, 16, dtype=F16),
                 out=torch.zeros_like(inp.out), lse=torch.zeros_like(inp.lse))
    plans = []
    for case in cases:
        c_in, prm = case.inputs, case.params
        inputs = dataclasses.replace(
            c_in, q_nope=_into(fixed["q_nope"], c_in.q_nope), q_pe=_into(fixed["q_pe"], c_in.q_pe),
            ckv_cache=fixed["ckv"], kpe_cache=fixed["kpe"], out=fixed["out"].fill_(float("nan")),
            lse=fixed["lse"].fill_(float("nan")))
        inputs.ckv_cache[: c_in.ckv_cache.shape[0]] = c_in.ckv_cache
        inputs.kpe_cache[: c_in.kpe_cache.shape[0]] = c_in.kpe_cache
        params = dataclasses.replace(prm, workspace=floats, int_workspace=ints,
                                     **{name: _into(bufs[name], getattr(prm, name)) for name in bufs})
        plans.append(plan_mla(case.problem, case.device, params))
        plans[0].run(inputs)  # the first plan's launch: the captured graph
        assert_close(inputs.out, inputs.lse, *case.oracle(), TOL[F16])
    first, later = plans
    assert first.grid == later.grid and first._merge is not None
    for name in ("count", "work", "qo_indptr", "kv_lens", "po", "plse"):
        assert getattr(first, name).data_ptr() == getattr(later, name).data_ptr(), name


def test_cuda_graph_wrapper_on_fa2_replans():
    """The MLA wrapper with use_cuda_graph=True and its buffers, re-planned with other lengths."""
    torch.manual_seed(14)
    heads, ckv, kpe, page = 4, 64, 16, 16
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (3, 3, 64, 2)]
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.zeros(1 << 24, dtype=torch.int8), True, *bufs,
                                                     backend="fa2")
    ref = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.zeros(1 << 24, dtype=torch.int8), backend="reference")
    ckv_c, kpe_c = torch.randn(64, page, ckv).half(), torch.randn(64, page, kpe).half()
    q_nope, q_pe = torch.randn(2, heads, ckv).half(), torch.randn(2, heads, kpe).half()
    for lens in ([30, 400], [600, 1]):
        pages = [-(-n // page) for n in lens]
        args = (torch.tensor([0, 1, 2]).int(), torch.tensor([0, pages[0], sum(pages)]).int(),
                torch.randperm(64)[: sum(pages)].int(), torch.tensor(lens).int(), heads, ckv, kpe, page, False, 0.1,
                F16, F16)
        results = []
        for wrapper in (w, ref):
            wrapper.plan(*args)
            results.append(wrapper.run(q_nope, q_pe, ckv_c, kpe_c, return_lse=True))
        (o, lse), (ref_o, ref_lse) = results
        assert w.decision.backend == "fa2"
        assert_close(o, lse, ref_o.double(), ref_lse.double(), TOL[F16])
