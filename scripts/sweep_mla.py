"""Sweep fa2 MLA tiles over `bench mla` rows: a TFLOP/s table, every result checked.

Each config (`MLATiles` fields over the default `mla_tiles` choice of the row; the row ``{}``
is the default) is planned with ``plan_mla(..., tiles)`` and timed as sweep_decode.py times (median
of --reps calls, each after the bench's 256 MB write flush and a GPU spin, CUDA events; wall time on the CPU).
TFLOP/s is `bench.mla.mla_flops` over the time. Each output is compared with the reference
backend's on the same inputs: "!" after a figure means ||out - ref|| / ||ref|| > --tol, and the
script then exits 1 (also where a config raised: its cell names the error).

    python scripts/sweep_mla.py --grid '{"block_m": [16, 32, 64], "num_warps": [4, 8]}'
    python scripts/sweep_mla.py --shapes 64x4096 --grid '[{"block_n": 64, "num_stages": 3}]'
    # smoke test on the CPU (Triton interpreter, tiny rows)
    TRITON_INTERPRET=1 .venv/bin/python scripts/sweep_mla.py --device cpu --shapes 2x300:p16 --heads 4 \\
        --head-dim 64 --dtype fp16 --reps 1 --grid '{"block_n": [16, 32]}'
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashdispatch.backends.base import MLAInputs, MLAParams  # noqa: E402
from flashdispatch.bench import mla as bench_mla  # noqa: E402
from flashdispatch.dispatch.problem import device_of  # noqa: E402
from flashdispatch.mla import _mla_problem  # noqa: E402
from sweep_decode import config_grid, median_ms  # noqa: E402  (scripts/, the script's own folder)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def row_case(s, device: str, seed: int):
    """(problem, params, inputs) of one bench row, as the MLA wrapper plans it."""
    d = bench_mla.make_mla_data(s, device=device, seed=seed)
    problem = _mla_problem(s.dtype, s.dtype, s.dtype, s.heads, s.head_dim_ckv, s.head_dim_kpe, s.page_size, False)
    lens = np.full(s.batch, s.kv_len, dtype=np.int64)
    params = MLAParams(kv_indptr=d.kv_indptr, kv_indices=d.kv_indices, qo_lens_host=[1] * s.batch,
                       kv_lens_host=lens.tolist(), sm_scale=1.0 / 192 ** 0.5,
                       workspace=torch.zeros(128 << 20, dtype=torch.uint8, device=device))
    out = torch.empty(s.batch, s.heads, s.head_dim_ckv, dtype=s.dtype, device=device)
    return problem, params, MLAInputs(d.q_nope, d.q_pe, d.ckv_cache, d.kpe_cache, out)


def reference_out(problem, params, inputs) -> torch.Tensor:
    from flashdispatch.backends.reference import BACKEND
    backend = BACKEND()
    ref = dataclasses.replace(inputs, out=torch.empty(inputs.out.shape, dtype=torch.float32,
                                                      device=inputs.out.device))
    backend.run(backend.plan(problem.with_(o_dtype=torch.float32), device_of(inputs.out.device), params), ref)
    return ref.out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=bench_mla.DEFAULT_SHAPES)
    ap.add_argument("--grid", default='[{}]', help="JSON: a list of MLATiles dicts or a dict of lists")
    ap.add_argument("--no-default", action="store_true", help="leave out the default tiles' row")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=512, help="ckv (kpe 64)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    from flashdispatch.backends.fa2.mla import mla_tiles, plan_mla
    from flashdispatch.bench.timing import L2Flusher

    shapes = bench_mla.parse_mla_shapes(args.shapes, DTYPES[args.dtype], (args.heads, 1), args.head_dim,
                                        args.page_size)
    grid = config_grid(args.grid, not args.no_default)
    dev = torch.device(args.device)
    device = device_of(dev)
    flush = L2Flusher(dev) if dev.type == "cuda" else None
    print("config".ljust(60) + "".join(s.label.rjust(16) for s in shapes))
    status = 0
    cases = [row_case(s, args.device, seed) for seed, s in enumerate(shapes)]
    refs = [reference_out(*case) for case in cases]
    for cfg in grid:
        cells = []
        for s, (problem, params, inputs), ref in zip(shapes, cases, refs):
            tiles = dataclasses.replace(mla_tiles(problem, s.heads), **cfg)
            try:
                plan = plan_mla(problem, device, params, tiles)
                plan.run(inputs)  # compiles
                ms = median_ms(lambda: plan.run(inputs), args.reps, dev, flush)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a cell
                cells.append(f"{type(e).__name__}"[:15])
                status = 1
                continue
            err = ((inputs.out.float() - ref).norm() / ref.norm()).item()
            rate = bench_mla.mla_flops(s) / (ms * 1e-3) / 1e12
            status = status if err <= args.tol else 1
            cells.append(f"{rate:.1f}" + ("!" if not err <= args.tol else "") + f" ({plan.grid[0]})")
        t = mla_tiles(cases[0][0], shapes[0].heads)
        label = json.dumps(cfg) if cfg else f"default m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages}"
        print(label[:60].ljust(60) + "".join(c.rjust(16) for c in cells), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
