"""Benchmark results: one `Cell` per (shape, column), printed as tables, saved as JSON/PNG.

The detail table has one line per cell (ms, rate, % of the measured ceiling, ratios to
the peer, host times, first-call time, error against the baseline column, the reason a
cell has no number). The summary table pivots the rates: shapes down, columns across.

``python -m flashdispatch.bench summary RESULT.json ...`` prints the summaries of saved runs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from dataclasses import dataclass, field

NOTE_WIDTH = 90


@dataclass
class Cell:
    """One measurement. ``rate`` is TB/s (decode) or TFLOP/s (prefill); ``error`` says why a
    cell has no number (unavailable backend, rejected shape, exception)."""

    shape: str
    column: str
    ms: float | None = None
    rate: float | None = None
    pct_ceiling: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    plan_us: float | None = None
    run_us: float | None = None
    first_s: float | None = None
    rel_err: float | None = None
    error: str | None = None
    info: str = ""
    ms_all: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.rate is not None


@dataclass
class Report:
    """A whole run: what was measured, the ceilings, the environment and every cell."""

    kind: str  # "decode" | "prefill"
    unit: str  # "TB/s" | "TFLOP/s"
    ceiling_name: str
    ceiling: float | None
    ratio_refs: dict[str, list[str]]  # ratio name -> peer columns whose best rate is the reference
    env: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    baselines: dict[str, str] = field(default_factory=dict)  # shape -> column that err is against

    def cell(self, shape: str, column: str) -> Cell | None:
        for c in self.cells:
            if c.shape == shape and c.column == column:
                return c
        return None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for c in d["cells"]:
            c["ms_all"] = [round(v, 5) for v in c["ms_all"]]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Report":
        d = dict(d)
        cells = [Cell(**c) for c in d.pop("cells", [])]
        return cls(**d, cells=cells)

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, allow_nan=True)


def fill_derived(report: Report, shape: str, work: float) -> None:
    """Rates, % of ceiling and ratios of every measured cell of ``shape``; ``work`` is the
    bytes (decode) or FLOPs (prefill) of one call."""
    cells = [c for c in report.cells if c.shape == shape]
    for c in cells:
        if c.error is None and c.ms:
            c.rate = work / (c.ms * 1e-3) / 1e12
            if report.ceiling:
                c.pct_ceiling = 100.0 * c.rate / report.ceiling
    for name, peers in report.ratio_refs.items():
        ref = max((c.rate for c in cells if c.column in peers and c.ok), default=None)
        if ref:
            for c in cells:
                if c.ok:
                    c.ratios[name] = c.rate / ref


def _num(v: float | None, digits: int) -> str:
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.{digits}f}"


def _err(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.1e}"


def one_line(text: str, width: int = NOTE_WIDTH) -> str:
    """The error text on one line, cut to ``width`` characters."""
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text if len(text) <= width else text[: width - 3] + "..."


def detail_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """Headers and rows (strings) of the per-cell table."""
    rate_digits = 2 if report.unit == "TB/s" else 0
    headers = ["shape", "backend", "ms", report.unit, "% ceil"]
    headers += [f"x {name}" for name in report.ratio_refs]
    headers += ["plan us", "run us", "first s", "err", "note"]
    rows = []
    for c in report.cells:
        row = [c.shape, c.column, _num(c.ms, 4), _num(c.rate, rate_digits), _num(c.pct_ceiling, 0)]
        row += [_num(c.ratios.get(name), 2) for name in report.ratio_refs]
        row += [_num(c.plan_us, 0), _num(c.run_us, 0), _num(c.first_s, 2), _err(c.rel_err)]
        row.append(one_line(c.error) if c.error else c.info)
        rows.append(row)
    return headers, rows


def best_ours_ratio(report: Report, shape: str, ref: str) -> float | None:
    """The ``ref`` ratio of our fastest column (``fd:``) on ``shape`` (None when none ran)."""
    ours = [c for c in report.cells if c.shape == shape and c.column.startswith("fd:") and c.ok]
    best = max(ours, key=lambda c: c.rate, default=None)
    return best.ratios.get(ref) if best else None


def summary_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the pivot table: rate per shape and column, then the best of
    ours over the best peer of the first ratio reference."""
    rate_digits = 2 if report.unit == "TB/s" else 0
    first_ref = next(iter(report.ratio_refs), None)
    headers = [f"shape ({report.unit})"] + list(report.columns)
    if first_ref:
        headers.append(f"best fd / {first_ref}")
    rows = []
    for shape in report.shapes:
        row = [shape]
        for col in report.columns:
            c = report.cell(shape, col)
            row.append("" if c is None else _num(c.rate, rate_digits) if c.ok else "x")
        if first_ref:
            row.append(_num(best_ours_ratio(report, shape, first_ref), 2))
        rows.append(row)
    return headers, rows


def geomean_lines(report: Report) -> list[str]:
    """The geometric mean of the summary's last column over every row that has one, and over
    the rows without a modifier (``:fp8``, ``:mha``, ... : ANCHORS.md's matrix) when they differ."""
    ref = next(iter(report.ratio_refs), None)
    if ref is None:
        return []
    ratios = {s: best_ours_ratio(report, s, ref) for s in report.shapes}
    ratios = {s: r for s, r in ratios.items() if r}
    plain = {s: r for s, r in ratios.items() if ":" not in s}
    def line(label: str, subset: dict[str, float]) -> str:
        g = math.exp(sum(math.log(r) for r in subset.values()) / len(subset))
        return f"geomean best fd / {ref}, {label} ({len(subset)}): {g:.3f}"

    lines = [line("every row", ratios)] if ratios else []
    if plain and len(plain) < len(ratios):
        lines.append(line("rows without a modifier", plain))
    return lines


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def render_plain(headers: list[str], rows: list[list[str]]) -> str:
    """A fixed-width text table: the first column and text left-aligned, numbers right-aligned."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        out = [c.rjust(w) if i > 0 and (_is_number(c) or c == "-") else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def render(headers: list[str], rows: list[list[str]], title: str, use_rich: bool | None = None) -> None:
    """Print a table with rich when it is importable (and not disabled), else plain text."""
    if use_rich is None:
        try:
            import rich  # noqa: F401
            use_rich = True
        except ImportError:
            use_rich = False
    if not use_rich:
        print(title)
        print(render_plain(headers, rows))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h, justify="left" if h in ("shape", "backend", "note") else "right")
    for r in rows:
        table.add_row(*r)
    width = None if sys.stdout.isatty() else max(160, shutil.get_terminal_size().columns)
    Console(width=width).print(table)


def print_report(report: Report, detail: bool = True, use_rich: bool | None = None) -> None:
    """Header lines (environment, ceilings, notes), the detail table, then the summary."""
    for k, v in report.env.items():
        print(f"{k}: {v}")
    for k, v in report.ceilings.items():
        print(f"ceiling {k}: {v:.3g}")
    for note in report.notes:
        print(f"note: {note}")
    for base in sorted(set(report.baselines.values())):
        shapes = [s for s, b in report.baselines.items() if b == base]
        print(f"err = ||out - ref|| / ||ref|| with ref = {base} on {', '.join(shapes)}")
    if detail:
        render(*detail_rows(report), title=f"{report.kind} (per cell)", use_rich=use_rich)
    render(*summary_rows(report), title=f"{report.kind} summary: {report.unit}", use_rich=use_rich)
    for line in geomean_lines(report):
        print(line)


def save_plot(report: Report, path: str) -> str | None:
    """A grouped bar chart of the rates (one group per shape) with the ceiling as a line.
    Returns None on success, else why no chart was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"--plot skipped: matplotlib not importable ({e})"
    cols = report.columns
    n = max(1, len(cols))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(min(20, 3 + 0.15 * n * len(report.shapes)), 5))
    colors = plt.get_cmap("tab20").colors
    for i, col in enumerate(cols):
        xs, ys = [], []
        for j, shape in enumerate(report.shapes):
            c = report.cell(shape, col)
            if c is not None and c.ok:
                xs.append(j + (i - (n - 1) / 2) * width)
                ys.append(c.rate)
        ax.bar(xs, ys, width=width, label=col, color=colors[i % len(colors)])
    if report.ceiling:
        ax.axhline(report.ceiling, color="black", linestyle="--", linewidth=1,
                   label=f"{report.ceiling_name} {report.ceiling:.3g}")
    ax.set_xticks(range(len(report.shapes)))
    ax.set_xticklabels(report.shapes, rotation=30, ha="right")
    ax.set_ylabel(report.unit)
    ax.set_title(f"{report.kind}: {report.env.get('gpu', '')}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    """Print the summary table of each saved JSON report; 2 if any could not be read."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m flashdispatch.bench summary RESULT.json [...]", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        try:
            with open(path) as f:
                report = Report.from_json(json.load(f))
            lines = [f"== {path}", *(f"note: {note}" for note in report.notes),
                     f"{report.kind} summary: {report.unit}", render_plain(*summary_rows(report)),
                     *geomean_lines(report)]
        except Exception as e:  # noqa: BLE001 - any unreadable or malformed file is reported, not raised
            print(f"bench: summary: {path}: cannot read report: {type(e).__name__}: {one_line(str(e), 200)}",
                  file=sys.stderr)
            failed = True
            continue
        print("\n".join(lines))
    return 2 if failed else 0
