"""MLA decode rows: DeepSeek's matrix-absorbed attention over a paged latent cache.

Shape syntax: ``BxK`` is B requests of one query token over K keys each; ``:p<N>`` sets the
page size (default ``--page-size``, 64). Every row has ``--heads`` query heads (default 128),
ckv ``--head-dim`` (default 512) and kpe 64, pages in random order.
TFLOP/s = 2 x batch x heads x kv_len x (ckv + kpe + ckv) / time (ANCHORS.md's count).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .decode import DTYPE_BYTES, INT32_MAX, MAX_BATCH, MAX_INPUT_BYTES, WORKSPACE_BYTES, check_limit, selected_backend
from .matrix import Column
from .timing import Job

DEFAULT_SHAPES = "64x4096,128x8192,16x32768,128x2048:p1"  # ANCHORS.md's MLA rows (page 64, the last 1)
BASELINE_ORDER = ["fi:fa2", "fi:fa3", "fd:fa2", "fd:auto"]
PEER_COLUMNS = ("fa2", "fa3")
DEFAULT_PEERS = ("fa2",)  # fa3 is opt-in (its JIT compile is slow)
KPE_DIM = 64


@dataclass(frozen=True)
class MLAShape:
    """One MLA decode row: ``batch`` requests of one query token over ``kv_len`` keys."""

    batch: int
    kv_len: int
    page_size: int = 64
    heads: int = 128
    head_dim_ckv: int = 512
    head_dim_kpe: int = KPE_DIM
    dtype: torch.dtype = torch.bfloat16
    label: str = field(default="", compare=False)  # the row as given

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.kv_len / self.page_size)


def parse_mla_shapes(text: str, dtype: torch.dtype = torch.bfloat16, heads: tuple[int, int] = (128, 1),
                     head_dim: int = 512, page_size: int = 64) -> list[MLAShape]:
    """``"64x4096,128x2048:p1"`` -> shapes (see the module doc); ``heads`` is (query heads, 1)."""
    if heads[1] != 1:
        raise ValueError(f"heads={heads[0]}/{heads[1]}: MLA has one KV head (give --heads {heads[0]}/1)")
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *mods = item.split(":")
        batch_text, _, kv_text = head.lower().partition("x")
        try:
            batch, kv_len = int(batch_text), int(kv_text)
        except ValueError:
            raise ValueError(f"mla shape {item!r}: expected BxK with an optional :p<N>, e.g. 64x4096 or "
                             "128x2048:p1") from None
        if batch <= 0 or kv_len <= 0:
            raise ValueError(f"mla shape {item!r}: need batch > 0 and kv_len > 0")
        shape = MLAShape(batch, kv_len, page_size, heads[0], head_dim, dtype=dtype, label=item)
        for mod in mods:
            if not (mod.startswith("p") and mod[1:].isdigit() and int(mod[1:]) > 0):
                raise ValueError(f"mla shape {item!r}: unknown modifier {mod!r} (p<N>: page size)")
            shape = replace(shape, page_size=int(mod[1:]))
        check_mla_limits(f"mla shape {item!r}", shape)
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"no mla shapes in {text!r}")
    return shapes


def check_mla_limits(where: str, s: MLAShape) -> None:
    """Refuse a row past `decode.MAX_BATCH`, int32 lengths and cache slots, or
    `decode.MAX_INPUT_BYTES` of cache."""
    check_limit(where, "batch", s.batch, MAX_BATCH, "past any serving batch")
    slots = s.batch * s.pages_per_request * s.page_size
    check_limit(where, "KV cache slots", slots, INT32_MAX, "int32 page tables")
    nbytes = slots * (s.head_dim_ckv + s.head_dim_kpe) * DTYPE_BYTES[s.dtype]
    check_limit(where, f"cache bytes (ckv {s.head_dim_ckv}, kpe {s.head_dim_kpe})", nbytes, MAX_INPUT_BYTES,
                "no GPU holds 1 TiB")


def mla_flops(s: MLAShape) -> float:
    """2 x batch x heads x kv_len x (ckv + kpe + ckv): the score and output products."""
    return 2.0 * s.batch * s.heads * s.kv_len * (2 * s.head_dim_ckv + s.head_dim_kpe)


@dataclass
class MLAData:
    """Inputs of one row on the GPU: q_nope [B, H, ckv], q_pe [B, H, kpe], caches [pages, page,
    ckv] and [pages, page, kpe] in random page order, the page table and the lengths."""

    shape: MLAShape
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor


def make_mla_data(s: MLAShape, device: str = "cuda", seed: int = 0) -> MLAData:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=s.dtype)

    num_pages = s.batch * s.pages_per_request
    i32 = dict(dtype=torch.int32, device=device)
    return MLAData(
        s, randn(s.batch, s.heads, s.head_dim_ckv), randn(s.batch, s.heads, s.head_dim_kpe),
        randn(num_pages, s.page_size, s.head_dim_ckv), randn(num_pages, s.page_size, s.head_dim_kpe),
        qo_indptr=torch.arange(s.batch + 1, **i32),
        kv_indptr=torch.arange(s.batch + 1, **i32) * s.pages_per_request,
        kv_indices=torch.randperm(num_pages, generator=g, device=device).to(torch.int32),
        kv_lens=torch.full((s.batch,), s.kv_len, **i32))


def wrapper_job(mod, backend: str, d: MLAData) -> Job:
    """``mla.BatchMLAPagedAttentionWrapper(workspace, backend=...)``: plan, run."""
    s = d.shape
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=d.q_nope.device)
    wrapper = mod.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    sm_scale = 1.0 / math.sqrt(128 + s.head_dim_kpe)  # DeepSeek's scale before absorption

    def plan():
        wrapper.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.kv_lens, s.heads, s.head_dim_ckv, s.head_dim_kpe,
                     s.page_size, False, sm_scale, s.dtype, s.dtype)

    return Job(run=lambda: wrapper.run(d.q_nope, d.q_pe, d.ckv_cache, d.kpe_cache), plan=plan,
               info=lambda: selected_backend(wrapper))


def our_column(fd, name: str) -> Column:
    return Column(f"fd:{name}", lambda d: wrapper_job(fd, name, d))


def peer_column(fi, name: str) -> Column:
    """FlashInfer's MLA wrapper with ``backend=`` ``fa2`` or ``fa3``."""
    if name not in PEER_COLUMNS:
        raise ValueError(f"FlashInfer MLA peer {name!r}: valid: {', '.join(PEER_COLUMNS)}")
    return Column(f"fi:{name}", lambda d: wrapper_job(fi, name, d))
