"""Prefill / append attention (FlashInfer's ``flashinfer.prefill``): single-request prefill, the
paged and ragged batch prefill wrappers, and the cuDNN / TensorRT-LLM style entry points."""
from __future__ import annotations

import math

import numpy as np
import torch

from . import checks
from .backends.base import AttentionParams, PagedKV, RaggedKV
from .backends.cudnn import direct as cudnn_direct
from .decode import _split_kv_cache, paged_attention_from_block_tables
from .deferred_check import DeferredPageCheck
from .dispatch.entry_paths import selects_cudnn_direct
from .dispatch.problem import Problem
from .dispatch.reasons import Unsupported
from .page import block_table_to_indptr, host_seq_lens
from .planned import (WrapperBase, device_int32, host_workload, on_device, paged_params, run_attention,
                      refuse_runs_after_failure, scratch_workspace, single_key, single_plans)
from .quantization import packbits, segment_packbits


def _packed_mask(custom_mask, packed_custom_mask, qo_lens: np.ndarray, kv_lens: np.ndarray, device):
    """(packed uint8 mask, byte mask_indptr) from a flattened bool mask or an already packed one
    (per-request segments packed with ``segment_packbits(..., bitorder="little")``)."""
    bits = qo_lens * kv_lens
    if packed_custom_mask is not None:
        checks.check_tensor(packed_custom_mask, "packed_custom_mask", ndim=1, dtypes=(torch.uint8,))
        byte_indptr = np.concatenate([[0], np.cumsum((bits + 7) // 8)])
        if packed_custom_mask.numel() < int(byte_indptr[-1]):
            raise ValueError(f"packed_custom_mask has {packed_custom_mask.numel()} bytes, the lengths need "
                             f"{int(byte_indptr[-1])} (sum of ceil(qo_len * kv_len / 8))")
        return on_device(packed_custom_mask, device), device_int32(device, byte_indptr)[0]
    checks.check_tensor(custom_mask, "custom_mask", dtypes=(torch.bool,))
    square = len(bits) == 1 and custom_mask.dim() == 2
    if square and tuple(custom_mask.shape) != (int(qo_lens[0]), int(kv_lens[0])):
        raise ValueError(f"custom_mask has shape {list(custom_mask.shape)}, expected [qo_len, kv_len] = "
                         f"[{int(qo_lens[0])}, {int(kv_lens[0])}] or flattened")
    if not square and (custom_mask.dim() != 1 or custom_mask.numel() != int(bits.sum())):
        raise ValueError(f"custom_mask has shape {list(custom_mask.shape)}, expected the flattened masks "
                         f"[sum(qo_len * kv_len)] = [{int(bits.sum())}]")
    bit_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(bits)]))
    packed, indptr = segment_packbits(custom_mask.contiguous().view(-1), bit_indptr.to(custom_mask.device),
                                      bitorder="little")
    return on_device(packed, device), on_device(indptr, device)


class _PrefillWrapper(WrapperBase):
    """Plan logic shared by the paged and ragged prefill wrappers."""

    _UNSUPPORTED_PLAN_ARGS = ("prefix_len_ptr", "token_pos_in_items_ptr", "max_item_len_ptr")

    def _check_unsupported(self, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                           max_item_len_ptr) -> None:
        for name, value in zip(self._UNSUPPORTED_PLAN_ARGS, (prefix_len_ptr, token_pos_in_items_ptr,
                                                             max_item_len_ptr)):
            if value is not None:
                raise Unsupported(f"{name}: multi-item scoring is not supported by flashdispatch")
        if token_pos_in_items_len:
            raise Unsupported("token_pos_in_items_len: multi-item scoring is not supported by flashdispatch")

    def _problem_and_params(self, op, qo_lens_h, kv_lens_h, *, num_qo_heads, num_kv_heads, head_dim_qk,
                            head_dim_vo, page_size, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                            sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type,
                            kv_data_type, o_data_type, fixed_split_size, disable_split_kv, mask_bufs,
                            tables=()):
        """The Problem, the params' keyword arguments and the views of the fixed buffers that
        ``tables`` ((buf, tensor, name) each) were written into with the packed mask's (one
        `_fixed_buffers`: all checked before any is written); the scalar part is checked only
        when the scalar arguments differ from the last plan()'s."""
        masked = custom_mask is not None or packed_custom_mask is not None
        key = (op, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, masked, causal,
               pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type,
               kv_data_type, o_data_type, fixed_split_size, disable_split_kv)
        problem, scalars = self._scalars(key, lambda: self._check_scalars(*key))
        packed = mask_indptr = None
        tables = list(tables)
        if masked:
            packed, mask_indptr = _packed_mask(custom_mask, packed_custom_mask, qo_lens_h, kv_lens_h, self._device)
            if self._use_cuda_graph and mask_bufs is None:
                raise ValueError("use_cuda_graph=True with a custom mask needs custom_mask_buf and mask_indptr_buf "
                                 "(the mask must stay at the address a captured graph reads)")
        if masked and mask_bufs is not None:
            *views, packed, mask_indptr = self._fixed_buffers(
                tables + [(mask_bufs[0], packed, "custom_mask_buf"), (mask_bufs[1], mask_indptr, "mask_indptr_buf")])
        else:
            views = self._fixed_buffers(tables)
        extra = dict(scalars, packed_mask=packed, mask_indptr=mask_indptr, workspace=self._workspace())
        return problem, extra, views

    def _check_scalars(self, op, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, masked, causal,
                       pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                       q_data_type, kv_data_type, o_data_type, fixed_split_size, disable_split_kv):
        checks.check_heads(num_qo_heads, num_kv_heads)
        checks.check_positive_int(head_dim_qk, "head_dim_qk", high=checks.MAX_KV_TOKENS)
        head_dim_vo = head_dim_qk if head_dim_vo is None else checks.check_positive_int(
            head_dim_vo, "head_dim_vo", high=checks.MAX_KV_TOKENS)
        if fixed_split_size is not None:
            checks.check_positive_int(fixed_split_size, "fixed_split_size", high=checks.MAX_KV_TOKENS)
        q_dtype, kv_dtype, o_dtype = checks.attention_dtypes(q_data_type, kv_data_type, o_data_type)
        mask_mode = "custom" if masked else ("causal" if causal else "none")
        problem = Problem(op, q_dtype, kv_dtype, o_dtype, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                          page_size, self._kv_layout, mask_mode, checks.check_window_left(window_left),
                          checks.check_soft_cap(logits_soft_cap), checks.check_pos_encoding(pos_encoding_mode),
                          use_cuda_graph=self._use_cuda_graph)
        return problem, dict(sm_scale=checks.check_scale(sm_scale, "sm_scale", 1.0 / math.sqrt(head_dim_qk)),
                             **checks.check_rope(rope_scale, rope_theta),
                             fixed_split_size=fixed_split_size, disable_split_kv=bool(disable_split_kv))

    def run_return_lse(self, *args, **kwargs):
        """`run` with ``return_lse=True``."""
        return self.run(*args, return_lse=True, **kwargs)

    def end_forward(self) -> None:
        """Deprecated no-op kept for old FlashInfer code."""


class BatchPrefillWithPagedKVCacheWrapper(DeferredPageCheck, _PrefillWrapper):
    """Batch prefill/append attention of ragged queries against a paged KV cache.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        User-reserved workspace (128 MB recommended).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Keep index arrays in the fixed ``*_buf`` tensors so ``run()`` can be captured.
    qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf : torch.Tensor
        CUDA-graph buffers (int32), needed with use_cuda_graph.
    custom_mask_buf, mask_indptr_buf : torch.Tensor
        CUDA-graph buffers for a custom mask (uint8 packed bits, int32 byte offsets).
    backend : str
        ``"auto"`` or a backend name.
    jit_args, jit_kwargs : not supported; must be None.

    With qo_indptr, paged_kv_indptr and paged_kv_last_page_len on the host and the page indices on
    a GPU, plan() checks the indices without waiting for the GPU when the backend clamps them
    (fa2); the check ends at a later run() or plan() (deferred_check.py).
    """

    _INDICES = "paged_kv_indices"
    _INDPTR = "paged_kv_indptr"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs)
        self._graph_buffers = self._mask_bufs = None
        if use_cuda_graph:
            bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
            names = ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf")
            for buf, name in zip(bufs, names):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs {name}")
            checks.check_disjoint((*bufs, custom_mask_buf, mask_indptr_buf, float_workspace_buffer),
                                  (*names, "custom_mask_buf", "mask_indptr_buf", "float_workspace_buffer"))
            self._graph_buffers = bufs
            if custom_mask_buf is not None:
                self._mask_bufs = (custom_mask_buf, mask_indptr_buf)

    @refuse_runs_after_failure
    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking: bool = True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence: int | None = None, max_sequence_kv: int | None = None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """Plan paged prefill; see FlashInfer's documentation of each argument.

        ``custom_mask`` is the flattened bool mask (row-major [qo_len, kv_len] per request, True
        keeps); ``packed_custom_mask`` the same packed per request with
        ``segment_packbits(..., bitorder="little")``. A mask overrides ``causal``.
        ``use_fp16_qk_reduction`` only permits lower precision; results keep float32 accumulation.
        ``seq_lens``/``block_tables`` may replace the page-table arguments.
        """
        self._check_unsupported(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        checks.check_page_size(page_size)
        if paged_kv_indptr is None:
            if block_tables is None or seq_lens is None:
                raise ValueError("plan() needs paged_kv_indptr/indices/last_page_len, or block_tables with seq_lens")
            # indptr and last_page_len on the host, moved to the device with the params; the page
            # indices (gathered on the table's device) are checked below as the API's are
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len = block_table_to_indptr(
                block_tables, seq_lens, page_size, check_indices=False)[:3]
        names = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
        tensors = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        for name, t in zip(names, tensors):
            checks.check_index_tensor(t, name)
        n = checks.check_indptr_length(paged_kv_indptr, "paged_kv_indptr")
        checks.check_indptr_length(qo_indptr, "qo_indptr", n)
        checks.check_lengths_count(paged_kv_last_page_len, "paged_kv_last_page_len", n - 1)
        self._finish_page_check()  # the last plan()'s, if its runs did not finish it
        lengths = [paged_kv_indptr, qo_indptr, paged_kv_last_page_len]
        defer = self._defers_page_check(lengths, paged_kv_indices)  # (deferred_check.py)
        (kv_indptr_h, qo_indptr_h, last_h), minmax = checks.host_arrays(lengths, None if defer else paged_kv_indices)
        pages = checks.check_indptr(kv_indptr_h, "paged_kv_indptr")
        qo_lens_h = checks.check_indptr(qo_indptr_h, "qo_indptr")
        used_pages = int(kv_indptr_h[-1])
        kv_lens_h = checks.paged_kv_lengths(pages, last_h, page_size, used_pages, "paged_kv_last_page_len")
        max_page_index = checks.check_page_indices(paged_kv_indices.numel(), used_pages, minmax,
                                                   "paged_kv_indices", "paged_kv_indptr")
        indices = paged_kv_indices  # the user's tensor: what a deferred check reads
        tables = ()
        if self._graph_buffers is not None:
            tables = zip(self._graph_buffers, (qo_indptr, paged_kv_indptr, paged_kv_indices[:used_pages],
                                               paged_kv_last_page_len), (n + "_buf" for n in names))
        problem, extra, views = self._problem_and_params(
            "prefill_paged", qo_lens_h, kv_lens_h, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, mask_bufs=self._mask_bufs,
            tables=tables)
        qo_param = qo_indptr_h  # copied to the device with the kv lengths, unless the graph buffer holds it
        if views:
            qo_param, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len = views
        params = paged_params(qo_param, kv_lens_h, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                              self._device, qo_lens_h.tolist(), indices_checked=minmax is not None, **extra)
        if defer:  # queued once every argument has passed its check: a plan() that raised leaves none
            max_page_index = self._begin_page_check(indices, used_pages, max_page_index)[0]
        self._planning_with_page_check(lambda: self._set_plan(
            problem, params, total_q=int(qo_indptr_h[-1]), max_page_index=max_page_index,
            workload=host_workload(qo_lens_h, kv_lens_h)))

    def _set_max_page_index(self, high: int) -> None:
        self._base_plan[2]["max_page_index"] = high  # for the variants planned later
        super()._set_max_page_index(high)

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None):
        """Prefill of ``q`` ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` against the paged cache
        (5-D ``[pages, 2, ...]`` or a (k, v) tuple). Returns the output
        ``[qo_indptr[-1], num_qo_heads, head_dim_vo]`` and, with ``return_lse``, the base-2 lse."""
        checks.reject_extra_args(args, "run")
        planned = self._variant(return_lse)
        kv = checks.unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        self._page_check_at_run(planned, kv.num_pages)
        return run_attention(planned, q, kv, out=out, lse=lse, return_lse=return_lse, q_scale=q_scale,
                             k_scale=k_scale, v_scale=v_scale)

    forward = run
    begin_forward = plan


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """Batch prefill/append attention of ragged queries against ragged (contiguous) keys/values.

    Parameters as `BatchPrefillWithPagedKVCacheWrapper`; CUDA-graph buffers are ``qo_indptr_buf``,
    ``kv_indptr_buf`` and, with a custom mask, ``custom_mask_buf``/``mask_indptr_buf``.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs)
        self._graph_buffers = self._mask_bufs = None
        if use_cuda_graph:
            if qo_indptr_buf is None or kv_indptr_buf is None:
                raise ValueError("use_cuda_graph=True needs qo_indptr_buf and kv_indptr_buf")
            checks.check_disjoint((qo_indptr_buf, kv_indptr_buf, custom_mask_buf, mask_indptr_buf,
                                   float_workspace_buffer), ("qo_indptr_buf", "kv_indptr_buf", "custom_mask_buf",
                                                             "mask_indptr_buf", "float_workspace_buffer"))
            self._graph_buffers = (qo_indptr_buf, kv_indptr_buf)
            if custom_mask_buf is not None:
                self._mask_bufs = (custom_mask_buf, mask_indptr_buf)

    @refuse_runs_after_failure
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking: bool = True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
             max_item_len_ptr=None, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             seq_lens=None, seq_lens_q=None, max_token_per_sequence: int | None = None,
             max_sequence_kv: int | None = None, v_indptr=None, o_indptr=None) -> None:
        """Plan ragged prefill: ``qo_indptr``/``kv_indptr`` [batch+1] int32 row offsets of q and k/v.
        Masks and the other arguments as in `BatchPrefillWithPagedKVCacheWrapper.plan`.
        ``v_indptr``/``o_indptr`` (cuDNN's separate offsets) must equal kv_indptr/qo_indptr."""
        self._check_unsupported(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            checks.check_index_tensor(t, name)
        n = checks.check_indptr_length(kv_indptr, "kv_indptr")
        checks.check_indptr_length(qo_indptr, "qo_indptr", n)
        (kv_indptr_h, qo_indptr_h), _ = checks.host_arrays([kv_indptr, qo_indptr])
        kv_lens_h = checks.check_indptr(kv_indptr_h, "kv_indptr")
        qo_lens_h = checks.check_indptr(qo_indptr_h, "qo_indptr")
        for name, given, same in (("v_indptr", v_indptr, kv_indptr), ("o_indptr", o_indptr, qo_indptr)):
            if given is not None and not torch.equal(checks.check_index_tensor(given, name).to(same.device), same):
                raise Unsupported(f"{name} different from {'kv' if name[0] == 'v' else 'qo'}_indptr is not supported")
        tables = ()
        if self._graph_buffers is not None:
            tables = zip(self._graph_buffers, (qo_indptr, kv_indptr), ("qo_indptr_buf", "kv_indptr_buf"))
        problem, extra, views = self._problem_and_params(
            "prefill_ragged", qo_lens_h, kv_lens_h, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=0, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, mask_bufs=self._mask_bufs,
            tables=tables)
        if views:
            qo_indptr, kv_indptr = views
        params = AttentionParams(qo_indptr=on_device(qo_indptr, self._device),
                                 kv_indptr=on_device(kv_indptr, self._device),
                                 kv_lens=device_int32(self._device, kv_lens_h)[0],
                                 qo_lens_host=qo_lens_h.tolist(), kv_lens_host=kv_lens_h.tolist(), **extra)
        self._set_plan(problem, params, total_q=int(qo_indptr_h[-1]), total_kv=int(kv_indptr_h[-1]),
                       workload=host_workload(qo_lens_h, kv_lens_h))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, q_scale=None, k_scale=None,
            v_scale=None, o_scale=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None):
        """Prefill of ``q`` ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` against ``k``
        ``[kv_indptr[-1], num_kv_heads, head_dim_qk]`` and ``v`` ``[..., head_dim_vo]`` (NHD; HND:
        heads first). ``o_scale`` multiplies the output. Returns the output and, with
        ``return_lse``, the base-2 lse."""
        checks.reject_extra_args(args, "run")
        planned = self._variant(return_lse)
        checks.check_tensor(k, "k", ndim=3)
        checks.check_tensor(v, "v", ndim=3)
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        if o_scale is not None:
            o_scale = checks.check_run_scale(o_scale, "o_scale", self._device)
            v_scale = (1.0 if v_scale is None else checks.check_run_scale(v_scale, "v_scale", self._device)) * o_scale
        return run_attention(planned, q, RaggedKV(k, v), out=out, lse=lse, return_lse=return_lse, q_scale=q_scale,
                             k_scale=k_scale, v_scale=v_scale)

    forward = run
    begin_forward = plan


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q=None, scale_k=None,
                                 scale_v=None, o_dtype: torch.dtype | None = None,
                                 custom_mask: torch.Tensor | None = None,
                                 packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                                 window_left: int = -1, logits_soft_cap: float | None = None,
                                 rope_scale: float | None = None, rope_theta: float | None = None,
                                 backend: str = "auto", return_lse: bool = False):
    """Prefill/append attention of one request.

    ``q`` ``[qo_len, num_qo_heads, head_dim_qk]``; ``k``/``v`` ``[kv_len, num_kv_heads, head_dim]``
    (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND). ``custom_mask`` ``[qo_len, kv_len]`` bool
    (or flattened), ``packed_custom_mask`` its little-endian packed bits; a mask overrides
    ``causal``. ``scale_q/k/v`` are fp8 calibration scales. Returns ``[qo_len, num_qo_heads,
    head_dim_vo]`` and, with ``return_lse``, the base-2 lse ``[qo_len, num_qo_heads]``.

    The plan is kept (`planned.single_plans`, 64 of them) per shapes, dtypes, device and scalar
    arguments, so a repeated call only checks its tensors and launches; with a mask it also hands
    the new mask to the plan (fa2 rebuilds its tile lists on the device). Calls on one device
    share a scratch workspace: run them on one stream (see `planned.PlanCache`).
    """
    mask = packed_custom_mask if packed_custom_mask is not None else custom_mask
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    key = single_key(tensors, (o_dtype, causal, kv_layout, pos_encoding_mode, sm_scale, window_left,
                               logits_soft_cap, rope_scale, rope_theta, return_lse, packed_custom_mask is None),
                     backend)
    planned = single_plans.lookup(key)
    if planned is None:
        planned = single_plans.keep(key, _plan_single_prefill(
            q, k, v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
            window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse))
    elif mask is not None:  # of the shape, dtype and device this plan checked
        packed = packbits(mask.reshape(-1), bitorder="little") if packed_custom_mask is None else mask
        planned.replan_mask(on_device(packed, q.device))
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    return run_attention(planned, q, RaggedKV(k, v), return_lse=return_lse, q_scale=scale_q, k_scale=scale_k,
                         v_scale=scale_v)


def _plan_single_prefill(q, k, v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                         sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse):
    """Check a single-request prefill's arguments and plan it (as a batch of one) on the device's
    scratch workspace; only the variant this call runs (with or without lse) is planned."""
    checks.check_tensor(q, "q", ndim=3)
    checks.check_tensor(k, "k", ndim=3, device=q.device)
    checks.check_tensor(v, "v", ndim=3, device=q.device)
    checks.check_layout(kv_layout)
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(scratch_workspace(q.device), kv_layout, backend=backend)
    wrapper._DEFAULT_VARIANT = bool(return_lse)
    wrapper.plan(torch.tensor([0, q.shape[0]], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                 q.shape[1], num_kv_heads, q.shape[2],
                 v.shape[2], custom_mask=custom_mask,
                 packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
                 window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                 rope_theta=rope_theta, q_data_type=q.dtype, kv_data_type=k.dtype, o_data_type=o_dtype)
    return wrapper._variant(bool(return_lse))


def single_prefill_with_kv_cache_return_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
    """`single_prefill_with_kv_cache` with ``return_lse=True``."""
    kwargs["return_lse"] = True
    return single_prefill_with_kv_cache(q, k, v, *args, **kwargs)


def cudnn_batch_prefill_with_kv_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                                      workspace_buffer: torch.Tensor, *, max_token_per_sequence: int,
                                      max_sequence_kv: int, actual_seq_lens_q: torch.Tensor,
                                      actual_seq_lens_kv: torch.Tensor, block_tables: torch.Tensor | None = None,
                                      causal: bool, return_lse: bool, batch_offsets_q=None, batch_offsets_o=None,
                                      batch_offsets_k=None, batch_offsets_v=None, batch_offsets_stats=None,
                                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                                      is_cuda_graph_compatible: bool = False, backend: str | None = None):
    """Batch prefill through cuDNN (FlashInfer signature), with no device->host synchronisation.

    ``q`` ``[total_q, num_qo_heads, head_dim]`` holds the requests' rows one after the other
    (``actual_seq_lens_q`` ``[batch, 1, 1, 1]`` or ``[batch]`` int32 on q's device); with
    ``block_tables`` ``[batch, max_pages]`` int32 the caches are HND ``[pages, num_kv_heads,
    page_size, head_dim]``, without they are ragged ``[total_kv, num_kv_heads, head_dim]`` packed
    by ``actual_seq_lens_kv`` the same way. ``causal`` aligns the diagonal bottom-right (row i of a
    request sees keys j <= i + kv_len - qo_len). Returns ``(out [total_q, num_qo_heads, head_dim_vo],
    lse [total_q, num_qo_heads] base 2 or None)``; rows that see no key get 0 and lse -inf.

    ``batch_offsets_q/o/stats`` (and, for ragged k/v, ``batch_offsets_k/v``), ``[batch + 1]`` int32
    element offsets, place each request's rows in q/out/lse (k/v) instead of packing them; out and
    lse then may have any number of rows. ``max_token_per_sequence`` and ``max_sequence_kv`` (host
    ints) pick the cuDNN graph bucket with the batch size. The caller guarantees, as with FlashInfer,
    what only the device values could show: lengths within those maxima, the packed lengths adding
    up to at most the rows of their tensors (rows past them are not written), pages in use within
    the cache, offsets non-decreasing multiples of the row stride inside their tensors. Set
    FLASHDISPATCH_CHECK_INPUTS=1 to have every call read and check them.

    ``is_cuda_graph_compatible=True`` builds graphs for CUDA-graph replay; any call can be captured
    once its bucket (batch, max_token_per_sequence and max pages rounded up to powers of two) and
    tensor layout ran once eagerly. ``backend`` ``None``/``"cudnn"``/``"cubin"`` (FlashInfer's
    cuDNN flavours; `dispatch.entry_paths.selects_cudnn_direct`) run this path; another backend
    name runs the same attention through the dispatcher, which reads the lengths on the host.
    """
    if selects_cudnn_direct(backend):
        offsets = dict(q=batch_offsets_q, o=batch_offsets_o, k=batch_offsets_k, v=batch_offsets_v,
                       stats=batch_offsets_stats)
        return cudnn_direct.batch_prefill(
            q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence=max_token_per_sequence,
            max_sequence_kv=max_sequence_kv, actual_seq_lens_q=actual_seq_lens_q,
            actual_seq_lens_kv=actual_seq_lens_kv, block_tables=block_tables, causal=causal, return_lse=return_lse,
            batch_offsets=offsets, out=out, lse=lse, cuda_graph=bool(is_cuda_graph_compatible))
    if is_cuda_graph_compatible:
        raise Unsupported(f"is_cuda_graph_compatible=True with backend={backend!r}: that path reads the lengths on "
                          "the host at every call; use backend=None (cuDNN) or a wrapper with use_cuda_graph=True")
    if any(t is not None for t in (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v,
                                   batch_offsets_stats)):
        raise Unsupported(f"batch_offsets_* with backend={backend!r}: only the cuDNN path (backend=None) takes them")
    return _prefill_through_dispatch(q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence,
                                     max_sequence_kv, actual_seq_lens_q, actual_seq_lens_kv, block_tables, causal,
                                     return_lse, out, lse, backend)


def _prefill_through_dispatch(q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence, max_sequence_kv,
                              actual_seq_lens_q, actual_seq_lens_kv, block_tables, causal, return_lse, out, lse,
                              backend):
    """`cudnn_batch_prefill_with_kv_cache` through the dispatcher (lengths read on the host)."""
    checks.check_tensor(q, "q", ndim=3)
    checks.check_positive_int(max_token_per_sequence, "max_token_per_sequence")
    checks.check_positive_int(max_sequence_kv, "max_sequence_kv")
    for name, t in (("actual_seq_lens_q", actual_seq_lens_q), ("actual_seq_lens_kv", actual_seq_lens_kv)):
        checks.check_tensor(t, name, dtypes=(torch.int32,), device=q.device)
    batch = actual_seq_lens_q.numel()
    q_lens = torch.from_numpy(host_seq_lens(actual_seq_lens_q, "actual_seq_lens_q", batch, "{batch} requests"))
    kv_lens = torch.from_numpy(host_seq_lens(actual_seq_lens_kv, "actual_seq_lens_kv", batch,
                                             "actual_seq_lens_q has {batch}"))
    qo_indptr_h = torch.zeros(q_lens.numel() + 1, dtype=torch.int64)
    qo_indptr_h[1:] = torch.cumsum(q_lens, 0)
    if q_lens.numel() and int(q_lens.max()) > max_token_per_sequence:
        raise ValueError(f"actual_seq_lens_q holds {int(q_lens.max())} > "
                         f"max_token_per_sequence={max_token_per_sequence}")
    if kv_lens.numel() and int(kv_lens.max()) > max_sequence_kv:
        raise ValueError(f"actual_seq_lens_kv holds {int(kv_lens.max())} > max_sequence_kv={max_sequence_kv}")
    if block_tables is not None:
        cudnn_direct.paged_cache(q, k_cache, v_cache, block_tables, max_sequence_kv)
        result = paged_attention_from_block_tables(
            q, PagedKV(k_cache, v_cache, "HND"), block_tables, actual_seq_lens_kv, qo_indptr_h=qo_indptr_h,
            bmm1_scale=scale, bmm2_scale=1.0, window_left=-1, out=out, out_dtype=None, sinks=None,
            backend=backend, causal=causal, workspace_buffer=workspace_buffer, return_lse=return_lse, lse=lse,
            op="prefill_paged")
    else:
        checks.check_tensor(k_cache, "k_cache", ndim=3, device=q.device)
        checks.check_tensor(v_cache, "v_cache", ndim=3, device=q.device)
        kv_indptr = torch.zeros(kv_lens.numel() + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(kv_lens, 0)
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace_buffer, "NHD", backend=backend)
        wrapper.plan(qo_indptr_h.to(device=q.device, dtype=torch.int32), kv_indptr.to(q.device), q.shape[1],
                     k_cache.shape[1], q.shape[2], v_cache.shape[2], causal=causal, sm_scale=scale,
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        result = wrapper.run(q, k_cache, v_cache, out=out, lse=lse, return_lse=return_lse)
    return result if return_lse else (result, None)


def trtllm_batch_context_with_kv_cache(query: torch.Tensor, kv_cache, workspace_buffer: torch.Tensor,
                                       block_tables: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int,
                                       max_kv_len: int, bmm1_scale, bmm2_scale, batch_size: int,
                                       cum_seq_lens_q: torch.Tensor, cum_seq_lens_kv: torch.Tensor,
                                       window_left: int = -1, out=None, out_dtype=None, o_sf_scale=None,
                                       o_sf_vec_size=None, kv_layout: str = "HND", enable_pdl=None, sinks=None,
                                       backend: str = "auto"):
    """TensorRT-LLM style causal context (prefill) attention over a paged cache (FlashInfer signature).

    ``query`` ``[total_q, num_qo_heads, head_dim]`` packed by ``cum_seq_lens_q`` ``[batch+1]``;
    ``kv_cache`` a (k, v) tuple or 5-D ``[pages, 2, ...]`` in ``kv_layout`` (default HND);
    ``block_tables`` ``[batch, max_pages]``; ``seq_lens`` ``[batch]`` KV lengths. ``bmm1_scale`` is
    the whole softmax scale, ``bmm2_scale`` the output scale. nvfp4 output is not supported.
    """
    if out_dtype == "nvfp4" or o_sf_scale is not None or o_sf_vec_size is not None:
        raise Unsupported("nvfp4 output (out_dtype='nvfp4', o_sf_scale, o_sf_vec_size) is not supported")
    checks.check_positive_int(batch_size, "batch_size")
    checks.check_positive_int(max_q_len, "max_q_len")  # (the longest of cum_seq_lens_q's lengths)
    checks.check_positive_int(max_kv_len, "max_kv_len")
    if cum_seq_lens_kv is not None:  # (not read: seq_lens gives the KV lengths)
        checks.check_tensor(cum_seq_lens_kv, "cum_seq_lens_kv", ndim=1, dtypes=(torch.int32,), shape=(batch_size + 1,))
    kv = _split_kv_cache(kv_cache, checks.check_layout(kv_layout))
    qo_indptr_h = checks.host_indptr(cum_seq_lens_q, "cum_seq_lens_q", batch_size + 1)
    longest_q = int((qo_indptr_h[1:] - qo_indptr_h[:-1]).max())
    if longest_q > max_q_len:
        raise ValueError(f"cum_seq_lens_q holds a request of {longest_q} query tokens, above max_q_len={max_q_len}")
    return paged_attention_from_block_tables(
        query, kv, block_tables, seq_lens, qo_indptr_h=qo_indptr_h,
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, window_left=window_left, out=out, out_dtype=out_dtype,
        sinks=sinks, backend=backend, causal=True, workspace_buffer=workspace_buffer, op="prefill_paged")
