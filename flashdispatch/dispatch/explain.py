"""Text views of the dispatch: one decision's table, a problem described from CLI-style
arguments, and the list of backends with their availability.

```
decode q=bf16 kv=bf16 heads=32/8 d=128 page=16 NHD  B=64 q<=1 kv<=4096   device sm_90 NVIDIA H200
order from rule 'hopper-decode' (configs/default.yaml)
  fa2         OK      <- selected
  cudnn       REJECT  feature.soft_cap  logits_soft_cap > 0 is not supported
  reference   OK      (last resort on a GPU)
  fa3         REJECT  not_implemented  flashdispatch has no fa3 kernels yet  (not in order)
```
"""
from __future__ import annotations

import torch

from . import registry
from .caps import ALL_FEATURES
from .policy import parse_dtype
from .problem import EMPTY_WORKLOAD, FP8_DTYPES, OPS, Device, Problem, Workload, device_of
from .reasons import Reason
from .select import SELECTED, Decision, decide

_NAME_W = max(len(n) for n in registry.BACKEND_NAMES) + 2
_INDENT = " " * (2 + _NAME_W + 8)


def _reason_text(reason: Reason) -> str:
    text = f"{reason.code}  {reason.detail}"
    return f"{text} ({reason.hint})" if reason.hint else text


def _note_text(note: str) -> str:
    parts = [p for p in note.split(", ") if p]
    text = ["<- selected"] if SELECTED in parts else []
    text += [f"({p})" for p in parts if p != SELECTED]
    return " ".join(text)


def format_decision(decision: Decision) -> str:
    """The explain() table of a decision: every registered backend and its verdict."""
    header = decision.problem.describe()
    if decision.workload.batch_size:
        header += f"  {decision.workload.describe()}"
    lines = [f"{header}   {decision.device.describe()}", f"order from {decision.order_source}"]
    for name, reasons, note in decision.candidates:
        notes = _note_text(note)
        if not reasons:
            lines.append(f"  {name:<{_NAME_W}}OK      {notes}".rstrip())
            continue
        first = _reason_text(reasons[0]) + (f"  {notes}" if notes else "")
        lines.append(f"  {name:<{_NAME_W}}REJECT  {first}")
        lines += [_INDENT + _reason_text(r) for r in reasons[1:]]
    if decision.backend is None:
        lines.append(f"no backend selected: {decision.failure}")
    return "\n".join(lines)


def explain_problem(problem: Problem, device: Device | None = None, workload: Workload = EMPTY_WORKLOAD,
                    requested: str = "auto") -> str:
    """The explain() table for a problem (on this machine's device unless one is given)."""
    return format_decision(decide(problem, describe_device() if device is None else device, workload, requested))


# --- problems, workloads and devices from CLI-style arguments ----------------------------------
def _pair(value: int | str | tuple, what: str) -> tuple[int, int]:
    """``128`` -> (128, 128); ``"192/128"`` or (192, 128) -> (192, 128)."""
    if isinstance(value, str):
        parts = value.split("/")
    elif isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        parts = [value]
    try:
        nums = [int(p) for p in parts]
    except (TypeError, ValueError):
        nums = []
    if len(nums) == 1:
        nums *= 2
    if len(nums) != 2 or min(nums) <= 0:
        raise ValueError(f"{what}={value!r}: expected a positive integer or 'A/B'")
    return nums[0], nums[1]


def describe_device(spec: str | None = None) -> Device:
    """A Device from ``None`` (this machine: the current CUDA device, else the CPU), ``"cpu"``,
    ``"cuda[:N]"`` (a real one), or a compute capability to explain for a GPU that is not
    here: ``"sm90"``, ``"sm_90a"``, ``"9.0"``, ``"100"``."""
    if spec is None:
        return device_of("cuda") if torch.cuda.is_available() else Device("cpu")
    if spec == "cpu" or spec.startswith("cuda"):
        return device_of(spec)
    text = spec.lower().removeprefix("sm").lstrip("_").rstrip("af")
    major, _, minor = text.partition(".") if "." in text else (text[:-1], "", text[-1:])
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"device={spec!r}: expected cpu, cuda[:N] or a compute capability like sm90 or 9.0")
    cc = (int(major), int(minor))
    return Device("cuda", 0, cc, "(described)", described=True)


def describe_workload(batch_size: int = 0, kv_len: int = 0, qo_len: int = 1) -> Workload:
    """A Workload of ``batch_size`` requests, each with ``qo_len`` queries over ``kv_len`` keys."""
    if batch_size <= 0:
        return EMPTY_WORKLOAD
    return Workload(batch_size, batch_size * qo_len, qo_len, batch_size * kv_len, kv_len)


_VALUED_FEATURES = {"sliding_window": "window_left", "soft_cap": "logits_soft_cap", "q_len_per_req": "q_len_per_req"}


def describe_problem(op: str = "decode", heads: int | str | tuple | None = None,
                     head_dim: int | str | tuple | None = None, page_size: int | None = None,
                     q_dtype: str | torch.dtype = "bf16", kv_dtype: str | torch.dtype | None = None,
                     o_dtype: str | torch.dtype | None = None, layout: str = "NHD",
                     features: str | list[str] | tuple[str, ...] = (), window_left: int = -1,
                     logits_soft_cap: float = 0.0, q_len_per_req: int = 1,
                     return_lse: bool = False) -> Problem:
    """A Problem from CLI-style arguments (``python -m flashdispatch explain``).

    heads: ``"32/8"`` (qo/kv) or one number; default 32/8, for MLA 128/1.
    head_dim: ``128`` or ``"192/128"`` (qk/vo); for MLA ``"512/64"`` (ckv/kpe, the default).
    page_size: default 16 for paged ops, 64 for MLA, 0 (ragged) for prefill_ragged and merge.
    features: names as Caps spells them (``"causal,sinks"``); sliding_window, soft_cap and
    q_len_per_req need their value (window_left, logits_soft_cap, q_len_per_req).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}; valid: {', '.join(OPS)}")
    feats = [f.strip() for f in features.split(",") if f.strip()] if isinstance(features, str) else list(features)
    for f in feats:
        if f not in ALL_FEATURES:
            raise ValueError(f"feature {f!r}; valid: {', '.join(sorted(ALL_FEATURES))}")
    values = {"window_left": window_left >= 0, "logits_soft_cap": logits_soft_cap > 0, "q_len_per_req": q_len_per_req > 1}
    for f, arg in _VALUED_FEATURES.items():
        if f in feats and not values[arg]:
            raise ValueError(f"feature {f} needs its value: give {arg}=...")
    if "causal" in feats and "custom_mask" in feats:
        raise ValueError("features causal and custom_mask exclude each other (a custom mask replaces causal)")
    if "alibi" in feats and "rope" in feats:
        raise ValueError("features alibi and rope exclude each other (one pos_encoding_mode)")
    mla = op == "mla"
    qo_heads, kv_heads = _pair(heads if heads is not None else ("128/1" if mla else "32/8"), "heads")
    d_a, d_b = _pair(head_dim if head_dim is not None else ("512/64" if mla else 128), "head_dim")
    if mla:
        head_dims = {"head_dim_qk": d_a + d_b, "head_dim_vo": d_a, "head_dim_kpe": d_b}
    else:
        head_dims = {"head_dim_qk": d_a, "head_dim_vo": d_b}
    if page_size is None:
        page_size = 64 if mla else (16 if op in ("decode", "prefill_paged") else 0)
    q = parse_dtype(q_dtype, "q_dtype")
    kv = parse_dtype(kv_dtype, "kv_dtype") if kv_dtype is not None else (
        torch.float8_e4m3fn if "fp8_kv" in feats else q)
    if "fp8_kv" in feats and kv not in FP8_DTYPES:
        raise ValueError(f"feature fp8_kv needs an fp8 kv_dtype, got kv_dtype={kv_dtype!r}")
    o = parse_dtype(o_dtype, "o_dtype") if o_dtype is not None else (torch.bfloat16 if q in FP8_DTYPES else q)
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout={layout!r}; valid: NHD, HND")
    mask = "causal" if "causal" in feats else ("custom" if "custom_mask" in feats else "none")
    pos = "ALIBI" if "alibi" in feats else ("ROPE_LLAMA" if "rope" in feats else "NONE")
    return Problem(
        op=op, q_dtype=q, kv_dtype=kv, o_dtype=o, num_qo_heads=qo_heads, num_kv_heads=kv_heads,
        page_size=page_size, kv_layout=layout, mask_mode=mask, window_left=window_left,
        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos, q_len_per_req=q_len_per_req,
        use_cuda_graph="cuda_graph" in feats, return_lse=return_lse or "lse" in feats,
        sinks="sinks" in feats, spec_decode_mask="spec_decode" in feats, **head_dims,
    )


# --- the backends on this machine ------------------------------------------------------------
def backends_table() -> str:
    """Every registered backend: available or not on this machine, why not, and its version."""
    rows = []
    for name in registry.BACKEND_NAMES:
        failure = registry.load_failure(name)
        if failure is not None:
            rows.append((name, "unavailable", "-", [failure]))
            continue
        cls = registry.backend_class(name)
        reasons = list(cls.availability())
        rows.append((name, "unavailable" if reasons else "available", cls.version() or "-", reasons))
    ver_w = max(len("version"), *(len(r[2]) for r in rows)) + 2
    lines = [f"{'backend':<{_NAME_W}}{'status':<13}{'version':<{ver_w}}why not"]
    for name, status, version, reasons in rows:
        first = str(reasons[0]) if reasons else ""
        lines.append(f"{name:<{_NAME_W}}{status:<13}{version:<{ver_w}}{first}".rstrip())
        lines += [" " * (_NAME_W + 13 + ver_w) + str(r) for r in reasons[1:]]
    return "\n".join(lines)
