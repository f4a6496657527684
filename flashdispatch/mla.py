"""Multi-head latent attention (DeepSeek MLA) over a paged compressed-KV cache
(FlashInfer's ``flashinfer.mla``): `BatchMLAPagedAttentionWrapper` and the TensorRT-LLM style
``trtllm_batch_decode_with_kv_cache_mla``."""
from __future__ import annotations

import math

import numpy as np
import torch

from . import checks
from .backends.base import MLAParams
from .dispatch.problem import Problem
from .dispatch.reasons import Unsupported
from .page import block_table_to_indptr
from .planned import (WrapperBase, host_workload, on_device, plan_refreshing, run_mla,
                      refuse_runs_after_failure, user_workspace)

LN2 = math.log(2.0)


def _mla_problem(q_dtype, kv_dtype, o_dtype, num_heads, ckv, kpe, page_size, causal, use_cuda_graph=False,
                 return_lse=True) -> Problem:
    return Problem("mla", q_dtype, kv_dtype, o_dtype, num_heads, 1, ckv + kpe, ckv, page_size, "NHD",
                   "causal" if causal else "none", use_cuda_graph=use_cuda_graph, return_lse=return_lse,
                   head_dim_kpe=kpe)


def _mla_params(qo_indptr_h: np.ndarray, kv_indptr, kv_indices, kv_lens_h: np.ndarray, device, sm_scale, causal,
                workspace, int_workspace=None) -> MLAParams:
    return MLAParams(kv_indptr=on_device(kv_indptr, device), kv_indices=on_device(kv_indices, device),
                     qo_lens_host=(qo_indptr_h[1:] - qo_indptr_h[:-1]).tolist(), kv_lens_host=kv_lens_h.tolist(),
                     sm_scale=sm_scale, causal=causal, workspace=workspace,
                     int_workspace=int_workspace)


def _check_kv_lens(lens: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    """kv_len_arr's host values against the page counts (more query tokens than keys is allowed:
    a query row that sees no key gives 0 and lse -inf, as in the prefill wrappers)."""
    bad = (lens < 0) | (lens > pages * page_size) | ((pages > 0) & (lens <= (pages - 1) * page_size))
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"kv_len_arr[{b}]={int(lens[b])} does not fit request {b}'s {int(pages[b])} pages of "
                         f"page_size={page_size}")
    return lens


class BatchMLAPagedAttentionWrapper(WrapperBase):
    """MLA paged attention for decode and incremental prefill (with matrix absorption).

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        User-reserved workspace (128 MB recommended).
    use_cuda_graph : bool
        Keep index arrays in the fixed buffers below so ``run()`` can be captured.
    qo_indptr, kv_indptr, kv_indices, kv_len_arr : Optional[torch.Tensor]
        CUDA-graph buffers (int32), needed with use_cuda_graph.
    backend : str
        ``"auto"`` or a backend name.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, "NHD", use_cuda_graph, backend)
        self._graph_buffers = None
        if use_cuda_graph:
            bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
            names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
            for buf, name in zip(bufs, names):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs the {name} buffer")
            checks.check_disjoint((*bufs, float_workspace_buffer), (*names, "float_workspace_buffer"))
            self._graph_buffers = bufs

    @refuse_runs_after_failure
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        """Plan MLA attention: ``qo_indptr`` [batch+1] query offsets, ``kv_indptr`` [batch+1] page
        offsets, ``kv_indices`` page ids, ``kv_len_arr`` [batch] KV lengths (all int32);
        ``sm_scale`` is the scale before matrix absorption (e.g. 1/sqrt(128 + 64))."""
        if use_profiler:
            raise Unsupported("use_profiler=True: flashdispatch has no in-kernel profiler")
        q_dtype = checks.as_dtype(q_data_type, "q_data_type")
        kv_dtype = checks.as_dtype(kv_data_type, "kv_data_type")
        checks.check_positive_int(num_heads, "num_heads")
        checks.check_positive_int(head_dim_ckv, "head_dim_ckv")
        checks.check_positive_int(head_dim_kpe, "head_dim_kpe")
        checks.check_page_size(page_size)
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            checks.check_index_tensor(t, name)
        n = checks.check_indptr_length(kv_indptr, "kv_indptr")
        checks.check_indptr_length(qo_indptr, "qo_indptr", n)
        checks.check_lengths_count(kv_len_arr, "kv_len_arr", n - 1)
        (kv_indptr_h, qo_indptr_h, lens_h), minmax = checks.host_arrays([kv_indptr, qo_indptr, kv_len_arr],
                                                                        kv_indices)
        pages = checks.check_indptr(kv_indptr_h, "kv_indptr")
        qo_lens_h = checks.check_indptr(qo_indptr_h, "qo_indptr")
        kv_lens_h = _check_kv_lens(lens_h, pages, page_size)
        max_page_index = checks.check_page_indices(kv_indices.numel(), int(kv_indptr_h[-1]), minmax, "kv_indices",
                                                   "kv_indptr")
        o_dtype = q_dtype if q_dtype.itemsize > 1 else torch.bfloat16
        problem = _mla_problem(q_dtype, kv_dtype, o_dtype, num_heads, head_dim_ckv, head_dim_kpe, page_size,
                               causal, self._use_cuda_graph)
        scale = checks.check_scale(sm_scale, "sm_scale", 1.0)
        if self._graph_buffers is not None:  # (once every argument has passed its check)
            qo_indptr, kv_indptr, kv_indices, kv_len_arr = self._fixed_buffers(zip(
                self._graph_buffers, (qo_indptr, kv_indptr, kv_indices[: int(kv_indptr_h[-1])], kv_len_arr),
                ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")))
        params = _mla_params(qo_indptr_h, kv_indptr, kv_indices, kv_lens_h, self._device, scale, bool(causal),
                             self._workspace())
        self._set_plan(problem, params, total_q=int(qo_indptr_h[-1]), max_page_index=max_page_index,
                       workload=host_workload(qo_lens_h, kv_lens_h))

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False):
        """Run MLA: ``q_nope`` [tokens, heads, ckv], ``q_pe`` [tokens, heads, kpe], ``ckv_cache``
        [pages, page_size, ckv], ``kpe_cache`` [pages, page_size, kpe]. Returns the output
        [tokens, heads, ckv] and, with ``return_lse``, the lse [tokens, heads] (base 2, or base e
        with ``return_lse_base_on_e``)."""
        planned = self._variant(return_lse)
        if profiler_buffer is not None:
            raise Unsupported("profiler_buffer: flashdispatch has no in-kernel profiler")
        if kv_len is not None or page_table is not None:
            raise Unsupported("kv_len/page_table at run() are the cutlass backend's inputs, which flashdispatch "
                              "does not have; pass kv_indptr/kv_indices/kv_len_arr to plan()")
        result = run_mla(planned, q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse, return_lse=return_lse)
        if return_lse and return_lse_base_on_e:
            result[1].mul_(LN2)
        return result


def mla_paged_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, *, sm_scale, workspace_buffer,
                     v_scale=None, out_dtype=None, q_len_per_req: int = 1, out=None, lse=None, return_lse=False,
                     backend: str = "auto"):
    """MLA over block tables (shared by the TensorRT-LLM and XQA entry points); ``workspace_buffer``
    holds run()'s scratch."""
    checks.check_tensor(q_nope, "query", ndim=3)
    checks.check_positive_int(q_nope.shape[1], "the query's head count")
    page_size = ckv_cache.shape[1]
    indptr, indices, _, kv_lens_h, max_page = block_table_to_indptr(block_tables, seq_lens, page_size)
    batch = indptr.numel() - 1
    qo_indptr_h = torch.arange(batch + 1, dtype=torch.int64) * q_len_per_req
    if int(qo_indptr_h[-1]) != q_nope.shape[0]:
        raise ValueError(f"query has {q_nope.shape[0]} rows, expected batch x q_len_per_req = {int(qo_indptr_h[-1])}")
    # a tensor scale is read on the host once: the MLA contract has no run-time q scale
    sm_scale = checks.check_scale(sm_scale, "bmm1_scale", 1.0)
    dev = q_nope.device
    o_dtype = checks.as_dtype(out_dtype, "out_dtype") if out_dtype is not None else (
        q_nope.dtype if q_nope.dtype.itemsize > 1 else torch.bfloat16)
    problem = _mla_problem(q_nope.dtype, ckv_cache.dtype, o_dtype, q_nope.shape[1], q_nope.shape[2],
                           q_pe.shape[2], page_size, q_len_per_req > 1, return_lse=return_lse)
    params = _mla_params(qo_indptr_h.numpy(), indptr, indices, kv_lens_h.numpy(), dev, sm_scale,
                         q_len_per_req > 1, user_workspace(workspace_buffer, "workspace_buffer", dev))
    planned = plan_refreshing(problem, dev, params, backend, total_q=q_nope.shape[0], max_page_index=max_page)
    return run_mla(planned, q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse, return_lse=return_lse,
                   v_scale=v_scale)


def trtllm_batch_decode_with_kv_cache_mla(query: torch.Tensor, kv_cache: torch.Tensor,
                                          workspace_buffer: torch.Tensor, qk_nope_head_dim: int, kv_lora_rank: int,
                                          qk_rope_head_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                          max_seq_len: int, sparse_mla_top_k: int = 0, out=None, bmm1_scale=1.0,
                                          bmm2_scale=1.0, sinks=None, enable_pdl=None, backend: str = "auto",
                                          lse=None, return_lse: bool = False):
    """MLA decode in TensorRT-LLM's layout (FlashInfer signature).

    ``query`` ``[batch, q_len_per_request, heads, kv_lora_rank + qk_rope_head_dim]`` (q_nope then
    q_rope); ``kv_cache`` ``[pages, page_size, kv_lora_rank + qk_rope_head_dim]`` (or with a
    singleton dim 1); ``bmm1_scale`` the whole softmax scale, ``bmm2_scale`` the output scale.
    Returns ``[batch, q_len_per_request, heads, kv_lora_rank]``.
    """
    if sparse_mla_top_k:
        raise Unsupported(f"sparse_mla_top_k={sparse_mla_top_k}: sparse MLA is not supported")
    if sinks is not None:
        raise Unsupported("sinks with MLA are not supported")
    for name, value in (("qk_nope_head_dim", qk_nope_head_dim), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("max_seq_len", max_seq_len)):
        checks.check_positive_int(value, name, high=checks.MAX_KV_TOKENS)
    checks.check_tensor(query, "query", ndim=4)
    checks.check_tensor(kv_cache, "kv_cache")
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache[:, 0]
    width = kv_lora_rank + qk_rope_head_dim
    checks.check_tensor(kv_cache, "kv_cache", ndim=3, shape=(None, None, width))
    checks.check_tensor(query, "query", shape=(None, None, None, width))
    b, q_len, heads, _ = query.shape
    for buf, name, shape in ((out, "out", (b, q_len, heads, kv_lora_rank)), (lse, "lse", (b, q_len, heads))):
        if buf is not None:  # (written through a flat view of it)
            checks.check_tensor(buf, name, shape=shape, contiguous=True)
    bmm2_scale = checks.check_run_scale(bmm2_scale, "bmm2_scale", query.device)
    flat = query.reshape(b * q_len, heads, width)
    if lse is not None:
        lse = lse.reshape(b * q_len, heads)
    result = mla_paged_decode(flat[..., :kv_lora_rank], flat[..., kv_lora_rank:], kv_cache[..., :kv_lora_rank],
                              kv_cache[..., kv_lora_rank:], block_tables, seq_lens, sm_scale=bmm1_scale,
                              workspace_buffer=workspace_buffer, v_scale=bmm2_scale, q_len_per_req=q_len,
                              out=None if out is None else out.reshape(b * q_len, heads, kv_lora_rank),
                              lse=lse, return_lse=return_lse, backend=backend)
    if return_lse:
        return result[0].reshape(b, q_len, heads, kv_lora_rank), result[1].reshape(b, q_len, heads)
    return result.reshape(b, q_len, heads, kv_lora_rank)
