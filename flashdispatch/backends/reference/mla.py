"""Reference MLA (paged, matrix-absorbed): one latent KV head shared by every query head.

s = (q_nope . ckv_j + q_pe . kpe_j) * sm_scale, out = softmax(s) @ ckv (times v_scale); causal is
bottom-right aligned. Computed by `attention.attend` with keys ckv|kpe and values ckv.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...dispatch.problem import Problem
from ..base import MLAInputs, MLAParams
from .attention import attend, scale_value, write_block, zero_missing_keys
from .layout import BatchShape, KVGroup, Visibility, gather_keys, plan_groups


@dataclass
class MLAPlan:
    problem: Problem
    groups: list[KVGroup]
    sm_scale: float

    def run(self, inputs: MLAInputs) -> None:
        v_scale = scale_value(inputs.v_scale, inputs.q_nope.device)
        for group in self.groups:
            index = group.token_index()
            ckv = zero_missing_keys(gather_keys(inputs.ckv_cache, group, index, "NHD"), group)
            kpe = gather_keys(inputs.kpe_cache, group, index, "NHD")
            k = torch.cat([ckv, kpe], -1).unsqueeze(2)
            v = ckv.unsqueeze(2)
            for block in group.row_blocks():
                q = torch.cat([inputs.q_nope[block.rows], inputs.q_pe[block.rows]], -1).to(torch.float32)
                o, lse_b = attend(q, k, v, block.visible, self.sm_scale)
                write_block(block, o, lse_b, inputs.out, inputs.lse, v_scale)


def plan_mla(problem: Problem, params: MLAParams) -> MLAPlan:
    """Plan MLA on the device of ``params.kv_indptr``; pages of ``problem.page_size`` tokens."""
    shape = BatchShape(
        qo_lens=list(params.qo_lens_host), kv_lens=list(params.kv_lens_host), kv_indptr=params.kv_indptr,
        kv_indices=params.kv_indices, page_size=problem.page_size, num_qo_heads=problem.num_qo_heads,
        kv_elems_per_token=problem.head_dim_qk + problem.head_dim_vo)
    groups = plan_groups(shape, params.kv_indptr.device, Visibility(params.causal, -1))
    return MLAPlan(problem, groups, params.sm_scale)
