"""fa2 prefill tile-config sweep on a GPU: rows of `python -m flashdispatch bench prefill` x configs.

    python scripts/sweep_prefill.py --shapes 4096:w1024,16x2048/2048 \
        --configs "128,64,8,3;128,128,8,2;64,64,4,3"
    python scripts/sweep_prefill.py --shapes 16x2048/2048 --page-size 128 --configs ""   # fewer, longer pages

Each config is FLASHDISPATCH_FA2_PREFILL_CONFIG's syntax (four numbers block_m,block_n,warps,stages
or key=value pairs, ';' between configs; '' = the defaults). Each cell goes through the public API
exactly like the bench's fd:fa2 column, and its output is checked against the default config's.
Prints TFLOP/s (visible pairs only) per shape and config.
"""
from __future__ import annotations

import argparse
import os

import torch

import flashdispatch as fd
from flashdispatch.dispatch import select
from flashdispatch.backends.fa2.prefill_config import CONFIG_ENV
from flashdispatch.bench.prefill import make_prefill_data, our_column, parse_prefill_shapes, prefill_flops
from flashdispatch.bench.timing import L2Flusher, measure, relative_error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", required=True, help="bench prefill shapes, e.g. 4096:w1024,16x2048/2048")
    ap.add_argument("--configs", required=True, help="';'-separated configs ('' = defaults)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=16, help="page size of the paged (batch) rows")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(";")]
    device = torch.device("cuda")
    flush = L2Flusher(device)
    column = our_column(fd, "fa2")
    for shape in parse_prefill_shapes(args.shapes, page_size=args.page_size):
        data = make_prefill_data(shape, "cuda")
        cells, ref = [], None
        for cfg in configs:
            os.environ[CONFIG_ENV] = cfg
            select.clear_cache()  # single-request calls keep their plan: drop it, or the first config runs again
            try:
                t = measure(column.build(data), args.reps, flush)
            except Exception as e:  # a config that does not compile or fit: report it, go on
                cells.append(f"[{cfg or 'default'}] {type(e).__name__}: {str(e)[:80]}")
                continue
            err = "" if ref is None else f" err {relative_error(t.output, ref):.1e}"
            ref = t.output.clone() if ref is None else ref
            cells.append(f"[{cfg or 'default'}] {prefill_flops(shape) / t.ms / 1e9:.0f}{err}")
        os.environ.pop(CONFIG_ENV, None)
        print(f"{shape.label}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
