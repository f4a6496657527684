"""``python -m flashdispatch backends | explain | demo | bench``."""
from __future__ import annotations

import argparse

from .dispatch.caps import ALL_FEATURES
from .dispatch.problem import OPS


def _add_explain(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="show which backend would run a described problem, and why")
    p.add_argument("--op", choices=OPS, default="decode")
    p.add_argument("--heads", type=int, nargs="+", metavar="N",
                   help="qo heads [kv heads] (default 32 8); MLA: the query heads (default 128)")
    p.add_argument("--head-dim", type=int, nargs="+", metavar="D",
                   help="qk dim [vo dim] (default 128); MLA: ckv [kpe] (default 512 64)")
    p.add_argument("--page-size", type=int, help="tokens per page (default 16, MLA 64); ragged ops have none")
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
    return p


def _one_line(error: Exception) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _run_explain(args, parser: argparse.ArgumentParser) -> int:
    from .dispatch.explain import describe_device, describe_problem, describe_workload, explain_problem

    for flag, values in (("--heads", args.heads), ("--head-dim", args.head_dim)):
        if values and len(values) > 2:
            parser.error(f"argument {flag}: expected 1 or 2 values, got {len(values)}: {' '.join(map(str, values))}")

    def pair(values):
        return None if not values else (values[0] if len(values) == 1 else tuple(values))

    try:
        problem = describe_problem(
            op=args.op, heads=pair(args.heads), head_dim=pair(args.head_dim), page_size=args.page_size,
            q_dtype=args.q_dtype, kv_dtype=args.kv_dtype, layout=args.layout, features=args.features,
            window_left=args.window_left, logits_soft_cap=args.soft_cap, q_len_per_req=args.q_len_per_req)
        workload = describe_workload(args.batch, args.kv_len, args.q_len_per_req)
        text = explain_problem(problem, describe_device(args.device), workload, args.backend)
    except ValueError as e:
        parser.error(_one_line(e))
    print(text)
    return 0


def _run_demo(args, parser: argparse.ArgumentParser) -> int:
    from .demo import demo_device, run_demo
    try:
        device = demo_device(args.device)
    except ValueError as e:
        parser.error(_one_line(e))
    return run_demo(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashdispatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list every backend: available or not, why, version")
    explain = _add_explain(sub)
    demo = sub.add_parser("demo", help="run decode, paged prefill and MLA through auto and check them")
    demo.add_argument("--device", help="cpu or cuda[:N] (default: cuda if present, else cpu)")
    from .bench import add_bench_parser, run_bench
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "backends":
        from .dispatch.explain import backends_table
        print(backends_table())
        return 0
    if args.command == "explain":
        return _run_explain(args, explain)
    if args.command == "demo":
        return _run_demo(args, demo)
    return run_bench(args)
