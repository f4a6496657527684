"""Decode attention (FlashInfer's ``flashinfer.decode``): single-request decode, the paged batch
decode wrappers, and the cuDNN / TensorRT-LLM style batch decode entry points.

Each function checks its arguments, builds a `Problem`, lets the registry pick a backend and runs
it; see `explain()` for why a backend was chosen.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from . import checks
from .backends.base import PagedKV
from .backends.cudnn import direct as cudnn_direct
from .block_table_plan import (check_queries_fit, check_table_pages, check_table_values, plan_block_table,
                               planning_bound, table_tensors)
from .deferred_check import DeferredPageCheck
from .dispatch.problem import Problem, Workload
from .dispatch.reasons import Unsupported
from .page import block_table_to_indptr
from .planned import (WrapperBase, check_requested, device_int32, on_device, paged_params, plan_refreshing,
                      refuse_runs_after_failure, require_plan, run_attention, scratch_workspace, single_key,
                      single_plans, user_workspace)
from .mla import trtllm_batch_decode_with_kv_cache_mla  # noqa: F401  (re-exported, as FlashInfer's decode module)
from .xqa import spec_mask_to_custom, xqa, xqa_mla  # noqa: F401  (re-exported, as in FlashInfer)


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False,
                                q_scale: float | None = None, k_scale: float | None = None,
                                v_scale: float | None = None, window_left: int = -1,
                                logits_soft_cap: float | None = None, sm_scale: float | None = None,
                                rope_scale: float | None = None, rope_theta: float | None = None,
                                return_lse: bool = False, backend: str = "auto"):
    """Decode attention of one request against its KV cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[num_qo_heads, head_dim]``.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    pos_encoding_mode : str
        ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"``.
    use_tensor_cores : bool
        Accepted for compatibility; the kernel choice is the backend's.
    q_scale, k_scale, v_scale : Optional[float]
        fp8 calibration scales (default 1).
    window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta :
        As in `BatchDecodeWithPagedKVCacheWrapper.plan`.
    return_lse : bool
        Also return the base-2 logsumexp ``[num_qo_heads]``.
    backend : str
        ``"auto"`` or a backend name (flashdispatch extension).

    Returns
    -------
    ``[num_qo_heads, head_dim]`` output, or ``(output, lse)``.

    The plan is kept (`planned.single_plans`, 64 of them) per shapes, dtypes, device and scalar
    arguments, so a repeated call only checks its tensors and launches; calls on one device share
    a scratch workspace: run them on one stream (see `planned.PlanCache`).
    """
    key = single_key((q, k, v), (kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                                 rope_theta, return_lse), backend)
    planned = single_plans.get(key, lambda: _plan_single_decode(
        q, k, v, kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
        backend, return_lse))
    if kv_layout == "NHD":
        kv = PagedKV(k.unsqueeze(1), v.unsqueeze(1), "NHD")
    else:  # [kv_heads, kv_len, dim] as pages of one token: [kv_len, kv_heads, 1, dim]
        kv = PagedKV(k.transpose(0, 1).unsqueeze(2), v.transpose(0, 1).unsqueeze(2), "HND")
    result = run_attention(planned, q.unsqueeze(0), kv, return_lse=return_lse, q_scale=q_scale, k_scale=k_scale,
                           v_scale=v_scale)
    if return_lse:
        return result[0][0], result[1][0]
    return result[0]


def _plan_single_decode(q, k, v, kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                        rope_theta, backend, return_lse):
    """Check a single-request decode's arguments and plan it (a batch of one, pages of one token)
    on the device's scratch workspace; only the variant this call runs is planned."""
    checks.check_layout(kv_layout)
    checks.check_tensor(q, "q", ndim=2)
    checks.check_tensor(k, "k", ndim=3, device=q.device)
    checks.check_tensor(v, "v", ndim=3, device=q.device, dtypes=(k.dtype,))
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} differ in their first two dimensions")
    if k.shape[2] != q.shape[1]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} differ in head_dim ({q.shape[1]} != {k.shape[2]})")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(scratch_workspace(q.device), kv_layout, backend=backend)
    wrapper._DEFAULT_VARIANT = (1, bool(return_lse))
    wrapper.plan(torch.tensor([0, kv_len], dtype=torch.int32), torch.arange(kv_len, dtype=torch.int32),
                 torch.tensor([1 if kv_len else 0], dtype=torch.int32), q.shape[0], num_kv_heads, q.shape[1], 1,
                 pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                 q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=sm_scale, rope_scale=rope_scale,
                 rope_theta=rope_theta, head_dim_vo=v.shape[-1])
    return wrapper._variant((1, bool(return_lse)))


class _DecodePlanArgs(NamedTuple):
    """What a decode plan() checked, kept for the variants planned at the first run() that asks."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    used_pages: int
    kv_lens_h: np.ndarray
    kv_total: int
    kv_max: int
    max_page_index: int
    scalars: tuple
    workspace: torch.Tensor


class BatchDecodeWithPagedKVCacheWrapper(DeferredPageCheck, WrapperBase):
    """Batch decode attention over a paged KV cache: ``plan()`` once per step, ``run()`` per layer.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        User-reserved workspace (128 MB recommended) on the device of the inputs.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Keep the index arrays in the fixed ``paged_kv_*_buffer`` tensors so ``run()`` can be captured;
        the batch size must then stay fixed.
    use_tensor_cores : bool
        Accepted for compatibility; the backend decides.
    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
        CUDA-graph buffers (``[batch + 1]``, ``[max_num_pages]``, ``[batch]``), needed with use_cuda_graph.
    backend : str
        ``"auto"`` or one of the backend names (``fa2``, ``cudnn``, ``reference``, ...).
    jit_args : not supported (custom JIT variants); must be None.
    """

    _DEFAULT_VARIANT = (1, False)  # (q_len_per_req, return_lse)

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
                 jit_args=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._graph_buffers = None
        if use_cuda_graph:
            bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer")
            for buf, name in zip(bufs, names):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs {name}")
                checks.check_tensor(buf, name, ndim=1, dtypes=(torch.int32,), device=self._device,
                                    contiguous=True)  # (a captured graph reads it in place, as flat memory)
            if bufs[0].numel() < 1 or bufs[2].numel() != bufs[0].numel() - 1:
                raise ValueError(f"paged_kv_indptr_buffer ({bufs[0].numel()} entries) and "
                                 "paged_kv_last_page_len_buffer "
                                 f"({bufs[2].numel()}) fix the batch size: batch_size + 1 and batch_size entries")
            checks.check_disjoint((*bufs, float_workspace_buffer), (*names, "float_workspace_buffer"))
            self._graph_buffers = bufs
        self._plan_args: _DecodePlanArgs | None = None
        self._qo_indptrs: dict[int, torch.Tensor] = {}  # q_len -> qo_indptr of the last batch size

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether this wrapper was made with ``use_cuda_graph=True``."""
        return self._use_cuda_graph

    @property
    def use_tensor_cores(self) -> bool:
        """The ``use_tensor_cores`` this wrapper was made with (a hint: fa2 chooses its own math)."""
        return self._use_tensor_cores

    @refuse_runs_after_failure
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: str | torch.dtype | None = "float16", kv_data_type: str | torch.dtype | None = None,
             o_data_type: str | torch.dtype | None = None, data_type: str | torch.dtype | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True, block_tables: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, head_dim_vo: int | None = None) -> None:
        """Plan batch decode for a page table; see FlashInfer's documentation of each argument.

        ``indptr`` [batch+1], ``indices`` [indptr[-1]] and ``last_page_len`` [batch] are int32.
        ``block_tables`` [batch, max_pages] with ``seq_lens`` [batch] may be given instead of them.
        ``data_type`` (deprecated) sets both q and kv dtypes. ``head_dim_vo`` (flashdispatch
        extension) allows a value head dim other than ``head_dim``.
        """
        if indptr is None:
            if block_tables is None or seq_lens is None:
                raise ValueError("plan() needs indptr/indices/last_page_len, or block_tables with seq_lens")
            # indptr and last_page_len on the host, moved to the device with the params; the page
            # indices (gathered on the table's device) are checked below as the API's are
            indptr, indices, last_page_len = block_table_to_indptr(block_tables, seq_lens, page_size,
                                                                   check_indices=False)[:3]
        if data_type is not None:
            checks.as_dtype(data_type, "data_type")
            q_data_type = kv_data_type = data_type
        scalars = self._scalars(
            (q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, fixed_split_size,
             disable_split_kv, head_dim_vo),
            lambda: self._check_scalars(q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads, head_dim,
                                        page_size, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                                        rope_scale, rope_theta, fixed_split_size, disable_split_kv, head_dim_vo))
        checks.check_index_tensor(indptr, "indptr")
        checks.check_index_tensor(indices, "indices")
        checks.check_index_tensor(last_page_len, "last_page_len")
        batch = checks.check_indptr_length(indptr, "indptr") - 1
        checks.check_lengths_count(last_page_len, "last_page_len", batch)
        self._finish_page_check()  # the last plan()'s, if its runs did not finish it
        defer = self._defers_page_check((indptr, last_page_len), indices)  # (deferred_check.py)
        table = checks.paged_lengths(indptr, last_page_len, None if defer else indices, page_size)
        used_pages = table.used_pages
        max_page_index = checks.check_page_indices(indices.numel(), used_pages, table.index_range,
                                                   "indices" if block_tables is None else "block_tables")
        if self._graph_buffers is not None and batch + 1 != self._graph_buffers[0].numel():
            raise ValueError(f"use_cuda_graph=True fixes batch_size={self._graph_buffers[0].numel() - 1} "
                             f"(paged_kv_indptr_buffer), got indptr for batch_size={batch}")
        if defer:  # indptr and last_page_len go to the device with the check's launch
            max_page_index, uploaded = self._begin_page_check(indices, used_pages, max_page_index,
                                                              [table.indptr, table.last_page_len])
            if uploaded is not None:
                indptr, last_page_len = uploaded
        previous = self._plan_args
        self._plan_args = _DecodePlanArgs(indptr, indices, last_page_len, used_pages, table.kv_lens, table.kv_total,
                                          table.kv_max, max_page_index, scalars, self._workspace())
        refresh = (previous is not None and previous.scalars is scalars and previous.kv_lens_h.size == batch
                   and previous.workspace is self._plan_args.workspace)
        self._planning_with_page_check(lambda: self._plan_variants(refresh=refresh))

    def _set_max_page_index(self, high: int) -> None:
        self._plan_args = self._plan_args._replace(max_page_index=high)
        super()._set_max_page_index(high)

    def _check_scalars(self, q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads, head_dim, page_size,
                       pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                       fixed_split_size, disable_split_kv, head_dim_vo) -> tuple[Problem, dict]:
        """The checked scalar arguments of plan(): the base Problem and the params' scalars."""
        q_dtype, kv_dtype, o_dtype = checks.attention_dtypes(
            q_data_type if q_data_type is not None else "float16", kv_data_type, o_data_type)
        checks.check_heads(num_qo_heads, num_kv_heads)
        checks.check_positive_int(head_dim, "head_dim", high=checks.MAX_KV_TOKENS)
        head_dim_vo = head_dim if head_dim_vo is None else checks.check_positive_int(
            head_dim_vo, "head_dim_vo", high=checks.MAX_KV_TOKENS)
        checks.check_page_size(page_size)
        if fixed_split_size is not None:
            checks.check_positive_int(fixed_split_size, "fixed_split_size", high=checks.MAX_KV_TOKENS)
        problem = Problem(
            "decode", q_dtype, kv_dtype, o_dtype, num_qo_heads, num_kv_heads, head_dim, head_dim_vo,
            page_size, self._kv_layout, "none", checks.check_window_left(window_left),
            checks.check_soft_cap(logits_soft_cap), checks.check_pos_encoding(pos_encoding_mode),
            use_cuda_graph=self._use_cuda_graph)
        return problem, dict(sm_scale=checks.check_scale(sm_scale, "sm_scale", 1.0 / math.sqrt(head_dim)),
                             **checks.check_rope(rope_scale, rope_theta), fixed_split_size=fixed_split_size,
                             disable_split_kv=bool(disable_split_kv))

    def _build_variant(self, key: tuple[int, bool]):
        """The plan for ``q_len`` query tokens per request (speculative decode: causal in the block),
        with or without lse."""
        q_len, return_lse = key
        a = self._plan_args
        base, scalars = a.scalars
        batch = a.kv_lens_h.size
        problem = self._problem(base, key, q_len_per_req=q_len, mask_mode="causal" if q_len > 1 else "none",
                                return_lse=return_lse)
        indptr, indices, last = a.indptr, a.indices, a.last_page_len
        if self._graph_buffers is not None:
            indptr, indices, last = self._fixed_buffers(zip(
                self._graph_buffers, (indptr, indices[: a.used_pages], last),
                ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer")))
        params = paged_params(self._qo_indptr(batch, q_len), a.kv_lens_h, indptr, indices, last, self._device,
                              qo_lens_host=[q_len] * batch, kv_stats=(a.kv_total, a.kv_max), workspace=a.workspace,
                              int_workspace=self._int_workspace(key) if self._use_cuda_graph else None,
                              **scalars)
        workload = Workload(batch, batch * q_len, q_len if batch else 0, a.kv_total, a.kv_max)
        return self._plan(problem, params, total_q=batch * q_len, max_page_index=a.max_page_index,
                          workload=workload, previous=self._refreshable.get(key))

    def _qo_indptr(self, batch: int, q_len: int) -> torch.Tensor:
        """``arange(batch + 1) * q_len`` (int32) on the device, kept while the batch size stays."""
        qo = self._qo_indptrs.get(q_len)
        if qo is None or qo.numel() != batch + 1:
            qo = self._qo_indptrs[q_len] = device_int32(self._device, np.arange(batch + 1) * q_len)[0]
        return qo

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, q_len_per_req: int | None = 1):
        """Batch decode of ``q`` ``[batch * q_len_per_req, num_qo_heads, head_dim]`` against the cache.

        ``paged_kv_cache`` is a 5-D ``[pages, 2, ...]`` tensor or a ``(k_cache, v_cache)`` tuple in
        the wrapper's layout. ``q_scale``/``k_scale``/``v_scale`` are fp8 calibration scales
        (float or 1-element tensor). ``enable_pdl`` is accepted as a hint with no effect on
        results; fa2 on sm90+ launches its split-KV merge as a programmatic dependent launch
        whatever it says (``FLASHDISPATCH_FA2_DECODE_CONFIG='{"pdl": false}'`` turns that off).
        Returns the output ``[batch * q_len_per_req, num_qo_heads, head_dim]`` and, with
        ``return_lse``, the base-2 lse ``[batch * q_len_per_req, num_qo_heads]``.
        """
        checks.reject_extra_args(args, "run")
        require_plan(self._plan_args, type(self).__name__)
        q_len = checks.check_positive_int(1 if q_len_per_req is None else q_len_per_req, "q_len_per_req",
                                           high=checks.MAX_KV_TOKENS)
        planned = self._variant((q_len, return_lse))
        kv = checks.unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        self._page_check_at_run(planned, kv.num_pages)
        return run_attention(planned, q, kv, out=out, lse=lse, return_lse=return_lse,
                             q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs):
        """`run` with ``return_lse=True``."""
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    forward = run
    forward_return_lse = run_return_lse
    begin_forward = plan

    def end_forward(self) -> None:
        """Deprecated no-op kept for old FlashInfer code."""


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """`BatchDecodeWithPagedKVCacheWrapper` with ``use_cuda_graph=True`` and its fixed buffers.

    ``plan()`` cannot be captured; ``run()`` can, and a captured run replays correctly after later
    ``plan()`` calls with the same batch size. Each variant of a run (``return_lse``,
    ``q_len_per_req``) is planned at its first use: run it once eagerly before capturing it; every
    variant used so far is planned again by each later ``plan()``.
    """

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor, indices_buffer: torch.Tensor,
                 last_page_len_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def _split_kv_cache(kv_cache, layout: str, name: str = "kv_cache") -> PagedKV:
    """A (k, v) tuple, a 5-D [pages, 2, ...] tensor, or [pages, 1, ...] (k and v shared), in ``layout``."""
    if isinstance(kv_cache, (tuple, list)):
        return checks.unpack_paged_kv_cache(tuple(kv_cache), layout, name)
    checks.check_tensor(kv_cache, name, ndim=5)
    if kv_cache.shape[1] == 1:
        return PagedKV(kv_cache[:, 0], kv_cache[:, 0], layout)
    return checks.unpack_paged_kv_cache(kv_cache, layout, name)


def _sinks_tensor(sinks):
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            raise ValueError(f"sinks as a list must hold one tensor of [num_qo_heads], got {len(sinks)}")
        sinks = sinks[0]
    return sinks


def _scale_split(scale, name: str, device: torch.device):
    """A float scale goes into sm_scale/plan; a tensor scale (one element on ``device``) is applied
    at run time."""
    if isinstance(scale, torch.Tensor):
        return 1.0, checks.check_run_scale(scale, name, device)
    return checks.check_scale(scale, name, 1.0), None


def _output_scale(bmm2_scale, o_scale):
    """``bmm2_scale`` x ``o_scale``, each checked under its own name (a tensor ``bmm2_scale`` is
    scaled on its device; its value is not read)."""
    o = checks.check_scale(o_scale, "o_scale", 1.0)
    if isinstance(bmm2_scale, torch.Tensor):
        checks.check_run_scale(bmm2_scale, "bmm2_scale", bmm2_scale.device)
        return bmm2_scale if o == 1.0 else bmm2_scale * o
    return checks.scale_product(checks.check_scale(bmm2_scale, "bmm2_scale", 1.0), o, "bmm2_scale x o_scale")


def paged_attention_from_block_tables(query, kv: PagedKV, block_tables, seq_lens, *, bmm1_scale, bmm2_scale,
                                      window_left, out, out_dtype, sinks, backend, causal, workspace_buffer,
                                      q_len_per_req: int = 1, qo_indptr_h: torch.Tensor | None = None,
                                      packed_mask=None, mask_indptr=None, spec_decode_mask=False, return_lse=False,
                                      lse=None, op="decode", max_seq_len=None, table_name="block_tables"):
    """The TensorRT-LLM style entry points: block tables + KV lengths, fused bmm1/bmm2 scales;
    ``workspace_buffer`` holds run()'s scratch (split-KV partials). Each request has
    ``q_len_per_req`` query rows, or ``qo_indptr_h`` (host int64 ``[batch + 1]``) gives them. A
    decode of equal query rows per request on a backend that reads block tables makes no host
    read (`block_table_plan`; its plan assumes at most ``max_seq_len`` KV tokens a request, None:
    the table's whole row). ``table_name`` names ``block_tables`` in the errors."""
    check_requested(backend)
    checks.check_tensor(query, "query", ndim=3)
    if out is not None:
        checks.check_tensor(out, "out")
    dev = query.device
    shape = kv.k_shape
    page_size, num_kv_heads = (shape[1], shape[2]) if kv.layout == "NHD" else (shape[2], shape[1])
    checks.check_heads(query.shape[1], num_kv_heads)
    if query.shape[2] != shape[3]:
        raise ValueError(f"query has head_dim={query.shape[2]}, but the cache's keys have {shape[3]} (k shape "
                         f"{list(shape)}, {kv.layout})")
    sm_scale, q_scale = _scale_split(bmm1_scale, "bmm1_scale", dev)
    v_scale_f, v_scale_t = _scale_split(bmm2_scale, "bmm2_scale", dev)
    v_scale = v_scale_t if v_scale_t is not None else v_scale_f
    if qo_indptr_h is None:
        batch = checks.check_tensor(block_tables, table_name, ndim=2).shape[0]
        q_len, total_q, uniform = q_len_per_req, batch * q_len_per_req, True
    else:
        qo_lens = qo_indptr_h[1:] - qo_indptr_h[:-1]
        batch, total_q = qo_lens.numel(), int(qo_indptr_h[-1])
        q_len = int(qo_lens.max()) if op == "decode" and batch else 1
        uniform = total_q == batch * q_len
    if total_q != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} rows, but the query lengths add up to {total_q}")
    o_dtype = out.dtype if out is not None and out_dtype is None else (
        checks.as_dtype(out_dtype, "out_dtype") if out_dtype is not None else query.dtype)
    sinks = _sinks_tensor(sinks)
    problem = Problem(op, query.dtype, kv.dtype, o_dtype, query.shape[1], num_kv_heads, query.shape[2],
                      shape[3] if kv.combined is not None else kv.v.shape[-1], page_size, kv.layout,
                      "custom" if packed_mask is not None else ("causal" if causal else "none"),
                      checks.check_window_left(window_left), return_lse=return_lse, sinks=sinks is not None,
                      spec_decode_mask=spec_decode_mask, q_len_per_req=q_len if op == "decode" else 1)
    workspace = user_workspace(workspace_buffer, "workspace_buffer", dev)
    run = dict(out=out, lse=lse, return_lse=return_lse, q_scale=q_scale, v_scale=v_scale, sinks=sinks)
    tables = (table_tensors(block_tables, seq_lens, batch, dev)
              if op == "decode" and packed_mask is None and batch and uniform else None)
    if tables is not None:
        bound = planning_bound(max_seq_len, tables[0].shape[1], page_size)
        planned = plan_block_table(problem, dev, *tables, bound, sm_scale=sm_scale, workspace=workspace,
                                   requested=backend, total_q=total_q)
        if planned is not None:  # (else the conversion below reads and checks the values)
            if dev.type == "cpu" or (checks.device_values_checked() and not torch.cuda.is_current_stream_capturing()):
                check_table_values(*tables, kv, page_size, q_len, table_name)
            return run_attention(planned, query, kv, **run)
    if qo_indptr_h is None:
        qo_indptr_h = torch.arange(batch + 1, dtype=torch.int64) * q_len
        qo_lens = qo_indptr_h[1:] - qo_indptr_h[:-1]
    indptr, indices, last, kv_lens_h, max_page = block_table_to_indptr(block_tables, seq_lens, page_size)
    check_queries_fit(qo_lens.numpy(), kv_lens_h.numpy())
    check_table_pages(max_page, kv, table_name)
    params = paged_params(qo_indptr_h.numpy(), kv_lens_h.numpy(), indptr, indices, last, dev, qo_lens.tolist(),
                          sm_scale=sm_scale, workspace=workspace, packed_mask=on_device(packed_mask, dev),
                          mask_indptr=on_device(mask_indptr, dev))
    planned = plan_refreshing(problem, dev, params, backend, keep=packed_mask is None, total_q=total_q,
                              max_page_index=max_page)
    return run_attention(planned, query, kv, **run)


def trtllm_batch_decode_with_kv_cache(query: torch.Tensor, kv_cache, workspace_buffer: torch.Tensor,
                                      block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                                      bmm1_scale=1.0, bmm2_scale=1.0, window_left: int = -1, out=None,
                                      out_dtype=None, o_sf_scale=None, o_sf_vec_size=None, sinks=None,
                                      kv_layout: str = "HND", enable_pdl=None, backend: str = "auto",
                                      q_len_per_req: int | None = 1, o_scale: float | None = 1.0, mask=None,
                                      max_q_len: int | None = None, cum_seq_lens_q: torch.Tensor | None = None):
    """TensorRT-LLM style batch decode over a paged cache (FlashInfer signature).

    ``query`` ``[num_tokens, num_qo_heads, head_dim]``; ``kv_cache`` a (k, v) tuple of 4-D tensors or
    a 5-D ``[pages, 1 or 2, ...]`` tensor in ``kv_layout`` (default HND); ``block_tables``
    ``[batch, max_pages]`` int32; ``seq_lens`` ``[batch]`` KV lengths. ``bmm1_scale`` is the whole
    softmax scale (sm_scale x q_scale x k_scale), ``bmm2_scale`` x ``o_scale`` scales the output.
    ``sinks`` ``[num_qo_heads]`` float32; ``mask`` the xqa speculative-decoding mask
    ``[batch, q_len_per_req, ceil(q_len/32)*2]`` uint16. nvfp4 output is not supported.

    ``max_seq_len``: the longest ``seq_lens`` entry, as in FlashInfer. On a backend whose kernel
    reads the block table itself (fa2), a call without ``mask`` and with equal query rows per
    request reads nothing back from the GPU: its plan, kept for the next calls, is sized for
    ``max_seq_len``, and a call of the same shapes can be captured in a CUDA graph once one ran
    eagerly. The device values are then not checked (each length is clamped to its table row and
    each page to the cache) unless FLASHDISPATCH_CHECK_INPUTS=1; CPU tensors are always checked.
    """
    if out_dtype == "nvfp4" or o_sf_scale is not None or o_sf_vec_size is not None:
        raise Unsupported("nvfp4 output (out_dtype='nvfp4', o_sf_scale, o_sf_vec_size) is not supported")
    kv = _split_kv_cache(kv_cache, checks.check_layout(kv_layout))
    max_seq_len = checks.check_positive_int(max_seq_len, "max_seq_len")
    batch = checks.check_tensor(block_tables, "block_tables", ndim=2).shape[0]
    qo_indptr_h, q_len = None, checks.check_positive_int(1 if q_len_per_req is None else q_len_per_req,
                                                         "q_len_per_req", high=checks.MAX_KV_TOKENS)
    if max_q_len is not None:
        checks.check_positive_int(max_q_len, "max_q_len", high=checks.MAX_KV_TOKENS)
    if cum_seq_lens_q is not None:
        qo_indptr_h = checks.host_indptr(cum_seq_lens_q, "cum_seq_lens_q", batch + 1)
        q_len = int((qo_indptr_h[1:] - qo_indptr_h[:-1]).max()) if batch else 1
        if max_q_len is not None and q_len > max_q_len:
            raise ValueError(f"cum_seq_lens_q holds a request of {q_len} query tokens, above max_q_len={max_q_len}")
    packed = mask_indptr = None
    if mask is not None:
        if qo_indptr_h is None:
            qo_indptr_h = torch.arange(batch + 1, dtype=torch.int64) * q_len
        packed, mask_indptr = spec_mask_to_custom(mask, qo_indptr_h, seq_lens, "mask")
    bmm2 = _output_scale(bmm2_scale, o_scale)
    return paged_attention_from_block_tables(
        query, kv, block_tables, seq_lens, q_len_per_req=q_len, qo_indptr_h=qo_indptr_h,
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2, window_left=window_left, out=out, out_dtype=out_dtype,
        sinks=sinks, backend=backend, causal=q_len > 1,
        workspace_buffer=workspace_buffer, packed_mask=packed, mask_indptr=mask_indptr,
        spec_decode_mask=mask is not None, max_seq_len=max_seq_len)


def cudnn_batch_decode_with_kv_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                                     workspace_buffer: torch.Tensor, *, max_sequence_kv: int,
                                     actual_seq_lens_kv: torch.Tensor | None = None,
                                     block_tables: torch.Tensor | None = None, is_cuda_graph_compatible: bool = False,
                                     batch_offsets_q=None, batch_offsets_o=None, batch_offsets_k=None,
                                     batch_offsets_v=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Batch decode through cuDNN (FlashInfer signature), with no device->host synchronisation.

    ``q`` ``[batch, num_qo_heads, head_dim]``; ``k_cache``/``v_cache`` HND
    ``[pages, num_kv_heads, page_size, head_dim]``; ``block_tables`` ``[batch, max_pages]`` int32 and
    ``actual_seq_lens_kv`` ``[batch, 1, 1, 1]`` (or ``[batch]``) int32, both on q's device; ``scale``
    the softmax scale (a float: a device tensor is refused). ``max_sequence_kv`` (host int) picks the
    cuDNN graph bucket with the batch size; the caller guarantees, as with FlashInfer, that every
    ``actual_seq_lens_kv[b] <= max_sequence_kv`` and that the first ``ceil(actual_seq_lens_kv[b] /
    page_size)`` entries of ``block_tables[b]`` are pages of the cache: checking them would need a
    host sync. Set FLASHDISPATCH_CHECK_INPUTS=1 to have every call read and check them.
    A request with ``actual_seq_lens_kv[b] == 0`` gets 0.

    ``is_cuda_graph_compatible=True`` builds graphs for CUDA-graph replay; any call can be captured
    once its bucket (the batch size, ceil(max_sequence_kv / page_size) pages rounded up to a power
    of two) and tensor layout ran once eagerly: the first call of a bucket builds its graph,
    which cannot happen during a capture. Each batch size has its own graph (the rows are dense,
    as FlashInfer declares them): its first call builds it (~0.05 s on an H200). Ragged
    ``batch_offsets_*`` are not supported here.
    """
    if any(t is not None for t in (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v)):
        raise Unsupported("batch_offsets_q/o/k/v (ragged q/o/kv offsets) are not supported by "
                          "cudnn_batch_decode_with_kv_cache: decode reads one row per request")
    return cudnn_direct.batch_decode(q, k_cache, v_cache, scale, workspace_buffer, max_sequence_kv=max_sequence_kv,
                                     actual_seq_lens_kv=actual_seq_lens_kv, block_tables=block_tables,
                                     cuda_graph=bool(is_cuda_graph_compatible), out=out)
