"""``python -m flashdispatch demo``: batch decode, paged prefill and MLA through ``auto`` on
whatever device exists, each checked against the reference backend, with what ran and why."""
from __future__ import annotations

import torch

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .dispatch.explain import torch_device
from .mla import BatchMLAPagedAttentionWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _report(name: str, wrapper, out, ref, tol: float) -> bool:
    err = _rel_err(out, ref)
    ok = err < tol and not bool(torch.isnan(out).any())
    print(f"\n== {name}: backend {wrapper.decision.backend}, rel. error vs reference {err:.2e} "
          f"({'ok' if ok else 'FAIL'}, tolerance {tol:.0e})")
    print(wrapper.explain())
    return ok


def _paged_table(dev):
    indptr = torch.tensor([0, 17, 29, 44, 48, 66, 100, 128], dtype=torch.int32, device=dev)
    last = torch.tensor([1, 7, 14, 4, 3, 1, 16], dtype=torch.int32, device=dev)
    indices = torch.randperm(128, device=dev).int()
    return indptr, indices, last


def _decode(dev, dtype, gen) -> bool:
    indptr, indices, last = _paged_table(dev)
    kv = torch.randn(128, 2, 16, 8, 128, dtype=dtype, device=dev, generator=gen)
    q = torch.randn(7, 64, 128, dtype=dtype, device=dev, generator=gen)
    outs = []
    for backend in ("auto", "reference"):
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD",
                                               backend=backend)
        w.plan(indptr, indices, last, 64, 8, 128, 16, q_data_type=dtype)
        outs.append((w, w.run(q, kv)))
    return _report("batch decode (7 requests, 64/8 heads, d128, page 16)", outs[0][0], outs[0][1], outs[1][1],
                   2e-2 if dtype != torch.float32 else 1e-4)


def _prefill(dev, dtype, gen) -> bool:
    indptr, indices, last = _paged_table(dev)
    qo_indptr = torch.tensor([0, 33, 44, 55, 66, 77, 88, 100], dtype=torch.int32, device=dev)
    kv = torch.randn(128, 2, 16, 16, 128, dtype=dtype, device=dev, generator=gen)
    q = torch.randn(100, 64, 128, dtype=dtype, device=dev, generator=gen)
    outs = []
    for backend in ("auto", "reference"):
        w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD",
                                                backend=backend)
        w.plan(qo_indptr, indptr, indices, last, 64, 16, 128, 16, causal=True, q_data_type=dtype)
        outs.append((w, w.run(q, kv)))
    return _report("paged prefill, causal (7 requests, 100 tokens, 64/16 heads)", outs[0][0], outs[0][1],
                   outs[1][1], 2e-2 if dtype != torch.float32 else 1e-4)


def _mla(dev, dtype, gen) -> bool:
    batch, heads, ckv, kpe, kv_len, page = 8, 16, 512, 64, 300, 16
    pages = (kv_len + page - 1) // page
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages
    kv_indices = torch.randperm(batch * pages, device=dev).int()
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
    q_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q_nope = torch.randn(batch, heads, ckv, dtype=dtype, device=dev, generator=gen)
    q_pe = torch.randn(batch, heads, kpe, dtype=dtype, device=dev, generator=gen)
    ckv_cache = torch.randn(batch * pages, page, ckv, dtype=dtype, device=dev, generator=gen)
    kpe_cache = torch.randn(batch * pages, page, kpe, dtype=dtype, device=dev, generator=gen)
    outs = []
    for backend in ("auto", "reference"):
        w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend=backend)
        w.plan(q_indptr, kv_indptr, kv_indices, kv_lens, heads, ckv, kpe, page, False, 1.0 / (192 ** 0.5),
               dtype, dtype)
        outs.append((w, w.run(q_nope, q_pe, ckv_cache, kpe_cache)))
    return _report("MLA decode (8 requests, 16 heads, ckv 512 + kpe 64, page 16)", outs[0][0], outs[0][1],
                   outs[1][1], 2e-2 if dtype != torch.float32 else 1e-4)


def demo_device(device: str | torch.device | None = None) -> torch.device:
    """The device the demo runs on: ``device`` (cpu or cuda[:N] of this machine, else ValueError),
    by default cuda if present, else cpu."""
    return torch_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def run_demo(device: str | torch.device | None = None) -> int:
    """Run the three checks; exit status 0 when every output matches the reference."""
    dev = demo_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"flashdispatch demo on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), "
          f"dtype {dtype}")
    results = [_decode(dev, dtype, gen), _prefill(dev, dtype, gen), _mla(dev, dtype, gen)]
    print(f"\n{sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1
