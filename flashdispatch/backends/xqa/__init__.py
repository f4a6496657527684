"""xqa: XQA-style GQA decode kernels (one query-head group per CTA, attention sinks, fp8 KV,
speculative-decoding masks), sm80+; the engine behind xqa() and trtllm_* decode.

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch has no xqa kernels yet, so it is never available and never
computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ..base import KernelLessBackend

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


class XQABackend(KernelLessBackend):
    name = "xqa"
    packages = ("triton",)
    caps = DECODE_CAPS
    device_hint = "an sm80+ GPU"
    missing = "flashdispatch has no xqa kernels yet"
    alternative = "use fa2 or cudnn for decode"
    version_dist = "triton"


BACKEND = XQABackend
