"""Reference attention: decode, paged and ragged prefill, in float32 with batched tensor ops.

`attend` is the whole semantics on one padded block; `AttentionPlan.run` feeds it the groups and
row blocks planned in `layout`, and writes the real rows into ``out``/``lse``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...dispatch.problem import Problem
from ..base import AttentionInputs, AttentionParams, PagedKV, Scale
from ..common import alibi_slopes
from .layout import BatchShape, KVGroup, RowBlock, Visibility, gather_keys, plan_groups, unpack_mask_bits
from .positions import alibi_bias, apply_rope, rope_inv_freq

LOG2E = 1.0 / math.log(2.0)


def scale_value(x: Scale, device: torch.device) -> float | torch.Tensor:
    """A scale as a float, or as a 0-d float32 tensor on ``device`` (no host sync)."""
    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(())
    return float(x)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           score_scale: float | torch.Tensor, *, bias: torch.Tensor | None = None,
           soft_cap: float = 0.0, sinks: torch.Tensor | None = None):
    """Softmax attention of one padded block, all float32.

    q [nb, qc, heads, dqk], k [nb, kc, kv_heads, dqk], v [nb, kc, kv_heads, dvo] (no NaN where
    not visible is required of v: callers zero missing keys), visible [nb, qc, kc],
    bias [nb, kv_heads, group, qc, kc], sinks [heads].
    Returns out [nb, qc, heads, dvo] and lse [nb, qc, heads] (base 2; -inf, out 0 where nothing is seen).
    """
    nb, qc, heads, dqk = q.shape
    kc, kv_heads, dvo = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    qh = q.view(nb, qc, kv_heads, group, dqk).permute(0, 2, 3, 1, 4).reshape(nb, kv_heads, group * qc, dqk)
    s = torch.matmul(qh, k.permute(0, 2, 3, 1)).view(nb, kv_heads, group, qc, kc)
    s = s * score_scale
    if bias is not None:
        s = s + bias
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.view(1, kv_heads, group, 1, 1)
        m = torch.maximum(m, sink)
    m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    o = torch.matmul(p.view(nb, kv_heads, group * qc, kc), v.permute(0, 2, 1, 3))
    inv = torch.where(denom > 0, 1.0 / denom, 0.0).view(nb, kv_heads, group * qc, 1)
    o = (o * inv).view(nb, kv_heads, group, qc, dvo).permute(0, 3, 1, 2, 4).reshape(nb, qc, heads, dvo)
    lse = (m * LOG2E + torch.log2(denom)).view(nb, kv_heads, group, qc).permute(0, 3, 1, 2)
    return o, lse.reshape(nb, qc, heads)


def zero_missing_keys(x: torch.Tensor, group: KVGroup) -> torch.Tensor:
    """Zero the padded keys of a gathered [nb, kc, ...] tensor (cache slots past kv_len may hold NaN)."""
    j = torch.arange(x.shape[1], device=x.device)
    missing = (j[None, :] >= group.kv_len[:, None]).view(*x.shape[:2], *([1] * (x.dim() - 2)))
    return x.masked_fill(missing, 0.0)


def write_block(block: RowBlock, o: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor | None, v_scale: float | torch.Tensor) -> None:
    """Copy the real rows of a block's results into ``out`` (times v_scale) and ``lse``."""
    rows = o.reshape(-1, *o.shape[2:])[block.src] * v_scale
    out[block.dest] = rows.to(out.dtype)
    if lse is not None:
        lse[block.dest] = lse_b.reshape(-1, lse_b.shape[-1])[block.src]


@dataclass
class AttentionPlan:
    """Everything `run` needs: the groups, the KV layout and the per-problem constants."""

    problem: Problem
    groups: list[KVGroup]
    layout: str                          # "ragged", "NHD" or "HND"
    sm_scale: float
    alibi_slopes: torch.Tensor | None    # [heads] float32
    inv_freq: torch.Tensor | None        # [head_dim_qk // 2] float64 (RoPE)
    rope_scale: float

    def run(self, inputs: AttentionInputs) -> None:
        pb, q = self.problem, inputs.q
        if isinstance(inputs.kv, PagedKV) != (self.layout != "ragged"):
            raise TypeError(f"this plan is for {self.layout} KV, got {type(inputs.kv).__name__}")
        score_scale = self.sm_scale * scale_value(inputs.q_scale, q.device) * scale_value(inputs.k_scale, q.device)
        v_scale = scale_value(inputs.v_scale, q.device)
        sinks = inputs.sinks.to(torch.float32) if inputs.sinks is not None else None
        for group in self.groups:
            index = group.token_index()
            k = gather_keys(inputs.kv.k, group, index, self.layout)
            v = zero_missing_keys(gather_keys(inputs.kv.v, group, index, self.layout), group)
            if self.inv_freq is not None:
                k_pos = torch.arange(group.kc, device=q.device).expand(k.shape[0], -1)
                k = apply_rope(k, k_pos, self.inv_freq, self.rope_scale)
            for block in group.row_blocks():
                qb = q[block.rows].to(torch.float32)
                if self.inv_freq is not None:
                    qb = apply_rope(qb, block.pos, self.inv_freq, self.rope_scale)
                bias = None
                if self.alibi_slopes is not None:
                    bias = alibi_bias(self.alibi_slopes, block.pos, group.kc, pb.num_kv_heads)
                o, lse_b = attend(qb, k, v, block.visible, score_scale, bias=bias,
                                  soft_cap=pb.logits_soft_cap, sinks=sinks)
                write_block(block, o, lse_b, inputs.out, inputs.lse, v_scale)


def plan_attention(problem: Problem, params: AttentionParams) -> AttentionPlan:
    """Plan decode / prefill_paged / prefill_ragged on the device of ``params.qo_indptr``."""
    device = params.qo_indptr.device
    paged = problem.op != "prefill_ragged"
    if paged and params.kv_indices is None:
        raise ValueError(f"{problem.op} needs kv_indices (paged KV)")
    visibility = Visibility(problem.mask_mode == "causal", problem.window_left)
    if problem.mask_mode == "custom" or problem.spec_decode_mask:
        if params.packed_mask is None or params.mask_indptr is None:
            raise ValueError("a custom (or speculative-decoding) mask needs packed_mask and mask_indptr")
        visibility = Visibility(False, problem.window_left, unpack_mask_bits(params.packed_mask), params.mask_indptr)
    shape = BatchShape(
        qo_lens=list(params.qo_lens_host), kv_lens=list(params.kv_lens_host), kv_indptr=params.kv_indptr,
        kv_indices=params.kv_indices if paged else None, page_size=problem.page_size if paged else 0,
        num_qo_heads=problem.num_qo_heads,
        kv_elems_per_token=problem.num_kv_heads * (problem.head_dim_qk + problem.head_dim_vo))
    groups = plan_groups(shape, device, visibility)
    rope = problem.pos_encoding_mode == "ROPE_LLAMA"
    return AttentionPlan(
        problem=problem, groups=groups, layout=problem.kv_layout if paged else "ragged",
        sm_scale=params.sm_scale,
        alibi_slopes=alibi_slopes(problem.num_qo_heads, device) if problem.pos_encoding_mode == "ALIBI" else None,
        inv_freq=rope_inv_freq(problem.head_dim_qk, params.rope_theta, device) if rope else None,
        rope_scale=params.rope_scale)
