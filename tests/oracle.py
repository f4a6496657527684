"""Float64 oracle of the attention semantics, and builders of test cases every backend shares.

The oracle is written straight from the semantics in DESIGN.md with plain Python loops over
requests, rows, heads and keys (small sizes only). It does not import the reference backend.

The builders (`make_paged_case`, `make_ragged_case`, `make_mla_case`) return a `Case`:
Problem + Device + params + inputs, with random data, pages in random order, unused cache
slots poisoned with NaN and the outputs poisoned with NaN. Run a backend with `run_case` and
compare with `assert_close`.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from operator import mul

import torch

from flashdispatch.backends.base import (AttentionInputs, AttentionParams, MLAInputs, MLAParams,
                                         PagedKV, RaggedKV)
from flashdispatch.dispatch.problem import Device, Problem, device_of

LN2 = math.log(2.0)
NEG_INF = float("-inf")


# --- the oracle ----------------------------------------------------------------------------
def _scalar(x) -> float:
    return 1.0 if x is None else float(x)


def _dot(a: list[float], b: list[float]) -> float:
    return math.fsum(map(mul, a, b))


def oracle_alibi_slopes(n: int) -> list[float]:
    """m = 2**floor(log2 n); 2**(-8(i+1)/m) for i < m, then 2**(-4(2k+1)/m) for the rest."""
    m = 2 ** int(math.floor(math.log2(n)))
    slopes = [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]
    return slopes + [2.0 ** (-4.0 * (2 * k + 1) / m) for k in range(n - m)]


def oracle_rope(x: list[float], pos: float, theta: float, scale: float) -> list[float]:
    """Llama rotate-half RoPE of one vector at position ``pos``."""
    half = len(x) // 2
    out = [0.0] * len(x)
    for t in range(half):
        angle = (pos / scale) * (1.0 / theta ** (2.0 * t / len(x)))
        c, s = math.cos(angle), math.sin(angle)
        out[t] = x[t] * c - x[t + half] * s
        out[t + half] = x[t + half] * c + x[t] * s
    return out


def _softmax_row(logits: list[tuple[float, list[float]]], sink: float | None, dim: int):
    """(sum_j p_j v_j, lse base 2) over (logit, value) pairs plus an optional valueless sink."""
    scores = [s for s, _ in logits] + ([sink] if sink is not None else [])
    if not scores:
        return [0.0] * dim, NEG_INF
    m = max(scores)
    denom = math.fsum(math.exp(s - m) for s in scores)
    acc = [0.0] * dim
    for s, v in logits:
        w = math.exp(s - m) / denom
        for d in range(dim):
            acc[d] += w * v[d]
    return acc, (m + math.log(denom)) / LN2


def _unpack_bit(packed: list[int], n: int) -> bool:
    return bool((packed[n >> 3] >> (n & 7)) & 1)


def _paged_tokens(params, b: int, page_size: int, kv_len: int):
    """(page, slot) of each token of request b."""
    ind = params.kv_indices.tolist()
    start = int(params.kv_indptr[b])
    return [(ind[start + t // page_size], t % page_size) for t in range(kv_len)]


def paged_kv_len(num_pages: int, last_page_len: int, page_size: int) -> int:
    return 0 if num_pages == 0 else (num_pages - 1) * page_size + last_page_len


def oracle_attention(problem: Problem, params: AttentionParams, inputs: AttentionInputs):
    """(out [total_q, qo_heads, head_dim_vo], lse [total_q, qo_heads]) in float64, on the CPU."""
    heads, group = problem.num_qo_heads, problem.num_qo_heads // problem.num_kv_heads
    dvo = problem.head_dim_vo
    q = inputs.q.float().double().cpu().tolist()
    scale = params.sm_scale * _scalar(inputs.q_scale) * _scalar(inputs.k_scale)
    v_scale = _scalar(inputs.v_scale)
    slopes = oracle_alibi_slopes(heads) if problem.pos_encoding_mode == "ALIBI" else None
    rope = problem.pos_encoding_mode == "ROPE_LLAMA"
    sinks = inputs.sinks.double().tolist() if inputs.sinks is not None else None
    custom = problem.mask_mode == "custom" or problem.spec_decode_mask
    packed = params.packed_mask.tolist() if custom else None
    causal = problem.mask_mode == "causal" and not custom
    cap, window = problem.logits_soft_cap, problem.window_left
    qo_indptr = params.qo_indptr.tolist()
    kv = inputs.kv
    k_all, v_all = kv.k.float().double().cpu().tolist(), kv.v.float().double().cpu().tolist()

    out = torch.zeros(len(q), heads, dvo, dtype=torch.float64)
    lse = torch.full((len(q), heads), NEG_INF, dtype=torch.float64)
    for b in range(len(qo_indptr) - 1):
        q0, q_len = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
        if isinstance(kv, PagedKV):
            n_pages = int(params.kv_indptr[b + 1] - params.kv_indptr[b])
            kv_len = paged_kv_len(n_pages, int(params.kv_last_page_len[b]), problem.page_size)
            if kv.layout == "NHD":
                fetch = lambda src, t, h: src[t[0]][t[1]][h]  # noqa: E731
            else:
                fetch = lambda src, t, h: src[t[0]][h][t[1]]  # noqa: E731
            tokens = _paged_tokens(params, b, problem.page_size, kv_len)
        else:
            start = int(params.kv_indptr[b])
            kv_len = int(params.kv_indptr[b + 1]) - start
            fetch = lambda src, t, h: src[t][h]  # noqa: E731
            tokens = [start + t for t in range(kv_len)]
        keys = [[fetch(k_all, tok, h) for h in range(problem.num_kv_heads)] for tok in tokens]
        vals = [[fetch(v_all, tok, h) for h in range(problem.num_kv_heads)] for tok in tokens]
        if rope:
            keys = [[oracle_rope(k, j, params.rope_theta, params.rope_scale) for k in kh]
                    for j, kh in enumerate(keys)]
        bit0 = int(params.mask_indptr[b]) * 8 if custom else 0
        for i in range(q_len):
            p = i + kv_len - q_len
            for h in range(heads):
                qv = q[q0 + i][h]
                if rope:
                    qv = oracle_rope(qv, p, params.rope_theta, params.rope_scale)
                logits = []
                for j in range(kv_len):
                    if causal and j > p:
                        continue
                    if window >= 0 and j < p - window:
                        continue
                    if custom and not _unpack_bit(packed, bit0 + i * kv_len + j):
                        continue
                    s = _dot(qv, keys[j][h // group]) * scale
                    if slopes is not None:
                        s += slopes[h] * (j - p)
                    if cap > 0:
                        s = cap * math.tanh(s / cap)
                    logits.append((s, vals[j][h // group]))
                acc, row_lse = _softmax_row(logits, sinks[h] if sinks else None, dvo)
                out[q0 + i, h] = torch.tensor(acc, dtype=torch.float64) * v_scale
                lse[q0 + i, h] = row_lse
    return out, lse


def oracle_mla(problem: Problem, params: MLAParams, inputs: MLAInputs):
    """MLA: s = (q_nope . ckv_j + q_pe . kpe_j) * sm_scale, out = P @ ckv (x v_scale), float64."""
    q_nope = inputs.q_nope.float().double().cpu().tolist()
    q_pe = inputs.q_pe.float().double().cpu().tolist()
    ckv = inputs.ckv_cache.float().double().cpu().tolist()
    kpe = inputs.kpe_cache.float().double().cpu().tolist()
    page_size, dim = inputs.ckv_cache.shape[1], inputs.ckv_cache.shape[2]
    heads = problem.num_qo_heads
    v_scale = _scalar(inputs.v_scale)
    qo_indptr = _indptr(params.qo_lens_host)
    out = torch.zeros(len(q_nope), heads, dim, dtype=torch.float64)
    lse = torch.full((len(q_nope), heads), NEG_INF, dtype=torch.float64)
    for b in range(len(qo_indptr) - 1):
        q0, q_len = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
        kv_len = params.kv_lens_host[b]
        tokens = _paged_tokens(params, b, page_size, kv_len)
        for i in range(q_len):
            p = i + kv_len - q_len
            for h in range(heads):
                logits = [((_dot(q_nope[q0 + i][h], ckv[pg][sl]) + _dot(q_pe[q0 + i][h], kpe[pg][sl]))
                           * params.sm_scale, ckv[pg][sl])
                          for j, (pg, sl) in enumerate(tokens) if not (params.causal and j > p)]
                acc, row_lse = _softmax_row(logits, None, dim)
                out[q0 + i, h] = torch.tensor(acc, dtype=torch.float64) * v_scale
                lse[q0 + i, h] = row_lse
    return out, lse


def oracle_merge(v: torch.Tensor, s: torch.Tensor):
    """merge_states of v [seq, n, heads, dim] with base-2 lse s [seq, n, heads], float64."""
    seq, n, heads, dim = v.shape
    vl, sl = v.double().tolist(), s.double().tolist()
    v_out = torch.zeros(seq, heads, dim, dtype=torch.float64)
    s_out = torch.full((seq, heads), NEG_INF, dtype=torch.float64)
    for t in range(seq):
        for h in range(heads):
            m = max(sl[t][i][h] for i in range(n))
            if m == NEG_INF:
                continue
            w = [2.0 ** (sl[t][i][h] - m) for i in range(n)]
            total = math.fsum(w)
            v_out[t, h] = torch.tensor([math.fsum(w[i] * vl[t][i][h][d] for i in range(n)) / total
                                        for d in range(dim)], dtype=torch.float64)
            s_out[t, h] = m + math.log2(total)
    return v_out, s_out


# --- test cases ----------------------------------------------------------------------------
@dataclass
class Case:
    """One planned problem with its data: ``backend.plan(problem, device, params)`` then
    ``backend.run(plan, inputs)``."""

    problem: Problem
    device: Device
    params: AttentionParams | MLAParams
    inputs: AttentionInputs | MLAInputs

    def oracle(self):
        """(out, lse) of the float64 oracle for this case."""
        if self.problem.op == "mla":
            return oracle_mla(self.problem, self.params, self.inputs)
        return oracle_attention(self.problem, self.params, self.inputs)


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _indptr(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def packbits_little(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, bit i of byte n = element 8n + i (bitorder little)."""
    bits = bits.flatten().to(torch.int64)
    padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.int64)
    padded[:bits.numel()] = bits
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)


def random_custom_masks(gen, qo_lens, kv_lens, density=0.6) -> list[torch.Tensor]:
    """One random [qo_len, kv_len] bool mask per request (True keeps)."""
    return [torch.rand(q, k, generator=gen) < density for q, k in zip(qo_lens, kv_lens)]


def pack_custom_masks(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8, mask_indptr int32 byte offsets): each request packed on its own, like
    ``segment_packbits``."""
    packed = [packbits_little(m) for m in masks]
    indptr = _indptr([p.numel() for p in packed])
    flat = torch.cat(packed) if packed else torch.zeros(0, dtype=torch.uint8)
    return flat, torch.tensor(indptr, dtype=torch.int32)


def _page_table(gen, kv_lens, page_size, extra_pages, shuffle):
    """(kv_indptr, kv_indices, last_page_len, num_pages) with pages in random order."""
    counts = [(k + page_size - 1) // page_size for k in kv_lens]
    num_pages = sum(counts) + extra_pages
    order = torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)
    indices = order[:sum(counts)].to(torch.int32)
    last = [k - (n - 1) * page_size if n else 0 for k, n in zip(kv_lens, counts)]
    return _indptr(counts), indices, last, num_pages


def _paged_cache(gen, kv_indptr, indices, kv_lens, page_size, num_pages, heads, dim, poison):
    """A random NHD cache [pages, page_size, heads, dim] (float32); unused slots NaN if poison."""
    cache = _rand(gen, num_pages, page_size, heads, dim)
    if poison:
        used = torch.zeros(num_pages, page_size, dtype=torch.bool)
        for b, k in enumerate(kv_lens):
            for t in range(k):
                used[indices[kv_indptr[b] + t // page_size], t % page_size] = True
        cache[~used] = float("nan")
    return cache


def _problem(op, q_dtype, kv_dtype, o_dtype, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
             **fields) -> Problem:
    return Problem(op=op, q_dtype=q_dtype, kv_dtype=kv_dtype or q_dtype, o_dtype=o_dtype or q_dtype,
                   num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
                   head_dim_vo=head_dim_vo or head_dim_qk, **fields)


def _attention_case(op, gen, device, qo_lens, kv_lens, kv, page_size, kv_layout, *, num_qo_heads,
                    num_kv_heads, head_dim_qk, head_dim_vo, q_dtype, kv_dtype, o_dtype, mask_mode,
                    window_left, logits_soft_cap, pos_encoding_mode, rope_scale, rope_theta,
                    sm_scale, return_lse, sinks, q_scale, k_scale, v_scale, custom_masks,
                    q_len_per_req, use_cuda_graph, paged_tables):
    """Problem, params and NaN-poisoned inputs around an already-built KV."""
    dvo = head_dim_vo or head_dim_qk
    problem = _problem(op, q_dtype, kv_dtype, o_dtype, num_qo_heads, num_kv_heads, head_dim_qk, dvo,
                       page_size=page_size, kv_layout=kv_layout, mask_mode=mask_mode,
                       window_left=window_left, logits_soft_cap=logits_soft_cap,
                       pos_encoding_mode=pos_encoding_mode, q_len_per_req=q_len_per_req,
                       use_cuda_graph=use_cuda_graph, return_lse=return_lse, sinks=sinks)
    i32 = lambda x: torch.as_tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    packed = mask_indptr = None
    if mask_mode == "custom":
        masks = custom_masks or random_custom_masks(gen, qo_lens, kv_lens)
        packed, mask_indptr = (t.to(device) for t in pack_custom_masks(masks))
    kv_indptr, kv_indices, last = paged_tables or (_indptr(kv_lens), None, None)
    params = AttentionParams(
        qo_indptr=i32(_indptr(qo_lens)), kv_indptr=i32(kv_indptr), kv_lens=i32(kv_lens),
        qo_lens_host=list(qo_lens), kv_lens_host=list(kv_lens),
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk),
        kv_indices=None if kv_indices is None else kv_indices.to(device),
        kv_last_page_len=None if last is None else i32(last),
        packed_mask=packed, mask_indptr=mask_indptr, rope_scale=rope_scale, rope_theta=rope_theta)
    total_q = sum(qo_lens)
    inputs = AttentionInputs(
        q=_rand(gen, total_q, num_qo_heads, head_dim_qk).to(q_dtype).to(device), kv=kv,
        out=torch.full((total_q, num_qo_heads, dvo), float("nan"), dtype=problem.o_dtype, device=device),
        lse=torch.full((total_q, num_qo_heads), float("nan"), device=device) if return_lse else None,
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        sinks=(2 * _rand(gen, num_qo_heads)).to(device) if sinks else None)
    return Case(problem, device_of(torch.device(device)), params, inputs)


_FEATURE_DEFAULTS = dict(
    num_qo_heads=4, num_kv_heads=2, head_dim_qk=32, head_dim_vo=None, q_dtype=torch.float32,
    kv_dtype=None, o_dtype=None, mask_mode="none", window_left=-1, logits_soft_cap=0.0,
    pos_encoding_mode="NONE", rope_scale=1.0, rope_theta=1e4, sm_scale=None, return_lse=True,
    sinks=False, q_scale=None, k_scale=None, v_scale=None, custom_masks=None, use_cuda_graph=False)


def make_paged_case(op: str = "prefill_paged", *, kv_lens: list[int], qo_lens: list[int] | None = None,
                    q_len_per_req: int = 1, page_size: int = 16, kv_layout: str = "NHD",
                    kv_storage: str = "5d", extra_pages: int = 3, shuffle_pages: bool = True,
                    poison_unused: bool = True, device="cpu", seed: int = 0, **features) -> Case:
    """A paged case (op ``decode`` or ``prefill_paged``). Decode gets ``q_len_per_req`` rows per
    request unless ``qo_lens`` is given. ``kv_storage``: ``"5d"`` (one [pages, 2, ...] tensor,
    k and v as strided views) or ``"tuple"`` (two 4-D tensors; needed when head dims differ).
    ``features`` are the keyword arguments of ``_FEATURE_DEFAULTS`` (Problem fields, scales,
    ``sinks=True``, ``custom_masks`` list of [qo_len, kv_len] bool tensors)."""
    unknown = set(features) - set(_FEATURE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown case options: {sorted(unknown)}")
    f = {**_FEATURE_DEFAULTS, **features}
    gen = torch.Generator().manual_seed(seed)
    qo_lens = list(qo_lens) if qo_lens is not None else [q_len_per_req] * len(kv_lens)
    kv_indptr, indices, last, num_pages = _page_table(gen, kv_lens, page_size, extra_pages, shuffle_pages)
    kv_dtype = f["kv_dtype"] or f["q_dtype"]
    dqk, dvo = f["head_dim_qk"], f["head_dim_vo"] or f["head_dim_qk"]
    # each cast to the KV dtype as it is drawn: the GPU tests' caches hold GBs (160 MHA requests
    # of ~4K tokens: 21 GB as float32, which a stack of float32 k and v doubled)
    k, v = (_paged_cache(gen, kv_indptr, indices, kv_lens, page_size, num_pages, f["num_kv_heads"], d,
                         poison_unused).to(kv_dtype) for d in (dqk, dvo))
    if kv_layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    if kv_storage == "5d":
        if dqk != dvo:
            raise ValueError("a 5-D cache needs head_dim_qk == head_dim_vo; use kv_storage='tuple'")
        cache = torch.stack([k, v], 1).to(device)
        k, v = cache[:, 0], cache[:, 1]
    elif kv_storage == "tuple":
        k, v = k.to(device), v.to(device)
    else:
        raise ValueError(f"kv_storage={kv_storage!r} not in {{'5d', 'tuple'}}")
    return _attention_case(op, gen, device, qo_lens, kv_lens, PagedKV(k, v, kv_layout), page_size,
                           kv_layout, q_len_per_req=q_len_per_req if op == "decode" else 1,
                           paged_tables=(kv_indptr, indices, last), **f)


def make_ragged_case(*, qo_lens: list[int], kv_lens: list[int], device="cpu", seed: int = 0,
                     **features) -> Case:
    """A ragged-KV prefill case (op ``prefill_ragged``); ``features`` as in `make_paged_case`."""
    unknown = set(features) - set(_FEATURE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown case options: {sorted(unknown)}")
    f = {**_FEATURE_DEFAULTS, **features}
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = f["kv_dtype"] or f["q_dtype"]
    total, heads = sum(kv_lens), f["num_kv_heads"]
    k = _rand(gen, total, heads, f["head_dim_qk"]).to(kv_dtype).to(device)
    v = _rand(gen, total, heads, f["head_dim_vo"] or f["head_dim_qk"]).to(kv_dtype).to(device)
    return _attention_case("prefill_ragged", gen, device, qo_lens, kv_lens, RaggedKV(k, v), 0, "NHD",
                           q_len_per_req=1, paged_tables=None, **f)


def make_mla_case(*, qo_lens: list[int], kv_lens: list[int], num_heads: int = 8, head_dim_ckv: int = 64,
                  head_dim_kpe: int = 16, page_size: int = 1, causal: bool = False,
                  q_dtype=torch.float32, kv_dtype=None, o_dtype=None, sm_scale: float | None = None,
                  v_scale=None, return_lse: bool = True, extra_pages: int = 3, poison_unused: bool = True,
                  use_cuda_graph: bool = False, device="cpu", seed: int = 0) -> Case:
    """An MLA paged case: caches [pages, page_size, ckv] and [pages, page_size, kpe]."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or q_dtype
    kv_indptr, indices, _, num_pages = _page_table(gen, kv_lens, page_size, extra_pages, True)
    ckv, kpe = (_paged_cache(gen, kv_indptr, indices, kv_lens, page_size, num_pages, 1, d,
                             poison_unused)[:, :, 0] for d in (head_dim_ckv, head_dim_kpe))
    q_len_max = max(qo_lens, default=1)
    problem = _problem("mla", q_dtype, kv_dtype, o_dtype, num_heads, 1, head_dim_ckv + head_dim_kpe,
                       head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
                       mask_mode="causal" if causal else "none", q_len_per_req=max(q_len_max, 1),
                       use_cuda_graph=use_cuda_graph, return_lse=return_lse)
    i32 = lambda x: torch.as_tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    params = MLAParams(
        kv_indptr=i32(kv_indptr), kv_indices=indices.to(device), qo_lens_host=list(qo_lens), kv_lens_host=list(kv_lens),
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_ckv + head_dim_kpe),
        causal=causal)
    total_q = sum(qo_lens)
    inputs = MLAInputs(
        q_nope=_rand(gen, total_q, num_heads, head_dim_ckv).to(q_dtype).to(device),
        q_pe=_rand(gen, total_q, num_heads, head_dim_kpe).to(q_dtype).to(device),
        ckv_cache=ckv.to(kv_dtype).to(device), kpe_cache=kpe.to(kv_dtype).to(device),
        out=torch.full((total_q, num_heads, head_dim_ckv), float("nan"), dtype=problem.o_dtype,
                       device=device),
        lse=torch.full((total_q, num_heads), float("nan"), device=device) if return_lse else None,
        v_scale=v_scale)
    return Case(problem, device_of(torch.device(device)), params, inputs)


# --- running and comparing -------------------------------------------------------------------
def run_case(backend, case: Case):
    """Plan and run ``case`` on ``backend`` (an instance); returns (out, lse) from the inputs."""
    plan = backend.plan(case.problem, case.device, case.params)
    backend.run(plan, case.inputs)
    return case.inputs.out, case.inputs.lse


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are 0)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def assert_close(out, lse, ref_out, ref_lse, tol: float) -> None:
    """out within ``tol`` relative error of ref_out, no NaN, rows that see nothing exactly 0 with
    lse -inf, and (when lse is given) finite lse within ``tol * max(1, |ref|)``."""
    out_c, ref_lse_c = out.double().cpu(), ref_lse.cpu()
    assert not torch.isnan(out_c).any(), "NaN in out"
    err = rel_err(out_c, ref_out)
    assert err <= tol, f"rel err {err:.3g} > {tol}"
    empty = ref_lse_c == NEG_INF
    assert (out_c[empty] == 0).all(), "rows that see no key must be exactly 0"
    if lse is None:
        return
    lse_c = lse.double().cpu()
    assert not torch.isnan(lse_c).any(), "NaN in lse"
    assert torch.equal(lse_c == NEG_INF, empty), "lse -inf exactly where no key is visible"
    if (~empty).any():
        diff = (lse_c[~empty] - ref_lse_c[~empty]).abs().max().item()
        bound = tol * max(1.0, ref_lse_c[~empty].abs().max().item())
        assert diff <= bound, f"lse max abs err {diff:.3g} > {bound:.3g}"


def reference_plan_result(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(out as float32, lse) of the reference backend's plan for the case's own problem (its
    o_dtype), on fresh buffers: what the fa2 prefill GPU tests compare a kernel with."""
    from flashdispatch.backends.reference.attention import plan_attention
    inp = case.inputs
    ref = dataclasses.replace(inp, out=torch.empty_like(inp.out),
                              lse=torch.empty(inp.out.shape[:2], device=inp.out.device))
    plan_attention(case.problem, case.params).run(ref)
    return ref.out.float(), ref.lse


def reference_backend_result(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(out float32, lse) of the reference backend on the same problem, params and inputs (fresh
    buffers): what the GPU tests compare a kernel with."""
    from flashdispatch.backends.reference import BACKEND
    backend = BACKEND()
    problem = case.problem.with_(o_dtype=torch.float32, return_lse=True)
    q = case.inputs.q
    inputs = dataclasses.replace(
        case.inputs, out=torch.empty(*q.shape[:2], problem.head_dim_vo, dtype=torch.float32, device=q.device),
        lse=torch.empty(*q.shape[:2], dtype=torch.float32, device=q.device))
    backend.run(backend.plan(problem, case.device, case.params), inputs)
    return inputs.out, inputs.lse


def run_fa2_decode(case: Case, config=None, **params):
    """Plan fa2 decode with ``config`` (a DecodeConfig override dict) and ``params`` set on the
    case's AttentionParams, and run it into NaN-poisoned out/lse (a 128 MiB workspace on a GPU,
    4 MiB on the CPU); returns the plan."""
    from flashdispatch.backends.fa2.decode import plan_decode
    prm = case.params
    on_gpu = case.inputs.q.is_cuda
    prm.workspace = torch.zeros((128 << 20) if on_gpu else (1 << 22), dtype=torch.uint8, device=case.inputs.q.device)
    for name, value in params.items():
        setattr(prm, name, value)
    case.inputs.out.fill_(float("nan"))
    if case.inputs.lse is not None:
        case.inputs.lse.fill_(float("nan"))
    plan = plan_decode(case.problem, case.device, prm, config)
    plan.run(case.inputs)
    if on_gpu:
        torch.cuda.synchronize()
    return plan
