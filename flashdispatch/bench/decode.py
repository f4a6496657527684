"""Batch decode over a paged KV cache: shapes, inputs, and one job builder per API.

Every builder takes the attention module (``flashdispatch`` or ``flashinfer``: the same
API) and runs one call of it, so our backends and FlashInfer's run the same code path.
TB/s counts the KV bytes read once: the requests' tokens (batch x kv_len, or the drawn lengths
of a ``:var`` row) x kv_heads x head_dim x 2 (K and V) x bytes per element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .matrix import Column, NotApplicable
from .timing import Job, graphed

WORKSPACE_BYTES = 128 * 1024 * 1024

# ANCHORS.md's matrix (bf16, 32/8 heads, d128, page 16), then fp8 e4m3 KV, MHA (32/32) and mixed
# lengths (a serving batch: one wave of requests, then past it)
DEFAULT_SHAPES = (
    "1x32768,16x8192,64x4096,128x2048,256x1024,64x16384,256x4096,"
    "64x4096:fp8,256x4096:fp8,16x8192:mha,64x4096:mha,48x4096:var,128x4096:var,128x4096:var:fp8"
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KV_MODS = {"fp8": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
VAR_SEED = 20261201  # the draw of a ``:var`` row's lengths
DTYPE_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1, torch.float8_e5m2: 1}

# Limits of a row (decode and prefill), checked when its shape is parsed, before anything is
# allocated: lengths, indptrs, page tables and cache slots are int32 in our kernels and
# FlashInfer's; no GPU holds 1 TiB (the largest hold 288 GB), so bigger inputs can only fail;
# a million requests is far past any serving batch, and the host builds per-request arrays.
INT32_MAX = 2**31 - 1
MAX_INPUT_BYTES = 2**40
MAX_BATCH = 2**20


@dataclass(frozen=True)
class DecodeShape:
    """One decode row: ``batch`` requests of ``kv_len`` tokens each (one query token); with
    ``var``, lengths drawn uniformly from 1 .. 2 x kv_len - 1 (mean ~kv_len, the same draw in
    every run and process: a serving batch's mix of short and long requests)."""

    batch: int
    kv_len: int
    qo_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16  # q and output
    kv_dtype: torch.dtype = torch.bfloat16
    var: bool = False
    rope: bool = False  # pos_encoding_mode ROPE_LLAMA (rope_scale 1, rope_theta 1e4)
    mods: tuple[str, ...] = field(default=(), compare=False)

    @property
    def label(self) -> str:
        return ":".join([f"{self.batch}x{self.kv_len}", *self.mods])

    def kv_lens(self) -> np.ndarray:
        """Each request's KV length (int64)."""
        if not self.var:
            return np.full(self.batch, self.kv_len, dtype=np.int64)
        return np.random.default_rng(VAR_SEED).integers(1, 2 * self.kv_len, self.batch, dtype=np.int64)


def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> (32, 8); the query heads must be a multiple of the KV heads."""
    try:
        qo, kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"heads={text!r}: expected QO/KV, e.g. 32/8") from None
    if qo <= 0 or kv <= 0 or qo % kv:
        raise ValueError(f"heads={text!r}: query heads must be a positive multiple of KV heads")
    return qo, kv


def parse_decode_shapes(text: str, dtype: torch.dtype = torch.bfloat16, heads: tuple[int, int] = (32, 8),
                        head_dim: int = 128, page_size: int = 16) -> list[DecodeShape]:
    """``"64x4096,256x1024:fp8,16x8192:mha,36x4096:var"`` -> shapes. Modifiers after ``:``:
    ``fp8`` (= ``e4m3``) or ``e5m2`` KV, ``mha`` (as many KV heads as query heads), ``var``
    (lengths drawn around kv_len, see `DecodeShape`), ``rope`` (RoPE applied in the kernel)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *mods = item.split(":")
        try:
            batch, kv_len = (int(x) for x in head.lower().split("x"))
        except ValueError:
            raise ValueError(f"decode shape {item!r}: expected BATCHxKV_LEN[:fp8|e5m2|mha|var|rope], "
                             "e.g. 64x4096") from None
        if batch <= 0 or kv_len <= 0:
            raise ValueError(f"decode shape {item!r}: batch and kv_len must be positive")
        shape = DecodeShape(batch, kv_len, heads[0], heads[1], head_dim, page_size, dtype, dtype)
        for mod in mods:
            if mod in KV_MODS:
                shape = replace(shape, kv_dtype=KV_MODS[mod])
            elif mod == "mha":
                shape = replace(shape, kv_heads=shape.qo_heads)
            elif mod in ("var", "rope"):
                shape = replace(shape, **{mod: True})
            else:
                raise ValueError(f"decode shape {item!r}: unknown modifier {mod!r} (fp8, e4m3, e5m2, mha, var, rope)")
        check_decode_limits(f"decode shape {item!r}", shape)
        shapes.append(replace(shape, mods=tuple(mods)))
    if not shapes:
        raise ValueError(f"no decode shapes in {text!r}")
    return shapes


def check_limit(where: str, what: str, value: int, limit: int, why: str) -> None:
    """ValueError ``"<where>: <what> <value> > <limit> (<why>)"`` when ``value > limit``."""
    if value > limit:
        raise ValueError(f"{where}: {what} {value} > {limit} ({why})")


def check_decode_limits(where: str, s: DecodeShape) -> None:
    """Refuse a row past `MAX_BATCH`, int32 lengths and cache slots, or `MAX_INPUT_BYTES` of KV."""
    check_limit(where, "batch", s.batch, MAX_BATCH, "past any serving batch")
    check_limit(where, "kv_len", s.kv_len, INT32_MAX, "int32 lengths")
    slots = int((-(-s.kv_lens() // s.page_size)).sum()) * s.page_size
    check_limit(where, "KV cache slots (pages x page size)", slots, INT32_MAX, "int32 page tables")
    check_limit(where, f"KV cache bytes ({s.kv_heads} KV heads, head dim {s.head_dim})",
                slots * kv_bytes_per_token(s), MAX_INPUT_BYTES, "no GPU holds 1 TiB")


def kv_bytes_per_token(s: DecodeShape) -> int:
    return s.kv_heads * s.head_dim * 2 * DTYPE_BYTES[s.kv_dtype]


def kv_bytes(s: DecodeShape) -> int:
    """Bytes of K and V a decode call must read."""
    return int(s.kv_lens().sum()) * kv_bytes_per_token(s)


@dataclass
class DecodeData:
    """Inputs of one row on the GPU: NHD cache [pages, 2, page, kv_heads, dim] with pages in
    random order, q [batch, qo_heads, dim], the page table in CSR and as a block table
    [batch, max_pages] (a shorter request's row padded with page 0, never read), and the
    lengths ``seq_lens`` [batch]."""

    shape: DecodeShape
    q: torch.Tensor
    cache: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    _hnd: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.head_dim)

    @property
    def max_kv_len(self) -> int:
        return int(self.shape.kv_lens().max())

    def hnd(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous HND copies of K and V ([pages, kv_heads, page, dim]), made once."""
        if self._hnd is None:
            self._hnd = tuple(self.cache[:, i].transpose(1, 2).contiguous() for i in (0, 1))
        return self._hnd


def make_decode_data(s: DecodeShape, device: str = "cuda", seed: int = 0) -> DecodeData:
    g = torch.Generator(device=device).manual_seed(seed)
    lens = s.kv_lens()
    pages = -(-lens // s.page_size)
    num_pages = int(pages.sum())
    indices = torch.randperm(num_pages, generator=g, device=device).to(torch.int32)
    indptr_h = np.concatenate([[0], pages.cumsum()])
    i32 = dict(dtype=torch.int32, device=device)
    indptr = torch.tensor(indptr_h, **i32)
    last_page_len = torch.tensor(lens - (pages - 1) * s.page_size, **i32)
    width = int(pages.max())
    columns = np.arange(width)
    at = np.where(columns < pages[:, None], indptr_h[:-1, None] + columns, -1)  # [batch, width] into indices
    block_tables = torch.where(torch.tensor(at >= 0, device=device),
                               indices[torch.tensor(np.maximum(at, 0), device=device)], 0).to(torch.int32)
    cache = torch.randn(num_pages, 2, s.page_size, s.kv_heads, s.head_dim, generator=g, device=device,
                        dtype=s.dtype).to(s.kv_dtype)
    q = torch.randn(s.batch, s.qo_heads, s.head_dim, generator=g, device=device, dtype=s.dtype)
    return DecodeData(s, q, cache, indptr, indices, last_page_len, block_tables.contiguous(),
                      torch.tensor(lens, **i32))


def api_function(mod, submodule: str, name: str):
    """``mod.<name>`` or ``mod.<submodule>.<name>``; NotImplementedError if neither exists."""
    fn = getattr(mod, name, None) or getattr(getattr(mod, submodule, None), name, None)
    if fn is None:
        raise NotImplementedError(f"{mod.__name__} has no {name}")
    return fn


def wrapper_job(mod, backend: str, d: DecodeData, cuda_graph: bool = False, **wrapper_kwargs) -> Job:
    """``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", backend=...)``: plan, run.
    ``cuda_graph``: a ``use_cuda_graph=True`` wrapper with its own fixed index buffers, whose
    run() is captured once and replayed (`graphed`), as serving engines run decode."""
    s = d.shape
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=d.q.device)
    if cuda_graph:
        wrapper_kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(d.indptr),
                              paged_kv_indices_buffer=torch.empty_like(d.indices),
                              paged_kv_last_page_len_buffer=torch.empty_like(d.last_page_len))
    wrapper = mod.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", backend=backend, **wrapper_kwargs)

    def plan():
        wrapper.plan(d.indptr, d.indices, d.last_page_len, s.qo_heads, s.kv_heads, s.head_dim,
                     s.page_size, pos_encoding_mode="ROPE_LLAMA" if s.rope else "NONE", q_data_type=s.dtype,
                     kv_data_type=s.kv_dtype)

    job = Job(run=lambda: wrapper.run(d.q, d.cache), plan=plan, info=lambda: selected_backend(wrapper))
    return _maybe_graphed(job, cuda_graph)


def selected_backend(wrapper) -> str:
    """``"selected <name>"`` for our wrappers (they expose the plan's ``decision``), else ""."""
    decision = getattr(wrapper, "decision", None)
    return f"selected {decision.backend}" if decision is not None else ""


def cudnn_fn_job(mod, d: DecodeData) -> Job:
    """``cudnn_batch_decode_with_kv_cache`` on an HND cache (no plan; no RoPE argument)."""
    s = d.shape
    if s.rope:
        raise NotApplicable
    fn = api_function(mod, "decode", "cudnn_batch_decode_with_kv_cache")
    k, v = d.hnd()
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=d.q.device)
    seq_lens, max_len = d.seq_lens.view(s.batch, 1, 1, 1), d.max_kv_len
    return Job(run=lambda: fn(d.q, k, v, d.sm_scale, workspace, max_sequence_kv=max_len,
                              actual_seq_lens_kv=seq_lens, block_tables=d.block_tables))


def block_table_fn_job(mod, d: DecodeData, backend: str) -> Job:
    """``trtllm_batch_decode_with_kv_cache(..., kv_layout="NHD", backend=backend)`` (no plan; no
    RoPE argument)."""
    if d.shape.rope:
        raise NotApplicable
    fn = api_function(mod, "decode", "trtllm_batch_decode_with_kv_cache")
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=d.q.device)
    kv, max_len = (d.cache[:, 0], d.cache[:, 1]), d.max_kv_len
    return Job(run=lambda: fn(d.q, kv, workspace, d.block_tables, d.seq_lens, max_len, bmm1_scale=d.sm_scale,
                              bmm2_scale=1.0, kv_layout="NHD", backend=backend))


# Our columns that call an API function instead of the wrapper, and the backend behind them:
# cudnn_batch_decode_with_kv_cache, and the block-table function trtllm_batch_decode_with_kv_cache.
OUR_FUNCTION_COLUMNS = {"cudnn-fn": "cudnn", "xqa-fn": "xqa", "fa2-fn": "fa2"}
PEER_COLUMNS = ("fa2-cc", "fa2-tc", "cudnn-fn", "xqa-fn")
# The baseline of the err column: FlashInfer's tensor-core decode when it ran.
BASELINE_ORDER = ["fi:fa2-tc", "fi:fa2-cc", "fd:fa2", "fd:auto"]


def our_column(fd, name: str, cuda_graph: bool = False) -> Column:
    """Our column ``name`` (a backend through the wrapper, or an API function column);
    ``cuda_graph``: each call a CUDA-graph replay (`wrapper_job`, `graphed`)."""
    if name == "cudnn-fn":
        return Column(f"fd:{name}", lambda d: _maybe_graphed(cudnn_fn_job(fd, d), cuda_graph))
    if name in OUR_FUNCTION_COLUMNS:
        backend = OUR_FUNCTION_COLUMNS[name]
        return Column(f"fd:{name}", lambda d: _maybe_graphed(block_table_fn_job(fd, d, backend), cuda_graph))
    return Column(f"fd:{name}", lambda d: wrapper_job(fd, name, d, cuda_graph))


def peer_column(fi, name: str, cuda_graph: bool = False) -> Column:
    """FlashInfer's column ``name`` (`PEER_COLUMNS`), replayed from a CUDA graph with ``cuda_graph``."""
    builders = {
        "fa2-cc": lambda d: wrapper_job(fi, "fa2", d, cuda_graph, use_tensor_cores=False),
        "fa2-tc": lambda d: wrapper_job(fi, "fa2", d, cuda_graph, use_tensor_cores=True),
        "cudnn-fn": lambda d: _maybe_graphed(cudnn_fn_job(fi, d), cuda_graph),
        "xqa-fn": lambda d: _maybe_graphed(block_table_fn_job(fi, d, "xqa"), cuda_graph),
    }
    if name not in builders:
        raise ValueError(f"decode peer {name!r}: valid: {', '.join(builders)}")
    return Column(f"fi:{name}", builders[name])


def _maybe_graphed(job: Job, cuda_graph: bool) -> Job:
    return graphed(job) if cuda_graph else job
