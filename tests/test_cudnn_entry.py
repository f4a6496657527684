"""The plan-less cuDNN entry points without a GPU: argument checks, bucket choice, and the device
metadata they hand to cuDNN, checked by running them on CPU tensors with the cuDNN graph replaced
by an emulator of its semantics (reading only the variant pack), compared with the float64 oracle.
Also: no call reads a device value (the host-read methods raise during the call), rows of out/lse
that belong to no request keep what the caller had there, and FLASHDISPATCH_CHECK_INPUTS=1 reports
bad lengths, pages and offsets by name."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

import flashdispatch as fi
from flashdispatch import checks
from flashdispatch.backends.base import AttentionInputs, AttentionParams, PagedKV, RaggedKV
from flashdispatch.backends.cudnn import CudnnBackend, direct, graphs
from flashdispatch.backends.cudnn.plan import blind_rows, bucket_options, empty_rows, request_rows
from flashdispatch.dispatch.entry_paths import selects_cudnn_direct
from flashdispatch.dispatch.problem import Problem
from flashdispatch.page import block_table_to_indptr
from tests.oracle import oracle_attention, rel_err

WS = torch.zeros(1 << 16, dtype=torch.uint8)
G = graphs


# --- a CPU stand-in for the cuDNN graph ---------------------------------------------------------
class HostReadGuard:
    """While ``active``, the methods that read a tensor's values on the host raise."""

    METHODS = ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        self.active = False
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._guarded(name, original))

    def _guarded(self, name, original):
        def method(t, *args, **kwargs):
            if self.active:
                raise AssertionError(f"host read: Tensor.{name}() during the call")
            return original(t, *args, **kwargs)
        return method

    @contextlib.contextmanager
    def on(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    @contextlib.contextmanager
    def off(self):
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


def _view(t: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """``rows`` rows of ``t`` from element offset ``offset`` (cuDNN's ragged addressing)."""
    return t.as_strided((rows, *t.shape[1:]), t.stride(), t.storage_offset() + offset)


def row_offsets(opts: graphs.GraphOptions, geo: graphs.Geometry, pack: dict) -> tuple[list, list, list | None]:
    """Element offsets of each request's first q/o/lse row: dense rows (decode) at b x the row stride
    the graph was built for, with no offset tensor in the pack; else the ragged offset tensors."""
    B, has_lse = opts.batch, G.UID_STATS in pack
    if opts.dense_rows:
        assert not {G.UID_Q_OFF, G.UID_O_OFF, G.UID_STATS_OFF} & pack.keys(), "dense rows take no offsets"
        assert opts.max_q == 1
        assert pack[G.UID_Q].stride(0) == geo.q_stride[0] and pack[G.UID_O].stride(0) == geo.o_stride[0]
        return ([b * geo.q_stride[0] for b in range(B)], [b * geo.o_stride[0] for b in range(B)],
                [b * geo.lse_stride[0] for b in range(B)] if has_lse else None)
    q_off, o_off = pack[G.UID_Q_OFF].tolist(), pack[G.UID_O_OFF].tolist()
    assert len(q_off) == len(o_off) == B + 1
    return q_off, o_off, pack[G.UID_STATS_OFF].tolist() if has_lse else None


def emulate_sdpa(opts: graphs.GraphOptions, geo: graphs.Geometry, pack: dict) -> None:
    """What the graph computes, from the variant pack alone: padded requests, dense or ragged rows,
    block table, bottom-right causal; rows that see no key come out NaN (as garbage would). Rows are
    read and written through as_strided, which raises for a row past its tensor's storage."""
    B, S, group = opts.batch, opts.max_q, opts.num_qo_heads // opts.num_kv_heads
    seq_q, seq_kv = pack[G.UID_SEQ_Q].tolist(), pack[G.UID_SEQ_KV].tolist()
    assert len(seq_q) == len(seq_kv) == B
    q_off, o_off, stats_off = row_offsets(opts, geo, pack)
    lse = pack.get(G.UID_STATS)
    scale = float(pack[G.UID_SCALE].reshape(-1)[0])
    q, k, v, out = pack[G.UID_Q], pack[G.UID_K], pack[G.UID_V], pack[G.UID_O]
    if opts.paged:
        width = geo.table_width or opts.max_pages
        table = pack[G.UID_TABLE_K]
        assert table is pack[G.UID_TABLE_V] and table.numel() == B * width
        table = table.reshape(B, width).tolist()
    for b in range(B):
        n_q, n_kv = seq_q[b], seq_kv[b]
        assert 0 <= n_q <= S and 0 <= n_kv <= opts.max_kv, (b, n_q, n_kv)
        if n_q == 0:
            continue
        if opts.paged:
            pages = table[b][:-(-n_kv // opts.page_size)]
            keys = k[pages].permute(0, 2, 1, 3).reshape(-1, *k.shape[1::2])[:n_kv]
            vals = v[pages].permute(0, 2, 1, 3).reshape(-1, *v.shape[1::2])[:n_kv]
        else:
            k_off, v_off = pack[G.UID_K_OFF].tolist(), pack[G.UID_V_OFF].tolist()
            keys, vals = _view(k, k_off[b], n_kv), _view(v, v_off[b], n_kv)
        qb = _view(q, q_off[b], n_q).double()
        keys = keys.double().repeat_interleave(group, dim=1)
        vals = vals.double().repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb, keys) * scale
        i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
        if opts.causal:
            s = s.masked_fill(j > i + n_kv - n_q, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)                      # natural log, -inf when blind
        o = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), vals)
        o[torch.isinf(row_lse).T] = float("nan")
        _view(out, o_off[b], n_q).copy_(o)
        if lse is not None:
            _view(lse, stats_off[b], n_q).copy_(torch.where(torch.isinf(row_lse), float("nan"), row_lse).T)


@pytest.fixture
def fake_cudnn(monkeypatch):
    """cudnn 'available', graphs emulated on the CPU; records each (opts, geometry, pack)."""
    calls, guard = [], HostReadGuard(monkeypatch)

    def cached_graph(opts, geo, what):
        def execute(pack, workspace, handle=None):
            calls.append(SimpleNamespace(opts=opts, geo=geo, pack=dict(pack), workspace=workspace))
            with guard.off():
                emulate_sdpa(opts, geo, pack)
        return graphs.BuiltGraph(SimpleNamespace(execute=execute), 1024, 0.0), False

    monkeypatch.setattr(CudnnBackend, "supports", classmethod(lambda cls, problem, device: []))
    monkeypatch.setattr(direct, "_SUPPORT", {})
    monkeypatch.setattr(graphs, "cached_graph", cached_graph)
    monkeypatch.setattr(direct, "handle_on_current_stream", lambda index: None)
    monkeypatch.delenv(checks.CHECK_INPUTS_ENV, raising=False)
    return SimpleNamespace(calls=calls, guard=guard)


# --- test data ----------------------------------------------------------------------------------
def paged_data(kv_lens, *, heads=(4, 2), dim=16, page_size=4, width=None, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    width = width or max(pages + [1])
    total = sum(pages) + 3
    order = torch.randperm(total, generator=g)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n].to(torch.int32)
        table[b, n:] = 999_999                              # never read: past the request's pages
        used += n
    k = torch.randn(total, heads[1], page_size, dim, generator=g).to(dtype)
    v = torch.randn(total, heads[1], page_size, dim, generator=g).to(dtype)
    return k, v, table, torch.tensor(kv_lens, dtype=torch.int32).view(-1, 1, 1, 1)


def reference(qo_lens, kv_lens, q, k, v, table, *, causal, scale, page_size=None):
    """float64 oracle (out, lse base 2) of the same call, paged (table given) or ragged."""
    hq, dqk = q.shape[1:]
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    if table is not None:
        indptr, indices, last = block_table_to_indptr(table, torch.tensor(kv_lens), page_size)[:3]
        params = AttentionParams(qo_indptr=qo, kv_indptr=indptr, kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                                 qo_lens_host=qo_lens, kv_lens_host=kv_lens, sm_scale=scale, kv_indices=indices,
                                 kv_last_page_len=last)
        kv, op, hk, dvo = PagedKV(k, v, "HND"), "prefill_paged", k.shape[1], v.shape[3]
    else:
        params = AttentionParams(qo_indptr=qo, kv_indptr=torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32),
                                 kv_lens=torch.tensor(kv_lens, dtype=torch.int32), qo_lens_host=qo_lens,
                                 kv_lens_host=kv_lens, sm_scale=scale)
        kv, op, hk, dvo, page_size = RaggedKV(k, v), "prefill_ragged", k.shape[1], v.shape[2], 0
    problem = Problem(op, q.dtype, q.dtype, q.dtype, hq, hk, dqk, dvo, page_size=page_size, kv_layout="HND",
                      mask_mode="causal" if causal else "none")
    return oracle_attention(problem, params, AttentionInputs(q, kv, None, None))


def check(out, lse, ref_out, ref_lse):
    assert not out.isnan().any() and rel_err(out, ref_out) < 4e-3
    blind = torch.isinf(ref_lse).all(dim=1)
    assert (out[blind] == 0).all()
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and (lse[torch.isinf(lse)] < 0).all()
        finite = torch.isfinite(ref_lse)
        assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-2


def nan_like(shape, dtype=torch.float16):
    return torch.full(shape, float("nan"), dtype=dtype)


GAP = 7.0   # a finite sentinel in rows that belong to no request (NaN would survive a rescale)


def sentinel_gaps(shape, request_rows, dtype=torch.float16):
    """NaN in ``request_rows`` (the call must write them), GAP elsewhere (it must leave them)."""
    t = torch.full(shape, GAP, dtype=dtype)
    t[list(request_rows)] = float("nan")
    return t


# --- argument checks (no cudnn needed) -----------------------------------------------------------
def decode_args(**kw):
    k, v, table, lens = paged_data([40, 33])
    args = dict(q=torch.randn(2, 4, 16).half(), k_cache=k, v_cache=v, scale=0.25, workspace_buffer=WS,
                max_sequence_kv=48, actual_seq_lens_kv=lens, block_tables=torch.zeros(2, 12, dtype=torch.int32))
    args.update(kw)
    return args


@pytest.mark.parametrize("change,error,match", [
    (dict(k_cache=torch.randn(10, 4, 2, 16).half()), ValueError, "cuDNN expects HND"),
    (dict(scale=torch.tensor(0.25, device="meta")), ValueError, "scale must be a float or a one-element CPU"),
    (dict(scale=None), ValueError, "scale=None"),
    (dict(actual_seq_lens_kv=torch.tensor([40, 33])), TypeError, "actual_seq_lens_kv.dtype=int64"),
    (dict(actual_seq_lens_kv=torch.tensor([40, 33, 1], dtype=torch.int32)), ValueError, r"expected \[2\] or"),
    (dict(block_tables=torch.zeros(3, 12, dtype=torch.int32)), ValueError, "block_tables has 3 rows"),
    (dict(block_tables=None), ValueError, "needs block_tables and actual_seq_lens_kv"),
    (dict(max_sequence_kv=0), ValueError, "max_sequence_kv=0"),
    (dict(out=torch.empty(2, 4, 8).half()), ValueError, r"out has shape \[2, 4, 8\]"),
    (dict(out=torch.empty(2, 4, 16)), TypeError, "out.dtype=float32"),
    (dict(v_cache=torch.randn(11, 2, 4, 16).half()), ValueError, "v_cache .* and k_cache .* differ"),
    (dict(batch_offsets_q=torch.zeros(3, dtype=torch.int32)), fi.Unsupported, "batch_offsets"),
    (dict(workspace_buffer=torch.zeros(64, 2)[:, 0]), ValueError, "workspace_buffer must be a contiguous"),
])
def test_decode_argument_errors(change, error, match):
    with pytest.raises(error, match=match):
        fi.cudnn_batch_decode_with_kv_cache(**decode_args(**change))


def test_decode_without_cudnn_is_unsupported_naming_cudnn():
    for graph_compatible in (False, True):
        with pytest.raises(fi.Unsupported, match="cudnn") as e:
            fi.cudnn_batch_decode_with_kv_cache(**decode_args(), is_cuda_graph_compatible=graph_compatible)
        assert "is_cuda_graph_compatible" not in str(e.value), "capture is supported: only cudnn is missing"


def prefill_args(**kw):
    args = dict(q=torch.randn(7, 4, 16).half(), k_cache=torch.randn(9, 2, 16).half(),
                v_cache=torch.randn(9, 2, 16).half(), scale=0.25, workspace_buffer=WS, max_token_per_sequence=5,
                max_sequence_kv=6, actual_seq_lens_q=torch.tensor([3, 4], dtype=torch.int32),
                actual_seq_lens_kv=torch.tensor([3, 6], dtype=torch.int32), causal=True, return_lse=True)
    args.update(kw)
    return args


@pytest.mark.parametrize("change,error,match", [
    (dict(k_cache=torch.randn(9, 2, 8).half()), ValueError, r"k_cache has shape \[9, 2, 8\]"),
    (dict(v_cache=torch.randn(9, 3, 16).half()), ValueError, r"v_cache has shape \[9, 3, 16\]"),
    (dict(k_cache=torch.randn(9, 3, 16).half(), v_cache=torch.randn(9, 3, 16).half()), ValueError,
     "num_qo_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(lse=torch.empty(7, 4, 1)), ValueError, r"lse has shape \[7, 4, 1\]"),
    (dict(out=torch.empty(6, 4, 16).half()), ValueError, r"out has shape \[6, 4, 16\]"),
    (dict(actual_seq_lens_kv=torch.tensor([3], dtype=torch.int32)), ValueError, "actual_seq_lens_kv has shape"),
    (dict(max_token_per_sequence=-1), ValueError, "max_token_per_sequence=-1"),
    (dict(batch_offsets_o=torch.zeros(2, dtype=torch.int32)), ValueError, r"batch_offsets_o has shape \[2\]"),
    (dict(k_cache=torch.randn(3, 2, 4, 16).half(), v_cache=torch.randn(3, 2, 4, 16).half(),
          block_tables=torch.zeros(2, 2, dtype=torch.int32), batch_offsets_k=torch.zeros(3, dtype=torch.int32)),
     fi.Unsupported, "batch_offsets_k/v with block_tables"),
    (dict(backend="fa2", is_cuda_graph_compatible=True), fi.Unsupported, "reads the lengths on the host"),
])
def test_prefill_argument_errors(change, error, match):
    with pytest.raises(error, match=match):
        fi.cudnn_batch_prefill_with_kv_cache(**prefill_args(**change))


def test_prefill_without_cudnn_is_unsupported():
    with pytest.raises(fi.Unsupported, match="the cudnn backend cannot run"):
        fi.cudnn_batch_prefill_with_kv_cache(**prefill_args(is_cuda_graph_compatible=True))


def test_backend_names_of_the_cudnn_path():
    assert all(selects_cudnn_direct(name) for name in (None, "cudnn", "cubin"))
    assert not any(selects_cudnn_direct(name) for name in ("fa2", "reference", "auto"))


def test_check_inputs_settings(monkeypatch):
    """One variable, two readers: page-index checks on unless "0", device-value checks only with "1"."""
    for value, pages, values in ((None, True, False), ("0", False, False), ("1", True, True), ("2", True, False)):
        if value is None:
            monkeypatch.delenv(checks.CHECK_INPUTS_ENV, raising=False)
        else:
            monkeypatch.setenv(checks.CHECK_INPUTS_ENV, value)
        assert (checks.page_indices_checked(), checks.device_values_checked()) == (pages, values), value


def test_prefill_through_another_backend_still_runs():
    args = prefill_args(backend="reference")
    out, lse = fi.cudnn_batch_prefill_with_kv_cache(**args)
    ref_out, ref_lse = reference([3, 4], [3, 6], args["q"], args["k_cache"], args["v_cache"], None, causal=True,
                                 scale=0.25)
    check(out, lse, ref_out, ref_lse)


# --- bucket choice ----------------------------------------------------------------------------
def entry_problem(op="decode", **kw):
    base = dict(op=op, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16, num_qo_heads=32,
                num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=0 if op == "prefill_ragged" else 16,
                kv_layout="HND", return_lse=False)
    base.update(kw)
    return Problem(**base)


def test_bucket_from_host_maxima():
    o = bucket_options(entry_problem(), 0, batch=64, max_q=1, max_kv=4096)
    assert (o.batch, o.max_q, o.max_pages, o.max_kv) == (64, 1, 256, 4096)
    o = bucket_options(entry_problem(), 0, batch=100, max_q=1, max_kv=4000)          # 250 pages
    assert (o.batch, o.max_pages, o.max_kv, o.dense_rows) == (100, 256, 4096, True), "decode: exact batch"
    o = bucket_options(entry_problem(page_size=64), 0, batch=3, max_q=1, max_kv=65)
    assert (o.batch, o.max_pages, o.max_kv) == (3, 2, 128)
    o = bucket_options(entry_problem("prefill_paged"), 0, batch=100, max_q=3, max_kv=4000)
    assert (o.batch, o.max_q, o.max_pages, o.dense_rows) == (128, 4, 256, False)
    o = bucket_options(entry_problem("prefill_ragged", mask_mode="causal"), 0, batch=5, max_q=100, max_kv=3000)
    assert (o.batch, o.max_q, o.max_pages, o.max_kv, o.causal) == (8, 128, 0, 4096, True)


def test_table_passes_through_only_when_it_fits_the_bucket():
    o = bucket_options(entry_problem(), 0, batch=4, max_q=1, max_kv=64)              # 4 rows, 4 pages
    assert direct.table_width(torch.zeros(4, 4, dtype=torch.int32), o) == 0           # as the bucket
    assert direct.table_width(torch.zeros(4, 6, dtype=torch.int32), o) == 6           # wider: declared
    assert direct.table_width(torch.zeros(4, 3, dtype=torch.int32), o) == -1          # narrower: copy
    assert direct.table_width(torch.zeros(3, 4, dtype=torch.int32), o) == -1          # fewer rows: copy
    assert direct.table_width(torch.zeros(4, 8, dtype=torch.int32)[:, :5], o) == -1   # rows not packed
    narrow = torch.arange(6, dtype=torch.int32).view(3, 2)
    filled = direct.fitted_table(narrow, o, -1)
    assert filled.tolist() == [[0, 1, 0, 0], [2, 3, 0, 0], [4, 5, 0, 0], [0, 0, 0, 0]]


def test_padding_helpers():
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert direct.fit(lens, 3) is lens
    assert direct.fit(lens, 4).tolist() == [3, 0, 5, 0]
    assert direct.indptr(direct.fit(lens, 4)).tolist() == [0, 3, 3, 8, 8]
    assert direct.fit_offsets(torch.tensor([0, 6, 10], dtype=torch.int32), 5).tolist() == [0, 6, 10, 10, 10]
    assert direct.ones(3, torch.device("cpu")).tolist() == [1, 1, 1]


def test_ones_are_cached_per_stream_and_bounded():
    cpu = torch.device("cpu")
    assert direct.ones(5, cpu) is direct.ones(5, cpu)
    for batch in range(1, direct.ONES_CACHE_SIZE + 10):
        direct.ones(batch, cpu)
    assert direct._ones_of_stream.cache_info().currsize <= direct.ONES_CACHE_SIZE


@pytest.mark.parametrize("seed", range(5))
def test_blind_rows_match_the_host_rule(seed):
    g = torch.Generator().manual_seed(seed)
    qo = torch.randint(0, 6, (7,), generator=g)
    kv = torch.randint(0, 6, (7,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), qo.cumsum(0)[:-1]]).to(torch.int32)
    n = int(qo.sum())
    for causal in (False, True):
        got = blind_rows(starts, qo.to(torch.int32), kv.to(torch.int32), n + 2, causal)
        want = torch.zeros(n + 2, dtype=torch.bool)
        want[empty_rows(qo.tolist(), kv.tolist(), causal)] = True
        assert torch.equal(got, want)


def test_request_rows_with_gaps_and_empty_requests_inside_others():
    """Caller offsets: gaps between requests, an empty request starting inside another's rows,
    rows past the last request; only the requests' rows are owned."""
    starts = torch.tensor([1, 3, 6, 6, 12], dtype=torch.int32)
    seq_q = torch.tensor([4, 0, 3, 0, 0], dtype=torch.int32)     # rows 1-4, 6-8
    seq_kv = torch.tensor([0, 5, 2, 1, 0], dtype=torch.int32)
    owned, blind = request_rows(starts, seq_q, seq_kv, 14, causal=True)
    assert owned.nonzero().view(-1).tolist() == [1, 2, 3, 4, 6, 7, 8]
    assert blind.nonzero().view(-1).tolist() == [1, 2, 3, 4, 6]    # request 0: no keys; 2: row 0 at p = -1


# --- the calls, on the CPU emulator ----------------------------------------------------------
@pytest.mark.parametrize("kv_lens,width,fused_qkv", [([40, 0, 16, 1], None, False), ([40, 0, 16, 1, 9], None, True),
                                                     ([7, 30], 16, False)])
def test_decode_metadata_gives_the_oracle_and_reads_nothing(fake_cudnn, kv_lens, width, fused_qkv):
    k, v, table, lens = paged_data(kv_lens, width=width)
    batch = len(kv_lens)
    # fused: q sliced out of a [batch, q + k + v heads, dim] projection (row stride 8 x 16, not 4 x 16)
    q = torch.randn(batch, 8, 16).half()[:, :4] if fused_qkv else torch.randn(batch, 4, 16).half()
    out = nan_like((batch, 4, 16))
    args = dict(max_sequence_kv=max(kv_lens), actual_seq_lens_kv=lens, block_tables=table, out=out)
    with fake_cudnn.guard.on():
        result = fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.25, WS, **args)
    assert result is out
    ref_out, ref_lse = reference([1] * batch, kv_lens, q, k, v, table, causal=False, scale=0.25, page_size=4)
    check(out, None, ref_out, ref_lse)
    call = fake_cudnn.calls[-1]
    assert call.opts.dense_rows and call.opts.batch == batch and call.geo.q_stride == tuple(q.stride())
    assert (call.pack[G.UID_TABLE_K] is table) == (table.shape[1] >= call.opts.max_pages)
    assert call.pack[G.UID_SEQ_KV].data_ptr() == lens.data_ptr(), "the caller's lengths, as they are"


def test_first_call_of_a_new_batch_size_reads_nothing(fake_cudnn, monkeypatch):
    """Nothing is made once with a sync: a batch size never seen before runs with every host read
    (and torch.cuda's synchronize calls) raising."""
    def no_sync(*args, **kwargs):
        raise AssertionError("synchronize() during the call")

    for target in (torch.cuda, torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(target, "synchronize", no_sync)
    direct._ones_of_stream.cache_clear()
    for batch in (11, 13):
        k, v, table, lens = paged_data(list(range(3, 3 + batch)))
        q = torch.randn(batch, 4, 16).half()
        out = nan_like((batch, 4, 16))
        with fake_cudnn.guard.on():
            fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.25, WS, max_sequence_kv=3 + batch,
                                                actual_seq_lens_kv=lens, block_tables=table, out=out)
        assert fake_cudnn.calls[-1].opts.batch == batch
        check(out, None, *reference([1] * batch, list(range(3, 3 + batch)), q, k, v, table, causal=False,
                                    scale=0.25, page_size=4))


def test_decode_buckets_share_a_graph_key_and_mark_cuda_graphs(fake_cudnn):
    """Decode graphs: the exact batch (dense rows), KV pages rounded up to a power of two."""
    keys = []
    for kv_lens, max_kv in (([40, 3, 5], 48), ([2, 9, 33], 60), ([2, 9, 33, 1], 48)):
        k, v, table, lens = paged_data(kv_lens, width=16)
        q = torch.randn(len(kv_lens), 4, 16).half()
        fi.cudnn_batch_decode_with_kv_cache(q, k, v, 0.25, WS, max_sequence_kv=max_kv, actual_seq_lens_kv=lens,
                                            block_tables=table, is_cuda_graph_compatible=True)
        call = fake_cudnn.calls[-1]
        keys.append((call.opts, call.geo.q_stride, call.geo.table_width))
    assert keys[0] == keys[1] and keys[0][0].cuda_graph and keys[0][0].batch == 3 and keys[0][0].max_pages == 16
    assert keys[2][0].batch == 4 and keys[2] != keys[0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_prefill_gives_the_oracle_and_reads_nothing(fake_cudnn, paged, causal):
    qo_lens, kv_lens = [3, 7, 0, 2, 4], [9, 5, 4, 0, 4]       # req 1: more rows than keys; 3: no keys
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(qo_lens), 4, 16, generator=g).half()
    if paged:
        k, v, table, lens_kv = paged_data(kv_lens, width=5)
    else:
        k, v = (torch.randn(sum(kv_lens), 2, 16, generator=g).half() for _ in range(2))
        table, lens_kv = None, torch.tensor(kv_lens, dtype=torch.int32).view(-1, 1, 1, 1)
    lens_q = torch.tensor(qo_lens, dtype=torch.int32).view(-1, 1, 1, 1)
    out, lse = nan_like((q.shape[0], 4, 16)), nan_like((q.shape[0], 4), torch.float32)
    args = dict(max_token_per_sequence=8, max_sequence_kv=12, actual_seq_lens_q=lens_q, actual_seq_lens_kv=lens_kv,
                block_tables=table, causal=causal, return_lse=True, out=out, lse=lse)
    with fake_cudnn.guard.on():
        result = fi.cudnn_batch_prefill_with_kv_cache(q, k, v, 0.25, WS, **args)
    assert result[0] is out and result[1] is lse
    ref_out, ref_lse = reference(qo_lens, kv_lens, q, k, v, table, causal=causal, scale=0.25, page_size=4)
    check(out, lse, ref_out, ref_lse)
    assert fake_cudnn.calls[-1].opts.max_q == 8 and fake_cudnn.calls[-1].opts.batch == 8


@pytest.mark.parametrize("heads,declared", [((4, 2), 2), ((2, 2), 1)])
def test_one_row_prefill_declares_two_rows_for_gqa_lse(fake_cudnn, heads, declared):
    """At most one query row per request with GQA and lse: the graph declares two rows (cuDNN's
    one-row ragged kernel writes the lse of the first head of each group only); MHA keeps one."""
    qo_lens, kv_lens = [1, 0, 1], [5, 3, 0]
    q = torch.randn(2, heads[0], 16).half()
    k, v = (torch.randn(8, heads[1], 16).half() for _ in range(2))
    out, lse = nan_like((2, heads[0], 16)), nan_like((2, heads[0]), torch.float32)
    fi.cudnn_batch_prefill_with_kv_cache(q, k, v, 0.25, WS, max_token_per_sequence=1, max_sequence_kv=5,
                                         actual_seq_lens_q=torch.tensor(qo_lens, dtype=torch.int32),
                                         actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32), causal=True,
                                         return_lse=True, out=out, lse=lse)
    assert fake_cudnn.calls[-1].opts.max_q == declared and not fake_cudnn.calls[-1].opts.dense_rows
    check(out, lse, *reference(qo_lens, kv_lens, q, k, v, None, causal=True, scale=0.25))


def test_prefill_with_caller_offsets_places_rows(fake_cudnn):
    """batch_offsets_q/o/stats/k/v: each request's rows start where the caller says (gaps allowed)."""
    qo_lens, kv_lens, h, d = [3, 0, 4], [5, 2, 6], 4, 16
    q_rows, o_rows, kv_rows = [0, 4, 4], [1, 5, 6], [2, 8, 10]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(9, h, d, generator=g).half()
    k, v = (torch.randn(16, 2, d, generator=g).half() for _ in range(2))
    rows = [r for s, n in zip(o_rows, qo_lens) for r in range(s, s + n)]
    gaps = [r for r in range(11) if r not in rows]
    out, lse = sentinel_gaps((11, h, d), rows), sentinel_gaps((11, h), rows, torch.float32)

    def off(starts, total, stride):
        return torch.tensor(starts + [total], dtype=torch.int32) * stride

    args = dict(max_token_per_sequence=4, max_sequence_kv=6, actual_seq_lens_q=torch.tensor(qo_lens, dtype=torch.int32),
                actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32), causal=True, return_lse=True,
                batch_offsets_q=off(q_rows, 9, h * d), batch_offsets_o=off(o_rows, 11, h * d),
                batch_offsets_stats=off(o_rows, 11, h), batch_offsets_k=off(kv_rows, 16, 2 * d),
                batch_offsets_v=off(kv_rows, 16, 2 * d), out=out, lse=lse)
    with fake_cudnn.guard.on():
        fi.cudnn_batch_prefill_with_kv_cache(q, k, v, 0.25, WS, **args)
    packed_q = torch.cat([q[s:s + n] for s, n in zip(q_rows, qo_lens)])
    packed_k = torch.cat([k[s:s + n] for s, n in zip(kv_rows, kv_lens)])
    packed_v = torch.cat([v[s:s + n] for s, n in zip(kv_rows, kv_lens)])
    ref_out, ref_lse = reference(qo_lens, kv_lens, packed_q, packed_k, packed_v, None, causal=True, scale=0.25)
    check(out[rows], lse[rows], ref_out, ref_lse)
    assert (out[gaps] == GAP).all() and (lse[gaps] == GAP).all(), "rows of no request keep their values"


@pytest.mark.parametrize("stats_offsets", [False, True])
def test_rows_past_the_requests_keep_their_values(fake_cudnn, stats_offsets):
    """Packed rows past sum(actual_seq_lens_q), and lse rows between caller offsets that differ from
    out's, are neither written nor rescaled (a buffer shared across calls keeps its other rows)."""
    qo_lens, kv_lens, h = [2, 3], [4, 0], 4
    q = torch.randn(7, h, 16).half()
    k, v = torch.randn(4, 2, 16).half(), torch.randn(4, 2, 16).half()
    lse_rows, lse_total = ([1, 2, 5, 6, 7], 9) if stats_offsets else ([0, 1, 2, 3, 4], 7)
    out, lse = sentinel_gaps((7, h, 16), range(5)), sentinel_gaps((lse_total, h), lse_rows, torch.float32)
    for _ in range(2):                                          # a second call: gaps still as they were
        fi.cudnn_batch_prefill_with_kv_cache(
            q, k, v, 0.25, WS, max_token_per_sequence=3, max_sequence_kv=4, causal=False, return_lse=True,
            actual_seq_lens_q=torch.tensor(qo_lens, dtype=torch.int32), out=out, lse=lse,
            actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32),
            batch_offsets_stats=torch.tensor([1 * h, 5 * h, 9 * h], dtype=torch.int32) if stats_offsets else None)
        ref_out, ref_lse = reference(qo_lens, kv_lens, q[:5], k, v, None, causal=False, scale=0.25)
        check(out[:5], lse[lse_rows], ref_out, ref_lse)
        lse_gaps = [r for r in range(lse_total) if r not in lse_rows]
        assert (out[5:] == GAP).all() and (lse[lse_gaps] == GAP).all(), "rows of no request keep their values"


def test_lse_of_packed_rows_when_only_out_has_offsets(fake_cudnn):
    qo_lens, kv_lens = [2, 3], [0, 4]
    q = torch.randn(5, 4, 16).half()
    k, v = torch.randn(4, 2, 16).half(), torch.randn(4, 2, 16).half()
    out, lse = nan_like((8, 4, 16)), nan_like((5, 4), torch.float32)
    fi.cudnn_batch_prefill_with_kv_cache(
        q, k, v, 0.25, WS, max_token_per_sequence=3, max_sequence_kv=4, causal=False, return_lse=True,
        actual_seq_lens_q=torch.tensor(qo_lens, dtype=torch.int32), out=out, lse=lse,
        actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32),
        batch_offsets_o=torch.tensor([0, 3 * 64, 8 * 64], dtype=torch.int32))
    ref_out, ref_lse = reference(qo_lens, kv_lens, q, k, v, None, causal=False, scale=0.25)
    check(out[[0, 1, 3, 4, 5]], lse, ref_out, ref_lse)


def test_workspace_too_small_is_named(fake_cudnn):
    k, v, table, lens = paged_data([5])
    with pytest.raises(ValueError, match="workspace_buffer too small for cudnn: 16 bytes"):
        fi.cudnn_batch_decode_with_kv_cache(torch.randn(1, 4, 16).half(), k, v, 0.25,
                                            torch.zeros(16, dtype=torch.uint8), max_sequence_kv=8,
                                            actual_seq_lens_kv=lens, block_tables=table)


# --- FLASHDISPATCH_CHECK_INPUTS=1 -------------------------------------------------------------
def test_checked_mode_names_bad_device_values(fake_cudnn, monkeypatch):
    k, v, table, lens = paged_data([40, 33], width=12)
    q = torch.randn(2, 4, 16).half()
    run = lambda **kw: fi.cudnn_batch_decode_with_kv_cache(  # noqa: E731
        q, k, v, 0.25, WS, **{**dict(max_sequence_kv=48, actual_seq_lens_kv=lens, block_tables=table), **kw})
    bad_lens = torch.tensor([40, 50], dtype=torch.int32)
    bad_table = table.clone()
    bad_table[1, 3] = k.shape[0]
    readable = table.masked_fill(table == 999_999, 0)         # the extra page it reads exists
    run(actual_seq_lens_kv=bad_lens, block_tables=readable)   # unchecked: the caller's promise
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "1")
    run()
    with pytest.raises(ValueError, match=r"actual_seq_lens_kv\[1\]=50 is outside the accepted range "
                                         r"\[0, max_sequence_kv=48\]"):
        run(actual_seq_lens_kv=bad_lens)
    with pytest.raises(ValueError, match=rf"block_tables\[1, 3\]={k.shape[0]} is not a page of the cache "
                                         rf"\(accepted: 0 <= page < {k.shape[0]}\)"):
        run(block_tables=bad_table)
    bad_table[1, 11] = -5                                     # past the request's 9 pages: not read
    bad_table[1, 3] = 0
    run(block_tables=bad_table)


def test_checked_mode_prefill(fake_cudnn, monkeypatch):
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "1")
    base = prefill_args()
    with pytest.raises(ValueError, match=r"actual_seq_lens_q\[1\]=6 is outside the accepted range "
                                         r"\[0, max_token_per_sequence=5\]"):
        fi.cudnn_batch_prefill_with_kv_cache(**{**base, "actual_seq_lens_q": torch.tensor([1, 6], dtype=torch.int32)})
    with pytest.raises(ValueError, match="actual_seq_lens_q adds up to 8 rows, but q has only 7"):
        fi.cudnn_batch_prefill_with_kv_cache(**{**base, "actual_seq_lens_q": torch.tensor([4, 4], dtype=torch.int32)})
    with pytest.raises(ValueError, match="actual_seq_lens_kv adds up to 11 rows, but k_cache has only 9"):
        fi.cudnn_batch_prefill_with_kv_cache(**{**base, "actual_seq_lens_kv": torch.tensor([5, 6], dtype=torch.int32)})
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"batch_offsets_o\[1\]=70 must be a non-decreasing, non-negative "
                                         r"multiple of the row stride 64"):
        fi.cudnn_batch_prefill_with_kv_cache(**{**base, "batch_offsets_o": i32([0, 70, 448])})
    with pytest.raises(ValueError, match=r"batch_offsets_q\[1\]=256 places 4 rows from row 4, past the 7 rows"):
        fi.cudnn_batch_prefill_with_kv_cache(**{**base, "batch_offsets_q": i32([0, 256, 448])})
    fi.cudnn_batch_prefill_with_kv_cache(**base)


def test_scale_is_the_softmax_scale(fake_cudnn):
    k, v, table, lens = paged_data([9])
    fi.cudnn_batch_decode_with_kv_cache(torch.randn(1, 4, 16).half(), k, v, torch.tensor(0.5), WS,
                                        max_sequence_kv=9, actual_seq_lens_kv=lens, block_tables=table)
    assert math.isclose(float(fake_cudnn.calls[-1].pack[G.UID_SCALE]), 0.5)
