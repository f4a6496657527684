"""Positions for the reference: Llama RoPE, ALiBi biases and which keys each query row sees.

Query row i of a request with qo_len q and kv_len k sits at position i + k - q; key j at j.
"""
from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """float64 [head_dim // 2]: 1 / theta**(2t / head_dim)."""
    t = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return 1.0 / theta ** (2.0 * t / head_dim)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float) -> torch.Tensor:
    """Rotate-half RoPE of float32 ``x [..., L, heads, D]`` at positions ``pos [..., L]``.

    Angles and their cos/sin are computed in float64 (exact for long positions), then used in float32.
    """
    angle = (pos.to(torch.float64) / rope_scale)[..., None] * inv_freq
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.float32).unsqueeze(-2)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(torch.float32).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, num_keys: int, num_kv_heads: int) -> torch.Tensor:
    """float32 [nb, kv_heads, group, qc, num_keys]: slope_h * (j - p_i); query head h = kv_head * group + g."""
    j = torch.arange(num_keys, device=q_pos.device)
    dist = (j[None, None, :] - q_pos[..., None]).to(torch.float32)
    return slopes.view(1, num_kv_heads, -1, 1, 1) * dist[:, None, None]


def visible_keys(q_pos: torch.Tensor, kv_len: torch.Tensor, num_keys: int, causal: bool,
                 window_left: int, custom: torch.Tensor | None) -> torch.Tensor:
    """bool [nb, qc, num_keys]: key j exists (j < kv_len) and passes causal, window and custom mask."""
    j = torch.arange(num_keys, device=q_pos.device)[None, None, :]
    p = q_pos[..., None]
    seen = j < kv_len[:, None, None]
    if causal:
        seen = seen & (j <= p)
    if window_left >= 0:
        seen = seen & (j >= p - window_left)
    if custom is not None:
        seen = seen & custom
    return seen
