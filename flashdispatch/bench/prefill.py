"""Prefill: single-request (contiguous K/V) and paged batch rows, with their masks.

Shape syntax: ``N`` or ``Q/K`` is a single prefill (Q query tokens over K keys, K=Q by
default); ``BxQ/K`` is a paged batch of B requests with Q new tokens each and K keys in
total (the new ones included; K=Q by default). Modifiers after ``:``: ``nc`` (not causal),
``w<N>`` (window_left=N), ``mask`` (a custom mask equal to the causal pattern, passed as
a mask so the kernel cannot use the causal shortcut), ``cap<X>`` (logits_soft_cap=X), ``rope``
(pos_encoding_mode ROPE_LLAMA: RoPE applied by the attention call itself).
TFLOP/s = 4 x qo_heads x head_dim x (query-key pairs the mask lets through) / time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .decode import (DTYPE_BYTES, INT32_MAX, MAX_BATCH, MAX_INPUT_BYTES, WORKSPACE_BYTES, api_function, check_limit,
                     selected_backend)
from .matrix import Column, NotApplicable
from .timing import Job

DEFAULT_SHAPES = (
    "4096,16384,16x2048/2048,8x512/8192,64x128/4096,"
    "4096:nc,4096:w1024,8x512/8192:w1024,4096:mask,8x512/8192:mask"
)
BASELINE_ORDER = ["fi:fa2", "fi:fa3", "torch:sdpa-flash", "fd:fa2", "fd:auto"]
PEER_COLUMNS = ("fa2", "fa3", "sdpa-flash", "sdpa-cudnn", "flex")
DEFAULT_PEERS = ("fa2", "sdpa-flash", "sdpa-cudnn", "flex")  # fa3 is opt-in (88-101 s JIT)


@dataclass(frozen=True)
class PrefillShape:
    """One prefill row. ``batch`` 0 means single prefill (contiguous K/V, one request)."""

    batch: int
    qo_len: int
    kv_len: int
    causal: bool = True
    window_left: int = -1
    custom_mask: bool = False
    soft_cap: float = 0.0  # logits_soft_cap (0: none)
    rope: bool = False  # pos_encoding_mode ROPE_LLAMA (rope_scale 1, rope_theta 1e4)
    qo_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    text: str = field(default="", compare=False)

    @property
    def single(self) -> bool:
        return self.batch == 0

    @property
    def requests(self) -> int:
        return max(1, self.batch)

    @property
    def label(self) -> str:
        return self.text

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.kv_len / self.page_size)


def parse_prefill_shapes(text: str, dtype: torch.dtype = torch.bfloat16, heads: tuple[int, int] = (32, 8),
                         head_dim: int = 128, page_size: int = 16) -> list[PrefillShape]:
    """``"4096,16x2048/2048,4096:w1024,8x512/8192:mask"`` -> shapes (see the module doc)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *mods = item.split(":")
        try:
            batch_text, _, lens = head.lower().rpartition("x")
            q_text, _, k_text = lens.partition("/")
            batch = int(batch_text) if batch_text else 0
            qo_len = int(q_text)
            kv_len = int(k_text) if k_text else qo_len
        except ValueError:
            raise ValueError(f"prefill shape {item!r}: expected N, Q/K or BxQ/K with modifiers "
                             f":nc :w<N> :mask :cap<X> :rope, e.g. 4096 or 8x512/8192:w1024") from None
        if (batch_text and batch <= 0) or qo_len <= 0 or kv_len < qo_len:
            raise ValueError(f"prefill shape {item!r}: need batch > 0, qo_len > 0 and kv_len >= qo_len")
        shape = PrefillShape(batch, qo_len, kv_len, qo_heads=heads[0], kv_heads=heads[1], head_dim=head_dim,
                             page_size=page_size, dtype=dtype, text=item)
        for mod in mods:
            if mod == "nc":
                shape = replace(shape, causal=False)
            elif mod == "mask":
                shape = replace(shape, custom_mask=True)
            elif mod.startswith("w") and mod[1:].isdigit():
                shape = replace(shape, window_left=int(mod[1:]))
            elif mod.startswith("cap") and _positive_float(mod[3:]):
                shape = replace(shape, soft_cap=float(mod[3:]))
            elif mod == "rope":
                shape = replace(shape, rope=True)
            else:
                raise ValueError(f"prefill shape {item!r}: unknown modifier {mod!r} (nc, w<N>, mask, cap<X>, rope)")
        check_prefill_limits(f"prefill shape {item!r}", shape)
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"no prefill shapes in {text!r}")
    return shapes


def check_prefill_limits(where: str, s: PrefillShape) -> None:
    """Refuse a row past `decode.MAX_BATCH`, int32 lengths, token counts, cache slots and mask
    bits (FlashInfer's packed-mask offsets), or `decode.MAX_INPUT_BYTES` of q, k and v."""
    check_limit(where, "batch", s.batch, MAX_BATCH, "past any serving batch")
    check_limit(where, "kv_len", s.kv_len, INT32_MAX, "int32 lengths")
    check_limit(where, "query tokens", s.requests * s.qo_len, INT32_MAX, "int32 qo_indptr")
    slots = s.kv_len if s.single else s.batch * s.pages_per_request * s.page_size
    check_limit(where, "KV cache slots", slots, INT32_MAX, "int32 page tables")
    if s.custom_mask:
        check_limit(where, "mask bits", s.requests * s.qo_len * s.kv_len, INT32_MAX, "int32 mask offsets")
    nbytes = (s.requests * s.qo_len * s.qo_heads + 2 * slots * s.kv_heads) * s.head_dim * DTYPE_BYTES[s.dtype]
    check_limit(where, f"q, k and v bytes (heads {s.qo_heads}/{s.kv_heads}, head dim {s.head_dim})", nbytes,
                MAX_INPUT_BYTES, "no GPU holds 1 TiB")


def _positive_float(text: str) -> bool:
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False


def visible_pairs(qo_len: int, kv_len: int, causal: bool, window_left: int = -1) -> int:
    """Query-key pairs one request computes (kv_len >= qo_len): query i sits at
    p = i + kv_len - qo_len and sees keys j < kv_len, j <= p if causal, j >= p - window_left
    if window_left >= 0; summed in closed form over p = kv_len - qo_len .. kv_len - 1."""
    if kv_len < qo_len:
        raise ValueError(f"visible_pairs: kv_len={kv_len} < qo_len={qo_len}")
    first, last = kv_len - qo_len, kv_len - 1
    seen = _range_sum(first + 1, last + 1) if causal else qo_len * kv_len  # keys j <= hi
    if window_left >= 0:  # minus the keys j < p - window_left
        seen -= _range_sum(max(first, window_left + 1) - window_left, last - window_left)
    return seen


def _range_sum(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when hi < lo)."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def prefill_flops(s: PrefillShape) -> float:
    """4 x heads x head_dim x visible pairs (QK^T and PV, 2 FLOPs per multiply-add).
    A ``mask`` row's mask is the causal pattern, so it counts like a causal row."""
    pairs = visible_pairs(s.qo_len, s.kv_len, s.causal or s.custom_mask, s.window_left)
    return 4.0 * s.qo_heads * s.head_dim * pairs * s.requests


def causal_mask(qo_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [qo_len, kv_len], True where key j <= query position (bottom-right aligned)."""
    return torch.ones(qo_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - qo_len)


def pack_bits_little(bits: torch.Tensor) -> torch.Tensor:
    """Flattened booleans packed 8 per byte, first bit in the lowest bit (bitorder="little")."""
    flat = bits.flatten().to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


@dataclass
class PrefillData:
    """Inputs of one row on the GPU. Single: q [Q, qo_heads, d], k/v [K, kv_heads, d].
    Paged: q [B*Q, qo_heads, d], NHD cache [pages, 2, page, kv_heads, d] in random page
    order, CSR page table. ``mask`` is the per-request boolean mask when the row has one."""

    shape: PrefillShape
    q: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    cache: torch.Tensor | None = None
    qo_indptr: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def make_prefill_data(s: PrefillShape, device: str = "cuda", seed: int = 0) -> PrefillData:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=s.dtype)

    q = randn(s.requests * s.qo_len, s.qo_heads, s.head_dim)
    mask = causal_mask(s.qo_len, s.kv_len, device) if s.custom_mask else None
    if s.single:
        return PrefillData(s, q, k=randn(s.kv_len, s.kv_heads, s.head_dim),
                           v=randn(s.kv_len, s.kv_heads, s.head_dim), mask=mask)
    num_pages = s.batch * s.pages_per_request
    i32 = dict(dtype=torch.int32, device=device)
    last = s.kv_len - (s.pages_per_request - 1) * s.page_size
    return PrefillData(
        s, q,
        cache=randn(num_pages, 2, s.page_size, s.kv_heads, s.head_dim),
        qo_indptr=torch.arange(s.batch + 1, **i32) * s.qo_len,
        kv_indptr=torch.arange(s.batch + 1, **i32) * s.pages_per_request,
        kv_indices=torch.randperm(num_pages, generator=g, device=device).to(torch.int32),
        last_page_len=torch.full((s.batch,), last, **i32),
        mask=mask,
    )


def paged_wrapper_job(mod, backend: str, d: PrefillData) -> Job:
    """``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=...)``: plan, run."""
    s = d.shape
    if s.single:
        raise NotApplicable
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=d.q.device)
    wrapper = mod.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    mask = d.mask.flatten().repeat(s.batch) if d.mask is not None else None

    def plan():
        wrapper.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, s.qo_heads, s.kv_heads,
                     s.head_dim, s.page_size, causal=s.causal and mask is None, window_left=s.window_left,
                     custom_mask=mask, logits_soft_cap=s.soft_cap or None, pos_encoding_mode=_pos_encoding(s),
                     q_data_type=s.dtype,
                     kv_data_type=s.dtype)

    return Job(run=lambda: wrapper.run(d.q, d.cache), plan=plan, info=lambda: selected_backend(wrapper))


def single_job(mod, backend: str, d: PrefillData) -> Job:
    """``single_prefill_with_kv_cache(q, k, v, causal=..., backend=...)`` (no plan); a mask
    row passes the mask packed, so packing is not timed."""
    s = d.shape
    if not s.single:
        raise NotApplicable
    fn = api_function(mod, "prefill", "single_prefill_with_kv_cache")
    kwargs = dict(causal=s.causal, window_left=s.window_left, logits_soft_cap=s.soft_cap or None,
                  pos_encoding_mode=_pos_encoding(s), backend=backend)
    if d.mask is not None:
        kwargs.update(causal=False, packed_custom_mask=pack_bits_little(d.mask))
    return Job(run=lambda: fn(d.q, d.k, d.v, **kwargs))


def _pos_encoding(s: PrefillShape) -> str:
    return "ROPE_LLAMA" if s.rope else "NONE"


def our_column(fd, name: str) -> Column:
    def build(d: PrefillData) -> Job:
        return single_job(fd, name, d) if d.shape.single else paged_wrapper_job(fd, name, d)
    return Column(f"fd:{name}", build)


def peer_column(fi, name: str) -> Column:
    """FlashInfer's ``fa2``/``fa3`` through the same API as ours."""
    if name not in ("fa2", "fa3"):
        raise ValueError(f"FlashInfer prefill peer {name!r}: valid: fa2, fa3")
    return Column(f"fi:{name}", our_column(fi, name).build)
