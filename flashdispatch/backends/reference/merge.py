"""Reference merge_states: combine partial attention states by their base-2 lse."""
from __future__ import annotations

import torch

from ..base import MergeInputs


def merge_states(inputs: MergeInputs) -> None:
    """v [seq, n, heads, dim], s [seq, n, heads] -> v_out [seq, heads, dim], s_out [seq, heads].

    m = max s; w = 2**(s - m); v_out = sum w v / sum w; s_out = m + log2(sum w). A (seq, head) whose
    states are all -inf gets v_out 0 and s_out -inf.
    """
    s = inputs.s.to(torch.float32)
    m = s.amax(1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w = torch.exp2(s - m)
    total = w.sum(1)
    v = (w.unsqueeze(-1) * inputs.v.to(torch.float32)).sum(1)
    v = v * torch.where(total > 0, 1.0 / total, 0.0).unsqueeze(-1)
    inputs.v_out.copy_(v.to(inputs.v_out.dtype))
    inputs.s_out.copy_((m.squeeze(1) + torch.log2(total)).to(inputs.s_out.dtype))
