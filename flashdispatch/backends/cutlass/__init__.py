"""cutlass: CUTLASS MLA decode kernels for Blackwell (sm100/sm103), through the ``cutlass``
package of nvidia-cutlass-dsl.

Declared so that selection and explain() can name it and show what it will support; this
version of flashdispatch does not call CUTLASS yet, so it is never available and never
computes anything (plan() raises NotImplementedError).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import Caps
from ...dispatch.reasons import Reason
from ..base import Backend, package_version

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


class CutlassBackend(Backend):
    name = "cutlass"
    packages = ("cutlass",)
    caps = MLA_CAPS

    @classmethod
    def _availability(cls) -> list[Reason]:
        reasons = []
        if not torch.cuda.is_available():
            reasons.append(Reason("device", "no CUDA device", "cutlass MLA needs an sm100 GPU"))
        reasons.append(Reason("not_implemented", "flashdispatch does not call CUTLASS MLA kernels yet",
                              "use fa2 or fa3 for MLA"))
        return reasons

    @classmethod
    def version(cls) -> str | None:
        v = package_version("nvidia-cutlass-dsl")
        return f"nvidia-cutlass-dsl {v}" if v else None


BACKEND = CutlassBackend
