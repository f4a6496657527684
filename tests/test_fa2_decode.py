"""fa2 split-KV paged decode under the Triton interpreter (CPU), against the float64 oracle.

Small shapes, fp16 q/kv (the interpreter computes bf16 wrongly), every feature the decode
Caps declare, split and unsplit plans, and the CUDA-graph re-plan contract.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdispatch.backends.base import PagedKV
from flashdispatch.backends.common import TRITON_INTERPRETED
from flashdispatch.dispatch.caps import check_caps
from flashdispatch.dispatch.problem import Device, Problem

from oracle import assert_close, make_paged_case

pytestmark = pytest.mark.interpreted

if TRITON_INTERPRETED:
    from flashdispatch.backends.fa2.decode import DECODE_CAPS, plan_decode

F16 = torch.float16
TOL = {F16: 4e-3, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.5e-1}
WORKSPACE_BYTES = 1 << 22


def _run(case, *, fixed_split_size=None, disable_split_kv=False, config=None, workspace=None, int_workspace=None):
    case.params.fixed_split_size = fixed_split_size
    case.params.disable_split_kv = disable_split_kv
    case.params.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    if case.problem.use_cuda_graph:  # the wrapper's own metadata buffer
        case.params.int_workspace = int_workspace if int_workspace is not None else torch.zeros(1 << 20,
                                                                                              dtype=torch.uint8)
    case.inputs.out.fill_(float("nan"))
    if case.inputs.lse is not None:
        case.inputs.lse.fill_(float("nan"))
    plan = plan_decode(case.problem, case.device, case.params, config)
    plan.run(case.inputs)
    return plan


def _check(case, tol=None, **run_kw):
    ref_out, ref_lse = case.oracle()
    plan = _run(case, **run_kw)
    tol = tol or TOL[case.problem.kv_dtype]
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, tol)
    return plan


def _case(kv_lens=(0, 1, 37, 300), **kw):
    kw.setdefault("num_qo_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim_qk", 64)
    kw.setdefault("q_dtype", F16)
    return make_paged_case("decode", kv_lens=list(kv_lens), **kw)


@pytest.mark.parametrize("split", ["auto", "fixed1", "fixed3", "none"])
@pytest.mark.parametrize("layout,storage", [("NHD", "5d"), ("HND", "tuple"), ("HND", "5d")])
def test_layouts_and_splits(layout, storage, split):
    case = _case(kv_layout=layout, kv_storage=storage, seed=1)
    kw = {"auto": {}, "fixed1": {"fixed_split_size": 1}, "fixed3": {"fixed_split_size": 3},
          "none": {"disable_split_kv": True}}[split]
    plan = _check(case, **kw)
    if split == "fixed1":
        assert plan.n_merge > 0, "one-page chunks must split the long requests"


@pytest.mark.parametrize("page_size", [1, 5, 16, 64, 128])  # 5: the page arithmetic is not a shift
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2)])
def test_page_sizes_and_groups(page_size, heads):
    lens = (5, 70) if page_size == 1 else (0, 37, 300)
    _check(_case(lens, page_size=page_size, num_qo_heads=heads[0], num_kv_heads=heads[1], seed=2),
           fixed_split_size=max(1, 64 // page_size))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims_block_sizes(head_dim):
    case = _case((3, 129), head_dim_qk=head_dim, num_qo_heads=4, seed=3)
    for config in ({"block_n": 16}, {"block_n": 32, "k_rows": True}, {"block_n": 16, "heads_fastest": False},
                   {"block_n": 16, "swap_ab": True}, {"block_n": 32, "k_rows": True, "swap_ab": True}):
        _check(case, config=config, fixed_split_size=4)


@pytest.mark.parametrize("feature", [
    dict(window_left=20), dict(window_left=0), dict(logits_soft_cap=5.0), dict(logits_soft_cap=1e6),
    dict(pos_encoding_mode="ALIBI"),
    dict(pos_encoding_mode="ROPE_LLAMA"), dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
    dict(sm_scale=0.3), dict(sinks=True), dict(return_lse=False),
    dict(logits_soft_cap=3.0, pos_encoding_mode="ALIBI", window_left=50, sinks=True),
    dict(o_dtype=torch.float32),
])
def test_features(feature):
    case = _case(seed=4, **feature)
    _check(case)
    _check(case, fixed_split_size=2)
    _check(case, fixed_split_size=2, config={"swap_ab": True})


@pytest.mark.parametrize("rope", [dict(rope_scale=1e-30), dict(rope_theta=1e-30)])
def test_rope_without_a_phase_is_finite(rope):
    """rope_scale or rope_theta near 0 puts the fp32 angles past 2^31 radians, where they keep no
    phase (nothing to compare with the float64 reference): out and lse are finite, never NaN."""
    case = _case(seed=4, pos_encoding_mode="ROPE_LLAMA", **rope)
    _run(case)
    assert torch.isfinite(case.inputs.out).all() and not torch.isnan(case.inputs.lse).any()

@pytest.mark.parametrize("mask_mode", ["causal", "none"])
@pytest.mark.parametrize("q_len,heads", [(3, (8, 2)), (4, (4, 4)), (20, (8, 1))])
def test_q_len_per_req(q_len, heads, mask_mode):
    case = _case((0, 2, 40, 150), q_len_per_req=q_len, mask_mode=mask_mode, num_qo_heads=heads[0],
                 num_kv_heads=heads[1], seed=5, window_left=60 if q_len == 4 else -1)
    _check(case, fixed_split_size=3)
    _check(case, config={"max_block_m": 16})
    _check(case, config={"max_block_m": 16, "heads_fastest": False})
    _check(case, config={"max_block_m": 8, "swap_ab": True}, fixed_split_size=3)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_fp8_kv_and_scales(kv_dtype, tensor_scales):
    scales = (1.3, 0.7, 1.9)
    if tensor_scales:
        scales = tuple(torch.tensor([s]) for s in scales)
    case = _case(kv_dtype=kv_dtype, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2], seed=6)
    _check(case, fixed_split_size=2)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("v_storage", ["5d", "same strides", "other page stride", "other slot stride"])
def test_fp8_v_rows_at_k_offsets_only_with_k_strides(layout, v_storage):
    """DecodeConfig.shared_kv_rows (on for fp8): V's token rows are read at K's row offsets only
    where V's page and slot strides are K's (a 5-D cache, or a pair laid out alike); a V cache
    inside a wider buffer (another page or slot stride) keeps its own offsets. Either way the
    result matches the oracle, and the launched variant says which path ran."""
    case = _case(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.3, kv_layout=layout, seed=61,
                 kv_storage="5d" if v_storage == "5d" else "tuple")
    kv = case.inputs.kv
    if v_storage.startswith("other"):
        v = kv.v
        # one dim wider: dim 1 (NHD slots, HND heads) changes the page stride alone; NHD heads and
        # HND head_dim change the slot stride too
        wider = list(v.shape)
        wider[1 if v_storage == "other page stride" else 2 if layout == "NHD" else 3] += 3
        buf = torch.full(wider, float("nan")).to(v.dtype)  # the rows V does not own hold NaN
        view = buf[tuple(slice(0, n) for n in v.shape)]
        view.copy_(v)
        case.inputs.kv = PagedKV(kv.k, view, layout)
        assert case.inputs.kv.v.stride()[:3] != kv.k.stride()[:3]
    plan = _check(case, fixed_split_size=2)
    shared = v_storage in ("5d", "same strides")
    assert plan.config.shared_kv_rows and [key[4] for key in plan._launchers] == [shared]
    plan = _check(case, config={"shared_kv_rows": False}, fixed_split_size=2)
    assert [key[4] for key in plan._launchers] == [False]


def test_window_near_int32_max_is_no_window():
    """window_left = 2**31 - 1 with more query rows than keys (rows at negative positions): the
    window cuts nothing (the kernel's int32 token bounds must not wrap)."""
    _check(_case((2, 40), q_len_per_req=4, window_left=2**31 - 1, num_qo_heads=4, num_kv_heads=2, seed=9))


def test_empty_and_sink_rows():
    case = _case((0, 0, 3), sinks=True, seed=7)
    _check(case)
    case = _case((0, 5), window_left=2, seed=8)
    _check(case, disable_split_kv=True)


class _GraphBuffers:
    """The CUDA-graph wrapper's fixed kv_indices / kv_indptr / last_page_len buffers: each plan's
    tables are copied into their front, as the wrapper does, and the params point at those views."""

    def __init__(self, slots: int = 64, batch: int = 3):
        self.indices = torch.zeros(slots, dtype=torch.int32)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32)
        self.last = torch.zeros(batch, dtype=torch.int32)

    def adopt(self, case):
        prm = case.params
        for name, buf in (("kv_indices", self.indices), ("kv_indptr", self.indptr), ("kv_last_page_len", self.last)):
            t = getattr(prm, name)
            buf[:t.numel()] = t
            setattr(prm, name, buf[:t.numel()])
        return case


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "work-array"])
def test_cuda_graph_replan_in_place(direct):
    """Graph mode off the line (graph_few_line off): fixed grid; the kernel reads the wrapper's fixed
    buffers and splits itself (direct table) or reads plan arrays from the int workspace. A plan made
    first and run after a second plan (same batch size, other lengths and page table, same buffers)
    equals the second: what a graph captured on the first plan replays."""
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    iws = torch.zeros(1 << 20, dtype=torch.uint8)
    bufs, config = _GraphBuffers(), {"direct_table": direct, "min_chunk_tokens": 32, "graph_few_line": False}
    first = bufs.adopt(_case((10, 200, 33), use_cuda_graph=True, seed=9))
    plan1 = _check(first, workspace=ws, int_workspace=iws, config=config)
    assert plan1.direct == direct and plan1.n_merge == 3, "graph grids split every request into fixed slots"
    second = bufs.adopt(_case((300, 0, 17), use_cuda_graph=True, seed=10))
    plan2 = _check(second, workspace=ws, int_workspace=iws, config=config)
    assert (plan2.n_work, plan2.n_merge, plan2.split_tokens) == (plan1.n_work, plan1.n_merge, plan1.split_tokens)
    assert plan2.work.data_ptr() == plan1.work.data_ptr() and plan2.info.data_ptr() == plan1.info.data_ptr()
    ref = second.inputs.out.clone(), second.inputs.lse.clone()
    second.inputs.out.fill_(float("nan"))
    second.inputs.lse.fill_(float("nan"))
    plan1.run(second.inputs)
    assert torch.equal(second.inputs.out, ref[0]) and torch.equal(second.inputs.lse, ref[1])
    refreshed = plan1.refreshed(second.device, second.params)
    assert (refreshed is not None) == direct  # the direct graph layout is the batch size's alone
    if direct:
        second.inputs.out.fill_(float("nan"))
        refreshed.run(second.inputs)
        assert torch.equal(second.inputs.out, ref[0])


def test_cuda_graph_grid_of_one_chunk_with_a_long_request():
    """Graph mode off the line (graph_few_line off), more than half the split target's programs (9
    requests x 2 KV heads against the interpreter's 8 SMs x 4): the grid holds one chunk per
    request, and one request far longer than the others must not ask the policy for more chunks
    (plan() raised before)."""
    plan = _check(_case([3000] + [1] * 8, use_cuda_graph=True, seed=11), config={"graph_few_line": False})
    assert plan.max_chunks == 1 and plan.n_merge == 0


def test_batch_invariance_fixed_split():
    """fixed_split_size: a request's output does not depend on the rest of the batch."""
    big = _case((300, 0, 45, 129), seed=11)
    _run(big, fixed_split_size=2)
    out_big, lse_big = big.inputs.out.clone(), big.inputs.lse.clone()
    for keep in ([0], [3, 0]):
        sub = dataclasses.replace(big.inputs, q=big.inputs.q[keep], out=big.inputs.out[keep].clone(),
                                  lse=big.inputs.lse[keep].clone())
        params = big.params
        lens = [params.kv_lens_host[b] for b in keep]
        starts = params.kv_indptr.tolist()
        idx = torch.cat([params.kv_indices[starts[b]:starts[b + 1]] for b in keep])
        counts = [starts[b + 1] - starts[b] for b in keep]
        sub_params = dataclasses.replace(
            params, kv_lens_host=lens, qo_lens_host=[1] * len(keep), kv_indices=idx,
            kv_indptr=torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32),
            kv_lens=torch.tensor(lens, dtype=torch.int32))
        sub_params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
        sub_params.fixed_split_size = 2
        plan_decode(big.problem, big.device, sub_params).run(sub)
        assert torch.equal(sub.out, out_big[keep]) and torch.equal(sub.lse, lse_big[keep])


def test_workspace_too_small_names_the_buffer():
    case = _case(seed=12)
    with pytest.raises(ValueError, match="float_workspace_buffer.*bytes"):
        _run(case, fixed_split_size=1, workspace=torch.zeros(64, dtype=torch.uint8))


def test_config_override_and_unknown_key(monkeypatch):
    case = _case((50,), seed=13)
    monkeypatch.setenv("FLASHDISPATCH_FA2_DECODE_CONFIG", '{"block_n": 16, "num_stages": 2}')
    plan = _check(case)
    assert (plan.config.block_n, plan.config.num_stages) == (16, 2)
    with pytest.raises(ValueError, match="unknown fa2 decode config"):
        _run(case, config={"blockn": 3})


def test_caps():
    cuda = Device("cuda", 0, (9, 0), "H200", 132)
    case = _case()
    assert check_caps(DECODE_CAPS, case.problem, cuda) == []
    assert check_caps(DECODE_CAPS, case.problem, Device("cuda", 0, (7, 5), "T4", 40))
    bad = case.problem.with_(head_dim_qk=96, head_dim_vo=96, mask_mode="custom", q_dtype=torch.float32)
    codes = {r.code for r in check_caps(DECODE_CAPS, bad, cuda)}
    assert {"head_dim", "feature.custom_mask", "dtype"} <= codes


@pytest.mark.parametrize("batch,kv_len,chunks", [(32, 4096, 2), (16, 8192, 4), (64, 4096, None), (1, 32768, 64),
                                                 (4, 32768, 16)])
def test_split_policy_stays_within_one_wave(batch, kv_len, chunks):
    """Chunks per request are rounded down so the grid never exceeds SMs x ctas_per_sm programs
    (132 SMs x 4 = 528 on an H200; 8 KV heads): a chunk more would start a mostly idle wave."""
    from flashdispatch.backends.fa2.decode_split import chunk_tokens, split_target
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    case = _case((1,))
    case.params.fixed_split_size, case.params.disable_split_kv = None, False
    eff, cfg = np.full(batch, kv_len), DecodeConfig(block_n=64)
    chunk = chunk_tokens(eff, case.problem, case.params, cfg, 8, split_target(batch, cfg, 8, 132, kv_len))
    if chunks is None:
        assert chunk is None
    else:
        assert (-(-eff // chunk) == chunks).all() and batch * 8 * chunks <= 528


@pytest.mark.parametrize("batch,kv_len,chunks", [(64, 4096, 2), (48, 4096, 2), (16, 8192, 8), (1, 32768, 64),
                                                 (1, 1024, 4), (66, 4096, None)])
def test_split_ctas_per_sm_sets_the_few_programs_target(batch, kv_len, chunks):
    """Fewer than ctas_per_sm x SMs programs (528) split into a wave of split_ctas_per_sm x SMs
    (1056) instead, capped by max_splits and min_chunk_tokens; from 528 programs on, the target is
    the wave split's (none here: no wave_split_ctas)."""
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    from flashdispatch.backends.fa2.decode_split import chunk_tokens, split_target
    case = _case((1,))
    case.params.fixed_split_size, case.params.disable_split_kv = None, False
    eff, cfg = np.full(batch, kv_len), DecodeConfig(block_n=32, split_ctas_per_sm=8)
    target = split_target(batch, cfg, 8, 132, kv_len)
    assert target == (1056 if batch * 8 < 528 else None)
    chunk = chunk_tokens(eff, case.problem, case.params, cfg, 8, target)
    if chunks is None:
        assert chunk is None
    else:
        assert (-(-eff // chunk) == chunks).all() and batch * 8 * chunks <= 1056


@pytest.mark.parametrize("graph, config", [(False, None), (True, {"graph_few_line": False}), (True, None)],
                         ids=["eager", "cuda_graph-own-split", "cuda_graph-line"])
def test_fp8_few_programs_run_the_split_block_at_its_wave(graph, config):
    """fp8 GQA d128 on a described H200: 16 x 8192 (128 programs) splits into 8 chunks of the
    32 x 3 split block (1024 programs: one wave at 8 per SM); a CUDA-graph grid of its own split
    keeps the 64 x 3 tile in 4 chunk slots (512 programs: DecodeConfig.split_ctas_per_sm is for
    eager plans); the default graph plan (DecodeConfig.graph_few_line) is a line of the split
    block's wave (132 pieces x 8 programs)."""
    from flashdispatch.planned import paged_params
    h200 = Device("cuda", 0, (9, 0), "H200", 132, described=True)
    batch, pages = 16, 512
    problem = Problem("decode", torch.float16, torch.float8_e4m3fn, torch.float16, 32, 8, 128, 128, page_size=16,
                      use_cuda_graph=graph)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    params = paged_params(np.arange(batch + 1), np.full(batch, pages * 16), indptr, torch.arange(batch * pages,
                          dtype=torch.int32), torch.full((batch,), 16, dtype=torch.int32), torch.device("cpu"),
                          qo_lens_host=[1] * batch, workspace=torch.empty(64 << 20, dtype=torch.uint8), sm_scale=0.1,
                          int_workspace=torch.empty(8 << 20, dtype=torch.uint8) if graph else None)
    plan = plan_decode(problem, h200, params, config)
    if graph and config is None:
        assert plan.line and (plan.config.block_n, plan.config.num_stages, plan.n_work) == (32, 3, 132)
        return
    assert (plan.config.block_n, plan.config.num_stages) == ((64, 3) if graph else (32, 3))
    assert plan.split_slots == (4 if graph else 8) and plan.n_work * plan.units == (512 if graph else 1024)


@pytest.mark.parametrize("name, bads", [
    ("block_n", (0, 8, 48, 64.0, True)), ("max_block_m", (0, 4, 24)), ("split_block_n", (0, 8, 96)),
    ("num_warps", (0, 3, 32, 4.0)), ("num_stages", (0, -1, 2.0)), ("ctas_per_sm", (0, -2, True)),
    ("min_chunk_tokens", (0,)), ("max_splits", (0, 1.5)), ("split_chunk_tokens", (-1, 0.5)),
    ("split_ctas_per_sm", (-1, 2.0)), ("pack_items", (0, 5, 2.0)), ("pack_fill", (0, 1.5, True, "x")),
    ("wave_pack_spread", (-1, True, "x")), ("wave_pack_load", (0, 0.1, None)), ("wave_pack_max_waves", (-1, "4")),
    ("line_segment_tokens", (-1, 1.5, True, 4097)), ("line_page_prefetch", (1, "yes")), ("wave_pack_line", (0,)),
    ("line_align_fill", (0, 1.1, None)), ("few_pack_line", (0, "yes")), ("graph_few_line", (1, None)),
    ("line_waves", (0, 1.5, True)), ("few_line_mixed", (-1, 2.5, True)), ("wave_pack_below", (-0.1, 1.5, True, "x")),
    ("wave_pack_tokens", (-1, 1.5, True, "512")), ("wave_pack_below_tokens", (-1, 2.5, False, "1024")),
    ("shared_kv_rows", (1, "yes", None)),
])
def test_decode_config_refuses_bad_sizes(name, bads, monkeypatch):
    """Every size knob is checked where the config is built (a constructor call, the environment's
    JSON, a plan's ``config``): the error names the knob, the value and what is accepted."""
    import json
    from flashdispatch.backends.fa2.decode_config import CONFIG_ENV, DecodeConfig, _base_config
    for bad in bads:
        with pytest.raises(ValueError, match=f"{name} must be .*got {bad!r}"):
            DecodeConfig(**{name: bad})
    with pytest.raises(ValueError, match=f"{name} must be"):
        _check(_case(seed=34), config={name: bads[0]})
    monkeypatch.setenv(CONFIG_ENV, json.dumps({name: bads[0]}))
    _base_config.cache_clear()
    with pytest.raises(ValueError, match=f"{name} must be"):
        _check(_case(seed=34))
    monkeypatch.delenv(CONFIG_ENV)
    _base_config.cache_clear()
    assert DecodeConfig(split_block_n=None).split_block_n is None


def test_max_registers_config():
    """max_registers: 0 or a ptxas cap in [24, 255], passed as Triton's maxnreg; the interpreter
    (no ptxas) runs the same plan without it."""
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    for bad in (-1, 8, 256, True, 64.0):
        with pytest.raises(ValueError, match="max_registers"):
            DecodeConfig(max_registers=bad)
    _check(_case(seed=33), config={"max_registers": 64})


@pytest.mark.parametrize("feature", [
    {}, dict(window_left=20), dict(q_len_per_req=3, mask_mode="causal"), dict(kv_layout="HND", kv_storage="tuple"),
    dict(page_size=1), dict(pos_encoding_mode="ALIBI", sinks=True), dict(kv_lens=(0, 0)),
], ids=lambda f: ",".join(sorted(f)) or "plain")
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "work_array"])
def test_unsplit_plan_direct_table_or_work_array(feature, direct):
    """An unsplit plan with DecodeConfig.direct_table (default for 16-bit GQA KV) hands the kernel
    kv_indptr / last_page_len and builds no work array; without it, a work array (empty requests,
    windows, speculative rows, both layouts, page size 1)."""
    feature = dict(feature)
    case = _case(kv_lens=feature.pop("kv_lens", (0, 1, 37, 300)), seed=11, **feature)
    plan = _check(case, config={"direct_table": direct}, disable_split_kv=True)
    assert plan.direct == direct
    if direct:
        assert plan.work is case.params.kv_indptr and plan.last is case.params.kv_last_page_len


def test_measured_defaults():
    """The measured defaults: the direct table for 16-bit GQA KV up to d128 and fp8 GQA d128 and
    d256 (not MHA, 16-bit d256 or fp8 d64), and the 64-register cap on the d128 GQA config only,
    dropped where a split plan takes split_block_n or a config overrides block_n; the fused
    merge's tile; V rows at K's offsets for fp8 KV only."""
    from flashdispatch.backends.fa2.decode_config import apply_overrides, default_config
    from flashdispatch.backends.fa2.decode_variant import with_split_block
    from flashdispatch.dispatch.problem import Problem

    def cfg(kv=F16, heads=(32, 8), d=128, page=16):
        return default_config(Problem("decode", F16, kv, F16, heads[0], heads[1], d, d, page_size=page))
    assert cfg().direct_table and cfg().max_registers == 64 and with_split_block(cfg()).max_registers == 0
    assert apply_overrides(cfg(), {"block_n": 64}).max_registers == 0
    assert apply_overrides(cfg(), {"block_n": 64, "max_registers": 72}).max_registers == 72
    assert cfg(d=64).direct_table and cfg(page=1).direct_table and cfg(d=64).max_registers == 0
    assert cfg(kv=torch.float8_e4m3fn).direct_table and cfg(kv=torch.float8_e5m2, page=1).direct_table
    assert cfg(kv=torch.float8_e4m3fn, d=256).direct_table and cfg(kv=torch.float8_e4m3fn, d=256).max_registers == 0
    for other in (cfg(kv=torch.float8_e4m3fn, heads=(32, 32)), cfg(kv=torch.float8_e4m3fn, d=64),
                  cfg(kv=torch.float8_e4m3fn, heads=(32, 32), d=256),
                  cfg(heads=(32, 32)), cfg(heads=(32, 32), page=1), cfg(heads=(32, 32), d=256), cfg(d=256)):
        assert not other.direct_table and other.max_registers == 0
    # the fused merge's 8K tile: d128 group 4 only (measured there; MHA lost, groups 2 and 16 would
    # run 3 programs per SM)
    assert cfg().fused_merge_values == 8192
    for other in (cfg(heads=(16, 8)), cfg(heads=(64, 4)), cfg(heads=(32, 32)), cfg(d=64), cfg(page=1),
                  cfg(kv=torch.float8_e4m3fn)):
        assert other.fused_merge_values == 4096
    # V rows at K's offsets: the fp8 defaults (d64 to d256, GQA and MHA), not 16-bit KV
    for d in (64, 128, 256):
        for heads in ((32, 8), (32, 32)):
            assert cfg(kv=torch.float8_e4m3fn, heads=heads, d=d).shared_kv_rows
            assert not cfg(heads=heads, d=d).shared_kv_rows


@pytest.mark.parametrize("variant, expected", [
    ({}, 64), (dict(q_len_per_req=2), 0), (dict(pos_encoding_mode="ROPE_LLAMA"), (96, 80)),
    (dict(pos_encoding_mode="ALIBI"), 0), (dict(logits_soft_cap=30.0), 0), (dict(fused=True), 0),
    (dict(num_qo_heads=64, num_kv_heads=2), 0),  # group 32: a 32-row block
], ids=["plain", "qlen2", "rope", "alibi", "softcap", "fused", "rows32"])
def test_register_cap_only_on_the_measured_variant(variant, expected):
    """max_registers reaches ptxas only for one query row in a 16-row block without ALiBi, soft cap
    or fused merge (the others spill under 64 registers or do not compile); a RoPE plan's config
    (`rope_config`) takes its own caps, the block's and the split block's (``expected`` a pair)."""
    from flashdispatch.backends.fa2.decode_variant import register_cap, rope_config, with_split_block
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    from flashdispatch.dispatch.problem import Problem
    variant = dict(variant)
    fused = variant.pop("fused", False)
    heads = (variant.pop("num_qo_heads", 32), variant.pop("num_kv_heads", 8))
    p = Problem("decode", F16, F16, F16, heads[0], heads[1], 128, 128, page_size=16, **variant)
    block_m = max(16, 1 << (p.q_len_per_req * heads[0] // heads[1] - 1).bit_length())
    cfg = DecodeConfig(max_registers=64, split_block_n=32, rope_max_registers=96, rope_split_max_registers=80)
    if p.pos_encoding_mode == "ROPE_LLAMA":
        got = tuple(register_cap(p, c, block_m, fused) for c in (rope_config(cfg), with_split_block(rope_config(cfg))))
    else:
        got = register_cap(p, cfg, block_m, fused)
    assert got == expected


def test_direct_table_only_where_nothing_is_split():
    case = _case(seed=12)
    plan = _check(case, config={"direct_table": True}, fixed_split_size=1)
    assert plan.n_merge > 0 and not plan.direct


def test_sm90_register_cap_keeps_8_programs_per_sm():
    """Offline sm90 compile (scripts/decode_registers.py, no GPU): with the default cap both the
    work-array and the direct-table variants of bf16 32/8 d128 fit 8 programs per SM (uncapped,
    the direct table took 79 registers: 6 per SM)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "decode_registers.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line[:24].strip(): line[24:].split() for line in res.stdout.splitlines()[2:]}
    for name in ("work array, cap 64", "direct table, cap 64"):
        regs, spill, _, per_sm = rows[name]
        assert int(regs) <= 64 and int(spill) == 0 and int(per_sm) == 8, (name, rows)


MATRIX = [(128, 97), (64, 69), (256, 69)]  # head dim, combinations of scripts/decode_compile_matrix.py


def _compile_matrix(*args: str) -> list[str]:
    script = Path(__file__).resolve().parents[1] / "scripts" / "decode_compile_matrix.py"
    res = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.splitlines()


@pytest.mark.parametrize("head_dim, combinations", MATRIX)
def test_sm90_code_generation_of_every_feature_and_work_layout(head_dim, combinations):
    """Triton's code generation for sm90 (scripts/decode_compile_matrix.py --frontend, no GPU) of
    features x work layouts of each head dim's defaults (d128 has wave tiles, d64 and d256 their own
    tiles; all three packed plans, and the kernel's own packing where the defaults take it): the
    interpreter runs the kernel without Triton's type checks, which code generation applies."""
    assert len(_compile_matrix("--frontend", str(head_dim))) == combinations


def test_code_generation_refuses_what_the_interpreter_runs(tmp_path):
    """What the CPU matrix rests on: `offline_compile.frontend_like_launch` raises Triton's type
    error for a name that a runtime branch gives another type (the interpreter runs it), and
    passes the same kernel with one type."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    for name, initial in (("mismatch", "0"), ("match", "0.0")):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
            import os, sys
            os.environ.pop("TRITON_INTERPRET", None)
            sys.path.insert(0, {str(scripts)!r})
            import triton
            import triton.language as tl
            from triton.backends.compiler import GPUTarget
            from offline_compile import frontend_like_launch

            @triton.jit
            def kernel(out_ptr, n):
                x = {initial}
                if n > 0:
                    x = 1.5
                tl.store(out_ptr, x)

            frontend_like_launch(kernel, {{}}, lambda a: "*fp32" if a == "out_ptr" else "i32",
                                 GPUTarget("cuda", 90, 32), {{}})
            """))
        res = subprocess.run([sys.executable, str(tmp_path / f"{name}.py")], capture_output=True, text=True,
                             timeout=300, check=False)
        if name == "match":
            assert res.returncode == 0, res.stderr[-2000:]
        else:
            assert res.returncode != 0 and "the then block redefines it as fp32" in res.stderr, res.stderr[-2000:]


def test_pdl_only_where_a_merge_kernel_follows_on_sm90(monkeypatch):
    """DecodeConfig.pdl: the plan launches the merge kernel as a programmatic dependent only on
    sm90+, only when a merge kernel runs (split, not fused), and never under the interpreter. Plans
    only: the interpreter cannot run griddepcontrol (the GPU suite runs them)."""
    from flashdispatch.backends.fa2 import decode as fdec
    from flashdispatch.backends.fa2.decode_config import DecodeConfig
    fdec.kernel_constants.cache_clear()  # its key does not hold TRITON_INTERPRETED
    monkeypatch.setattr(fdec, "TRITON_INTERPRETED", False)
    case = _case(seed=47)
    case.params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)

    def pdl(cc, config, **params):
        for name, value in {"fixed_split_size": None, "disable_split_kv": False, **params}.items():
            setattr(case.params, name, value)
        plan = plan_decode(case.problem, dataclasses.replace(case.device, cc=cc, sm_count=8), case.params, config)
        assert plan._consts["PDL_TRIGGER"] == plan.pdl
        assert plan.pdl == (plan._merge is not None and plan._merge.pdl)
        return plan.pdl

    unfused = {"fused_merge_max_chunks": 0}
    assert pdl((9, 0), unfused, fixed_split_size=2)
    assert not pdl((8, 0), unfused, fixed_split_size=2)  # griddepcontrol is sm90 PTX
    assert not pdl((9, 0), {"fused_merge_max_chunks": 64}, fixed_split_size=2)  # no merge kernel
    assert not pdl((9, 0), unfused, disable_split_kv=True)  # nothing split
    assert not pdl((9, 0), {**unfused, "pdl": False}, fixed_split_size=2)
    monkeypatch.setattr(fdec, "TRITON_INTERPRETED", True)
    assert not pdl((9, 0), unfused, fixed_split_size=2)
    with pytest.raises(ValueError, match="pdl"):
        DecodeConfig(pdl=1)
    fdec.kernel_constants.cache_clear()


def test_pdl_reaches_the_merge_launch(monkeypatch):
    """A plan's pdl reaches its merge launch: the `DecodeMerge` an sm90 plan builds carries Triton's
    launch_pdl option and the kernel's PDL constexpr for both lse variants (an interpreted plan
    neither), and run() launches the plan's own merge."""
    from flashdispatch.backends.fa2 import decode as fdec, merge
    case = _case(seed=48)
    ref_out, ref_lse = case.oracle()
    case.params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    case.params.fixed_split_size = 2
    unfused = {"fused_merge_max_chunks": 0}
    fdec.kernel_constants.cache_clear()  # its key does not hold TRITON_INTERPRETED
    with monkeypatch.context() as m:
        m.setattr(fdec, "TRITON_INTERPRETED", False)
        sm90 = plan_decode(case.problem, dataclasses.replace(case.device, cc=(9, 0)), case.params, unfused)
    fdec.kernel_constants.cache_clear()
    assert sm90.pdl and sm90._merge.pdl
    for launcher in sm90._merge._launchers.values():
        assert launcher._kwargs["launch_pdl"] is True and launcher._kwargs["PDL"] is True
    plan = plan_decode(case.problem, case.device, case.params, unfused)  # the interpreter: no griddepcontrol
    assert plan.n_merge and not plan.pdl
    for launcher in plan._merge._launchers.values():
        assert "launch_pdl" not in launcher._kwargs and launcher._kwargs["PDL"] is False
    seen = []
    launch = merge.DecodeMerge.__call__

    def record(self, out, lse):
        seen.append(self)
        launch(self, out, lse)

    monkeypatch.setattr(merge.DecodeMerge, "__call__", record)
    plan.run(case.inputs)
    assert seen == [plan._merge]
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[F16])

