"""Where cudnn prefill loses to PyTorch's SDPA-cuDNN: one row per graph variant, same run.

Variants (bf16, 32/8 heads, d128 by default; TFLOP/s over visible pairs, median of --reps,
L2 flushed as in the bench), each step changing one thing:
  ragged     the bucketed ragged graph (offsets, seq lens, padding mask, bottom-right causal)
  dense      the one-request dense graph (exact lengths, q/k/v token-major as the API gets them)
  dense-bhsd the same graph on heads-first q/k/v/out (PyTorch's layout), GQA
  dense-mha  heads-first with K/V repeated to the query heads (the peer's work, our graph)
  torch      F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION, as the bench's peer
Batch shapes (BxQ/KV[:nc], paged NHD cache, page 16, random page order, as the bench):
  bucket     the bucketed graph (ragged q/o offsets, batch and rows rounded up)
  uniform    the dense-row graph of equal query lengths (exact batch and rows, no q/o offsets)
With --kernels, the CUDA kernels of one call of each variant (torch.profiler).

    python scripts/cudnn_prefill_ablation.py --shapes 4096,16384,4096:nc,8x512/8192 --reps 30 --kernels
"""
from __future__ import annotations

import argparse
import math

import torch

from flashdispatch.backends.base import AttentionInputs, AttentionParams, PagedKV, RaggedKV
from flashdispatch.backends.cudnn import CudnnBackend
from flashdispatch.bench.prefill import make_prefill_data, parse_prefill_shapes, prefill_flops, visible_pairs
from flashdispatch.bench.timing import L2Flusher, device_times_ms, median
from flashdispatch.dispatch.problem import Problem, device_of


def heads_first(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """[tokens, heads, d] -> the same values stored heads-first, viewed as [tokens, heads * repeat, d]."""
    x = x.repeat_interleave(repeat, dim=1) if repeat > 1 else x
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def cudnn_job(q, k, v, causal: bool, *, ragged: bool):
    """A planned cudnn call on these tensors (as given: any strides); ``ragged`` forces the bucket graph."""
    dev = q.device
    n_q, hq, d = q.shape
    n_kv, hk = k.shape[0], k.shape[1]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    problem = Problem("prefill_ragged", q.dtype, k.dtype, q.dtype, hq, hk, d, v.shape[2], page_size=0,
                      kv_layout="NHD", mask_mode="causal" if causal else "none", return_lse=False)
    params = AttentionParams(qo_indptr=i32([0, n_q]), kv_indptr=i32([0, n_kv]), kv_lens=i32([n_kv]),
                             qo_lens_host=[n_q], kv_lens_host=[n_kv], sm_scale=1 / math.sqrt(d),
                             workspace=torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    backend = CudnnBackend()
    plan = backend.plan(problem, device_of(dev), params)
    if ragged:
        plan.single_opts = None
    out = torch.empty_like(q) if q.is_contiguous() else heads_first(torch.empty_like(q))
    inputs = AttentionInputs(q, RaggedKV(k, v), out)
    return lambda: backend.run(plan, inputs)


def cudnn_paged_job(d, *, uniform: bool):
    """A planned cudnn paged-prefill call on the bench's data ``d``; ``uniform`` False forces the
    bucket graph."""
    s, dev = d.shape, d.q.device
    lens = torch.full((s.batch,), s.kv_len, dtype=torch.int32, device=dev)
    problem = Problem("prefill_paged", s.dtype, s.dtype, s.dtype, s.qo_heads, s.kv_heads, s.head_dim, s.head_dim,
                      page_size=s.page_size, kv_layout="NHD", mask_mode="causal" if s.causal else "none",
                      return_lse=False)
    params = AttentionParams(qo_indptr=d.qo_indptr, kv_indptr=d.kv_indptr, kv_lens=lens,
                             qo_lens_host=[s.qo_len] * s.batch, kv_lens_host=[s.kv_len] * s.batch,
                             sm_scale=1 / math.sqrt(s.head_dim), kv_indices=d.kv_indices,
                             kv_last_page_len=d.last_page_len,
                             workspace=torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    backend = CudnnBackend()
    plan = backend.plan(problem, device_of(dev), params)
    if not uniform:
        plan.uniform_opts = None
    inputs = AttentionInputs(d.q, PagedKV(d.cache[:, 0], d.cache[:, 1], "NHD"), torch.empty_like(d.q))
    return lambda: backend.run(plan, inputs)


def batch_jobs(item: str, heads: tuple[int, int], head_dim: int):
    """(flops, jobs) of a paged batch row ``BxQ/KV[:nc]``."""
    d = make_prefill_data(parse_prefill_shapes(item, heads=heads, head_dim=head_dim)[0])
    return prefill_flops(d.shape), {"bucket": lambda: cudnn_paged_job(d, uniform=False),
                   "uniform": lambda: cudnn_paged_job(d, uniform=True)}


def torch_job(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).repeat_interleave(r, dim=0).unsqueeze(0).contiguous()
                  for x, r in ((q, 1), (k, group), (v, group)))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return run


def single_jobs(item: str, hq: int, hk: int, head_dim: int):
    """(flops, jobs) of a single-request row ``N[:nc]``."""
    n_text, _, mod = item.partition(":")
    n, causal = int(n_text), mod != "nc"
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, head_dim, generator=g, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    flops = 4.0 * hq * head_dim * visible_pairs(n, n, causal)
    return flops, {
        "ragged": lambda: cudnn_job(q, k, v, causal, ragged=True),
        "dense": lambda: cudnn_job(q, k, v, causal, ragged=False),
        "dense-bhsd": lambda: cudnn_job(heads_first(q), heads_first(k), heads_first(v), causal, ragged=False),
        "dense-mha": lambda: cudnn_job(heads_first(q), heads_first(k, hq // hk), heads_first(v, hq // hk), causal,
                                       ragged=False),
        "torch": lambda: torch_job(q, k, v, causal),
    }


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_time_total > 0})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096,16384,4096:nc,8x512/8192,16x2048/2048,64x128/4096",
                    help="N[:nc] (single requests of N tokens) or BxQ/KV[:nc] (paged batches)")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kernels", action="store_true", help="print the CUDA kernels of each variant")
    args = ap.parse_args()
    hq, hk = map(int, args.heads.split("/"))
    flush = L2Flusher(torch.device("cuda"))
    print(f"cuDNN {torch.backends.cudnn.version()}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for item in args.shapes.split(","):
        if "x" in item:
            flops, jobs = batch_jobs(item, (hq, hk), args.head_dim)
            print(f"\n{item}: paged batch, {hq}/{hk} heads, d{args.head_dim}")
        else:
            flops, jobs = single_jobs(item, hq, hk, args.head_dim)
            print(f"\n{item}: single request, {hq}/{hk} heads, d{args.head_dim}")
        for name, make in jobs.items():
            try:
                fn = make()
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                ms = median(device_times_ms(fn, args.reps, flush))
            except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                print(f"  {name:11s} failed: {type(e).__name__}: {e}")
                continue
            print(f"  {name:11s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
            if args.kernels:
                for kname in kernel_names(fn):
                    print(f"      {kname[:150]}")


if __name__ == "__main__":
    main()
