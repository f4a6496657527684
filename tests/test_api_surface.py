"""FlashInfer's names where FlashInfer code reaches them: module paths, aliases, properties."""
import importlib

import pytest
import torch

import flashdispatch as fi

WS = torch.empty(1 << 20, dtype=torch.uint8)


@pytest.mark.parametrize("module, names", [
    ("decode", ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
                "single_decode_with_kv_cache", "cudnn_batch_decode_with_kv_cache", "trtllm_batch_decode_with_kv_cache",
                "trtllm_batch_decode_with_kv_cache_mla", "xqa", "xqa_mla"]),
    ("prefill", ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                 "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"]),
    ("mla", ["BatchMLAPagedAttentionWrapper", "trtllm_batch_decode_with_kv_cache_mla"]),
    ("quantization", ["packbits", "segment_packbits"]),
    ("cascade", ["merge_state", "merge_state_in_place", "merge_states"]),
])
def test_module_paths_hold_the_top_level_objects(module, names):
    mod = importlib.import_module(f"flashdispatch.{module}")
    for name in names:
        assert getattr(mod, name) is getattr(fi, name), f"flashdispatch.{module}.{name}"


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_wrappers_report_their_constructor_flags(use_tensor_cores):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_tensor_cores=use_tensor_cores)
    assert w.use_tensor_cores is use_tensor_cores and w.is_cuda_graph_enabled is False
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), torch.ones(2, dtype=torch.int32)]
    g = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs, use_tensor_cores=use_tensor_cores)
    assert g.use_tensor_cores is use_tensor_cores and g.is_cuda_graph_enabled is True
