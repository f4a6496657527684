"""What must be computed (`Problem`), where (`Device`) and how much of it (`Workload`).

All three are frozen and hashable: selection decisions are cached on them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

OPS = ("decode", "prefill_paged", "prefill_ragged", "mla", "merge")
LAYOUTS = ("NHD", "HND")
MASK_MODES = ("none", "causal", "custom")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
