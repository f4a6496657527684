"""Sweep fa2 paged-decode configs over decode shapes: a TB/s table, every result checked.

Each config of the grid (`DecodeConfig` fields; the row ``{}`` is `default_config`) is planned
with ``plan_decode(..., config)`` on each shape (the key ``fixed_split_size``, pages per chunk,
is the plan's parameter of that name instead: a split of every request into equal chunks) and
timed (median of --reps runs, each after a 256 MB L2 flush and a GPU spin (`--l2-flush`, the
bench's `L2Flusher`), CUDA events). TB/s counts the KV bytes read: the requests' tokens x kv_heads
x head_dim x 2 (K, V) x the KV dtype's size. Every result is compared with a dense float32
attention over the same cache (requests of one length together, in chunks, so 4 GB caches are
checked too): a "!" after a figure means ||out - ref|| / ||ref|| > --tol or (with --lse) an lse
error > --tol. Without --lse the plans write out only, as the bench's and a decode wrapper's
default run() (return_lse=False): the kernel that also writes lse is another compile, whose
registers and programs per SM may differ (RoPE d128 64 x 2 on sm90: 128 with lse, 145 without).

    # fp8 e4m3 KV: fp16 vs q-dtype dots x block_n x warps x stages (one GPU call, ~2-3 min)
    python scripts/sweep_decode.py --kv e4m3 --shapes 64x4096,256x4096,16x8192 \\
        --grid '{"fp8_dot_dtype": ["q", "fp16"], "block_n": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}'
    # mixed lengths (the bench's :var draw), the line against the host's packing, 3 rounds in turn
    python scripts/sweep_decode.py --shapes 128x4096:var,512x1024:var --no-default --rounds 3 \\
        --grid '[{"wave_pack_line": false}, {"wave_pack_line": true}]'
    # one request 64 x longer among the mix (:long): the fused merge against the merge kernel
    python scripts/sweep_decode.py --shapes 256x2048:long --grid '[{}, {"fused_merge_max_chunks": 0}]'
    # RoPE (ROPE_LLAMA, rope_scale 1, theta 1e4): tile and pipeline depth
    python scripts/sweep_decode.py --rope --shapes 64x4096 --grid '{"block_n": [16, 32], "num_stages": [2, 3]}'
    # a list of configs instead of a product; HND layout, page 1
    python scripts/sweep_decode.py --layout HND --page-size 1 --grid '[{"block_n": 128}, {"block_n": 64}]'
    # smoke test of the script itself on CPU (Triton interpreter, tiny shapes)
    .venv/bin/python scripts/sweep_decode.py --device cpu --shapes 2x64 --heads 4,2 --head-dim 64 --kv e4m3 \\
        --q-dtype fp16 --reps 1 --grid '{"fp8_dot_dtype": ["q", "fp16"]}'
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR_SHAPES = "1x32768,16x8192,64x4096,128x2048,256x1024,64x16384,256x4096"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CHECK_TOKENS = 1 << 16  # tokens per chunk of the dense check
LONG_FACTOR = 64  # a :long row's long request, in kv_len (2K-token requests and one of 128K)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=ANCHOR_SHAPES,
                    help="comma list of BATCHxKV_LEN[:var|:long] (default: ANCHORS.md; :var: the bench's mixed "
                         f"lengths; :long: those with the middle request {LONG_FACTOR} x KV_LEN tokens long)")
    ap.add_argument("--grid", default="{}", help="JSON: {field: [values]} (cartesian product) or [{config}, ...]")
    ap.add_argument("--no-default", action="store_true", help="leave out the default_config row (a {} of --grid "
                    "stays)")
    ap.add_argument("--kv", default="bf16", choices=list(DTYPES), help="KV cache dtype")
    ap.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--heads", default="32,8", help="QO_HEADS,KV_HEADS")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    ap.add_argument("--rope", action="store_true", help="pos_encoding_mode ROPE_LLAMA (rope_scale 1, theta 1e4)")
    ap.add_argument("--k-scale", type=float, default=None, help="float k_scale (fp8 dequant scale)")
    ap.add_argument("--v-scale", type=float, default=None, help="float v_scale")
    ap.add_argument("--reps", type=int, default=40, help="timed runs per (config, shape); the median is kept")
    ap.add_argument("--order", default="drawn", choices=("drawn", "interleaved", "longest", "shortest"),
                    help="the order of a :var row's requests (interleaved: longest, shortest, second longest, ...)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times every config is timed on a shape, in turn (the median of the rounds is kept)")
    ap.add_argument("--tol", type=float, default=2e-2, help="relative error (and lse error) that marks a '!'")
    ap.add_argument("--lse", action="store_true", help="time (and check) the kernel that also writes lse")
    ap.add_argument("--no-check", action="store_true", help="skip the dense float32 check")
    ap.add_argument("--json", default=None, help="also write every result to this JSON file")
    ap.add_argument("--l2-flush", default="write", choices=("write", "read"),
                    help="how the L2 is emptied before each timed run (bench --l2-flush)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: Triton interpreter (smoke test)")
    return ap.parse_args(argv)


def config_grid(text: str, with_default: bool) -> list[dict]:
    """The configs of ``--grid`` (a product of lists, or a list), after the default row ``{}``
    when ``with_default``; a ``{}`` of the grid is that row (kept once)."""
    grid = json.loads(text)
    if isinstance(grid, dict):
        keys = list(grid)
        configs = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
    elif isinstance(grid, list) and all(isinstance(c, dict) for c in grid):
        configs = grid
    else:
        raise SystemExit("--grid must be a JSON object of lists or a list of objects")
    if with_default:
        configs = [{}] + [c for c in configs if c]
    return configs


def parse_shapes(text: str) -> list[tuple[int, int, str]]:
    """(batch, kv_len, mix) of each BATCHxKV_LEN[:var|:long] item (mix "": equal lengths)."""
    shapes = []
    for item in text.split(","):
        size, _, mod = item.strip().lower().partition(":")
        if mod not in ("", "var", "long"):
            raise SystemExit(f"shape {item!r}: the modifiers are :var and :long")
        b, _, n = size.partition("x")
        shapes.append((int(b), int(n), mod))
    return shapes


def shape_label(batch: int, kv_len: int, mix: str) -> str:
    return f"{batch}x{kv_len}" + (f":{mix}" if mix else "")


def request_order(lens: np.ndarray, order: str) -> np.ndarray:
    """The indices of ``lens`` in the requested order (`parse_args` --order)."""
    from flashdispatch.backends.fa2.decode_split import interleaved
    if order == "interleaved":
        return interleaved(lens)
    if order == "drawn":
        return np.arange(lens.size)
    return np.argsort(-lens if order == "longest" else lens, kind="stable")


class Shape:
    """One decode problem: a random paged cache (pages in random order), q, params, inputs;
    ``mix`` "var": the bench's mixed lengths (`DecodeShape.kv_lens`, drawn from 1 .. 2 x kv_len - 1);
    "long": those with the middle request LONG_FACTOR x kv_len tokens long."""

    def __init__(self, args, batch: int, kv_len: int, device: torch.device, mix: str = ""):
        from flashdispatch.backends.base import AttentionInputs, AttentionParams, PagedKV
        from flashdispatch.bench.decode import DecodeShape
        from flashdispatch.dispatch.problem import Problem
        hq, hk = (int(x) for x in args.heads.split(","))
        d, ps = args.head_dim, args.page_size
        if kv_len % ps and not mix:
            raise SystemExit(f"kv_len {kv_len} is not a multiple of the page size {ps}")
        q_dtype, kv_dtype = DTYPES[args.q_dtype], DTYPES[args.kv]
        lens = DecodeShape(batch, kv_len, var=bool(mix)).kv_lens()
        if mix == "long":
            lens[batch // 2] = LONG_FACTOR * kv_len
        lens = lens[request_order(lens, args.order)]
        pages = -(-lens // ps)
        n = int(pages.sum())
        slot_shape = (n, 2, ps, hk, d) if args.layout == "NHD" else (n, 2, hk, ps, d)
        cache = torch.randn(slot_shape, dtype=q_dtype, device=device).to(kv_dtype)
        self.label, self.lens = shape_label(batch, kv_len, mix), lens
        self.batch, self.kv_len, self.hq, self.hk, self.d = batch, kv_len, hq, hk, d
        self.bytes = int(lens.sum()) * hk * d * 2 * cache.element_size()
        i32 = dict(dtype=torch.int32, device=device)
        indptr = torch.as_tensor(np.concatenate([[0], np.cumsum(pages)]), **i32)
        self.params = AttentionParams(
            qo_indptr=torch.arange(batch + 1, **i32), kv_indptr=indptr,
            kv_lens=torch.as_tensor(lens, **i32), qo_lens_host=[1] * batch, kv_lens_host=lens.tolist(),
            sm_scale=1.0 / math.sqrt(d), kv_indices=torch.randperm(n, device=device).to(torch.int32),
            kv_last_page_len=torch.as_tensor(lens - ps * (pages - 1), **i32),
            workspace=torch.zeros(128 << 20, dtype=torch.uint8, device=device))
        self.problem = Problem("decode", q_dtype, kv_dtype, q_dtype, hq, hk, d, d, page_size=ps,
                               kv_layout=args.layout, pos_encoding_mode="ROPE_LLAMA" if args.rope else "NONE")
        q = torch.randn(batch, hq, d, dtype=q_dtype, device=device)
        self.inputs = AttentionInputs(q=q, kv=PagedKV(cache[:, 0], cache[:, 1], args.layout), out=torch.empty_like(q),
                                      lse=torch.empty(batch, hq, device=device) if args.lse else None,
                                      k_scale=args.k_scale, v_scale=args.v_scale)
        self._ref = None

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[n, kv_len, kv_heads, d] float32 of requests whose page rows are ``pages``."""
        x = cache[pages]  # [n, P, ps, hk, d] (NHD) or [n, P, hk, ps, d] (HND)
        if self.problem.kv_layout == "HND":
            x = x.transpose(2, 3)
        return x.reshape(len(pages), -1, self.hk, self.d)[:, :kv_len].float()

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, hq, d] at position kv_len - 1 and k [n, kv_len, hk, d] at 0 .. kv_len - 1, rotated as
        the reference backend rotates them (rope_scale and rope_theta of the params)."""
        from flashdispatch.backends.reference.positions import apply_rope, rope_inv_freq
        inv_freq = rope_inv_freq(self.d, self.params.rope_theta, q.device)
        scale = self.params.rope_scale
        q = apply_rope(q[:, None], torch.full((1,), kv_len - 1, device=q.device), inv_freq, scale)[:, 0]
        return q, apply_rope(k, torch.arange(kv_len, device=k.device), inv_freq, scale)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense float32 (out, lse base 2), computed once: requests of one length together,
        CHECK_TOKENS tokens of KV at a time."""
        if self._ref is None:
            inp, prm = self.inputs, self.params
            ks = 1.0 if inp.k_scale is None else inp.k_scale
            vs = 1.0 if inp.v_scale is None else inp.v_scale
            indptr = prm.kv_indptr.tolist()
            out = torch.empty(self.batch, self.hq, self.d, device=inp.q.device)
            lse = torch.empty(self.batch, self.hq, device=inp.q.device)
            for kv_len in np.unique(self.lens):
                reqs = np.flatnonzero(self.lens == kv_len)
                step = max(1, CHECK_TOKENS // int(kv_len))
                for b0 in range(0, len(reqs), step):
                    rows = torch.as_tensor(reqs[b0:b0 + step], device=inp.q.device)
                    pages = torch.stack([prm.kv_indices[indptr[r]:indptr[r + 1]] for r in rows.tolist()]).long()
                    k, v = self._gather(inp.kv.k, pages, int(kv_len)), self._gather(inp.kv.v, pages, int(kv_len))
                    q = inp.q[rows].float()
                    if self.problem.pos_encoding_mode == "ROPE_LLAMA":
                        q, k = self._rotate(q, k, int(kv_len))
                    q = q.view(-1, self.hk, self.hq // self.hk, self.d)
                    s = torch.einsum("nhgd,nlhd->nhgl", q, k) * (prm.sm_scale * ks)
                    out[rows] = (torch.einsum("nhgl,nlhd->nhgd", s.softmax(-1), v) * vs).reshape(-1, self.hq, self.d)
                    lse[rows] = (torch.logsumexp(s, -1) / math.log(2)).reshape(-1, self.hq)
            self._ref = out, lse
        return self._ref

    def errors(self) -> tuple[float, float]:
        """(relative error of out, max abs error of lse or 0.0 without it) against `reference`."""
        ref_out, ref_lse = self.reference()
        out = self.inputs.out.float()
        rel = ((out - ref_out).norm() / ref_out.norm()).item()
        if torch.isnan(out).any():
            rel = float("nan")
        lse = self.inputs.lse
        return rel, (lse - ref_lse).abs().max().item() if lse is not None else 0.0


def median_ms(fn, reps: int, device: torch.device, flush) -> float:
    """Median time of fn() in ms: CUDA events after an L2 flush each, or wall time on CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    pairs = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_config(shape: Shape, cfg: dict, dev, args, flush) -> tuple[dict, float | None]:
    """Plan, time and check one config on one shape: (result row, seconds
    of the first call including any compile, or None when it failed)."""
    from flashdispatch.backends.fa2.decode import plan_decode
    device = shape.inputs.q.device
    row = dict(shape=shape.label, config=cfg)
    try:
        shape.inputs.out.fill_(float("nan"))
        t0 = time.perf_counter()
        knobs = {k: v for k, v in cfg.items() if k != "fixed_split_size"}
        params = dataclasses.replace(shape.params, fixed_split_size=cfg.get("fixed_split_size"))
        plan = plan_decode(shape.problem, dev, params, knobs or None)
        plan.run(shape.inputs)
        sync(device)
        first = time.perf_counter() - t0
        ms = median_ms(lambda: plan.run(shape.inputs), args.reps, device, flush)
    except Exception as ex:  # a config that does not compile or run: report it, keep sweeping
        row.update(error=f"{type(ex).__name__}: {str(ex)[:300]}")
        print(f"  {json.dumps(cfg)} {row['shape']}: {row['error']}", flush=True)
        return row, None
    row.update(ms=ms, tbps=shape.bytes / ms / 1e9, resolved=dataclasses.asdict(plan.config))
    if not args.no_check:
        rel, lse_err = shape.errors()
        row.update(rel_err=rel, lse_err=lse_err, ok=rel <= args.tol and lse_err <= args.tol)
    return row, first


def cell(results: list[dict], index: int, label: str) -> str:
    """The table cell of config ``index`` on shape ``label``: the median TB/s of its rounds, "!"
    where a round's check failed, ERR where one did not run."""
    rows = [r for r in results if r["index"] == index and r["shape"] == label]
    if any("error" in r for r in rows):
        return "ERR"
    return f"{statistics.median(r['tbps'] for r in rows):.2f}" + ("" if all(r.get("ok", True) for r in rows) else "!")


def best_config(results: list[dict], configs: list[dict], label: str, checked: bool) -> tuple[float, dict] | None:
    """(median TB/s, config) of the config with the highest median over its rounds on shape
    ``label``, among those that ran every round (``checked``: and passed every check); None if none did."""
    medians = []
    for index, cfg in enumerate(configs):
        rows = [r for r in results if r["index"] == index and r["shape"] == label]
        if rows and all("tbps" in r and (r.get("ok", True) or not checked) for r in rows):
            medians.append((statistics.median(r["tbps"] for r in rows), cfg))
    return max(medians, key=lambda m: m[0]) if medians else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, ROOT)
    from flashdispatch.bench.timing import L2Flusher
    from flashdispatch.dispatch.problem import Device, device_of

    device = torch.device(args.device)
    dev = device_of(device) if device.type == "cuda" else Device("cpu")
    configs = config_grid(args.grid, not args.no_default)
    shapes = parse_shapes(args.shapes)
    flush = L2Flusher(device, mode=args.l2_flush) if device.type == "cuda" else None
    print(f"{dev.name or device.type}: q {args.q_dtype}, KV {args.kv}, heads {args.heads}, d {args.head_dim}, "
          f"page {args.page_size}, {args.layout}{', RoPE' if args.rope else ''}; "
          f"{len(configs)} configs x {len(shapes)} shapes, median of {args.reps}", flush=True)

    results, first_call = [], {}
    for batch, kv_len, mix in shapes:
        shape = Shape(args, batch, kv_len, device, mix)
        for _ in range(args.rounds):
            for ci, cfg in enumerate(configs):
                row, first = run_config(shape, cfg, dev, args, flush)
                if first is not None:
                    first_call.setdefault(ci, first)
                results.append(dict(row, index=ci))
        best = best_config(results, configs, shape.label, checked=False)
        if best:
            print(f"done {shape.label}: best {best[0]:.2f} TB/s {json.dumps(best[1])}", flush=True)
        shape = None  # free the cache before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()

    names = [json.dumps(c) if c else "default" for c in configs]
    width = max(len(n) for n in names)
    heads = [shape_label(*s) for s in shapes]
    print(f"\nTB/s of KV read, median of {args.rounds} round(s) ('!': a check failed, tol {args.tol}); "
          "first: first call incl. compile, s")
    print(f"{'config':<{width}} | first | " + " | ".join(f"{h:>12}" for h in heads))
    for ci, name in enumerate(names):
        first = f"{first_call[ci]:5.1f}" if ci in first_call else "    -"
        print(f"{name:<{width}} | {first} | " + " | ".join(f"{cell(results, ci, h):>12}" for h in heads))
    for h in heads:
        best = best_config(results, configs, h, checked=True)
        if best:
            print(f"BEST {h}: {best[0]:.2f} TB/s {json.dumps(best[1])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), results=results), fh, indent=1)
    return 1 if any("error" in r or not r.get("ok", True) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
