"""trtllm-gen: TensorRT-LLM's generated attention kernels (decode, paged context, MLA) on
Blackwell (sm100/sm103), through the ``tensorrt_llm`` package (pip: tensorrt-llm).

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch does not call tensorrt_llm yet, so it is never available and
never computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ..base import KernelLessBackend

_HALF = frozenset({torch.float16, torch.bfloat16})
_FP8 = frozenset({torch.float8_e4m3fn})
_BLACKWELL = {"min_cc": (10, 0), "max_cc": (10, 3)}

DECODE_CAPS = Caps(
    ops=frozenset({"decode"}),
    q_dtypes=_HALF | _FP8,
    kv_dtypes=_HALF | _FP8,
    o_dtypes=_HALF,
    head_dims=frozenset({(64, 64), (128, 128), (256, 256)}),
    page_sizes=frozenset({16, 32, 64}),
    layouts=frozenset({"HND"}),
    features=frozenset({"sliding_window", "sinks", "fp8_kv", "q_len_per_req", "cuda_graph"}),
    max_q_len_per_req=16,
    **_BLACKWELL,
)

CONTEXT_CAPS = Caps(
    ops=frozenset({"prefill_paged"}),
    q_dtypes=_HALF | _FP8,
    kv_dtypes=_HALF | _FP8,
    o_dtypes=_HALF,
    head_dims=frozenset({(64, 64), (128, 128), (256, 256)}),
    page_sizes=frozenset({16, 32, 64}),
    layouts=frozenset({"HND"}),
    features=frozenset({"causal", "sliding_window", "sinks", "fp8_kv", "cuda_graph"}),
    **_BLACKWELL,
)

MLA_CAPS = Caps(
    ops=frozenset({"mla"}),
    q_dtypes=frozenset({torch.bfloat16}) | _FP8,
    kv_dtypes=frozenset({torch.bfloat16}) | _FP8,
    o_dtypes=frozenset({torch.bfloat16}),
    head_dims=frozenset({(512, 64)}),
    page_sizes=frozenset({32, 64}),
    features=frozenset({"fp8_kv", "cuda_graph"}),
    **_BLACKWELL,
)


class TrtllmGenBackend(KernelLessBackend):
    name = "trtllm-gen"
    packages = ("tensorrt_llm",)
    extra = "trtllm"
    caps = {"decode": DECODE_CAPS, "prefill_paged": CONTEXT_CAPS, "mla": MLA_CAPS}
    device_hint = "an sm100 GPU"
    missing = "flashdispatch does not call tensorrt_llm's kernels yet"
    alternative = "use fa2 or cudnn"
    version_dist = "tensorrt-llm"


BACKEND = TrtllmGenBackend
