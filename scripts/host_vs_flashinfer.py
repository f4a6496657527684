"""Host time of decode plan() and run(): our wrapper beside FlashInfer's, alternated in one process.

The bench's `plan us`/`run us` columns are one median of 20 calls per column, taken minutes
apart; this host's Python time drifts by 1.5-2x over that. Here both wrappers get the same
inputs (the bench's decode data: device indptr, indices and last_page_len, the page-index check
as configured), and each round times --calls calls of ours, then of FlashInfer's, plan then run;
the table shows the median over --rounds rounds of each round's median call (every call after
a device sync, as the bench's host columns), and as the ratio the median of the rounds' own
ratios (this host runs in slow and fast phases of a few seconds: both sides of a round share
one). ``--profile N`` adds a cProfile of our plan and run at the last shape (the N functions
with the most own time). ``--host-indptr`` passes indptr and
last_page_len as CPU tensors (indices stays on the GPU), as serving engines that build the
batch's metadata on the host do: FlashInfer's plan then reads nothing from the device, ours
still reduces the used page indices to their (min, max) for its page-index check (with fa2
queued without a wait, the check ending at a later run() or plan()). ``--cuda-graph`` times
use_cuda_graph=True wrappers, run() as a graph replay. ``--busy-ms MS`` adds two columns: plan()
issued right after a kernel of MS ms was queued (`host_overhead.busy_plan_us`): about the idle
figure when plan() does not wait for the GPU, about MS ms when it does. ``--step-layers L`` adds
a serving step's host time: plan() then L run()s (one per layer), issued right after a kernel of
``--busy-ms`` ms (5 when not given) was queued, as an engine issues a step while the GPU still
runs the last one: what the step costs beyond the bare calls (a page check still pending at the
runs, the first run() of a new plan) shows there.

    python scripts/host_vs_flashinfer.py --shapes 256x1024,64x4096,1x32768
    python scripts/host_vs_flashinfer.py --ours fa2 --peer fa2-tc --rounds 9 --profile 25
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashdispatch as fd  # noqa: E402
from flashdispatch.bench.decode import (make_decode_data, parse_decode_shapes, peer_column,  # noqa: E402
                                        wrapper_job)
from flashdispatch.bench.peers import import_flashinfer  # noqa: E402
from flashdispatch.bench.timing import host_time_us  # noqa: E402
from host_overhead import busy_plan_us, profile  # noqa: E402  (scripts/, the script's own folder)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="256x1024,64x4096,16x8192,1x32768", help="decode shapes, as the bench's")
    ap.add_argument("--ours", default="fa2", help="our backend (the wrapper's backend=)")
    ap.add_argument("--peer", default="fa2-tc", help="FlashInfer column, as the bench's --peers")
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds (the median is shown)")
    ap.add_argument("--calls", type=int, default=30, help="calls per round and side")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="cProfile our plan and run (last shape)")
    ap.add_argument("--host-indptr", action="store_true", help="indptr and last_page_len on the CPU")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="use_cuda_graph=True wrappers, run() a graph replay (as the bench's --cuda-graph)")
    ap.add_argument("--busy-ms", type=float, default=0.0, metavar="MS",
                    help="also time plan() queued behind an MS ms kernel (does it wait for the GPU?)")
    ap.add_argument("--step-layers", type=int, default=0, metavar="L",
                    help="also time plan() + L run()s issued behind a busy kernel (a serving step)")
    args = ap.parse_args(argv)
    fi, why = import_flashinfer()
    if fi is None:
        raise SystemExit(why)
    where = ("host" if args.host_indptr else "device") + (", CUDA-graph wrappers" if args.cuda_graph else "")
    print(f"host us per call, median of {args.rounds} rounds x {args.calls} calls; ours fd:{args.ours}, "
          f"peer fi:{args.peer}; indptr on the {where}; torch {torch.__version__}, flashinfer {fi.__version__}")
    busy_head = f" {'busy ours':>9} {'busy fi':>8}" if args.busy_ms else ""
    busy_head += f" {'step ours':>9} {'step fi':>8} {'ratio':>6}" if args.step_layers else ""
    print(f"{'shape':<12} {'plan ours':>9} {'plan fi':>8} {'ratio':>6} {'run ours':>9} {'run fi':>7} {'ratio':>6}"
          + busy_head)
    ours = None
    for shape in parse_decode_shapes(args.shapes):
        data = make_decode_data(shape)
        if args.host_indptr:
            data = dataclasses.replace(data, indptr=data.indptr.cpu(), last_page_len=data.last_page_len.cpu())
        ours = wrapper_job(fd, args.ours, data, args.cuda_graph)
        peer = peer_column(fi, args.peer, args.cuda_graph).build(data)
        for job in (ours, peer):
            job.plan()
            job.run()
        torch.cuda.synchronize()
        rounds = {key: [] for key in ("po", "pf", "ro", "rf")}
        for _ in range(args.rounds):
            rounds["po"].append(host_time_us(ours.plan, args.calls))
            rounds["pf"].append(host_time_us(peer.plan, args.calls))
            rounds["ro"].append(host_time_us(ours.run, args.calls))
            rounds["rf"].append(host_time_us(peer.run, args.calls))
        m = {key: statistics.median(values) for key, values in rounds.items()}
        plan_ratio, run_ratio = (statistics.median(o / f for o, f in zip(rounds[ours_key], rounds[peer_key]))
                                 for ours_key, peer_key in (("po", "pf"), ("ro", "rf")))
        busy = ""
        if args.busy_ms:
            busy = "".join(f" {busy_plan_us(job.plan, args.calls, args.busy_ms):{w}.1f}"
                           for job, w in ((ours, 9), (peer, 8)))
        if args.step_layers:  # alternated as the other columns: a round of steps each
            steps = [[busy_plan_us(serving_step(job, args.step_layers), 5, args.busy_ms or 5.0) for job in (ours, peer)]
                     for _ in range(args.rounds)]
            busy += "".join(f" {statistics.median(s[i] for s in steps):{w}.1f}" for i, w in ((0, 9), (1, 8)))
            busy += f" {statistics.median(o / f for o, f in steps):6.2f}"
        print(f"{shape.label:<12} {m['po']:9.1f} {m['pf']:8.1f} {plan_ratio:6.2f} "
              f"{m['ro']:9.1f} {m['rf']:7.1f} {run_ratio:6.2f}{busy}", flush=True)
    if args.profile and ours is not None:
        profile("our plan()", ours.plan, args.calls * 4, args.profile, torch.cuda.synchronize)
        profile("our run()", ours.run, args.calls * 4, args.profile, torch.cuda.synchronize)


def serving_step(job, layers: int):
    """One decode step of an engine: plan(), then a run() per layer."""
    def step():
        job.plan()
        for _ in range(layers):
            job.run()
    return step


if __name__ == "__main__":
    main()
