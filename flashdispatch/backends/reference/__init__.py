"""reference: pure PyTorch, float32 math, every op and feature; the ground truth of every test.

Runs on CPU and CUDA tensors. Slow by design but batched (no loop over tokens): requests are
grouped into padded blocks under a memory budget (see `layout`).
"""
from __future__ import annotations

import torch

from ...dispatch.caps import ALL_FEATURES, Caps
from ...dispatch.problem import FP8_DTYPES, Device, Problem
from ...dispatch.reasons import Reason
from ..base import AttentionParams, Backend, MergeInputs, MLAParams, package_version
from .attention import plan_attention
from .merge import merge_states
from .mla import plan_mla

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
_DEVICES = frozenset({"cpu", "cuda"})
_MAX_Q_LEN = 1 << 16


def _caps(op: str, q_dtypes: frozenset, features: frozenset) -> Caps:
    return Caps(ops=frozenset({op}), device_types=_DEVICES, q_dtypes=q_dtypes,
                kv_dtypes=_FLOATS | frozenset(FP8_DTYPES), o_dtypes=_FLOATS, features=features,
                max_q_len_per_req=_MAX_Q_LEN)


# MLA's contract (MLAParams/MLAInputs) carries no custom mask, sinks or RoPE tables, and its
# problems no window, soft cap or ALiBi: only the features it can be asked for are declared.
_MLA_FEATURES = frozenset({"causal", "lse", "cuda_graph", "fp8_kv", "q_len_per_req"})


class ReferenceBackend(Backend):
    name = "reference"
    caps = {
        "decode": _caps("decode", _FLOATS | frozenset(FP8_DTYPES), ALL_FEATURES),
        "prefill_paged": _caps("prefill_paged", _FLOATS, ALL_FEATURES),
        "prefill_ragged": _caps("prefill_ragged", _FLOATS, ALL_FEATURES),
        "mla": _caps("mla", _FLOATS | frozenset(FP8_DTYPES), _MLA_FEATURES),
        "merge": Caps(ops=frozenset({"merge"}), device_types=_DEVICES, features=ALL_FEATURES,
                      max_q_len_per_req=_MAX_Q_LEN),
    }

    @classmethod
    def version(cls) -> str | None:
        v = package_version("torch")
        return f"torch {v}" if v else None

    @classmethod
    def extra_checks(cls, problem: Problem, device: Device) -> list[Reason]:
        reasons = []
        if problem.pos_encoding_mode == "ROPE_LLAMA" and problem.head_dim_qk % 2:
            reasons.append(Reason("head_dim", f"head_dim_qk={problem.head_dim_qk} is odd: "
                                              "rotate-half RoPE needs an even head_dim_qk"))
        if problem.use_cuda_graph and device.is_cuda:
            reasons.append(Reason("feature.cuda_graph", "the reference's run() sizes its tensors from the plan's "
                                  "lengths, so a graph captured on one plan would replay it after a re-plan",
                                  "use fa2 or cudnn for CUDA graphs"))
        if problem.num_qo_heads % problem.num_kv_heads:
            reasons.append(Reason("heads", f"num_qo_heads={problem.num_qo_heads} is not a multiple of "
                                           f"num_kv_heads={problem.num_kv_heads}"))
        return reasons

    def plan(self, problem: Problem, device: Device, params: AttentionParams | MLAParams):
        if problem.op == "mla":
            return plan_mla(problem, params)
        return plan_attention(problem, params)

    def run(self, plan, inputs) -> None:
        plan.run(inputs)

    def merge_states(self, inputs: MergeInputs) -> None:
        merge_states(inputs)


BACKEND = ReferenceBackend
