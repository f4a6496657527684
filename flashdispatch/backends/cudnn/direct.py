"""FlashInfer's plan-less cuDNN entry points (``cudnn_batch_decode_with_kv_cache``,
``cudnn_batch_prefill_with_kv_cache``), run without reading anything from the device.

The graph bucket comes from host values only: the batch size (rows of the length tensors), the
maxima the caller passes (``max_sequence_kv`` -> max pages, ``max_token_per_sequence`` -> max
query rows), all rounded up to powers of two, except decode's batch, which is exact: its q/out
rows are dense, one per request, as in FlashInfer's decode graph (`plan.bucket_options`).
Lengths, block table and ragged offsets stay on the device: handed to cuDNN as they are when
their shape fits the bucket, else copied into bucket-sized buffers by device ops. Rows that see
no key (kv_len 0; causal rows with p_i < 0) are then set to out 0 / lse -inf by device ops
driven by the same lengths.

What only the device values could prove (lengths within the maxima, page ids within the cache,
offsets within the tensors) is the caller's promise, as in FlashInfer. With the environment
variable FLASHDISPATCH_CHECK_INPUTS=1 (`checks.device_values_checked`) each call reads them back
and checks them (a host sync; skipped while a CUDA graph is being captured).

CUDA graphs: a call can be captured once the graph of its bucket and tensor layout exists, so the
first call of each bucket must run eagerly; a capture that would need a new graph raises.
"""
from __future__ import annotations

import functools

import torch

from ... import checks
from ...dispatch.problem import Problem, device_of
from ...dispatch.reasons import Reason, Unsupported
from . import CudnnBackend, graphs
from .graphs import Geometry, GraphOptions, capturing
from .handles import handle_on_current_stream
from .plan import INT32_MAX, NEG_INF, bucket_options, byte_view, request_rows

DECODE = "cudnn_batch_decode_with_kv_cache"
PREFILL = "cudnn_batch_prefill_with_kv_cache"
ONES_CACHE_SIZE = 64    # decode's [batch] ones kept per (device, stream, batch)


# --- argument checks (host only) ------------------------------------------------------------
def host_scale(scale) -> float:
    """The softmax scale as a float; a device tensor is refused (reading it would be a sync)."""
    if isinstance(scale, torch.Tensor):
        if scale.device.type != "cpu" or scale.numel() != 1:
            raise ValueError(f"scale must be a float or a one-element CPU tensor, got a tensor of shape "
                             f"{list(scale.shape)} on {scale.device}: reading a device scale needs a host sync")
        scale = float(scale)
    if scale is None:
        raise ValueError("scale=None: pass the softmax scale (e.g. 1 / sqrt(head_dim))")
    return checks.check_scale(scale, "scale", 1.0)


def lengths(t, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """``t`` ([batch] or [batch, 1, 1, 1] int32 on ``device``) as a 1-D [batch] view."""
    checks.check_tensor(t, name, dtypes=(torch.int32,), device=device)
    if t.numel() != batch or any(s != 1 for s in t.shape[1:]):
        raise ValueError(f"{name} has shape {list(t.shape)}, expected [{batch}] or [{batch}, 1, 1, 1]")
    return t.reshape(batch)


def offsets(t, name: str, batch: int, device: torch.device) -> torch.Tensor | None:
    """A ragged offset tensor ([batch + 1] or [batch + 1, 1, 1, 1] int32 element offsets) as 1-D."""
    return None if t is None else lengths(t, name, batch + 1, device)


def paged_cache(q: torch.Tensor, k_cache, v_cache, block_tables, max_sequence_kv: int) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim_vo) of HND caches [pages, kv_heads, page_size, dim]; an
    NHD cache is caught here (FlashInfer crashed on it with an illegal memory access)."""
    checks.check_tensor(k_cache, "k_cache", ndim=4, device=q.device)
    checks.check_tensor(v_cache, "v_cache", ndim=4, device=q.device, dtypes=(k_cache.dtype,))
    checks.check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=q.device)
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    hnd = "cuDNN expects HND [pages, kv_heads, page_size, dim]"
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"k_cache.shape[1]={num_kv_heads} (num_kv_heads in HND) does not divide "
                         f"num_qo_heads={q.shape[1]}; {hnd}")
    if block_tables.shape[1] * page_size < max_sequence_kv:
        raise ValueError(f"block_tables holds {block_tables.shape[1]} pages of page_size={page_size} "
                         f"(k_cache.shape[2] in HND), fewer than max_sequence_kv={max_sequence_kv} tokens; "
                         f"is the cache NHD? {hnd}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} differs from q's {q.shape[2]}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache {list(v_cache.shape)} and k_cache {list(k_cache.shape)} differ in "
                         "[pages, kv_heads, page_size]")
    return page_size, num_kv_heads, v_cache.shape[3]


def output(t, name: str, shape: tuple, dtype: torch.dtype, device: torch.device, rows_free: bool = False):
    """``t`` checked (any row count when ``rows_free``: its rows are addressed by offsets), or a new tensor."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    want = (None, *shape[1:]) if rows_free else shape
    checks.check_tensor(t, name, dtypes=(dtype,), device=device, shape=want)
    checks.check_distinct_elements(t, name)
    return t


def check_int32(name: str, rows: int, stride: int) -> None:
    """Refuse a tensor of ``rows`` rows of ``stride`` elements whose element offsets pass int32 (the
    type of cuDNN's ragged offsets); ``name`` names the tensor or its offsets in the error."""
    if rows * stride > INT32_MAX:
        raise ValueError(f"cudnn: {name} spans {rows} rows of {stride} elements, past cuDNN's int32 ragged "
                         f"offsets ({INT32_MAX})")


_SUPPORT: dict[tuple, tuple[Problem, tuple[Reason, ...]]] = {}


def cudnn_problem(what: str, device: torch.device, **fields) -> Problem:
    """The `Problem` of a call, after checking that cudnn can run it (cached per problem)."""
    key = (device, *fields.values())
    hit = _SUPPORT.get(key)
    if hit is None:
        problem = Problem(**fields)
        hit = _SUPPORT[key] = (problem, tuple(CudnnBackend.supports(problem, device_of(device))))
    if hit[1]:
        raise Unsupported(f"{what}: the cudnn backend cannot run this call", {"cudnn": list(hit[1])})
    return hit[0]


# --- device metadata (device ops only) -------------------------------------------------------
@functools.lru_cache(maxsize=ONES_CACHE_SIZE)
def _ones_of_stream(device: torch.device, stream: int, batch: int) -> torch.Tensor:
    """An int32 ones vector of ``batch``, kept per (device, stream, batch) by the LRU cache."""
    return torch.ones(batch, dtype=torch.int32, device=device)


def ones(batch: int, device: torch.device) -> torch.Tensor:
    """[batch] int32 ones: decode's seq_len_q (one query row per request), with no host sync.

    Made on the current stream and kept in a small LRU cache keyed by (device, stream, batch): a
    later call on that stream reads it after its making, in stream order (an evicted one goes back
    to that stream's memory pool, reused in stream order too). During a CUDA-graph capture it is
    made afresh in the graph's memory pool (each replay remakes it) and not cached, so no captured
    graph reads a cached tensor that eviction could free."""
    if capturing(device):
        return torch.ones(batch, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _ones_of_stream(device, stream, batch)


def fit(t: torch.Tensor, n: int) -> torch.Tensor:
    """1-D int32 ``t`` as ``n`` values: itself when it has them contiguously, else zero-padded."""
    if t.numel() == n and t.stride(0) == 1:
        return t
    buf = torch.zeros(n, dtype=torch.int32, device=t.device)
    buf[:t.numel()].copy_(t)
    return buf


def fit_offsets(t: torch.Tensor, n: int) -> torch.Tensor:
    """1-D int32 offsets as ``n`` values: itself when it has them, else padded with its last value
    (the bucket's empty requests start where the batch ends)."""
    if t.numel() == n and t.stride(0) == 1:
        return t
    buf = torch.empty(n, dtype=torch.int32, device=t.device)
    buf[:t.numel()].copy_(t)
    buf[t.numel():].copy_(t[-1:].expand(n - t.numel()))
    return buf


def indptr(lens: torch.Tensor) -> torch.Tensor:
    """[n + 1] int32 prefix sums of the [n] lengths (row offsets of packed requests)."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, dtype=torch.int32, out=out[1:])
    return out


def table_width(block_tables: torch.Tensor, opts: GraphOptions) -> int:
    """The table width the graph declares: the caller's table is passed through when it has the
    bucket's rows, at least its pages and packed rows (0: we fill a [batch, max_pages] copy)."""
    b, w = block_tables.shape
    if b == opts.batch and w >= opts.max_pages and block_tables.stride() == (w, 1):
        return 0 if w == opts.max_pages else w
    return -1


def fitted_table(block_tables: torch.Tensor, opts: GraphOptions, width: int) -> torch.Tensor:
    """The block table handed to cuDNN: the caller's own when `table_width` gave ``width`` >= 0,
    else a zeroed [opts.batch, opts.max_pages] copy of its rows and first columns (device ops)."""
    if width >= 0:
        return block_tables
    b, w = block_tables.shape
    cols = min(w, opts.max_pages)
    buf = torch.zeros(opts.batch, opts.max_pages, dtype=torch.int32, device=block_tables.device)
    buf[:b, :cols].copy_(block_tables[:, :cols])   # columns past a request's pages are never read
    return buf


# --- launch ----------------------------------------------------------------------------------
def ready_graph(what: str, opts: GraphOptions, geo: Geometry, workspace: torch.Tensor):
    """(graph, its slice of the workspace): fetched or built, and the workspace checked, before any
    metadata is written."""
    built, _ = graphs.cached_graph(opts, geo, what)
    need = built.workspace_size
    if workspace.numel() < need:
        raise ValueError(f"workspace_buffer too small for cudnn: {workspace.numel()} bytes, the cuDNN graph "
                         f"needs {need} (graph.get_workspace_size())")
    return built, workspace[:need]


def execute(built: graphs.BuiltGraph, pack: dict, workspace: torch.Tensor, scale: float, device_index) -> None:
    """Run the graph on the current stream (the scale is passed by value)."""
    pack[graphs.UID_SCALE] = torch.full((1, 1, 1, 1), scale, dtype=torch.float32)
    built.graph.execute(pack, workspace, handle=handle_on_current_stream(device_index))


def batch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale, workspace_buffer, *,
                 max_sequence_kv: int, actual_seq_lens_kv, block_tables, cuda_graph: bool, out) -> torch.Tensor:
    """Batch decode through cuDNN; see `flashdispatch.decode.cudnn_batch_decode_with_kv_cache`."""
    checks.check_tensor(q, "q", ndim=3)
    dev = q.device
    batch, num_qo_heads, head_dim = q.shape
    checks.check_positive_int(max_sequence_kv, "max_sequence_kv")
    sm_scale = host_scale(scale)
    if block_tables is None or actual_seq_lens_kv is None:
        raise ValueError(f"{DECODE} needs block_tables and actual_seq_lens_kv")
    page_size, num_kv_heads, head_dim_vo = paged_cache(q, k_cache, v_cache, block_tables, max_sequence_kv)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, but q has batch_size={batch} rows")
    seq_kv = lengths(actual_seq_lens_kv, "actual_seq_lens_kv", batch, dev)
    out = output(out, "out", (batch, num_qo_heads, head_dim_vo), q.dtype, dev)
    workspace = byte_view(checks.check_tensor(workspace_buffer, "workspace_buffer"), "workspace_buffer", dev, 0, "")
    problem = cudnn_problem(DECODE, dev, op="decode", q_dtype=q.dtype, kv_dtype=k_cache.dtype, o_dtype=out.dtype,
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                            head_dim_vo=head_dim_vo, page_size=page_size, kv_layout="HND",
                            use_cuda_graph=cuda_graph, return_lse=False)
    graphs.check_alignment({"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out}, None)
    if batch == 0:
        return out
    if checks.device_values_checked() and not capturing(dev):
        check_lengths_on_host("actual_seq_lens_kv", seq_kv, "max_sequence_kv", max_sequence_kv)
        check_pages_on_host(block_tables, seq_kv, page_size, k_cache.shape[0])
    opts = bucket_options(problem, dev.index, batch=batch, max_q=1, max_kv=max_sequence_kv)
    width = table_width(block_tables, opts)
    geo = Geometry(tuple(q.stride()), tuple(k_cache.shape), tuple(k_cache.stride()), tuple(v_cache.shape),
                   tuple(v_cache.stride()), tuple(out.stride()), None, "HND", max(width, 0))
    built, workspace = ready_graph(DECODE, opts, geo, workspace)
    G, table = graphs, fitted_table(block_tables, opts, width)
    # dense rows (opts.dense_rows): q/out row b is request b, no offsets; the batch is exact
    execute(built, {G.UID_Q: q, G.UID_K: k_cache, G.UID_V: v_cache, G.UID_O: out,
                    G.UID_SEQ_Q: ones(batch, dev), G.UID_SEQ_KV: fit(seq_kv, batch),
                    G.UID_TABLE_K: table, G.UID_TABLE_V: table}, workspace, sm_scale, dev.index)
    out.masked_fill_((seq_kv == 0).view(batch, 1, 1), 0.0)
    return out


def batch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale, workspace_buffer, *,
                  max_token_per_sequence: int, max_sequence_kv: int, actual_seq_lens_q, actual_seq_lens_kv,
                  block_tables, causal: bool, return_lse: bool, batch_offsets: dict, out, lse,
                  cuda_graph: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batch prefill through cuDNN; see `flashdispatch.prefill.cudnn_batch_prefill_with_kv_cache`.
    ``batch_offsets`` maps q/o/k/v/stats to the caller's offset tensor (or None)."""
    checks.check_tensor(q, "q", ndim=3)
    dev = q.device
    total_q, num_qo_heads, head_dim = q.shape
    checks.check_positive_int(max_token_per_sequence, "max_token_per_sequence")
    checks.check_positive_int(max_sequence_kv, "max_sequence_kv")
    sm_scale = host_scale(scale)
    checks.check_tensor(actual_seq_lens_q, "actual_seq_lens_q")
    batch = actual_seq_lens_q.numel()
    seq_q = lengths(actual_seq_lens_q, "actual_seq_lens_q", batch, dev)
    seq_kv = lengths(actual_seq_lens_kv, "actual_seq_lens_kv", batch, dev)
    off = {k: offsets(t, f"batch_offsets_{k}", batch, dev) for k, t in batch_offsets.items()}
    paged = block_tables is not None
    if paged:
        if off["k"] is not None or off["v"] is not None:
            raise Unsupported("batch_offsets_k/v with block_tables: a paged cache is addressed through its "
                              "block table; batch_offsets_k/v are for ragged k/v")
        page_size, num_kv_heads, head_dim_vo = paged_cache(q, k_cache, v_cache, block_tables, max_sequence_kv)
        if block_tables.shape[0] != batch:
            raise ValueError(f"block_tables has {block_tables.shape[0]} rows, but actual_seq_lens_q has "
                             f"batch_size={batch}")
    else:
        checks.check_tensor(k_cache, "k_cache", ndim=3, device=dev, shape=(None, None, head_dim))
        num_kv_heads, page_size = k_cache.shape[1], 0
        checks.check_tensor(v_cache, "v_cache", ndim=3, device=dev, dtypes=(k_cache.dtype,),
                            shape=(None, num_kv_heads, None))
        head_dim_vo = v_cache.shape[2]
        checks.check_heads(num_qo_heads, num_kv_heads)
    out = output(out, "out", (total_q, num_qo_heads, head_dim_vo), q.dtype, dev, rows_free=off["o"] is not None)
    if return_lse:
        lse = output(lse, "lse", (total_q, num_qo_heads), torch.float32, dev, rows_free=off["stats"] is not None)
    else:
        lse = None
    workspace = byte_view(checks.check_tensor(workspace_buffer, "workspace_buffer"), "workspace_buffer", dev, 0, "")
    problem = cudnn_problem(PREFILL, dev, op="prefill_paged" if paged else "prefill_ragged", q_dtype=q.dtype,
                            kv_dtype=k_cache.dtype, o_dtype=out.dtype, num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim_vo,
                            page_size=page_size, kv_layout="HND" if paged else "NHD",
                            mask_mode="causal" if causal else "none", use_cuda_graph=cuda_graph,
                            return_lse=return_lse)
    graphs.check_alignment({"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out}, lse)
    rows = {"q": q, "o": out, "stats": lse, "k": None if paged else k_cache, "v": None if paged else v_cache}
    for key, t in rows.items():
        if t is not None:
            check_int32(f"batch_offsets_{key}" if off[key] is not None else key, t.shape[0], t.stride(0))
    if batch == 0 or total_q == 0:
        return out, lse
    if checks.device_values_checked() and not capturing(dev):
        check_prefill_on_host(seq_q, seq_kv, max_token_per_sequence, max_sequence_kv, rows, off,
                              block_tables, page_size, k_cache.shape[0])
    opts = bucket_options(problem, dev.index, batch=batch, max_q=max_token_per_sequence, max_kv=max_sequence_kv)
    width = table_width(block_tables, opts) if paged else 0
    geo = Geometry(tuple(q.stride()), tuple(k_cache.shape) if paged else None, tuple(k_cache.stride()),
                   tuple(v_cache.shape) if paged else None, tuple(v_cache.stride()), tuple(out.stride()),
                   tuple(lse.stride()) if lse is not None else None, "HND" if paged else "ragged", max(width, 0))
    built, workspace = ready_graph(PREFILL, opts, geo, workspace)
    G, B = graphs, opts.batch
    seq_q, seq_kv = fit(seq_q, B), fit(seq_kv, B)
    packed_rows = off["q"] is None or off["o"] is None or (lse is not None and off["stats"] is None)
    qo = indptr(seq_q) if packed_rows else None
    kv = indptr(seq_kv) if not paged and (off["k"] is None or off["v"] is None) else None

    def offs(key: str, ind: torch.Tensor | None) -> torch.Tensor:
        """[B + 1] element offsets of ``key``'s rows: the caller's, padded, or the packed ``ind``."""
        return fit_offsets(off[key], B + 1) if off[key] is not None else ind * rows[key].stride(0)

    pack = {G.UID_Q: q, G.UID_K: k_cache, G.UID_V: v_cache, G.UID_O: out, G.UID_SEQ_Q: seq_q, G.UID_SEQ_KV: seq_kv,
            G.UID_Q_OFF: offs("q", qo), G.UID_O_OFF: offs("o", qo)}
    if lse is not None:
        pack[G.UID_STATS], pack[G.UID_STATS_OFF] = lse, offs("stats", qo)
    if paged:
        pack[G.UID_TABLE_K] = pack[G.UID_TABLE_V] = fitted_table(block_tables, opts, width)
    else:
        pack[G.UID_K_OFF], pack[G.UID_V_OFF] = offs("k", kv), offs("v", kv)
    execute(built, pack, workspace, sm_scale, dev.index)

    def rows_of(t: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(owned, blind) rows of ``t`` (`request_rows`); a request's first row is its packed prefix
        sum, or the caller's element offset over the row stride."""
        given = pack[G.UID_O_OFF if key == "o" else G.UID_STATS_OFF] if off[key] is not None else None
        starts = qo[:-1] if given is None else torch.div(given[:-1], t.stride(0), rounding_mode="floor")
        return request_rows(starts, seq_q, seq_kv, t.shape[0], causal)

    owned_out, blind_out = rows_of(out, "o")
    out.masked_fill_(blind_out[:, None, None], 0.0)
    if lse is not None:
        # cuDNN's natural-log stats -> base 2 on the requests' rows only: rows of no request (gaps
        # between caller offsets, rows past the packed total) keep what the caller had there
        same_rows = off["o"] is None and off["stats"] is None
        owned, blind_lse = (owned_out, blind_out) if same_rows else rows_of(lse, "stats")
        lse.mul_(torch.where(owned, graphs.LOG2E, 1.0)[:, None])
        lse.masked_fill_(blind_lse[:, None], NEG_INF)
    return out, lse


# --- FLASHDISPATCH_CHECK_INPUTS=1: the device values, read back and checked ----------------------
def _host(t: torch.Tensor) -> list[int]:
    """The values of int tensor ``t`` on the host (a device->host copy: checked mode only)."""
    return t.detach().to("cpu", torch.int64).reshape(-1).tolist()


def check_lengths_on_host(name: str, lens: torch.Tensor, limit_name: str, limit: int) -> list[int]:
    """Read ``lens`` and check each is in [0, limit]; returns them as host ints."""
    values = _host(lens)
    for b, n in enumerate(values):
        if not 0 <= n <= limit:
            raise ValueError(f"{name}[{b}]={n} is outside the accepted range [0, {limit_name}={limit}]")
    return values


def check_pages_on_host(block_tables: torch.Tensor, lens, page_size: int, num_pages: int) -> None:
    """Read the block table and check that the pages each request reads (ceil(lens[b] / page_size)
    first entries of its row) are pages of the cache; ``lens`` host ints or a device tensor."""
    table = block_tables.detach().cpu().tolist()
    for b, n in enumerate(lens if isinstance(lens, list) else _host(lens)):
        used = -(-n // page_size)
        for j, page in enumerate(table[b][:used]):
            if not 0 <= page < num_pages:
                raise ValueError(f"block_tables[{b}, {j}]={page} is not a page of the cache (accepted: 0 <= page < "
                                 f"{num_pages}); request {b} has actual_seq_lens_kv={n}, so it reads {used} pages")


def check_offsets_on_host(name: str, given: torch.Tensor, lens: list[int], t: torch.Tensor) -> None:
    """Offsets in elements: non-decreasing multiples of the row stride, each request inside ``t``."""
    values, stride, rows = _host(given), t.stride(0), t.shape[0]
    for b, n in enumerate(lens):
        start = values[b]
        if start < 0 or start % stride or (b and start < values[b - 1]):
            raise ValueError(f"{name}[{b}]={start} must be a non-decreasing, non-negative multiple of the row "
                             f"stride {stride} (elements)")
        if start // stride + n > rows:
            raise ValueError(f"{name}[{b}]={start} places {n} rows from row {start // stride}, past the "
                             f"{rows} rows of its tensor")


def check_prefill_on_host(seq_q, seq_kv, max_q: int, max_kv: int, rows: dict, off: dict, block_tables,
                          page_size: int, num_pages: int) -> None:
    """Checked mode of `batch_prefill`: lengths within the maxima, pages within the cache, and each
    of q/o/stats/k/v (``rows``: its tensor or None) holding its requests' rows, at the caller's
    offsets (``off``) or packed."""
    q_lens = check_lengths_on_host("actual_seq_lens_q", seq_q, "max_token_per_sequence", max_q)
    kv_lens = check_lengths_on_host("actual_seq_lens_kv", seq_kv, "max_sequence_kv", max_kv)
    if block_tables is not None:
        check_pages_on_host(block_tables, kv_lens, page_size, num_pages)
    for key, t in rows.items():
        if t is None:
            continue
        name, lens = f"batch_offsets_{key}", kv_lens if key in ("k", "v") else q_lens
        if off[key] is not None:
            check_offsets_on_host(name, off[key], lens, t)
        elif sum(lens) > t.shape[0]:
            what = {"q": "q", "o": "out", "stats": "lse", "k": "k_cache", "v": "v_cache"}[key]
            src = "actual_seq_lens_kv" if key in ("k", "v") else "actual_seq_lens_q"
            raise ValueError(f"{src} adds up to {sum(lens)} rows, but {what} has only {t.shape[0]}")
