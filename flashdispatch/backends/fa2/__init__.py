"""fa2: our Triton kernels (split-KV paged decode, FlashAttention-2 style prefill, state merge).

Runs on CUDA GPUs from sm80 on; on the CPU only under TRITON_INTERPRET=1 (tests).
Each module declares the `Caps` of its op; this class routes plan()/run() to them.
"""
from __future__ import annotations

import torch

from ...dispatch.reasons import Reason
from ..common import TRITON_INTERPRETED
from ..base import AttentionInputs, AttentionParams, Backend, MergeInputs, package_version
from .decode import DECODE_CAPS, plan_decode
from .merge import MERGE_CAPS, merge_states
from .prefill import PREFILL_CAPS, plan_prefill, prefill_extra_checks

class FA2Backend(Backend):
    name = "fa2"
    packages = ("triton",)
    caps = {
        "decode": DECODE_CAPS,
        "prefill_paged": PREFILL_CAPS,
        "prefill_ragged": PREFILL_CAPS,
        "merge": MERGE_CAPS,
    }

    @classmethod
    def _availability(cls) -> list[Reason]:
        if not torch.cuda.is_available() and not TRITON_INTERPRETED:
            return [Reason("device", "no CUDA device", "fa2 runs on the CPU only under TRITON_INTERPRET=1 (tests)")]
        return []

    @classmethod
    def extra_checks(cls, problem, device) -> list[Reason]:
        reasons = []
        if problem.kv_dtype == torch.float8_e4m3fn and device.cc is not None and device.cc < (8, 9):
            reasons.append(Reason("dtype.fp8", f"float8_e4m3fn KV on sm_{device.cc[0]}{device.cc[1]}: Triton "
                                  "converts e4m3 from sm_89 on only", "use float8_e5m2 KV or another backend"))
        if problem.op in ("prefill_paged", "prefill_ragged"):
            reasons += prefill_extra_checks(problem, device)
        return reasons

    @classmethod
    def version(cls) -> str | None:
        v = package_version("triton")
        return f"triton {v}" if v else None

    def plan(self, problem, device, params: AttentionParams):
        if problem.op == "decode":
            return plan_decode(problem, device, params)
        return plan_prefill(problem, device, params)

    def replan_mask(self, plan, problem, device, params: AttentionParams):
        """Prefill: the tile lists are rebuilt from the new mask on the device (no host work)."""
        if problem.op == "decode":
            return super().replan_mask(plan, problem, device, params)
        plan.refresh_tile_lists()
        return plan

    def run(self, plan, inputs: AttentionInputs) -> None:
        plan.run(inputs)

    def merge_states(self, inputs: MergeInputs) -> None:
        merge_states(inputs)


BACKEND = FA2Backend
