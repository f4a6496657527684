"""XQA entry points (FlashInfer's ``flashinfer.xqa``): ``xqa`` and ``xqa_mla``.

They write into ``output`` in place. The backend is chosen by the registry like every other op
(the ``xqa`` backend when its kernels are available, else the fastest that can run the problem).
"""
from __future__ import annotations

import math

import torch

from . import checks
from .backends.base import PagedKV
from .block_table_plan import check_queries_fit
from .page import host_seq_lens
from .quantization import segment_packbits

_OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def spec_mask_to_custom(mask: torch.Tensor, qo_indptr_h: torch.Tensor, seq_lens: torch.Tensor, name: str = "mask"):
    """Turn the xqa speculative-decoding mask ``[batch, q_len, ceil(q_len/32)*2]`` (uint16 words,
    bit j of row i set: draft query i sees draft token j) into a packed custom mask over the whole
    KV (every key before the draft tokens is visible). Returns (packed uint8, byte mask_indptr)."""
    batch = qo_indptr_h.numel() - 1
    q_lens = (qo_indptr_h[1:] - qo_indptr_h[:-1])
    if batch == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32)
    q_len = int(q_lens.max())
    words = ((q_len + 31) // 32) * 2
    checks.check_tensor(mask, name, ndim=3, dtypes=(torch.uint16, torch.int16), shape=(batch, q_len, words))
    bits = mask.detach().to("cpu").view(torch.int16).to(torch.int32) & 0xFFFF
    j = torch.arange(q_len)
    draft = ((bits[:, :, j // 16] >> (j % 16)) & 1).bool()  # [batch, q_len, q_len]
    kv_lens = torch.from_numpy(host_seq_lens(seq_lens, "seq_lens", batch, "the queries hold {batch} requests"))
    check_queries_fit(q_lens.numpy(), kv_lens.numpy())
    rows = []
    for b in range(batch):
        ql, kl = int(q_lens[b]), int(kv_lens[b])
        full = torch.ones(ql, kl, dtype=torch.bool)
        full[:, kl - ql:] = draft[b, :ql, :ql]
        rows.append(full.reshape(-1))
    flat = torch.cat(rows)
    bit_indptr = torch.zeros(batch + 1, dtype=torch.int64)
    bit_indptr[1:] = torch.cumsum(q_lens * kv_lens, 0)
    return segment_packbits(flat, bit_indptr, bitorder="little")


def _scale(value, name: str, device: torch.device):
    """A q/kv/output scale: a 1-element tensor on ``device`` as it is (read by the kernels), else a
    checked float > 0."""
    if isinstance(value, torch.Tensor):
        return checks.check_run_scale(value, name, device)
    return checks.check_scale(value, name, 1.0)


def _kv_views(k_cache, v_cache, kv_layout):
    checks.check_layout(kv_layout)
    checks.check_tensor(k_cache, "k_cache", ndim=4)
    checks.check_tensor(v_cache, "v_cache", ndim=4, dtypes=(k_cache.dtype,), device=k_cache.device,
                        shape=list(k_cache.shape[:3]) + [None])  # (pages, tokens and heads: K's)
    return k_cache, v_cache


def xqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
        seq_lens: torch.Tensor, output: torch.Tensor, workspace_buffer: torch.Tensor, semaphores: torch.Tensor,
        num_kv_heads: int, page_size: int, sinks: torch.Tensor | None = None, q_scale=1.0, kv_scale=1.0,
        sliding_win_size: int = 0, kv_layout: str = "NHD", sm_count: int | None = None,
        enable_pdl: bool | None = None, rcp_out_scale: float = 1.0, q_seq_len: int = 1,
        mask: torch.Tensor | None = None) -> None:
    """GQA decode over a paged cache, XQA style; writes ``output`` in place.

    ``q`` ``[batch, beam_width=1, num_q_heads, head_dim]`` (or ``[batch, 1, q_seq_len, num_q_heads,
    head_dim]`` for speculative decoding); caches ``[pages, page_size, kv_heads, dim]`` (NHD) or
    ``[pages, kv_heads, page_size, dim]`` (HND); ``page_table`` ``[batch, pages_per_seq]`` int32;
    ``seq_lens`` ``[batch, 1]`` uint32/int32. Softmax scale = q_scale x kv_scale / sqrt(head_dim);
    the output is scaled by kv_scale x rcp_out_scale. ``sinks`` ``[num_kv_heads, group]`` float32.
    ``sliding_win_size`` w > 0 keeps the last w keys. ``mask``: see `spec_mask_to_custom`.
    ``semaphores``, ``sm_count`` and ``enable_pdl`` are launch resources/hints of the CUDA kernel.
    Without ``mask`` on a backend that reads the block table itself (fa2) the call reads nothing
    back from the GPU, as `trtllm_batch_decode_with_kv_cache` (its plan sized for the table's rows).
    """
    from .decode import paged_attention_from_block_tables

    checks.check_tensor(q, "q")
    checks.check_positive_int(q_seq_len, "q_seq_len", high=checks.MAX_KV_TOKENS)
    if q.dim() == 4:
        if q.shape[1] != 1:
            raise ValueError(f"q beam_width={q.shape[1]}: only beam_width 1 is supported")
        q_seq_len_found, query = 1, q[:, 0]
    elif q.dim() == 5:
        if q.shape[1] != 1:
            raise ValueError(f"q beam_width={q.shape[1]}: only beam_width 1 is supported")
        q_seq_len_found, query = q.shape[2], q[:, 0].reshape(-1, q.shape[3], q.shape[4])
    else:
        raise ValueError(f"q must be [batch, 1, heads, dim] or [batch, 1, q_seq_len, heads, dim], got {list(q.shape)}")
    if q_seq_len_found != q_seq_len:
        raise ValueError(f"q holds {q_seq_len_found} query tokens per request, but q_seq_len={q_seq_len}")
    checks.check_tensor(output, "output", shape=list(q.shape), device=q.device, dtypes=_OUTPUT_DTYPES)
    checks.check_distinct_elements(output, "output")
    k_cache, v_cache = _kv_views(k_cache, v_cache, kv_layout)
    found = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    found_page = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    if found != num_kv_heads or found_page != page_size:
        raise ValueError(f"k_cache {list(k_cache.shape)} ({kv_layout}) has kv_heads={found}, page_size={found_page}; "
                         f"expected num_kv_heads={num_kv_heads}, page_size={page_size}")
    if isinstance(sliding_win_size, bool) or not isinstance(sliding_win_size, int) or sliding_win_size < 0:
        raise ValueError(f"sliding_win_size={sliding_win_size!r} must be an int >= 0 (0 disables it)")
    batch = checks.check_tensor(page_table, "page_table", ndim=2).shape[0]
    seq_lens = seq_lens.reshape(-1) if isinstance(seq_lens, torch.Tensor) else seq_lens  # ([batch, 1])
    packed = mask_indptr = None
    if mask is not None:
        qo_indptr_h = torch.arange(batch + 1, dtype=torch.int64) * q_seq_len
        packed, mask_indptr = spec_mask_to_custom(mask, qo_indptr_h, seq_lens, "mask")
    if sinks is not None:
        checks.check_tensor(sinks, "sinks", dtypes=(torch.float32,), device=q.device,
                            shape=(num_kv_heads, query.shape[1] // num_kv_heads))
        sinks = sinks.reshape(-1)
    q_scale, kv_scale = _scale(q_scale, "q_scale", q.device), _scale(kv_scale, "kv_scale", q.device)
    rcp_out_scale = _scale(rcp_out_scale, "rcp_out_scale", q.device)
    bmm1 = checks.scale_product(q_scale, kv_scale, "q_scale x kv_scale") / math.sqrt(q.shape[-1])
    bmm2 = checks.scale_product(kv_scale, rcp_out_scale, "kv_scale x rcp_out_scale")
    out = output.view(query.shape) if output.is_contiguous() else None  # (written in place)
    result = paged_attention_from_block_tables(
        query, PagedKV(k_cache, v_cache, kv_layout), page_table, seq_lens, q_len_per_req=q_seq_len,
        bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=sliding_win_size - 1 if sliding_win_size > 0 else -1,
        out=out, out_dtype=output.dtype, sinks=sinks, backend="auto", causal=q_seq_len > 1 and mask is None,
        workspace_buffer=workspace_buffer, packed_mask=packed, mask_indptr=mask_indptr,
        spec_decode_mask=mask is not None, table_name="page_table")
    if out is None:
        output.copy_(result.reshape(output.shape))


def xqa_mla(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, output: torch.Tensor, workspace_buffer: torch.Tensor, semaphores: torch.Tensor,
            page_size: int, q_scale=1.0, kv_scale=1.0, sm_count: int | None = None,
            enable_pdl: bool | None = None) -> None:
    """MLA decode (DeepSeek shapes) XQA style; writes ``output`` ``[batch, 1, heads, 512]`` in place.

    ``q`` ``[batch, 1, heads, 576]`` (ckv 512 + kpe 64, fp8 in FlashInfer; any supported dtype
    here); ``k_cache`` holds the 576-wide rows ``[pages, page_size, 576]`` (or
    ``[pages * page_size, 576]``) and ``v_cache`` their first 512 columns (it may be the same
    storage). Softmax scale = q_scale x kv_scale / sqrt(576); output scaled by kv_scale.
    """
    from .mla import mla_paged_decode

    checks.check_tensor(q, "q", ndim=4)
    if q.shape[1] != 1:
        raise ValueError(f"q beam_width={q.shape[1]}: only beam_width 1 is supported")
    checks.check_tensor(output, "output", ndim=4, device=q.device)
    checks.check_distinct_elements(output, "output")
    checks.check_tensor(k_cache, "k_cache")
    if k_cache.dim() == 2:
        k_cache = k_cache.reshape(-1, page_size, k_cache.shape[-1])
    checks.check_tensor(k_cache, "k_cache", ndim=3, shape=(None, page_size, q.shape[-1]))
    ckv_dim = output.shape[-1]
    q_scale, kv_scale = _scale(q_scale, "q_scale", q.device), _scale(kv_scale, "kv_scale", q.device)
    bmm1 = checks.scale_product(q_scale, kv_scale, "q_scale x kv_scale") / math.sqrt(q.shape[-1])
    query = q[:, 0]
    result = mla_paged_decode(query[..., :ckv_dim], query[..., ckv_dim:], k_cache[..., :ckv_dim],
                              k_cache[..., ckv_dim:], page_table, seq_lens.reshape(-1).to(torch.int32),
                              sm_scale=bmm1, v_scale=kv_scale, out_dtype=output.dtype,
                              workspace_buffer=workspace_buffer)
    output.copy_(result.reshape(output.shape))
