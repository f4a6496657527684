"""fa2: our Triton kernels (split-KV paged decode, FlashAttention-2 style prefill, MLA, state merge).

Runs on CUDA GPUs from sm80 on; on the CPU only under TRITON_INTERPRET=1 (tests).
Each module declares the `Caps` of its op; this class routes plan()/run() to them.
"""
from __future__ import annotations

import torch

from ...dispatch.reasons import Reason
from ..common import TRITON_INTERPRETED
from ..base import AttentionInputs, AttentionParams, Backend, MergeInputs, package_version
from .decode import DECODE_CAPS, decode_extra_checks, plan_decode
from .merge import MERGE_CAPS, merge_states
from .mla import MLA_CAPS, mla_extra_checks, plan_mla
from .prefill import PREFILL_CAPS, plan_prefill, prefill_extra_checks

class FA2Backend(Backend):
    name = "fa2"
    packages = ("triton",)
    caps = {
        "decode": DECODE_CAPS,
        "prefill_paged": PREFILL_CAPS,
        "prefill_ragged": PREFILL_CAPS,
        "mla": MLA_CAPS,
        "merge": MERGE_CAPS,
    }

    @classmethod
    def _availability(cls) -> list[Reason]:
        if not torch.cuda.is_available() and not TRITON_INTERPRETED:
            return [Reason("device", "no CUDA device", "fa2 runs on the CPU only under TRITON_INTERPRET=1 (tests)")]
        return []

    @classmethod
    def extra_checks(cls, problem, device) -> list[Reason]:
        if problem.op in ("prefill_paged", "prefill_ragged"):
            return prefill_extra_checks(problem, device)
        if problem.op == "decode":
            return decode_extra_checks(problem, device)
        if problem.op == "mla":
            return mla_extra_checks(problem, device)
        return []

    @classmethod
    def version(cls) -> str | None:
        v = package_version("triton")
        return f"triton {v}" if v else None

    @classmethod
    def clamps_page_indices(cls, problem) -> bool:
        """Decode and paged prefill: their kernels clamp each page index to the cache's pages
        (paged prefill in the plans whose indices plan() has not checked, and under CUDA graphs:
        `PrefillPlan.clamp_pages`, the only ones a deferred check concerns)."""
        return problem.op in ("decode", "prefill_paged")

    @classmethod
    def reads_block_tables(cls, problem) -> bool:
        """Decode: the kernel reads seq_lens and the block table itself (`DecodePlan._place_table`)."""
        return problem.op == "decode"

    def plan(self, problem, device, params: AttentionParams):
        if problem.op == "decode":
            return plan_decode(problem, device, params)
        if problem.op == "mla":
            return plan_mla(problem, device, params)
        return plan_prefill(problem, device, params)

    def replan(self, plan, problem, device, params: AttentionParams):
        """Decode: the plan with the new tables when it reads them directly and keeps its layout
        (`DecodePlan.refreshed`)."""
        return plan.refreshed(device, params) if problem.op == "decode" else None

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
