"""fa3: Hopper-tuned Triton kernels (TMA, warp specialization) for prefill and MLA, sm90+.

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch has no fa3 kernels yet, so it is never available and never
computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ..base import KernelLessBackend

_HALF = frozenset({torch.float16, torch.bfloat16})

PREFILL_CAPS = Caps(
    ops=frozenset({"prefill_paged", "prefill_ragged"}),
    min_cc=(9, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF,
    o_dtypes=_HALF,
    head_dims=frozenset({(64, 64), (128, 128), (256, 256), (192, 128)}),
    features=frozenset({"causal", "sliding_window", "soft_cap", "lse", "cuda_graph"}),
)

MLA_CAPS = Caps(
    ops=frozenset({"mla"}),
    min_cc=(9, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF,
    o_dtypes=_HALF,
    head_dims=frozenset({(512, 64)}),
    features=frozenset({"causal", "lse", "cuda_graph"}),
)


class FA3Backend(KernelLessBackend):
    name = "fa3"
    packages = ("triton",)
    caps = {"prefill_paged": PREFILL_CAPS, "prefill_ragged": PREFILL_CAPS, "mla": MLA_CAPS}
    device_hint = "an sm90+ GPU"
    missing = "flashdispatch has no fa3 kernels yet"
    alternative = "use cudnn or fa2 for prefill, fa2 for MLA"
    version_dist = "triton"


BACKEND = FA3Backend
