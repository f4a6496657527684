"""Declared capabilities of a backend, as data, and the check of a problem against them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .problem import Device, Problem, dtype_name
from .reasons import Reason

ALL_FEATURES = frozenset({
    "causal", "custom_mask", "sliding_window", "soft_cap", "alibi", "rope", "lse",
    "cuda_graph", "fp8_kv", "sinks", "spec_decode", "q_len_per_req",
})

_FEATURE_ARGS = {
    "causal": "causal=True",
    "custom_mask": "custom_mask / packed_custom_mask",
    "sliding_window": "window_left >= 0",
    "soft_cap": "logits_soft_cap > 0",
    "alibi": "pos_encoding_mode='ALIBI'",
    "rope": "pos_encoding_mode='ROPE_LLAMA'",
    "lse": "return_lse=True",
    "cuda_graph": "use_cuda_graph=True",
    "fp8_kv": "fp8 KV cache",
    "sinks": "sinks",
    "spec_decode": "speculative-decoding mask",
    "q_len_per_req": "q_len_per_req > 1",
}


@dataclass(frozen=True)
class Caps:
    """What a backend supports. ``None`` in a field means "any value".

    head_dims holds (head_dim_qk, head_dim_vo) pairs; for MLA (ckv, kpe) pairs.
    """

    ops: frozenset[str]
    device_types: frozenset[str] = frozenset({"cuda"})
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    q_dtypes: frozenset[torch.dtype] | None = None
    kv_dtypes: frozenset[torch.dtype] | None = None
    o_dtypes: frozenset[torch.dtype] | None = None
    head_dims: frozenset[tuple[int, int]] | None = None
    page_sizes: frozenset[int] | None = None
    layouts: frozenset[str] = frozenset({"NHD", "HND"})
    features: frozenset[str] = frozenset()
    max_q_len_per_req: int = 1


def _fmt_set(values, fmt=str) -> str:
    items = sorted(values, key=lambda v: (str(type(v)), v) if not isinstance(v, torch.dtype) else dtype_name(v))
    return "{" + ", ".join(fmt(v) for v in items) + "}"


def check_caps(caps: Caps, problem: Problem, device: Device) -> list[Reason]:
    """Every way ``problem`` on ``device`` falls outside ``caps`` (empty list: supported)."""
    reasons: list[Reason] = []
    add = lambda code, detail, hint="": reasons.append(Reason(code, detail, hint))  # noqa: E731
    if problem.op not in caps.ops:
        add("op", f"op={problem.op} not in {_fmt_set(caps.ops)}" if caps.ops else f"op={problem.op} is not implemented")
        return reasons
    if device.type not in caps.device_types:
        add("device", f"device={device.type} not in {_fmt_set(caps.device_types)}")
    elif device.cc is not None:
        cc = f"sm_{device.cc[0]}{device.cc[1]}"
        if caps.min_cc is not None and device.cc < caps.min_cc:
            add("compute_capability", f"{cc} < sm_{caps.min_cc[0]}{caps.min_cc[1]}")
        if caps.max_cc is not None and device.cc > caps.max_cc:
            add("compute_capability", f"{cc} > sm_{caps.max_cc[0]}{caps.max_cc[1]}")
    for name, allowed in (("q_dtype", caps.q_dtypes), ("kv_dtype", caps.kv_dtypes), ("o_dtype", caps.o_dtypes)):
        value = getattr(problem, name)
        if allowed is not None and value not in allowed:
            add("dtype", f"{name}={dtype_name(value)} not in {_fmt_set(allowed, dtype_name)}")
    if caps.head_dims is not None:
        if problem.op == "mla":
            pair, label = (problem.head_dim_vo, problem.head_dim_kpe), "(head_dim_ckv, head_dim_kpe)"
        else:
            pair, label = (problem.head_dim_qk, problem.head_dim_vo), "(head_dim_qk, head_dim_vo)"
        if pair not in caps.head_dims:
            add("head_dim", f"{label}={pair} not in {_fmt_set(caps.head_dims)}")
    if problem.page_size and caps.page_sizes is not None and problem.page_size not in caps.page_sizes:
        add("page_size", f"page_size={problem.page_size} not in {_fmt_set(caps.page_sizes)}")
    if problem.op != "mla" and problem.kv_layout not in caps.layouts:
        add("layout", f"kv_layout={problem.kv_layout} not in {_fmt_set(caps.layouts)}")
    for feat in sorted(problem.features() - caps.features):
        add(f"feature.{feat}", f"{_FEATURE_ARGS[feat]} is not supported")
    if problem.q_len_per_req > caps.max_q_len_per_req:
        add("q_len_per_req", f"q_len_per_req={problem.q_len_per_req} > {caps.max_q_len_per_req}")
    return reasons
