"""``python -m flashdispatch.bench decode|prefill|summary ...``: the bench command on its own."""
import argparse
import sys

from . import add_bench_parser, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashdispatch.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
