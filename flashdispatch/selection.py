"""Top-level dispatch helpers: `explain()` and `select_backend()`."""
from __future__ import annotations

from .dispatch.explain import describe_problem, explain_problem
from .dispatch.problem import EMPTY_WORKLOAD, Device, Problem, Workload, device_of
from .dispatch.select import Decision, select


def select_backend(problem: Problem, device: Device | str | None = None, workload: Workload = EMPTY_WORKLOAD,
                   backend: str = "auto") -> Decision:
    """The `Decision` for a problem: which backend runs it and why every other one does not.

    ``device`` is a `Device` or a torch device spec (default: the current CUDA device, else CPU).
    """
    return select(problem, _device(device), workload, backend)


def _device(device) -> Device:
    if isinstance(device, Device):
        return device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device_of(device)


def explain(obj=None, *, device: Device | str | None = None, workload: Workload = EMPTY_WORKLOAD,
            backend: str = "auto", **problem_fields) -> str:
    """The selection table: for a wrapper after plan() (``explain(wrapper)``), a `Problem`, or a
    problem described by keywords (``explain(op="decode", heads=(32, 8), head_dim=128, page_size=16)``).

    Every registered backend is listed with its verdict and reasons; the chosen one is marked.
    """
    if obj is not None and hasattr(obj, "explain") and not isinstance(obj, Problem):
        return obj.explain()
    problem = obj if isinstance(obj, Problem) else describe_problem(**problem_fields)
    return explain_problem(problem, _device(device), workload, backend)
