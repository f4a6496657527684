"""Where cudnn prefill loses to PyTorch's SDPA-cuDNN: one row per graph variant, same run.

Variants (bf16, 32/8 heads, d128 by default; TFLOP/s over visible pairs, median of --reps,
L2 flushed as in the bench), each step changing one thing:
  ragged     the bucketed ragged graph (offsets, seq lens, padding mask, bottom-right causal)
  dense      the one-request dense graph (exact lengths, q/k/v token-major as the API gets them)
  dense-bhsd the same graph on heads-first q/k/v/out (PyTorch's layout), GQA
  dense-mha  heads-first with K/V repeated to the query heads (the peer's work, our graph)
  torch      F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION, as the bench's peer
Batch shapes (BxQ/KV[:nc], paged NHD cache, page 16, random page order, as the bench):
  bucket     the bucketed graph as the backend runs it (heuristics mode A's first plan)
  plan N     the same graph run with the N-th execution plan cuDNN offers for it under heuristics
             modes A, B and FALLBACK (every plan built, `execute_plan_at_index`), named by cuDNN
  cfg V      with --kernel-cfgs N: the first plan's engine with knob KERNEL_CFG = V, V < N (the
             kernel variant, e.g. its tile shape; values that do not build are skipped)
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


def cudnn_paged_job(d):
    """(backend, plan, inputs) of a cudnn paged-prefill call on the bench's data ``d``."""
    s, dev = d.shape, d.q.device
    lens = torch.full((s.batch,), s.kv_len, dtype=torch.int32, device=dev)
    problem = Problem("prefill_paged", s.dtype, s.dtype, s.dtype, s.qo_heads, s.kv_heads, s.head_dim, s.head_dim,
                      page_size=s.page_size, kv_layout="NHD", mask_mode="causal" if s.causal else "none",
                      window_left=s.window_left, return_lse=False)
    params = AttentionParams(qo_indptr=d.qo_indptr, kv_indptr=d.kv_indptr, kv_lens=lens,
                             qo_lens_host=[s.qo_len] * s.batch, kv_lens_host=[s.kv_len] * s.batch,
                             sm_scale=1 / math.sqrt(s.head_dim), kv_indices=d.kv_indices,
                             kv_last_page_len=d.last_page_len,
                             workspace=torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    backend = CudnnBackend()
    plan = backend.plan(problem, device_of(dev), params)
    inputs = AttentionInputs(d.q, PagedKV(d.cache[:, 0], d.cache[:, 1], "NHD"), torch.empty_like(d.q))
    return backend, plan, inputs


def engine_plans(plan, inputs, kernel_cfgs: int = 0) -> dict:
    """One job per execution plan cuDNN offers for ``plan``'s bucket graph (modes A, B, FALLBACK),
    then one per KERNEL_CFG value below ``kernel_cfgs`` of the first plan's engine."""
    import cudnn

    from flashdispatch.backends.cudnn import graphs
    from flashdispatch.backends.cudnn.handles import handle_for, handle_on_current_stream

    opts = plan.opts
    g = graphs.declare_graph(opts, plan._geometry(inputs), handle_for(opts.device_index))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    pack = {graphs.UID_Q: inputs.q, graphs.UID_K: inputs.kv.k, graphs.UID_V: inputs.kv.v, graphs.UID_O: inputs.out,
            graphs.UID_SCALE: torch.full((1, 1, 1, 1), plan.sm_scale)}
    plan._refresh_offsets(inputs)
    plan._bind_metadata(pack, False)
    heuristic_plans = g.get_execution_plan_count()
    if kernel_cfgs:
        engine = g.get_engine_and_knobs_at_index(0)[0]
        for value in range(kernel_cfgs):
            try:
                g.create_execution_plan(engine, {cudnn.knob_type.KERNEL_CFG: value})
                g.build_plan_at_index(g.get_execution_plan_count() - 1)
            except Exception as e:  # noqa: BLE001 - a knob value without a kernel
                print(f"  engine {engine} KERNEL_CFG={value}: {type(e).__name__}: {str(e)[:80]}")
    jobs = {}
    for i in range(g.get_execution_plan_count()):
        try:
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device=inputs.q.device)
            name = g.get_plan_name_at_index(i)
        except Exception as e:  # noqa: BLE001 - a plan that did not build
            print(f"  plan {i}: {type(e).__name__}: {e}")
            continue

        def run(i=i, ws=ws):
            g.execute_plan_at_index(pack, ws, i, handle=handle_on_current_stream(opts.device_index))
        jobs[f"plan {i} {name[:40]}" if i < heuristic_plans else f"cfg {i - heuristic_plans} {name[:40]}"] = run
    return jobs


def batch_jobs(item: str, heads: tuple[int, int], head_dim: int, kernel_cfgs: int):
    """(flops, jobs) of a paged batch row ``BxQ/KV[:nc][:wN]``."""
    d = make_prefill_data(parse_prefill_shapes(item, heads=heads, head_dim=head_dim)[0])
    backend, plan, inputs = cudnn_paged_job(d)
    jobs = {"bucket": lambda: lambda: backend.run(plan, inputs)}
    try:
        backend.run(plan, inputs)
        jobs.update({name: (lambda fn=fn: fn) for name, fn in engine_plans(plan, inputs, kernel_cfgs).items()})
    except Exception as e:  # noqa: BLE001 - report and keep the bucket row
        print(f"  engine plans: {type(e).__name__}: {e}")
    return prefill_flops(d.shape), jobs


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
    ap.add_argument("--kernel-cfgs", type=int, default=0, metavar="N",
                    help="batch rows: also try KERNEL_CFG values 0..N-1 of the heuristics' engine")
    args = ap.parse_args()
    hq, hk = map(int, args.heads.split("/"))
    flush = L2Flusher(torch.device("cuda"))
    print(f"cuDNN {torch.backends.cudnn.version()}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for item in args.shapes.split(","):
        if "x" in item:
            flops, jobs = batch_jobs(item, (hq, hk), args.head_dim, args.kernel_cfgs)
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
