"""The cudnn plan: bucket choice, device metadata (block table, lengths, ragged offsets) and run().

plan() decides everything and writes the metadata on the device, stream-ordered and without a
host sync. The metadata lives in the wrapper's int workspace when the wrapper passes one
(``params.int_workspace``: fixed addresses, so a re-plan of the same bucket rewrites what a
captured CUDA graph reads), else in memory the plan owns. The float workspace is only cuDNN's
scratch during run(). run() binds pointers and launches; the single exception is the first
run with a new tensor layout (strides, cache pages), which builds the graph for it and must
therefore happen before any CUDA-graph capture.
"""
from __future__ import annotations

import dataclasses

import torch

from ...dispatch.problem import Device, Problem
from ..base import AttentionInputs, AttentionParams, PagedKV
from . import graphs
from .graphs import Geometry, GraphOptions, pow2_bucket
from .handles import handle_on_current_stream

ALIGN = 256
INT32_MAX = 2**31 - 1
NEG_INF = float("-inf")


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _host_scale(x, name: str) -> float:
    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.device.type != "cpu":
            raise ValueError(f"cudnn: {name} must be a Python float or a one-element CPU tensor "
                             f"(got a tensor of shape {tuple(x.shape)} on {x.device}); a device scale would need "
                             "a host sync")
        return float(x.item())
    return float(x)


def empty_rows(qo_lens: list[int], kv_lens: list[int], causal: bool) -> list[int]:
    """Query rows that see no key: every row of a request with kv_len 0, and, when causal, the
    rows of position p_i = i + kv_len - qo_len < 0."""
    rows, start = [], 0
    for q_len, kv_len in zip(qo_lens, kv_lens):
        blind = q_len if kv_len == 0 else (max(0, q_len - kv_len) if causal else 0)
        rows.extend(range(start, start + min(blind, q_len)))
        start += q_len
    return rows


def bucket_options(problem: Problem, device_index: int, *, batch: int, max_q: int, max_kv: int) -> GraphOptions:
    """The graph bucket of a batch: batch, max query rows and max KV length (pages when paged)
    rounded up to powers of two; the op, dtypes, heads, mask and lse come from ``problem``.

    Decode has dense rows (one per request, no ragged offsets: the layout that gets cuDNN's decode
    kernels) and therefore the exact batch. Ragged rows with GQA, lse and at most one row per
    request declare two query rows: cuDNN's one-row ragged kernel writes the lse of only the first
    head of each GQA group (graphs.py)."""
    paged = problem.op != "prefill_ragged"
    dense = problem.op == "decode"
    max_pages = pow2_bucket(-(-max_kv // problem.page_size)) if paged else 0
    rows = 1 if dense else pow2_bucket(max_q)
    if rows == 1 and not dense and problem.return_lse and problem.num_qo_heads != problem.num_kv_heads:
        rows = 2
    return GraphOptions(
        device_index=device_index, dtype=problem.q_dtype, paged=paged,
        batch=max(batch, 1) if dense else pow2_bucket(batch), max_q=rows, max_pages=max_pages,
        max_kv=max_pages * problem.page_size if paged else pow2_bucket(max_kv),
        num_qo_heads=problem.num_qo_heads, num_kv_heads=problem.num_kv_heads,
        head_dim_qk=problem.head_dim_qk, head_dim_vo=problem.head_dim_vo,
        page_size=problem.page_size if paged else 0, causal=problem.mask_mode == "causal",
        window_left=problem.window_left, return_lse=problem.return_lse, cuda_graph=problem.use_cuda_graph,
        dense_rows=dense)


def single_options(problem: Problem, device_index: int, qo_lens: list[int], kv_lens: list[int]) -> GraphOptions | None:
    """The exact dense graph of a ragged prefill of one request (graphs.py, ``single``), or None
    where it does not apply: other ops, CUDA graphs (a re-plan must reuse the captured graph),
    empty requests, and a causal or windowed request with more queries than keys (cuDNN's dense
    bottom-right diagonal needs qo_len <= kv_len; such requests have rows that see no key)."""
    if problem.op != "prefill_ragged" or problem.use_cuda_graph or len(qo_lens) != 1:
        return None
    q_len, kv_len = qo_lens[0], kv_lens[0]
    masked = problem.mask_mode == "causal" or problem.window_left >= 0
    if q_len == 0 or kv_len == 0 or (masked and q_len > kv_len):
        return None
    bucket = bucket_options(problem, device_index, batch=1, max_q=q_len, max_kv=kv_len)
    return dataclasses.replace(bucket, max_q=q_len, max_kv=kv_len, single=True)


def graph_options(problem: Problem, device: Device, params: AttentionParams) -> GraphOptions:
    """The bucket a plan's graph is built for (from the plan's host lengths)."""
    return bucket_options(problem, device.index, batch=params.batch_size,
                          max_q=max(params.qo_lens_host, default=0), max_kv=max(params.kv_lens_host, default=0))


def request_rows(starts: torch.Tensor, seq_q: torch.Tensor, seq_kv: torch.Tensor, n_rows: int,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned, blind): bool [n_rows] on the device, with device ops only. Request b owns rows
    starts[b] .. starts[b] + seq_q[b] - 1 (``starts`` non-decreasing, requests with rows not
    overlapping; a request with no rows may start anywhere); ``owned`` marks the rows of some
    request. ``blind`` marks the owned rows that see no key: row i of request b when seq_kv[b] == 0
    or, causal, when i + seq_kv[b] - seq_q[b] < 0."""
    rows = torch.arange(n_rows, device=starts.device, dtype=starts.dtype)
    # the request of a row is the first whose end lies past it (running max: empty requests
    # starting inside an earlier request's rows end before it)
    ends = torch.cummax(starts + seq_q, 0).values
    req = torch.searchsorted(ends, rows, right=True).clamp_(max=starts.numel() - 1)
    i = rows - starts[req]
    q_len, kv_len = seq_q[req], seq_kv[req]
    owned = (i >= 0) & (i < q_len)
    blind = i + kv_len < q_len if causal else kv_len == 0
    return owned, blind & owned


def blind_rows(starts: torch.Tensor, seq_q: torch.Tensor, seq_kv: torch.Tensor, n_rows: int,
               causal: bool) -> torch.Tensor:
    """The ``blind`` mask of `request_rows`: rows of a request that see no key (others False)."""
    return request_rows(starts, seq_q, seq_kv, n_rows, causal)[1]


class _Metadata:
    """int32 device slots carved from one byte buffer: lengths, block table, row offsets (none for
    q/o/lse when the graph has dense rows)."""

    def __init__(self, buf: torch.Tensor, opts: GraphOptions):
        self.slots: dict[str, torch.Tensor] = {}
        off = 0
        for name, n in self.sizes(opts).items():
            self.slots[name] = buf[off:off + 4 * n].view(torch.int32)
            off += _aligned(4 * n)
        self.nbytes = off
        self.stride_of: dict[str, int] = {}   # the element stride each offset slot was computed for

    @staticmethod
    def sizes(opts: GraphOptions) -> dict[str, int]:
        """int32 element count of each slot the graph of ``opts`` reads."""
        B = opts.batch
        sizes = {"seq_q": B, "seq_kv": B, "qo_indptr": B + 1}
        if not opts.dense_rows:
            sizes.update(q_off=B + 1, o_off=B + 1, lse_off=B + 1)
        if opts.paged:
            sizes["table"] = B * opts.max_pages
        else:
            sizes.update(kv_indptr=B + 1, k_off=B + 1, v_off=B + 1)
        return sizes

    @staticmethod
    def size(opts: GraphOptions) -> int:
        """Bytes of all slots, each aligned to ALIGN."""
        return sum(_aligned(4 * n) for n in _Metadata.sizes(opts).values())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.slots[name]


def _pad_indptr(dst: torch.Tensor, indptr: torch.Tensor, batch: int) -> None:
    dst[:batch + 1].copy_(indptr)
    dst[batch + 1:].copy_(indptr[batch:batch + 1].expand(dst.numel() - batch - 1))


def byte_view(buf: torch.Tensor, name: str, dev: torch.device, need: int, what: str) -> torch.Tensor:
    """``buf`` as a flat uint8 tensor, checked to be contiguous, on ``dev`` and ``need`` bytes long."""
    if not buf.is_contiguous() or buf.device != dev:
        raise ValueError(f"{name} must be a contiguous tensor on {dev}, got device {buf.device}, "
                         f"strides {tuple(buf.stride())}")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() < need:
        raise ValueError(f"{name} too small for cudnn: {flat.numel()} bytes, {what} needs {need}")
    return flat


class CudnnPlan:
    """A planned cuDNN SDPA call. ``build_seconds``: graph-build time spent for this plan (0.0
    when every graph it used came from the cache)."""

    def __init__(self, problem: Problem, device: Device, params: AttentionParams):
        if not device.is_cuda:
            raise ValueError(f"cudnn plans need a CUDA device, got {device.describe()}")
        self.problem, self.device = problem, device
        self.opts = graph_options(problem, device, params)
        # one request: the dense exact-length graph, when run() gets tensors holding just its rows
        self.single_opts = single_options(problem, device.index, params.qo_lens_host, params.kv_lens_host)
        self.batch_size = params.batch_size
        self.total_q = sum(params.qo_lens_host)
        self.total_kv = sum(params.kv_lens_host)
        self.sm_scale = params.sm_scale
        self.build_seconds = 0.0
        self._bound: tuple[tuple[Geometry, GraphOptions], graphs.BuiltGraph] | None = None
        dev = torch.device("cuda", device.index)

        meta_bytes = _Metadata.size(self.opts)
        int_ws = getattr(params, "int_workspace", None)
        meta_buf = (byte_view(int_ws, "int_workspace_buffer", dev, meta_bytes, "the plan's metadata")[:meta_bytes]
                    if int_ws is not None else torch.empty(meta_bytes, dtype=torch.uint8, device=dev))
        self.meta = _Metadata(meta_buf, self.opts)
        self._owns_workspace = params.workspace is None
        self._graph_workspace = (None if params.workspace is None else
                                 byte_view(params.workspace, "float_workspace_buffer", dev, 0, ""))
        self._fill_metadata(params)

        # Rows that see no key come out of cuDNN as NaN/garbage: zero them (lse -inf). Eagerly only
        # the rows this plan has (none, usually); under CUDA graphs, found on the device at each
        # replay, since a re-plan replayed by the same graph may have others.
        rows = empty_rows(params.qo_lens_host, params.kv_lens_host, self.opts.causal)
        self._empty_rows = (torch.tensor(rows, dtype=torch.long, device=dev) if rows and not self.opts.cuda_graph
                            else None)
        self._scale_host = torch.empty((1, 1, 1, 1), dtype=torch.float32)

    # --- plan time ------------------------------------------------------------------------
    def _fill_metadata(self, params: AttentionParams) -> None:
        m, B = self.meta, params.batch_size
        qo = params.qo_indptr
        m["seq_q"][:B].copy_(qo[1:] - qo[:-1])
        m["seq_q"][B:].zero_()
        m["seq_kv"][:B].copy_(params.kv_lens)
        m["seq_kv"][B:].zero_()
        _pad_indptr(m["qo_indptr"], qo, B)
        p = self.problem
        if not self.opts.dense_rows:
            self._set_offsets("q_off", "qo_indptr", p.num_qo_heads * p.head_dim_qk, self.total_q)
            self._set_offsets("o_off", "qo_indptr", p.num_qo_heads * p.head_dim_vo, self.total_q)
            self._set_offsets("lse_off", "qo_indptr", p.num_qo_heads, self.total_q)
        if self.opts.paged:
            self._fill_block_table(params)
        else:
            _pad_indptr(m["kv_indptr"], params.kv_indptr, B)
            self._set_offsets("k_off", "kv_indptr", p.num_kv_heads * p.head_dim_qk, self.total_kv)
            self._set_offsets("v_off", "kv_indptr", p.num_kv_heads * p.head_dim_vo, self.total_kv)

    def _fill_block_table(self, params: AttentionParams) -> None:
        B, P = params.batch_size, self.opts.max_pages
        table = self.meta["table"].view(self.opts.batch, P)
        table.zero_()   # rows past the batch and columns past a request's pages read page 0, never used
        indices = params.kv_indices
        if B == 0 or indices is None or indices.numel() == 0:
            return
        indptr = params.kv_indptr.long()
        counts = indptr[1:] - indptr[:-1]
        cols = torch.arange(P, device=indptr.device)
        gather = (indptr[:-1, None] + cols[None, :]).clamp_(max=indices.numel() - 1)
        table[:B].copy_(torch.where(cols[None, :] < counts[:, None], indices[gather], 0))

    def _set_offsets(self, slot: str, indptr: str, stride: int, total: int) -> None:
        """offsets[b] = indptr[b] * stride, in elements, for the element stride of one row."""
        if total * stride > INT32_MAX:
            raise ValueError(f"cudnn: {slot.removesuffix('_off')} spans {total} rows of {stride} elements, "
                             f"past cuDNN's int32 ragged offsets ({INT32_MAX})")
        torch.mul(self.meta[indptr], stride, out=self.meta[slot])
        self.meta.stride_of[slot] = stride

    # --- run time ---------------------------------------------------------------------------
    def _geometry(self, inputs: AttentionInputs) -> Geometry:
        kv = inputs.kv
        lse_stride = tuple(inputs.lse.stride()) if inputs.lse is not None and self.opts.return_lse else None
        layout = kv.layout if isinstance(kv, PagedKV) else "ragged"
        if self.opts.paged != isinstance(kv, PagedKV):
            raise ValueError(f"cudnn plan for {self.problem.op} got {type(kv).__name__} inputs")
        if isinstance(kv, PagedKV) and layout != self.problem.kv_layout:
            raise ValueError(f"cudnn plan for kv_layout={self.problem.kv_layout} got a {layout} cache")
        paged = isinstance(kv, PagedKV)
        return Geometry(tuple(inputs.q.stride()), tuple(kv.k.shape) if paged else None, tuple(kv.k.stride()),
                        tuple(kv.v.shape) if paged else None, tuple(kv.v.stride()), tuple(inputs.out.stride()),
                        lse_stride, layout)

    def _bind(self, geo: Geometry, opts: GraphOptions) -> graphs.BuiltGraph:
        if self._bound is not None and self._bound[0] == (geo, opts):
            return self._bound[1]
        built, fresh = graphs.cached_graph(opts, geo, self.problem.describe())
        if fresh:
            self.build_seconds += built.build_seconds
        self._bound = ((geo, opts), built)
        return built

    def _cudnn_workspace(self, built: graphs.BuiltGraph) -> torch.Tensor:
        need = built.workspace_size
        if self._owns_workspace and (self._graph_workspace is None or self._graph_workspace.numel() < need):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("cudnn: the plan's private workspace must grow, which cannot happen during "
                                   "CUDA-graph capture; run once eagerly before capturing")
            self._graph_workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=self.meta["seq_q"].device)
        if self._graph_workspace.numel() < need:
            raise ValueError(f"float_workspace_buffer too small for cudnn: {self._graph_workspace.numel()} bytes, "
                             f"the cuDNN graph needs {need} (graph.get_workspace_size())")
        return self._graph_workspace[:need]

    def _refresh_offsets(self, inputs: AttentionInputs) -> None:
        """Recompute the offsets whose row stride differs from the one they hold (no allocation)."""
        rows = []
        if not self.opts.dense_rows:
            rows += [("q_off", "qo_indptr", inputs.q.stride(0), self.total_q),
                     ("o_off", "qo_indptr", inputs.out.stride(0), self.total_q)]
            if inputs.lse is not None and self.opts.return_lse:
                rows.append(("lse_off", "qo_indptr", inputs.lse.stride(0), self.total_q))
        if not self.opts.paged:
            rows += [("k_off", "kv_indptr", inputs.kv.k.stride(0), self.total_kv),
                     ("v_off", "kv_indptr", inputs.kv.v.stride(0), self.total_kv)]
        for slot, indptr, stride, total in rows:   # under CUDA graphs always: a re-plan resets them
            if self.opts.cuda_graph or self.meta.stride_of[slot] != stride:
                self._set_offsets(slot, indptr, stride, total)

    def run(self, inputs: AttentionInputs) -> None:
        """Write inputs.out (and inputs.lse, base 2). Capturable in a CUDA graph once warmed up."""
        if self.total_q == 0:
            return
        want_lse = inputs.lse is not None
        if want_lse and not self.opts.return_lse:
            raise ValueError("cudnn plan made with return_lse=False got an lse tensor")
        # checked before anything runs: a device scale is refused (it would need a host sync)
        scale = self.sm_scale * _host_scale(inputs.q_scale, "q_scale") * _host_scale(inputs.k_scale, "k_scale")
        # the dense graph addresses rows from 0: only when q/k hold exactly the request's rows
        # (indptr starting at 0); else the bucket's ragged graph, which reads the offsets
        single = (self.single_opts is not None and inputs.q.shape[0] == self.total_q
                  and inputs.kv.k.shape[0] == self.total_kv)
        base = self.single_opts if single else self.opts
        # a plan that may return lse runs the graph without stats when this call wants none
        opts = base if want_lse == base.return_lse else dataclasses.replace(base, return_lse=False)
        graphs.check_alignment({"q": inputs.q, "k": inputs.kv.k, "v": inputs.kv.v, "out": inputs.out},
                               inputs.lse if self.opts.return_lse else None)
        if self.opts.dense_rows:
            graphs.check_dense_rows({"q": inputs.q, "out": inputs.out, "lse": inputs.lse}, self.opts.batch)
        built = self._bind(self._geometry(inputs), opts)
        workspace = self._cudnn_workspace(built)
        self._scale_host.fill_(scale)
        G = graphs
        pack = {G.UID_Q: inputs.q, G.UID_K: inputs.kv.k, G.UID_V: inputs.kv.v, G.UID_O: inputs.out,
                G.UID_SCALE: self._scale_host}
        if want_lse:
            pack[G.UID_STATS] = inputs.lse
        if not single:
            self._refresh_offsets(inputs)
            self._bind_metadata(pack, want_lse)
        handle = handle_on_current_stream(self.device.index)
        built.graph.execute(pack, workspace, handle=handle)
        self._finish(inputs)

    def _bind_metadata(self, pack: dict, want_lse: bool) -> None:
        """Add the bucket graph's lengths, offsets and block table to the variant pack."""
        m, G = self.meta, graphs
        pack[G.UID_SEQ_Q], pack[G.UID_SEQ_KV] = m["seq_q"], m["seq_kv"]
        dense = self.opts.dense_rows
        if not dense:
            pack[G.UID_Q_OFF], pack[G.UID_O_OFF] = m["q_off"], m["o_off"]
        if self.opts.paged:
            pack[G.UID_TABLE_K] = pack[G.UID_TABLE_V] = m["table"]
        else:
            pack[G.UID_K_OFF], pack[G.UID_V_OFF] = m["k_off"], m["v_off"]
        if want_lse and not dense:
            pack[G.UID_STATS_OFF] = m["lse_off"]

    def _finish(self, inputs: AttentionInputs) -> None:
        """Base-2 lse, v_scale, and out 0 / lse -inf on rows that see no key."""
        if inputs.lse is not None:
            inputs.lse.mul_(graphs.LOG2E)
        if inputs.v_scale is not None and not (isinstance(inputs.v_scale, float | int) and inputs.v_scale == 1):
            inputs.out.mul_(inputs.v_scale)
        if self._empty_rows is not None:
            inputs.out.index_fill_(0, self._empty_rows, 0.0)
            if inputs.lse is not None:
                inputs.lse.index_fill_(0, self._empty_rows, NEG_INF)
        elif self.opts.cuda_graph:
            blind = self._blind_rows_on_device(inputs.out.shape[0])
            inputs.out.masked_fill_(blind[:, None, None], 0.0)
            if inputs.lse is not None:
                inputs.lse.masked_fill_(blind[:, None], NEG_INF)

    def _blind_rows_on_device(self, n_rows: int) -> torch.Tensor:
        """bool [n_rows]: rows that see no key, from the lengths in the metadata slots."""
        m = self.meta
        return blind_rows(m["qo_indptr"][:-1], m["seq_q"], m["seq_kv"], n_rows, self.opts.causal)
