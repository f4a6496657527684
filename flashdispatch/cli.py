"""``python -m flashdispatch backends | explain | demo | bench``."""
from __future__ import annotations

import argparse

from .dispatch.caps import ALL_FEATURES
from .dispatch.problem import OPS


def _add_explain(sub) -> None:
    p = sub.add_parser("explain", help="show which backend would run a described problem, and why")
    p.add_argument("--op", choices=OPS, default="decode")
    p.add_argument("--heads", type=int, nargs="+", metavar="N", help="qo heads [kv heads] (default 32 8)")
    p.add_argument("--head-dim", type=int, nargs="+", metavar="D", help="qk dim [vo dim]; MLA: ckv kpe")
    p.add_argument("--page-size", type=int, help="tokens per page (default 16; 0 for ragged)")
    p.add_argument("--q-dtype", default="bf16")
    p.add_argument("--kv-dtype")
    p.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    p.add_argument("--features", default="", help=f"comma list of {', '.join(sorted(ALL_FEATURES))}")
    p.add_argument("--window-left", type=int, default=-1)
    p.add_argument("--soft-cap", type=float, default=0.0)
    p.add_argument("--q-len-per-req", type=int, default=1)
    p.add_argument("--device", help="'cpu', 'cuda', or a fake device such as sm80, sm90, sm100")
    p.add_argument("--batch", type=int, default=0, help="batch size of the workload (for rules)")
    p.add_argument("--kv-len", type=int, default=0, help="kv length of each request (for rules)")
    p.add_argument("--backend", default="auto", help="request a backend by name")


def _run_explain(args) -> int:
    from .dispatch.explain import describe_device, describe_problem, describe_workload, explain_problem

    def pair(values):
        return None if not values else (values[0] if len(values) == 1 else f"{values[0]}/{values[1]}")

    problem = describe_problem(
        op=args.op, heads=pair(args.heads), head_dim=pair(args.head_dim), page_size=args.page_size,
        q_dtype=args.q_dtype, kv_dtype=args.kv_dtype, layout=args.layout, features=args.features,
        window_left=args.window_left, logits_soft_cap=args.soft_cap, q_len_per_req=args.q_len_per_req)
    workload = describe_workload(args.batch, args.kv_len, args.q_len_per_req)
    print(explain_problem(problem, describe_device(args.device), workload, args.backend))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashdispatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list every backend: available or not, why, version")
    _add_explain(sub)
    demo = sub.add_parser("demo", help="run decode, paged prefill and MLA through auto and check them")
    demo.add_argument("--device", help="torch device (default: cuda if present, else cpu)")
    from .bench import add_bench_parser, run_bench
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "backends":
        from .dispatch.explain import backends_table
        print(backends_table())
        return 0
    if args.command == "explain":
        return _run_explain(args)
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args.device)
    return run_bench(args)
