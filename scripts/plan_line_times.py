"""Host time of decode plan() per statement: where the microseconds of one plan() go.

cProfile names functions; this names lines. The functions in ``FUNCTIONS`` (and ``--extra``
ones) are compiled again from their source with a clock around each statement of their body and
of the bodies of their if/for/while/with/try statements (two levels), so a line's time holds
everything it calls. Each timed statement adds ~0.3 us of clock and bookkeeping to its own and
its enclosing lines: compare the lines with each other, and the "plain" figure (the same plans,
not rewritten) with the bench's.

    python scripts/plan_line_times.py --device cuda                   # indptr etc. on the GPU
    python scripts/plan_line_times.py --device cuda --host-indptr     # indptr, last_page_len on the host
    TRITON_INTERPRET=1 python scripts/plan_line_times.py --calls 500  # CPU tables (the host checks)
"""
from __future__ import annotations

import __future__
import argparse
import ast
import gc
import importlib
import inspect
import os
import sys
import textwrap
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_overhead import decode_calls  # noqa: E402  (scripts/, the script's own folder)

FUNCTIONS = (
    "flashdispatch.decode:BatchDecodeWithPagedKVCacheWrapper.plan",
    "flashdispatch.decode:BatchDecodeWithPagedKVCacheWrapper._build_variant",
    "flashdispatch.checks:paged_lengths",
    "flashdispatch.device_read:read_paged_lengths",
    "flashdispatch.device_read:_launch_summary",
    "flashdispatch.device_read:_read_back",
    "flashdispatch.device_read:IndexRangeReader.start",
    "flashdispatch.deferred_check:DeferredPageCheck._begin_page_check",
    "flashdispatch.deferred_check:DeferredPageCheck._finish_page_check",
    "flashdispatch.planned:plan_problem",
    "flashdispatch.planned:paged_params",
    "flashdispatch.dispatch.select:decide",
    "flashdispatch.backends.fa2.decode:DecodePlan.refreshed",
    "flashdispatch.backends.fa2.decode:DecodePlan._with_tables",
    "flashdispatch.backends.fa2.decode:DecodePlan._set_tables",
)
NESTED = (ast.If, ast.For, ast.While, ast.With, ast.Try)


class LineClock:
    """Nanoseconds and passes per timed statement, keyed "module.Qualname:line" ("+" per level
    of nesting), with the statement's first source line."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.passes: dict[str, int] = defaultdict(int)
        self.source: dict[str, str] = {}

    def reset(self) -> None:
        self.ns.clear()
        self.passes.clear()

    def report(self, calls: int, floor_us: float = 0.3) -> str:
        """The statements of at least ``floor_us`` us per call, slowest first."""
        rows = sorted(self.ns.items(), key=lambda item: -item[1])
        lines = [f"us per call over {calls} calls, passes per call, statement"]
        for key, ns in rows:
            if ns / calls / 1e3 >= floor_us:
                lines.append(f"{ns / calls / 1e3:8.2f} {self.passes[key] / calls:5.1f}x  {key:58s} {self.source[key]}")
        return "\n".join(lines)


def _timed_body(body: list, tag: str, first: int, clock: LineClock, depth: int = 0) -> list:
    """``body`` with each statement in try/finally adding its time to ``clock`` (names _lc_*)."""
    out = []
    for stmt in body:
        if depth < 2 and isinstance(stmt, NESTED):
            for field in ("body", "orelse", "finalbody"):
                if getattr(stmt, field, None):
                    setattr(stmt, field, _timed_body(getattr(stmt, field), tag, first, clock, depth + 1))
            for handler in getattr(stmt, "handlers", ()):
                handler.body = _timed_body(handler.body, tag, first, clock, depth + 1)
        key = f"{tag}:{stmt.lineno + first - 1}{'+' * depth}"
        clock.source[key] = ast.unparse(stmt).splitlines()[0][:90]
        start = ast.parse(f"_lc_t{depth} = _lc_now()").body
        add = ast.parse(f"_lc_ns[{key!r}] += _lc_now() - _lc_t{depth}; _lc_passes[{key!r}] += 1").body
        out += [*start, ast.Try(body=[stmt], handlers=[], orelse=[], finalbody=add)]
    return out


class _ExplicitSuper(ast.NodeTransformer):
    """``super()`` -> ``super(Class, self)``: a function compiled outside its class has no __class__ cell."""

    def __init__(self, cls: str):
        self.cls = cls

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
            node.args = [ast.Name(self.cls, ast.Load()), ast.Name("self", ast.Load())]
        return node


def instrument(target: str, clock: LineClock) -> None:
    """Replace ``"module:Qualname"`` (a function, or a method of a module-level class) by its
    statement-timed copy, which adds to ``clock``."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    kind = inspect.getattr_static(owner, name)
    fn = inspect.unwrap(getattr(owner, name))
    first = fn.__code__.co_firstlineno
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    definition = tree.body[0]
    definition.decorator_list = []
    if path:
        _ExplicitSuper(path[-1]).visit(definition)
    tag = f"{module_name.removeprefix('flashdispatch.')}.{qualname}"
    definition.body = _timed_body(definition.body, tag, first, clock)
    ast.increment_lineno(tree, first - 1)
    ast.fix_missing_locations(tree)
    scope = fn.__globals__
    scope.update(_lc_ns=clock.ns, _lc_passes=clock.passes, _lc_now=time.perf_counter_ns)
    made: dict = {}
    flags = __future__.annotations.compiler_flag  # (the modules' annotations name types imported for checkers)
    exec(compile(tree, inspect.getsourcefile(fn), "exec", flags=flags, dont_inherit=True), scope, made)
    timed = made[name]
    if isinstance(kind, (staticmethod, classmethod)):
        timed = type(kind)(timed)
    setattr(owner, name, timed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--host-indptr", action="store_true", help="indptr and last_page_len on the host")
    ap.add_argument("--shape", default="256x1024", help="BATCHxKV_LEN (32/8 heads, d128, page 16, fp16)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--extra", default="", help="more module:Qualname targets, comma separated")
    args = ap.parse_args(argv)
    batch, kv_len = (int(v) for v in args.shape.split("x"))
    device = torch.device(args.device)
    small = torch.device("cpu") if args.host_indptr else device
    plan, _ = decode_calls(batch, argparse.Namespace(kv_len=kv_len, backend="fa2"), device, small, torch.float16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def per_call_us(after_warmup=lambda: None) -> float:
        for _ in range(20):
            plan()
        sync()
        after_warmup()
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        for _ in range(args.calls):
            plan()
        sync()
        gc.enable()
        return (time.perf_counter() - start) / args.calls * 1e6

    where = "host" if args.host_indptr else "device"
    print(f"decode plan() {args.shape}, indptr on the {where} ({args.device}): plain {per_call_us():.1f} us")
    clock = LineClock()
    for target in FUNCTIONS + tuple(t for t in args.extra.split(",") if t):
        instrument(target, clock)
    timed = per_call_us(clock.reset)
    print(f"statement-timed {timed:.1f} us\n{clock.report(args.calls)}")


if __name__ == "__main__":
    main()
