"""xqa: XQA-style GQA decode kernels (one query-head group per CTA, attention sinks, fp8 KV,
speculative-decoding masks), sm80+; the engine behind xqa() and trtllm_* decode.

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch has no xqa kernels yet, so it is never available and never
computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ...dispatch.reasons import Reason
from ..base import Backend, package_version

_HALF = frozenset({torch.float16, torch.bfloat16})

DECODE_CAPS = Caps(
    ops=frozenset({"decode"}),
    min_cc=(8, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF | {torch.float8_e4m3fn},
    o_dtypes=_HALF,
    head_dims=frozenset({(64, 64), (128, 128), (256, 256)}),
    page_sizes=frozenset({16, 32, 64, 128}),
    features=frozenset({"sliding_window", "sinks", "fp8_kv", "spec_decode", "q_len_per_req", "cuda_graph"}),
    max_q_len_per_req=16,
)


class XQABackend(Backend):
    name = "xqa"
    packages = ("triton",)
    caps = DECODE_CAPS

    @classmethod
    def _availability(cls) -> list[Reason]:
        reasons = []
        if not torch.cuda.is_available():
            reasons.append(Reason("device", "no CUDA device", "xqa needs an sm80+ GPU"))
        reasons.append(Reason("not_implemented", "flashdispatch has no xqa kernels yet",
                              "use fa2 or cudnn for decode"))
        return reasons

    @classmethod
    def version(cls) -> str | None:
        v = package_version("triton")
        return f"triton {v}" if v else None


BACKEND = XQABackend
