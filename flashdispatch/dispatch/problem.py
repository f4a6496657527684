"""What must be computed (`Problem`), where (`Device`) and how much of it (`Workload`).

All three are frozen and hashable: selection decisions are cached on them.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, replace

import numpy as np
import torch

OPS = ("decode", "prefill_paged", "prefill_ragged", "mla", "merge")
LAYOUTS = ("NHD", "HND")
MASK_MODES = ("none", "causal", "custom")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALAR_LIMIT = 1e30  # float scalars' magnitude bound: the kernels' products of them stay finite in float32


@dataclass(frozen=True)
class Problem:
    """The attention problem a wrapper has planned, independent of the tensors' contents.

    ``op`` is one of ``decode`` (paged batch decode, also single decode and the trtllm/xqa
    decode entry points), ``prefill_paged``, ``prefill_ragged`` (also single prefill) and
    ``mla``. For MLA, ``head_dim_qk`` is ckv + kpe, ``head_dim_vo`` is ckv and
    ``head_dim_kpe`` is kpe. ``page_size`` is 0 for ragged KV.
    """

    op: str
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int = 0
    kv_layout: str = "NHD"
    mask_mode: str = "none"
    window_left: int = -1
    logits_soft_cap: float = 0.0
    pos_encoding_mode: str = "NONE"
    q_len_per_req: int = 1
    use_cuda_graph: bool = False
    return_lse: bool = True
    sinks: bool = False
    spec_decode_mask: bool = False
    head_dim_kpe: int = 0

    def __post_init__(self):
        # plan() builds Problems on every call: the valid case is one expression, `_check_fields` names the bad field
        if not (self.op in OPS and self.kv_layout in LAYOUTS and self.mask_mode in MASK_MODES
                and self.pos_encoding_mode in POS_ENCODINGS and type(self.q_dtype) is torch.dtype
                and type(self.kv_dtype) is torch.dtype and type(self.o_dtype) is torch.dtype
                and type(self.num_qo_heads) is int and type(self.num_kv_heads) is int and self.num_qo_heads > 0
                and self.num_kv_heads > 0
                and type(self.head_dim_qk) is int and self.head_dim_qk > 0
                and type(self.head_dim_vo) is int and self.head_dim_vo > 0
                and type(self.page_size) is int and self.page_size >= 0
                and type(self.window_left) is int and self.window_left >= -1
                and type(self.logits_soft_cap) is float and 0.0 <= self.logits_soft_cap <= SCALAR_LIMIT
                and type(self.q_len_per_req) is int and self.q_len_per_req >= 1
                and type(self.head_dim_kpe) is int and self.head_dim_kpe >= 0
                and type(self.use_cuda_graph) is bool and type(self.return_lse) is bool
                and type(self.sinks) is bool and type(self.spec_decode_mask) is bool):
            _check_fields(self)

    def features(self) -> frozenset[str]:
        """The feature names (as `Caps.features` spells them) this problem needs."""
        f = set()
        if self.mask_mode == "causal":
            f.add("causal")
        if self.mask_mode == "custom":
            f.add("custom_mask")
        if self.window_left >= 0:
            f.add("sliding_window")
        if self.logits_soft_cap > 0:
            f.add("soft_cap")
        if self.pos_encoding_mode == "ALIBI":
            f.add("alibi")
        if self.pos_encoding_mode == "ROPE_LLAMA":
            f.add("rope")
        if self.return_lse:
            f.add("lse")
        if self.use_cuda_graph:
            f.add("cuda_graph")
        if self.kv_dtype in FP8_DTYPES:
            f.add("fp8_kv")
        if self.sinks:
            f.add("sinks")
        if self.spec_decode_mask:
            f.add("spec_decode")
        if self.q_len_per_req > 1:
            f.add("q_len_per_req")
        return frozenset(f)

    def with_(self, **changes) -> "Problem":
        return replace(self, **changes)

    def describe(self) -> str:
        """One line for explain(): ``decode q=bf16 kv=bf16 heads=32/8 d=128 page=16 NHD``."""
        d = f"{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_vo else f"{self.head_dim_qk}/{self.head_dim_vo}"
        if self.op == "mla":
            d = f"ckv={self.head_dim_vo} kpe={self.head_dim_kpe}"
        parts = [
            self.op,
            f"q={dtype_name(self.q_dtype)}",
            f"kv={dtype_name(self.kv_dtype)}",
            f"heads={self.num_qo_heads}/{self.num_kv_heads}",
            f"d={d}",
        ]
        if self.page_size:
            parts.append(f"page={self.page_size}")
        if self.op != "mla":
            parts.append(self.kv_layout)
        extra = sorted(self.features() - {"lse"})
        if extra:
            parts.append("+" + ",".join(extra))
        return " ".join(parts)


_CHOICES = {"op": OPS, "kv_layout": LAYOUTS, "mask_mode": MASK_MODES, "pos_encoding_mode": POS_ENCODINGS}
_LOWEST = {"num_qo_heads": 1, "num_kv_heads": 1, "head_dim_qk": 1, "head_dim_vo": 1, "page_size": 0,
           "window_left": -1, "q_len_per_req": 1, "head_dim_kpe": 0}


def _fail(cls: str, name: str, value, accepted: str, error=ValueError):
    raise error(f"{cls}.{name}={value!r}: expected {accepted}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_ints(obj, lowest: dict[str, int]) -> None:
    """Int fields (numpy ints are taken as ints), each at least its ``lowest``."""
    for name, low in lowest.items():
        value = getattr(obj, name)
        if not _is_int(value):
            _fail(type(obj).__name__, name, value, f"an int >= {low}", TypeError)
        if value < low:
            _fail(type(obj).__name__, name, value, f"an int >= {low}")
        object.__setattr__(obj, name, int(value))


def _check_bool(obj, name: str) -> None:
    """A bool field; ints 0/1 and numpy bools are taken as bools."""
    value = getattr(obj, name)
    if isinstance(value, (bool, np.bool_)) or (_is_int(value) and value in (0, 1)):
        object.__setattr__(obj, name, bool(value))
    else:
        _fail(type(obj).__name__, name, value, "a bool", TypeError)


def _check_fields(p: Problem) -> None:
    """Raise TypeError/ValueError for the first field of ``p`` outside its accepted values."""
    for name, choices in _CHOICES.items():
        value = getattr(p, name)
        if not isinstance(value, str) or value not in choices:
            _fail("Problem", name, value, f"one of {', '.join(choices)}")
    for name in ("q_dtype", "kv_dtype", "o_dtype"):
        if not isinstance(getattr(p, name), torch.dtype):
            _fail("Problem", name, getattr(p, name), "a torch.dtype", TypeError)
    _check_ints(p, _LOWEST)
    cap = p.logits_soft_cap
    if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
        _fail("Problem", "logits_soft_cap", cap, "a float", TypeError)
    if not 0.0 <= cap <= SCALAR_LIMIT:  # (NaN fails it)
        _fail("Problem", "logits_soft_cap", cap, "a float in [0, 1e30] (0: no soft cap)")
    object.__setattr__(p, "logits_soft_cap", float(cap))
    for name in ("use_cuda_graph", "return_lse", "sinks", "spec_decode_mask"):
        _check_bool(p, name)


def _check_device(d: Device) -> None:
    """Raise TypeError/ValueError for the first field of ``d`` outside its accepted values."""
    if not isinstance(d.type, str) or not d.type:
        error = ValueError if isinstance(d.type, str) else TypeError
        _fail("Device", "type", d.type, "a device type such as 'cpu' or 'cuda'", error)
    cc = d.cc
    if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2 and all(_is_int(v) and v >= 0 for v in cc)):
        _fail("Device", "cc", cc, "None or a compute capability (major, minor) of two ints, e.g. (9, 0)")
    if not isinstance(d.name, str):
        _fail("Device", "name", d.name, "a str", TypeError)
    _check_ints(d, {"index": 0, "sm_count": 0, "shared_per_block": 0})
    _check_bool(d, "described")


_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# Every name a dtype argument or a policy file may use: the short names above, torch's own
# names and the common aliases.
DTYPE_BY_NAME = {
    **{name: dtype for dtype, name in _DTYPE_NAMES.items()},
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Device:
    """Where a problem runs. ``cc`` is the CUDA compute capability, None on CPU.
    ``shared_per_block``: the opt-in shared memory per block in bytes (0: unknown, e.g. described).

    ``described``: a GPU named for explain() that is not this machine's (``--device sm90``);
    backends then judge it by their capabilities, not by what this machine has installed.
    """

    type: str
    index: int = 0
    cc: tuple[int, int] | None = None
    name: str = "cpu"
    sm_count: int = 0
    described: bool = False
    shared_per_block: int = 0

    def __post_init__(self):
        if not (type(self.type) is str and self.type and type(self.index) is int and self.index >= 0
                and (self.cc is None or (type(self.cc) is tuple and len(self.cc) == 2 and type(self.cc[0]) is int
                                         and type(self.cc[1]) is int and min(self.cc) >= 0))
                and type(self.name) is str and type(self.sm_count) is int and self.sm_count >= 0
                and type(self.described) is bool and type(self.shared_per_block) is int
                and self.shared_per_block >= 0):
            _check_device(self)

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def describe(self) -> str:
        if self.cc is None:
            return f"device {self.type}"
        return f"device sm_{self.cc[0]}{self.cc[1]} {self.name}"


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> Device:
    props = torch.cuda.get_device_properties(index)
    return Device("cuda", index, (props.major, props.minor), props.name, props.multi_processor_count,
                  shared_per_block=getattr(props, "shared_memory_per_block_optin", 0))


def device_of(dev: torch.device | str | int | None) -> Device:
    """The `Device` of a torch device (``None`` means CPU)."""
    if dev is None:
        return Device("cpu")
    dev = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
    if dev.type == "cuda":
        return _cuda_device(dev.index if dev.index is not None else torch.cuda.current_device())
    return Device(dev.type)


def _bucket(n: int) -> int:
    """Round up to a power of two (0 stays 0): decisions are cached per bucket."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class Workload:
    """How much work a plan holds: batch size and query/KV lengths (exact values)."""

    batch_size: int
    total_qo_len: int
    max_qo_len: int
    total_kv_len: int
    max_kv_len: int

    def bucket(self) -> "Workload":
        """The workload rounded to powers of two: the part of it that policy rules see."""
        return Workload(*(_bucket(v) for v in (self.batch_size, self.total_qo_len, self.max_qo_len,
                                               self.total_kv_len, self.max_kv_len)))

    def describe(self) -> str:
        return f"B={self.batch_size} q<={self.max_qo_len} kv<={self.max_kv_len}"


EMPTY_WORKLOAD = Workload(0, 0, 0, 0, 0)
