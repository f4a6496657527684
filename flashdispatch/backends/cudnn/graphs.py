"""cuDNN SDPA graphs: the key that identifies one, its construction, and the process-wide cache.

A graph is built for a shape *bucket* (batch, page-table width, max query/KV length rounded up
to powers of two; decode: the exact batch) plus the exact layout of the tensors it reads
(strides, cache pages), so any batch that fits the bucket reuses it: the real lengths travel in
device tensors (seq_len_q/seq_len_kv, ragged offsets, page table), never in the graph.

Layouts handed to cuDNN (its dims are always [batch, heads, seq, dim]):
- decode (``dense_rows``): q/o/lse are *dense*, one row per request at batch stride, the seq
  axis of size 1 given the batch stride too (FlashInfer's decode graph). No ragged offsets: on
  cuDNN 9.x a ragged (THD) graph with one query row runs a generic Ampere-class kernel without
  split-KV and writes the Stats of only the first head of each GQA group, while the dense form
  gets the decode kernels (docs/perf-notes.md, "cudnn decode"). The graph's batch is therefore
  the exact batch (a bucket larger than the tensors would read and write past them).
- otherwise q/o/lse are *ragged*: one row per token, the start of each request given by a
  ragged offset tensor in elements ([batch + 1, 1, 1, 1] int32), so batches padded up to the
  bucket (length 0) can never be read or written. With GQA, lse and at most one row per request
  the declared query length is 2, not 1, to stay off that one-row ragged kernel.
- paged K/V are a container [pages, kv_heads, page_size, dim] (NHD views just have other
  strides) read through a block table [batch, 1, width, 1] int32: width is the bucket's
  max_pages for tables we fill, or the caller's own (wider) table passed through as it is.
- ragged K/V (prefill_ragged) are ragged like q.
- one request of ragged prefill (``single``: what single_prefill_with_kv_cache plans) gets the
  graph PyTorch's cuDNN SDPA builds: q/k/v/o/lse *dense* [1, heads, seq, dim] at the exact
  lengths with the tensors' own strides, no ragged offsets, no sequence-length tensors, no
  padding mask; causal is top-left when qo_len == kv_len (the same diagonal as bottom-right
  there), bottom-right otherwise (dense graphs allow it for qo_len <= kv_len). One graph per
  exact (qo_len, kv_len), like PyTorch's: each new length pays a graph build.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

LOG2E = 1.0 / math.log(2.0)

# Variant-pack uids of the graph's tensors.
UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE = 1, 2, 3, 4, 5, 6
UID_SEQ_Q, UID_SEQ_KV, UID_TABLE_K, UID_TABLE_V = 7, 8, 9, 10
UID_Q_OFF, UID_O_OFF, UID_STATS_OFF, UID_K_OFF, UID_V_OFF = 11, 12, 13, 14, 15

GRAPH_CACHE_SIZE = 256     # FlashInfer's graph_cache size; decode graphs are per exact batch


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two, at least 1."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class GraphOptions:
    """What a plan decides: everything about a graph except the tensors' run-time layout."""

    device_index: int
    dtype: torch.dtype
    paged: bool                # paged container + block table vs ragged K/V
    batch: int                 # bucketed batch size (exact when dense_rows)
    max_q: int                 # bucketed max query rows per request (1 for decode)
    max_pages: int             # bucketed page-table width (paged), 0 otherwise
    max_kv: int                # bucketed max KV length (ragged K/V); max_pages * page_size if paged
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    window_left: int
    return_lse: bool
    cuda_graph: bool
    dense_rows: bool           # q/o/lse one row per request at batch stride, no ragged offsets
    single: bool = False       # one dense request at the exact max_q/max_kv: no offsets, lengths, padding


@dataclass(frozen=True)
class Geometry:
    """The run-time layout the graph is compiled against (element strides, cache size)."""

    q_stride: tuple[int, ...]
    k_shape: tuple[int, ...] | None    # paged caches only: the container's extent
    k_stride: tuple[int, ...]
    v_shape: tuple[int, ...] | None
    v_stride: tuple[int, ...]
    o_stride: tuple[int, ...]
    lse_stride: tuple[int, ...] | None
    layout: str                # "NHD" / "HND" for paged caches, "ragged" otherwise
    table_width: int = 0       # block-table columns (row stride) when >= max_pages; 0: max_pages


@dataclass
class BuiltGraph:
    """A built cuDNN graph, the workspace bytes it needs and the seconds its build took."""

    graph: object
    workspace_size: int
    build_seconds: float


def _data_type(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _rows_bhsd(stride: tuple[int, ...], seq: int, dense: bool = False) -> list[int]:
    """[batch, heads, seq, dim] strides of a [tokens, heads, dim] view (ragged: batch stride = seq
    rows; dense, one row per request: batch and seq strides are both the row stride)."""
    tok, head, dim = stride
    return [tok if dense else seq * tok, head, tok, dim]


def _single_bhsd(stride: tuple[int, ...], seq: int, heads: int) -> list[int]:
    """[1, heads, seq, dim] strides of one request's [tokens, heads, dim] view; the batch stride
    (never used with one request) is the request's extent, so no two axes share a stride."""
    tok, head, dim = stride
    return [max(seq * tok, heads * head), head, tok, dim]


def _cache_bhsd(stride: tuple[int, ...], layout: str) -> list[int]:
    """[pages, kv_heads, page_size, dim] strides of an NHD or HND page view."""
    if layout == "NHD":
        return [stride[0], stride[2], stride[1], stride[3]]
    return list(stride)


def _cache_dims(shape: tuple[int, ...], layout: str) -> list[int]:
    if layout == "NHD":
        return [shape[0], shape[2], shape[1], shape[3]]
    return list(shape)


def declare_graph(opts: GraphOptions, geo: Geometry, handle):
    """The SDPA graph of ``opts`` on tensors of layout ``geo``, declared but not built (a cuDNN
    pygraph: `build_graph` builds it with the heuristics' first plan)."""
    import cudnn

    io = _data_type(opts.dtype)
    f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle,
                      is_cuda_graph_replay_expected=opts.cuda_graph)
    if opts.single:
        _single_graph(g, opts, geo, io, f32, cudnn)
    else:
        _batch_graph(g, opts, geo, io, f32, i32, cudnn)
    return g


def build_graph(opts: GraphOptions, geo: Geometry, handle) -> BuiltGraph:
    """Build (validate, plan, compile) one SDPA graph; raises cudnnGraphNotSupportedError or
    RuntimeError from cuDNN if it cannot."""
    import cudnn

    t0 = time.perf_counter()
    g = declare_graph(opts, geo, handle)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return BuiltGraph(g, int(g.get_workspace_size()), time.perf_counter() - t0)


def _scale_tensor(g, f32):
    """The softmax scale, a float passed by value at each execute."""
    return g.tensor(name="attn_scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32,
                    is_pass_by_value=True, uid=UID_SCALE)


def _single_graph(g, opts: GraphOptions, geo: Geometry, io, f32, cudnn) -> None:
    """One request, dense: PyTorch's cuDNN SDPA graph with FlashInfer's GQA and diagonal."""
    Hq, Hk, S, T = opts.num_qo_heads, opts.num_kv_heads, opts.max_q, opts.max_kv
    dqk, dvo = opts.head_dim_qk, opts.head_dim_vo
    q = g.tensor(name="q", dim=[1, Hq, S, dqk], stride=_single_bhsd(geo.q_stride, S, Hq), data_type=io, uid=UID_Q)
    k = g.tensor(name="k", dim=[1, Hk, T, dqk], stride=_single_bhsd(geo.k_stride, T, Hk), data_type=io, uid=UID_K)
    v = g.tensor(name="v", dim=[1, Hk, T, dvo], stride=_single_bhsd(geo.v_stride, T, Hk), data_type=io, uid=UID_V)
    masking = {}
    if (opts.causal or opts.window_left >= 0) and S != T:   # S == T: top-left is the same diagonal
        masking["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
    if opts.causal:
        masking["diagonal_band_right_bound"] = 0
    if opts.window_left >= 0:
        masking["diagonal_band_left_bound"] = opts.window_left + 1
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=_scale_tensor(g, f32), generate_stats=opts.return_lse,
                      compute_data_type=f32, **masking)
    o.set_output(True).set_dim([1, Hq, S, dvo]).set_stride(_single_bhsd(geo.o_stride, S, Hq)).set_uid(UID_O)
    if opts.return_lse:
        lse_stride = _single_bhsd((*geo.lse_stride, 1), S, Hq)
        stats.set_output(True).set_data_type(f32).set_dim([1, Hq, S, 1]).set_stride(lse_stride).set_uid(UID_STATS)


def _batch_graph(g, opts: GraphOptions, geo: Geometry, io, f32, i32, cudnn) -> None:
    """Bucketed batch: ragged or dense rows, paged or ragged K/V, lengths and padding mask."""
    B, Hq, Hk, S = opts.batch, opts.num_qo_heads, opts.num_kv_heads, opts.max_q
    dqk, dvo = opts.head_dim_qk, opts.head_dim_vo

    def offsets(name: str, uid: int):
        """A [batch + 1] int32 ragged-offset tensor of the graph."""
        return g.tensor(name=name, dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=uid)

    def lengths(name: str, uid: int):
        """A [batch] int32 sequence-length tensor of the graph."""
        return g.tensor(name=name, dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=uid)

    dense = opts.dense_rows
    q = g.tensor(name="q", dim=[B, Hq, S, dqk], stride=_rows_bhsd(geo.q_stride, S, dense), data_type=io, uid=UID_Q)
    if not dense:
        q.set_ragged_offset(offsets("q_offsets", UID_Q_OFF))
    if opts.paged:
        k = g.tensor(name="k_cache", dim=_cache_dims(geo.k_shape, geo.layout),
                     stride=_cache_bhsd(geo.k_stride, geo.layout), data_type=io, uid=UID_K)
        v = g.tensor(name="v_cache", dim=_cache_dims(geo.v_shape, geo.layout),
                     stride=_cache_bhsd(geo.v_stride, geo.layout), data_type=io, uid=UID_V)
        width = geo.table_width or opts.max_pages
        table = dict(dim=[B, 1, width, 1], stride=[width, width, 1, 1], data_type=i32)
        paging = dict(paged_attention_k_table=g.tensor(name="table_k", uid=UID_TABLE_K, **table),
                      paged_attention_v_table=g.tensor(name="table_v", uid=UID_TABLE_V, **table),
                      paged_attention_max_seq_len_kv=opts.max_kv)
    else:
        k = g.tensor(name="k", dim=[B, Hk, opts.max_kv, dqk], stride=_rows_bhsd(geo.k_stride, opts.max_kv),
                     data_type=io, uid=UID_K)
        v = g.tensor(name="v", dim=[B, Hk, opts.max_kv, dvo], stride=_rows_bhsd(geo.v_stride, opts.max_kv),
                     data_type=io, uid=UID_V)
        k.set_ragged_offset(offsets("k_offsets", UID_K_OFF))
        v.set_ragged_offset(offsets("v_offsets", UID_V_OFF))
        paging = {}
    scale = _scale_tensor(g, f32)
    masking = {}
    if opts.causal or opts.window_left >= 0:
        masking["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
    if opts.causal:
        masking["diagonal_band_right_bound"] = 0
    if opts.window_left >= 0:
        # cuDNN masks keys at or before row - left_bound: keeping j >= p - w means w + 1.
        masking["diagonal_band_left_bound"] = opts.window_left + 1
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=scale, generate_stats=opts.return_lse,
                      use_padding_mask=True, seq_len_q=lengths("seq_len_q", UID_SEQ_Q),
                      seq_len_kv=lengths("seq_len_kv", UID_SEQ_KV), compute_data_type=f32,
                      **paging, **masking)
    o.set_output(True).set_dim([B, Hq, S, dvo]).set_stride(_rows_bhsd(geo.o_stride, S, dense)).set_uid(UID_O)
    if not dense:
        o.set_ragged_offset(offsets("o_offsets", UID_O_OFF))
    if opts.return_lse:
        lse_stride = _rows_bhsd((*geo.lse_stride, 1), S, dense)
        stats.set_output(True).set_data_type(f32).set_dim([B, Hq, S, 1]).set_stride(lse_stride).set_uid(UID_STATS)
        if not dense:
            stats.set_ragged_offset(offsets("stats_offsets", UID_STATS_OFF))


def check_alignment(tensors: dict[str, torch.Tensor], lse: torch.Tensor | None) -> None:
    """cuDNN reads with 16-byte vectors: base pointers and row strides must allow it."""
    for name, t in tensors.items():
        elems = 16 // t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]):
            raise ValueError(f"cudnn: {name} needs a contiguous last dim, a 16-byte aligned pointer and strides "
                             f"in multiples of {elems} elements; got strides {tuple(t.stride())}, "
                             f"pointer offset {t.data_ptr() % 16}")
    if lse is not None and lse.stride(-1) != 1:
        raise ValueError(f"cudnn: lse needs a contiguous last dim, got strides {tuple(lse.stride())}")


def check_dense_rows(tensors: dict[str, torch.Tensor | None], batch: int) -> None:
    """A dense-row graph reads and writes rows 0 .. batch - 1 of q/out/lse: each must have them."""
    for name, t in tensors.items():
        if t is not None and t.shape[0] < batch:
            raise ValueError(f"cudnn: {name} has {t.shape[0]} rows, the decode graph addresses one row per "
                             f"request ({batch} requests)")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (never on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class GraphCache:
    """Process-wide LRU cache of built graphs, keyed by (GraphOptions, Geometry)."""

    def __init__(self, capacity: int = GRAPH_CACHE_SIZE):
        self.capacity = capacity
        self._graphs: OrderedDict[tuple[GraphOptions, Geometry], BuiltGraph] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, opts: GraphOptions, geo: Geometry) -> BuiltGraph | None:
        """The graph of this bucket and layout (now the most recently used), or None."""
        with self._lock:
            built = self._graphs.get((opts, geo))
            if built is not None:
                self._graphs.move_to_end((opts, geo))
            return built

    def put(self, opts: GraphOptions, geo: Geometry, built: BuiltGraph) -> None:
        """Keep ``built``, evicting the least recently used graphs past the capacity."""
        with self._lock:
            self._graphs[(opts, geo)] = built
            self._graphs.move_to_end((opts, geo))
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every cached graph."""
        with self._lock:
            self._graphs.clear()


GRAPHS = GraphCache()


def cached_graph(opts: GraphOptions, geo: Geometry, what: str) -> tuple[BuiltGraph, bool]:
    """(graph, built now) for this bucket and layout: from GRAPHS, else built and cached.
    Building cannot be captured in a CUDA graph: during a capture a missing graph is an error."""
    built = GRAPHS.get(opts, geo)
    if built is not None:
        return built, False
    if capturing(torch.device("cuda", opts.device_index)):
        raise RuntimeError(f"cudnn: {what} needs a new cuDNN graph (bucket batch={opts.batch}, max_q={opts.max_q}, "
                           f"max_pages={opts.max_pages}, max_kv={opts.max_kv}), which cannot be built during "
                           "CUDA-graph capture; make one call of this shape bucket eagerly before capturing")
    from .handles import handle_for

    try:
        built = build_graph(opts, geo, handle_for(opts.device_index))
    except Exception as e:  # cudnnGraphNotSupportedError, RuntimeError from the backend
        raise RuntimeError(f"cudnn could not build an SDPA graph for {what} (bucket {opts}, layout {geo}): "
                           f"{type(e).__name__}: {e}") from e
    GRAPHS.put(opts, geo, built)
    return built, True
