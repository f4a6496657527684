"""cutlass: CUTLASS MLA decode kernels for Blackwell (sm100/sm103), through the ``cutlass``
package of nvidia-cutlass-dsl.

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch does not call CUTLASS yet, so it is never available and never
computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ..base import KernelLessBackend

_HALF = frozenset({torch.float16, torch.bfloat16})

MLA_CAPS = Caps(
    ops=frozenset({"mla"}),
    min_cc=(10, 0),
    max_cc=(10, 3),
    q_dtypes=_HALF,
    kv_dtypes=_HALF,
    o_dtypes=_HALF,
    head_dims=frozenset({(512, 64)}),
    page_sizes=frozenset({128}),  # the kernel reads KV in 128-token pages
    features=frozenset({"lse", "cuda_graph"}),
)


class CutlassBackend(KernelLessBackend):
    name = "cutlass"
    packages = ("cutlass",)
    caps = MLA_CAPS
    device_hint = "an sm100 GPU"
    missing = "flashdispatch does not call CUTLASS MLA kernels yet"
    alternative = "use fa2 for MLA"
    version_dist = "nvidia-cutlass-dsl"


BACKEND = CutlassBackend
