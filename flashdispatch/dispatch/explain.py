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

from .. import checks
from . import registry
from .caps import ALL_FEATURES
from .problem import EMPTY_WORKLOAD, FP8_DTYPES, LAYOUTS, OPS, Device, Problem, Workload, device_of
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
def _numbers(value, what: str) -> list[int]:
    """``128`` -> [128]; ``"192/128"`` or (192, 128) -> [192, 128] (sizes are checked by the caller)."""
    if isinstance(value, str):
        try:
            nums = [int(p) for p in value.split("/")]
        except ValueError:
            raise ValueError(f"{what}={value!r}: expected a number or 'A/B'") from None
    else:
        nums = list(value) if isinstance(value, (tuple, list)) else [value]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
            raise TypeError(f"{what}={value!r}: expected an int, 'A/B' or a pair (A, B) of ints")
    if len(nums) not in (1, 2):
        raise ValueError(f"{what}={value!r}: expected one or two numbers, got {len(nums)}")
    return nums


def _checked(value, what: str, check, *args, **kwargs) -> None:
    """Run ``check(*args, **kwargs)``; its ValueError is raised again with ``what=value`` in front."""
    try:
        check(*args, **kwargs)
    except ValueError as e:
        raise ValueError(f"{what}={value!r}: {e}") from None


def torch_device(spec: str | torch.device | int, what: str = "device") -> torch.device:
    """A device of this machine that can hold tensors: ``cpu``, ``cuda`` or ``cuda:N`` (a str, a
    torch.device or a CUDA index); ValueError for another type, a CUDA device this machine lacks."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"
    if not isinstance(spec, (str, torch.device)):
        raise TypeError(f"{what}={spec!r}: expected cpu or cuda[:N] (a str, a torch.device or a CUDA index)")
    try:
        dev = torch.device(spec.strip().lower() if isinstance(spec, str) else spec)
    except RuntimeError:
        raise ValueError(f"{what}={spec!r} is not a device; expected cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}={spec!r}: expected cpu or cuda[:N], not a {dev.type} device")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"{what}={spec!r}: this machine has no CUDA device")
        if (dev.index or 0) >= count:
            raise ValueError(f"{what}={spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def describe_device(spec: Device | str | torch.device | int | None = None) -> Device:
    """A Device from ``None`` (this machine: the current CUDA device, else the CPU), a `Device`,
    ``"cpu"``, ``"cuda[:N]"`` (a real one; also a torch.device or a CUDA index), or a compute
    capability to explain for a GPU that is not here: ``"sm90"``, ``"sm_90a"``, ``"9.0"``, ``"100"``."""
    if spec is None:
        return device_of("cuda") if torch.cuda.is_available() else Device("cpu")
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str) or spec.strip().lower().startswith(("cpu", "cuda")):
        return device_of(torch_device(spec))
    text = spec.strip().lower().removeprefix("sm").lstrip("_").rstrip("af")
    major, _, minor = text.partition(".") if "." in text else (text[:-1], "", text[-1:])
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"device={spec!r}: expected cpu, cuda[:N] or a compute capability like sm90 or 9.0")
    return Device("cuda", 0, (int(major), int(minor)), "(described)", described=True)


def describe_workload(batch_size: int = 0, kv_len: int = 0, qo_len: int = 1) -> Workload:
    """A Workload of ``batch_size`` requests, each with ``qo_len`` queries over ``kv_len`` keys
    (none: batch_size 0)."""
    for name, value, low in (("batch_size", batch_size, 0), ("kv_len", kv_len, 0), ("qo_len", qo_len, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= checks.MAX_KV_TOKENS:
            raise ValueError(f"{name}={value!r} must be an int in [{low}, 2^31 - 1]")
    if batch_size == 0:
        if kv_len:
            raise ValueError(f"kv_len={kv_len} needs batch_size > 0 (the workload's number of requests)")
        return EMPTY_WORKLOAD
    return Workload(batch_size, batch_size * qo_len, qo_len, batch_size * kv_len, kv_len)


_VALUED_FEATURES = {"sliding_window": "window_left", "soft_cap": "logits_soft_cap", "q_len_per_req": "q_len_per_req"}
_RAGGED_OPS = ("prefill_ragged", "merge")
_MLA_KPE = 64  # DeepSeek's rope part of an MLA head (ckv 512 + kpe 64)


def _feature_list(features) -> list[str]:
    if isinstance(features, str):
        feats = [f.strip() for f in features.split(",") if f.strip()]
    elif isinstance(features, (list, tuple, set, frozenset)):
        feats = list(features)
    else:
        raise TypeError(f"features={features!r}: expected a comma-separated str or a list of feature names")
    for f in feats:
        if not isinstance(f, str) or f not in ALL_FEATURES:
            raise ValueError(f"features: {f!r} is not a feature; valid: {', '.join(sorted(ALL_FEATURES))}")
    return feats


def _heads(op: str, heads) -> tuple[int, int]:
    """(qo, kv) heads as plan() checks them; MLA has one KV head (the latent cache)."""
    nums = _numbers(heads if heads is not None else (128 if op == "mla" else "32/8"), "heads")
    if op == "mla" and len(nums) == 2 and nums[1] != 1:
        raise ValueError(f"heads={heads!r}: MLA has one KV head (the shared latent cache); give the query heads")
    qo, kv = (nums[0], 1) if op == "mla" else (nums[0], nums[-1])
    _checked(heads, "heads", checks.check_heads, qo, kv)
    return qo, kv


def _head_dims(op: str, head_dim) -> dict[str, int]:
    """The Problem's head dims: qk/vo, or for MLA ckv/kpe (kpe 64 unless given)."""
    nums = _numbers(head_dim if head_dim is not None else (512 if op == "mla" else 128), "head_dim")
    a, b = nums[0], (nums[1] if len(nums) == 2 else _MLA_KPE if op == "mla" else nums[0])
    names = ("head_dim_ckv", "head_dim_kpe") if op == "mla" else ("head_dim_qk", "head_dim_vo")
    for name, d in zip(names, (a, b)):
        _checked(head_dim, "head_dim", checks.check_positive_int, d, name, high=checks.MAX_KV_TOKENS)
    if op == "mla":
        return {"head_dim_qk": a + b, "head_dim_vo": a, "head_dim_kpe": b}
    return {"head_dim_qk": a, "head_dim_vo": b}


def _page_size(op: str, page_size) -> int:
    if op in _RAGGED_OPS:
        if page_size is not None and (type(page_size) is not int or page_size != 0):
            raise ValueError(f"page_size={page_size!r}: op {op} reads ragged KV, without pages (give 0 or none)")
        return 0
    return checks.check_page_size(page_size if page_size is not None else (64 if op == "mla" else 16))


def describe_problem(op: str = "decode", heads: int | str | tuple | None = None,
                     head_dim: int | str | tuple | None = None, page_size: int | None = None,
                     q_dtype: str | torch.dtype = "bf16", kv_dtype: str | torch.dtype | None = None,
                     o_dtype: str | torch.dtype | None = None, layout: str = "NHD",
                     features: str | list[str] | tuple[str, ...] = (), window_left: int = -1,
                     logits_soft_cap: float = 0.0, q_len_per_req: int = 1,
                     return_lse: bool = False) -> Problem:
    """A Problem from CLI-style arguments (``python -m flashdispatch explain``), checked as plan() checks them.

    heads: ``"32/8"`` (qo/kv) or one number (qo = kv); default 32/8, for MLA 128 (one KV head).
    head_dim: ``128`` or ``"192/128"`` (qk/vo); for MLA ``"512/64"`` (ckv/kpe, the default; kpe 64 if omitted).
    page_size: default 16 for paged ops, 64 for MLA; prefill_ragged and merge have none (0).
    o_dtype: default q_dtype (fp16 for an fp8 q; bf16 for MLA), as plan() does.
    features: names as Caps spells them (``"causal,sinks"``); sliding_window, soft_cap and
    q_len_per_req need their value (window_left, logits_soft_cap, q_len_per_req).
    """
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op={op!r}; valid: {', '.join(OPS)}")
    feats = _feature_list(features)
    window_left = checks.check_window_left(window_left)
    logits_soft_cap = checks.check_soft_cap(logits_soft_cap)
    checks.check_positive_int(q_len_per_req, "q_len_per_req", high=checks.MAX_KV_TOKENS)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse={return_lse!r} must be a bool")
    values = {"window_left": window_left >= 0, "logits_soft_cap": logits_soft_cap > 0,
              "q_len_per_req": q_len_per_req > 1}
    for f, arg in _VALUED_FEATURES.items():
        if f in feats and not values[arg]:
            raise ValueError(f"feature {f} needs its value: give {arg}=...")
    if "causal" in feats and "custom_mask" in feats:
        raise ValueError("features causal and custom_mask exclude each other (a custom mask replaces causal)")
    if "alibi" in feats and "rope" in feats:
        raise ValueError("features alibi and rope exclude each other (one pos_encoding_mode)")
    mla = op == "mla"
    qo_heads, kv_heads = _heads(op, heads)
    head_dims = _head_dims(op, head_dim)
    page_size = _page_size(op, page_size)
    q = checks.as_dtype(q_dtype, "q_dtype")
    kv = checks.as_dtype(kv_dtype, "kv_dtype") if kv_dtype is not None else (
        torch.float8_e4m3fn if "fp8_kv" in feats else q)
    if "fp8_kv" in feats and kv not in FP8_DTYPES:
        raise ValueError(f"feature fp8_kv needs an fp8 kv_dtype, got kv_dtype={kv_dtype!r}")
    o = checks.as_dtype(o_dtype, "o_dtype") if o_dtype is not None else (
        q if q not in FP8_DTYPES else (torch.bfloat16 if mla else torch.float16))
    if not isinstance(layout, str) or layout not in LAYOUTS or (mla and layout != "NHD"):
        raise ValueError(f"layout={layout!r}; valid: {'NHD (MLA has one cache layout)' if mla else 'NHD, HND'}")
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
