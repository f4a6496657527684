"""The loop shared by the decode and prefill benchmarks: every shape x every column.

Each cell is built, timed and checked inside its own try: a backend that is unavailable
or rejects a shape records the reason and the run goes on. If an error leaves the CUDA
context unusable, the remaining cells record that instead of crashing the run. The JSON
is rewritten after each shape so a run cut short by a time limit still leaves its data.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .report import Cell, Report, fill_derived, one_line
from .timing import Job, L2Flusher, measure, relative_error


class NotApplicable(Exception):
    """A column that has no meaning for a shape (e.g. SDPA on a paged batch): no cell."""


@dataclass(frozen=True)
class Column:
    """A benchmark column: ``build(data)`` returns a ready `Job` (or raises NotApplicable,
    or any error, which becomes the cell's reason)."""

    label: str
    build: Callable[[Any], Job]


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def cuda_context_ok() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_matrix(
    report: Report,
    shapes: list[Any],
    columns: list[Column],
    make_data: Callable[[Any], Any],
    work_of: Callable[[Any], float],
    reps: int,
    baseline_order: list[str],
    json_path: str | None = None,
    log: Callable[[str], None] = _stderr,
    flush_mode: str = "write",
) -> bool:
    """Measure every (shape, column) cell into ``report``; shapes have a ``label``;
    ``work_of(shape)`` is the bytes or FLOPs of one call; ``flush_mode``: `L2Flusher`'s.
    Returns False if the CUDA context was lost."""
    flush = L2Flusher(torch.device("cuda"), mode=flush_mode)
    lost: str | None = None
    for shape in shapes:
        report.shapes.append(shape.label)
        outputs: dict[str, torch.Tensor] = {}
        data, data_error = None, None
        if lost is None:
            try:
                data = make_data(shape)
            except Exception as e:  # noqa: BLE001 - recorded in every cell of the row
                data_error = f"making inputs: {error_text(e)}"
                lost = None if cuda_context_ok() else f"CUDA context lost making inputs of {shape.label}"
        for col in columns:
            cell = Cell(shape.label, col.label)
            if lost is not None or data is None:
                cell.error = lost or data_error
            else:
                try:
                    job = col.build(data)
                    t = measure(job, reps, flush)
                except NotApplicable:
                    continue
                except Exception as e:  # noqa: BLE001 - never crash the run for one cell
                    cell.error = error_text(e)
                    if not cuda_context_ok():
                        lost = f"CUDA context lost after {shape.label} {col.label}: {one_line(cell.error, 200)}"
                else:
                    cell.ms, cell.ms_all = t.ms, t.ms_all
                    cell.plan_us, cell.run_us, cell.first_s = t.plan_us, t.run_us, t.first_s
                    if t.output is not None:  # None: a column with no attention output (hw:stream)
                        outputs[col.label] = t.output
                    cell.info = job.info() if job.info is not None else ""
                    del job, t
            if col.label not in report.columns:
                report.columns.append(col.label)
            report.cells.append(cell)
            fill_derived(report, shape.label, work_of(shape))
            log(progress_line(cell, report.unit))
        if lost is None:
            check_outputs(report, shape.label, outputs, baseline_order)
        del data, outputs
        gc.collect()
        if lost is None:
            torch.cuda.empty_cache()
        if json_path:
            report.save_json(json_path)
    if lost is not None:
        report.notes.append(lost)
    return lost is None


def check_outputs(report: Report, shape: str, outputs: dict[str, torch.Tensor], order: list[str]) -> None:
    """rel_err of each output against the baseline: the first of ``order`` that was
    measured, else the first column measured."""
    if not outputs:
        return
    base = next((c for c in order if c in outputs), next(iter(outputs)))
    report.baselines[shape] = base
    ref = outputs[base]
    for c in report.cells:
        if c.shape == shape and c.column in outputs:
            try:
                c.rel_err = relative_error(outputs[c.column], ref)
            except Exception as e:  # noqa: BLE001 - e.g. an output of another dtype/shape
                c.error = f"output check: {error_text(e)}"


def progress_line(c: Cell, unit: str) -> str:
    if c.error:
        return f"[{c.shape} | {c.column}] {one_line(c.error, 200)}"
    rate = f"{c.rate:.3g} {unit}" if c.rate is not None else ""
    return f"[{c.shape} | {c.column}] {c.ms:.4f} ms {rate}  first {c.first_s:.2f} s  run {c.run_us:.0f} us"
