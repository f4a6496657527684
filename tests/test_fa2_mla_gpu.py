"""fa2 MLA on a CUDA GPU (``pytest -m gpu``), against the reference backend on the same GPU.

DeepSeek's dims (ckv 512, kpe 64) at 16 and 128 heads, pages of 1 and 64 tokens, bf16, fp16 and
fp8 e4m3 KV, decode and causal incremental-prefill rows, split long requests, NaN-poisoned
outputs and cache slots no request uses; the wrapper with backend="fa2", eager and replaying a
CUDA graph after a re-plan.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdispatch as flashinfer

from oracle import assert_close, make_mla_case

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 8e-2}
WORKSPACE_BYTES = 128 << 20
LENGTHS = {
    "decode": ([1] * 7, [0, 1, 63, 64, 65, 700, 4097]),
    "prefill": ([1, 4, 0, 2, 6], [10, 300, 5, 2000, 3]),
    "one-long": ([1], [32768]),
}


def _reference(case):
    """(out float32, lse) of the reference backend's MLA on fresh buffers."""
    from flashdispatch.backends.reference import BACKEND
    backend = BACKEND()
    problem = case.problem.with_(o_dtype=torch.float32, return_lse=True)
    inp = case.inputs
    ref = dataclasses.replace(inp, out=torch.empty(inp.out.shape, dtype=torch.float32, device="cuda"),
                              lse=torch.empty(inp.out.shape[:2], dtype=torch.float32, device="cuda"))
    backend.run(backend.plan(problem, case.device, case.params), ref)
    return ref.out, ref.lse


def _check(case):
    from flashdispatch.backends.fa2.mla import plan_mla
    ref_out, ref_lse = _reference(case)
    case.params.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    plan_mla(case.problem, case.device, case.params).run(case.inputs)
    assert_close(case.inputs.out, case.inputs.lse, ref_out, ref_lse, TOL[case.problem.kv_dtype])


DTYPES = pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.float16,) * 2,
                                             (torch.bfloat16, torch.float8_e4m3fn)], ids=["bf16", "fp16", "fp8kv"])
CANDIDATE_TILES = {"m64": '{"block_m": 64, "num_warps": 8}',
                   "m64-lazy": '{"block_m": 64, "num_warps": 8, "lazy_rescale": true}',
                   "n64": '{"block_n": 64}'}


def _deepseek_case(lengths: str, heads: int, page_size: int, dtypes: tuple, seed: int):
    """A case of LENGTHS' ``lengths`` (causal for "prefill") at ckv 512, kpe 64; a v scale with fp8 KV."""
    qo_lens, kv_lens = LENGTHS[lengths]
    return make_mla_case(qo_lens=qo_lens, kv_lens=kv_lens, num_heads=heads, head_dim_ckv=512, head_dim_kpe=64,
                         page_size=page_size, causal=lengths == "prefill", q_dtype=dtypes[0], kv_dtype=dtypes[1],
                         v_scale=1.5 if dtypes[1] != dtypes[0] else None, device="cuda", seed=seed)


def _use_candidate_tiles(name: str, monkeypatch) -> None:
    """Set FLASHDISPATCH_FA2_MLA_TILES to candidate ``name``; skip off sm90 (64-row programs need
    ~144 KB of shared memory, more than sm86/89 have)."""
    from flashdispatch.backends.fa2.mla import TILES_ENV
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the candidate tiles are for sm90 (64-row programs need ~144 KB of shared memory)")
    monkeypatch.setenv(TILES_ENV, CANDIDATE_TILES[name])


@DTYPES
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_grid(lengths, heads, page_size, dtypes):
    _check(_deepseek_case(lengths, heads, page_size, dtypes, seed=heads + page_size))


@DTYPES
@pytest.mark.parametrize("lengths", ["decode", "prefill"])
@pytest.mark.parametrize("tiles", list(CANDIDATE_TILES))
def test_candidate_tiles(tiles, lengths, dtypes, monkeypatch):
    """Tiles a sweep found faster than the default (docs/perf-notes.md, fa2 MLA), through
    FLASHDISPATCH_FA2_MLA_TILES, at 128 heads: what must pass before one becomes the default."""
    _use_candidate_tiles(tiles, monkeypatch)
    _check(_deepseek_case(lengths, 128, 64, dtypes, seed=77))


def test_wrapper_on_fa2_matches_the_reference_wrapper():
    torch.manual_seed(12)
    batch, heads, ckv, kpe, kv_len, page = 4, 128, 512, 64, 1000, 64
    pages = -(-kv_len // page)
    kv_indptr = (torch.arange(batch + 1) * pages).int().cuda()
    kv_indices = torch.randperm(batch * pages).int().cuda()
    args = (torch.arange(batch + 1).int().cuda(), kv_indptr, kv_indices,
            torch.full((batch,), kv_len, dtype=torch.int32).cuda(), heads, ckv, kpe, page, False, 1.0 / 192 ** 0.5,
            torch.bfloat16, torch.bfloat16)
    q_nope = torch.randn(batch, heads, ckv, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.randn(batch, heads, kpe, dtype=torch.bfloat16, device="cuda")
    ckv_c = torch.randn(batch * pages, page, ckv, dtype=torch.bfloat16, device="cuda")
    kpe_c = torch.randn(batch * pages, page, kpe, dtype=torch.bfloat16, device="cuda")
    results = []
    for backend in ("fa2", "reference"):
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.int8, device="cuda"),
                                                         backend=backend)
        w.plan(*args)
        results.append(w.run(q_nope, q_pe, ckv_c, kpe_c, return_lse=True))
    (o, lse), (ref_o, ref_lse) = results
    assert_close(o, lse, ref_o.float(), ref_lse, TOL[torch.bfloat16])


@pytest.mark.parametrize("tiles", ["default", "m64"])
def test_cuda_graph_replay_after_a_replan_equals_the_reference(tiles, monkeypatch):
    """A graph captured on one plan of a use_cuda_graph wrapper replays a later plan (other
    lengths and page table, same batch) into the captured output buffer (default tiles, and the
    64-row candidate on sm90)."""
    if tiles != "default":
        _use_candidate_tiles(tiles, monkeypatch)
    torch.manual_seed(13)
    batch, heads, ckv, kpe, page, pages = 8, 128, 512, 64, 64, 1024
    dev = dict(device="cuda")
    bufs = [torch.zeros(n, dtype=torch.int32, **dev) for n in (batch + 1, batch + 1, pages, batch)]
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.zeros(128 << 20, dtype=torch.int8, **dev), True, *bufs,
                                                     backend="fa2")
    ckv_c = torch.randn(pages, page, ckv, dtype=torch.bfloat16, **dev)
    kpe_c = torch.randn(pages, page, kpe, dtype=torch.bfloat16, **dev)
    q_nope = torch.randn(batch, heads, ckv, dtype=torch.bfloat16, **dev)
    q_pe = torch.randn(batch, heads, kpe, dtype=torch.bfloat16, **dev)
    out = torch.empty(batch, heads, ckv, dtype=torch.bfloat16, **dev)
    lse = torch.empty(batch, heads, **dev)

    def plan(lens, wrapper):
        n_pages = [-(-n // page) for n in lens]
        indptr = torch.tensor([0] + n_pages).cumsum(0).int().cuda()
        wrapper.plan(torch.arange(batch + 1).int().cuda(), indptr, torch.randperm(pages)[: sum(n_pages)].int().cuda(),
                     torch.tensor(lens).int().cuda(), heads, ckv, kpe, page, False, 1.0 / 192 ** 0.5,
                     torch.bfloat16, torch.bfloat16)

    plan([100, 2000, 1, 64, 5000, 300, 0, 4096], w)
    w.run(q_nope, q_pe, ckv_c, kpe_c, out=out, lse=lse, return_lse=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q_nope, q_pe, ckv_c, kpe_c, out=out, lse=lse, return_lse=True)
    later = [20000, 7, 900, 0, 65, 3000, 12000, 1]
    plan(later, w)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    ref = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.zeros(128 << 20, dtype=torch.int8, **dev),
                                                       backend="reference")
    n_pages = [-(-n // page) for n in later]
    ref.plan(bufs[0], bufs[1], bufs[2][: sum(n_pages)], bufs[3], heads, ckv, kpe, page, False, 1.0 / 192 ** 0.5,
             torch.bfloat16, torch.bfloat16)
    ref_o, ref_lse = ref.run(q_nope, q_pe, ckv_c, kpe_c, return_lse=True)
    assert_close(out, lse, ref_o.float(), ref_lse, TOL[torch.bfloat16])
