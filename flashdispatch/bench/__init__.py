"""``python -m flashdispatch bench decode|prefill|mla``: our backends against FlashInfer and PyTorch.

`add_bench_parser` adds the ``bench`` command to an argparse subparsers object and
`run_bench` runs it (exit code: 0 done, 1 CUDA context lost mid-run, 2 cannot run).
See docs/benchmarks.md for the method and the columns.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from . import decode, mla, prefill
from .matrix import Column
from .timing import FLUSH_MODES

KINDS = {"decode": dict(reps=50, shapes=decode.DEFAULT_SHAPES, heads=(32, 8), head_dim=128, page_size=16),
         "prefill": dict(reps=20, shapes=prefill.DEFAULT_SHAPES, heads=(32, 8), head_dim=128, page_size=16),
         "mla": dict(reps=20, shapes=mla.DEFAULT_SHAPES, heads=(128, 1), head_dim=512, page_size=64)}
MODULES = {"decode": decode, "prefill": prefill, "mla": mla}
SHAPE_SYNTAX = {"decode": "BATCHxKV_LEN[:fp8|:e5m2|:mha|:var]",
                "prefill": "N (single), Q/K (single), BxQ/K (paged), each [:nc|:w<N>|:mask]",
                "mla": "BATCHxKV_LEN[:p<PAGE>]"}
# Our extra column names beyond registered backends, per kind.
EXTRA_COLUMNS = {"decode": ("auto", *decode.OUR_FUNCTION_COLUMNS), "prefill": ("auto",), "mla": ("auto",)}
OPS = {"decode": ("decode",), "prefill": ("prefill_paged", "prefill_ragged"), "mla": ("mla",)}
OPT_IN_FA3 = {"prefill": "takes 88-101 s", "mla": "is slow (not measured)"}  # FlashInfer fa3's JIT, per kind
# Timing makes two CUDA events per rep up front and --json keeps every rep's time; 10^4 is 200x the default.
MAX_REPS = 10_000


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _heads(text: str) -> tuple[int, int]:
    try:
        return decode.parse_heads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench {decode,prefill,mla}`` with its options; returns the ``bench`` parser."""
    bench = subparsers.add_parser("bench", help="time attention backends against FlashInfer (GPU)",
                                  description=__doc__.splitlines()[0])
    kinds = bench.add_subparsers(dest="bench_kind", metavar="{decode,prefill,mla,summary}", required=True)
    summary = kinds.add_parser("summary", help="print the summary tables of saved --json results")
    summary.add_argument("paths", nargs="+", metavar="RESULT.json")
    for kind, defaults in KINDS.items():
        p = kinds.add_parser(kind, help=f"{kind} matrix (see docs/benchmarks.md)")
        p.add_argument("--shapes", default=defaults["shapes"],
                       help=f"comma list of {SHAPE_SYNTAX[kind]} (default: {defaults['shapes']})")
        p.add_argument("--backends", type=_csv, default=None,
                       help="our columns, comma list (default: auto + every available backend"
                            + (" + cudnn-fn, xqa-fn, fa2-fn" if kind == "decode" else "")
                            + "; reference only on request)")
        p.add_argument("--peers", type=_csv, default=None,
                       help=f"peer columns from {', '.join(MODULES[kind].PEER_COLUMNS)} (default: all"
                            + (" but fa3" if kind in OPT_IN_FA3 else "") + ")")
        p.add_argument("--no-peer", action="store_true", help="run our backends only")
        if kind == "decode":
            p.add_argument("--stream", action="store_true",
                           help="add hw:stream, a plain streaming read of each row's KV cache (docs/benchmarks.md)")
            p.add_argument("--cuda-graph", action="store_true",
                           help="time every attention call as a CUDA-graph replay (wrappers made with "
                                "use_cuda_graph=True, as serving engines run decode)")
        if kind in OPT_IN_FA3:
            p.add_argument("--peer-fa3", action="store_true",
                           help=f"add FlashInfer fa3 (its JIT compile {OPT_IN_FA3[kind]})")
        p.add_argument("--dtype", choices=sorted(decode.DTYPES), default="bf16",
                       help="q, output and K/V dtype" + (" (KV unless the row says fp8)" if kind == "decode" else "")
                       + " (default: bf16)")
        heads = "/".join(map(str, defaults["heads"]))
        p.add_argument("--heads", type=_heads, default=defaults["heads"], help=f"QO/KV heads (default: {heads})")
        p.add_argument("--head-dim", type=int, default=defaults["head_dim"],
                       help=("ckv dims (kpe: 64)" if kind == "mla" else "dims per head")
                       + f" (default: {defaults['head_dim']})")
        p.add_argument("--page-size", type=int, default=defaults["page_size"],
                       help=f"(default: {defaults['page_size']})")
        p.add_argument("--reps", type=int, default=defaults["reps"],
                       help=f"timed calls per cell, median reported (default: {defaults['reps']})")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--l2-flush", choices=FLUSH_MODES, default="write",
                       help="before each timed call: write (zero 256 MB, ANCHORS' method; the call also "
                            "writes back the dirty lines left in L2) or read (sum 256 MB: clean lines) "
                            "(default: write)")
        p.add_argument("--json", metavar="PATH", help="write every cell as JSON (rewritten after each row)")
        p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
        p.add_argument("--plain", action="store_true", help="plain-text tables even if rich is importable")
        p.add_argument("--dry-run", action="store_true", help="list rows and columns, run nothing")
    return bench


def check_options(args) -> None:
    """ValueError naming the first bad option, before any work: integer ranges, empty name
    lists, and --json/--plot paths (their directory must exist and be writable)."""
    ranges = (("--reps", args.reps, 1, MAX_REPS, "timed calls per cell"),
              ("--head-dim", args.head_dim, 1, None, "dims per head"),
              ("--page-size", args.page_size, 1, decode.INT32_MAX, "tokens per page, int32"),
              ("--seed", args.seed, 0, 2**64 - 1, "torch generator seeds are 64-bit"))
    for option, value, low, high, what in ranges:
        if value < low or (high is not None and value > high):
            accepted = f"{low} .. {high}" if high is not None else f">= {low}"
            raise ValueError(f"{option}={value}: expected {accepted} ({what})")
    for option, names in (("--backends", args.backends), ("--peers", args.peers)):
        if names == []:
            raise ValueError(f"{option}: no names in the comma list (leave it out for the default)")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_output_path(option, path)


def check_output_path(option: str, path: str) -> None:
    """ValueError unless ``path`` names a file that can be written in an existing directory."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.basename(path) or os.path.isdir(path):
        raise ValueError(f"{option}={path!r}: expected a file path, not a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"{option}={path!r}: directory {folder!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):  # a real write: os.access says yes to root, even on /proc
            pass
    except OSError as e:
        raise ValueError(f"{option}={path!r}: directory {folder!r} not writable ({e.strerror})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{option}={path!r}: file not writable")


def parse_shapes(args) -> list:
    parse = {"decode": decode.parse_decode_shapes, "prefill": prefill.parse_prefill_shapes,
             "mla": mla.parse_mla_shapes}[args.bench_kind]
    try:
        return parse(args.shapes, decode.DTYPES[args.dtype], args.heads, args.head_dim, args.page_size)
    except ValueError as e:
        raise ValueError(f"--shapes: {e}") from None


def default_backends(kind: str) -> tuple[list[str], list[str]]:
    """Our default columns for ``kind`` and a note for each registered backend left out."""
    from ..dispatch import registry

    names, notes = ["auto"], []
    for name in registry.BACKEND_NAMES:
        if name == registry.REFERENCE:  # ground truth, not a contender
            continue
        failure = registry.load_failure(name)
        if failure is not None:
            notes.append(f"fd:{name} not run: {failure}")
            continue
        cls = registry.backend_class(name)
        if not any(op in cls.caps_for(op).ops for op in OPS[kind]):
            continue
        reasons = cls.availability()
        if reasons:
            notes.append(f"fd:{name} not run: " + "; ".join(map(str, reasons)))
            continue
        names.append(name)
    if kind == "decode":
        names += [fn for fn, backend in decode.OUR_FUNCTION_COLUMNS.items() if backend in names]
    return names, notes


def check_backend_names(kind: str, names: list[str]) -> None:
    from ..dispatch import registry

    valid = set(registry.BACKEND_NAMES) | set(EXTRA_COLUMNS[kind])
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"--backends: {', '.join(bad)} not valid for {kind}; valid: {', '.join(sorted(valid))}")


def _failing_column(label: str, reason: str) -> Column:
    def build(_data):
        raise RuntimeError(reason)
    return Column(label, build)


def select_columns(args) -> tuple[list[Column], list[str]]:
    """Our columns then the peers', and notes on what was left out and why."""
    kind = args.bench_kind
    mod = MODULES[kind]
    notes: list[str] = []
    if args.backends is None:
        ours, notes = default_backends(kind)
    else:
        check_backend_names(kind, args.backends)
        ours = args.backends
    try:
        import flashdispatch as fd
        columns = [mod.our_column(fd, name, **_graph_arg(args)) for name in ours]
    except Exception as e:  # noqa: BLE001 - our package failing to import is shown per cell
        columns = [_failing_column(f"fd:{n}", f"import flashdispatch: {type(e).__name__}: {e}") for n in ours]
    if kind == "decode" and args.stream:
        from .stream import stream_column
        columns.append(stream_column(args.l2_flush))
    if args.no_peer:
        return columns, notes
    peers = args.peers
    if peers is None:
        peers = list(decode.PEER_COLUMNS) if kind == "decode" else list(mod.DEFAULT_PEERS)
        if kind in OPT_IN_FA3 and args.peer_fa3:
            peers.append("fa3")
    bad = [p for p in peers if p not in mod.PEER_COLUMNS]
    if bad:
        raise ValueError(f"--peers: {', '.join(bad)} not valid; valid: {', '.join(mod.PEER_COLUMNS)}")
    from .peers import import_flashinfer, torch_columns

    fi_names = [p for p in peers if p in ("fa2-cc", "fa2-tc", "cudnn-fn", "xqa-fn", "fa2", "fa3")]
    fi, why = import_flashinfer() if fi_names else (None, None)
    if fi is not None:
        columns += [mod.peer_column(fi, p, **_graph_arg(args)) for p in fi_names]
    elif fi_names:
        notes.append(f"FlashInfer columns not run: {why}")
    if kind == "prefill":
        columns += torch_columns(peers)
    return columns, notes


def _graph_arg(args) -> dict:
    """The column builders' ``cuda_graph`` keyword where the bench was asked for it (decode)."""
    return {"cuda_graph": True} if getattr(args, "cuda_graph", False) else {}


def decode_ratio_refs(labels: list[str]) -> dict[str, list[str]]:
    """The decode ratios that ``labels`` allow: ``FI best`` (the best FlashInfer column of the
    row) and ``stream`` (the row's plain streaming read, `stream.STREAM_COLUMN`), in that order."""
    from .stream import STREAM_COLUMN
    refs = {"FI best": [c for c in labels if c.startswith("fi:")], "stream": [STREAM_COLUMN]}
    return {name: cols for name, cols in refs.items() if set(cols) & set(labels)}


def _work(kind: str):
    if kind == "decode":
        return lambda s: float(decode.kv_bytes(s))
    return mla.mla_flops if kind == "mla" else prefill.prefill_flops


def dry_run(args, shapes, columns, notes) -> int:
    unit, scale = ("GB of KV", 1e9) if args.bench_kind == "decode" else ("TFLOP", 1e12)
    work = _work(args.bench_kind)
    print(f"{args.bench_kind}: {len(shapes)} rows x {len(columns)} columns, {args.reps} timed calls per cell")
    for s in shapes:
        print(f"  {s.label:24s} {work(s) / scale:10.3f} {unit}")
    print("columns: " + ", ".join(c.label for c in columns))
    for n in notes:
        print(f"note: {n}")
    return 0


def run_bench(args) -> int:
    """Run ``bench decode|prefill|mla|summary`` as parsed by `add_bench_parser`; returns the exit code."""
    if args.bench_kind == "summary":
        from .report import main as summary_main
        return summary_main(args.paths)
    try:
        check_options(args)
        shapes = parse_shapes(args)
        columns, notes = select_columns(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args, shapes, columns, notes)
    import torch

    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (no timing on the CPU); try --dry-run", file=sys.stderr)
        return 2
    from .matrix import run_matrix
    from .peers import environment
    from .report import Report, print_report, save_plot
    from .timing import copy_rate_tbs, matmul_tflops

    device = torch.device("cuda")
    ceilings = {"copy TB/s (read+write)": copy_rate_tbs(device), "bf16 matmul 8192^3 TFLOP/s": matmul_tflops(device)}
    if args.bench_kind == "decode":
        report = Report("decode", "TB/s", "copy", ceilings["copy TB/s (read+write)"],
                        decode_ratio_refs([c.label for c in columns]))
        make = lambda s: decode.make_decode_data(s, seed=args.seed)  # noqa: E731
        baseline = decode.BASELINE_ORDER
    else:
        mod = MODULES[args.bench_kind]
        refs = {f"fi:{p}": [f"fi:{p}"] for p in ("fa2", "fa3") if any(c.label == f"fi:{p}" for c in columns)}
        report = Report(args.bench_kind, "TFLOP/s", "bf16 matmul", ceilings["bf16 matmul 8192^3 TFLOP/s"], refs)
        maker = mla.make_mla_data if args.bench_kind == "mla" else prefill.make_prefill_data
        make = lambda s: maker(s, seed=args.seed)  # noqa: E731
        baseline = mod.BASELINE_ORDER
    report.env, report.ceilings, report.notes = environment(), ceilings, list(notes)
    if getattr(args, "cuda_graph", False):
        report.notes.append("every attention call a CUDA-graph replay (use_cuda_graph=True wrappers); "
                            "first call includes the capture")
    if args.l2_flush != "write":
        report.notes.append(f"L2 flush before each call: {args.l2_flush} (not ANCHORS' write flush)")
    intact = run_matrix(report, shapes, columns, make, _work(args.bench_kind), args.reps, baseline,
                        json_path=args.json, flush_mode=args.l2_flush)
    print_report(report, use_rich=False if args.plain else None)
    if args.json:
        report.save_json(args.json)
    if args.plot:
        why = save_plot(report, args.plot)
        if why:
            print(why, file=sys.stderr)
    return 0 if intact else 1
