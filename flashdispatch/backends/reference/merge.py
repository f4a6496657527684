"""Reference merge_states: combine partial attention states by their base-2 lse."""
from __future__ import annotations

import torch

from ..base import MergeInputs


def merge_states(inputs: MergeInputs) -> None:
    """v [seq, n, heads, dim], s [seq, n, heads] -> v_out [seq, heads, dim], s_out [seq, heads].

    m = max s; w = 2**(s - m); v_out = sum w v / sum w; s_out = m + log2(sum w). A state of weight 0
    (s = -inf) adds nothing, whatever its v holds (NaN, inf); a (seq, head) whose states are all -inf
    gets v_out 0 and s_out -inf. An s of +inf or NaN gives NaN (v_out and s_out).
    """
    s = inputs.s.to(torch.float32)
    m = s.amax(1)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w = torch.exp2(s - m.unsqueeze(1)).unsqueeze(-1)
    total = w.sum(1).squeeze(-1)
    safe = total.masked_fill(total == 0, 1.0)  # (as the fa2 kernel: a NaN total stays NaN)
    v = torch.where(w > 0, w * inputs.v.to(torch.float32), 0.0).sum(1) / safe.unsqueeze(-1)
    inputs.v_out.copy_(v.to(inputs.v_out.dtype))
    inputs.s_out.copy_(torch.where(total == 0, float("-inf"), m + torch.log2(safe)).to(inputs.s_out.dtype))
