"""flashdispatch: FlashInfer's attention API over many engines, with an explainable registry.

``import flashdispatch as flashinfer`` runs code written against FlashInfer's attention API.
`explain`, `select_backend`, `use_backends` and `load_config` expose the dispatch.
"""
from __future__ import annotations

from . import cascade, decode, mla, page, prefill, quantization, utils  # noqa: F401  (flashinfer.decode, ...)
from .cascade import (BatchDecodeWithSharedPrefixPagedKVCacheWrapper, BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
                      MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states)
from .decode import (BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                     cudnn_batch_decode_with_kv_cache, single_decode_with_kv_cache,
                     trtllm_batch_decode_with_kv_cache)
from .dispatch.policy import load_config
from .dispatch.problem import Device, Problem, Workload
from .dispatch.reasons import Reason, Unsupported
from .dispatch.select import Decision, use_backends
from .mla import BatchMLAPagedAttentionWrapper, trtllm_batch_decode_with_kv_cache_mla
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                      cudnn_batch_prefill_with_kv_cache, single_prefill_with_kv_cache,
                      single_prefill_with_kv_cache_return_lse, trtllm_batch_context_with_kv_cache)
from .quantization import packbits, segment_packbits
from .selection import explain, select_backend
from .xqa import xqa, xqa_mla

__version__ = "0.1.0"

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
    "single_decode_with_kv_cache", "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
    "cudnn_batch_decode_with_kv_cache", "cudnn_batch_prefill_with_kv_cache", "trtllm_batch_decode_with_kv_cache",
    "trtllm_batch_context_with_kv_cache", "trtllm_batch_decode_with_kv_cache_mla", "xqa", "xqa_mla",
    "MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper", "merge_state", "merge_state_in_place", "merge_states",
    "packbits", "segment_packbits", "get_seq_lens",
    "get_batch_indices_positions", "append_paged_kv_cache", "explain", "select_backend", "use_backends",
    "load_config", "Problem", "Device", "Workload", "Decision", "Reason", "Unsupported",
]
