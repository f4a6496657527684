"""trtllm-gen: TensorRT-LLM's generated attention kernels (decode, paged context, MLA) on
Blackwell (sm100/sm103), through the ``tensorrt_llm`` package (pip: tensorrt-llm).

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch does not call tensorrt_llm yet, so it is never available and
never computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ...dispatch.reasons import Reason
from ..base import Backend, package_version

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


class TrtllmGenBackend(Backend):
    name = "trtllm-gen"
    packages = ("tensorrt_llm",)
    extra = "trtllm"
    caps = {"decode": DECODE_CAPS, "prefill_paged": CONTEXT_CAPS, "mla": MLA_CAPS}

    @classmethod
    def _availability(cls) -> list[Reason]:
        reasons = []
        if not torch.cuda.is_available():
            reasons.append(Reason("device", "no CUDA device", "trtllm-gen needs an sm100 GPU"))
        reasons.append(Reason("not_implemented", "flashdispatch does not call tensorrt_llm's kernels yet",
                              "use fa2 or cudnn"))
        return reasons

    @classmethod
    def version(cls) -> str | None:
        v = package_version("tensorrt-llm")
        return f"tensorrt-llm {v}" if v else None


BACKEND = TrtllmGenBackend
