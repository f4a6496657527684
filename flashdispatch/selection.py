"""Top-level dispatch helpers: `explain()` and `select_backend()`."""
from __future__ import annotations

import inspect

from .dispatch.explain import describe_device, describe_problem, explain_problem
from .dispatch.problem import EMPTY_WORKLOAD, Device, Problem, Workload
from .dispatch.select import Decision, select

_PROBLEM_KEYWORDS = tuple(inspect.signature(describe_problem).parameters)


def _checked(problem, device, workload, what: str) -> tuple[Device, Workload]:
    if not isinstance(problem, Problem):
        raise TypeError(f"{what}: problem={problem!r:.80}: expected a flashdispatch.Problem")
    if not isinstance(workload, Workload):
        raise TypeError(f"{what}: workload={workload!r:.80}: expected a flashdispatch.Workload")
    return describe_device(device), workload


def select_backend(problem: Problem, device: Device | str | None = None, workload: Workload = EMPTY_WORKLOAD,
                   backend: str = "auto") -> Decision:
    """The `Decision` for a problem: which backend runs it and why every other one does not.

    ``device``: a `Device`, ``"cpu"``, ``"cuda[:N]"``, a compute capability for a GPU that is
    not here (``"sm90"``, ``"9.0"``) or None (the current CUDA device, else the CPU).
    """
    device, workload = _checked(problem, device, workload, "select_backend")
    return select(problem, device, workload, backend)


def explain(obj=None, *, device: Device | str | None = None, workload: Workload = EMPTY_WORKLOAD,
            backend: str = "auto", **problem_fields) -> str:
    """The selection table: for a wrapper after plan() or a `Decision` (``explain(wrapper)``), a
    `Problem`, or a problem described by keywords (``explain(op="decode", heads=(32, 8), head_dim=128,
    page_size=16)``, see `describe_problem`). ``device`` as in `select_backend`.

    Every registered backend is listed with its verdict and reasons; the chosen one is marked.
    """
    unknown = [k for k in problem_fields if k not in _PROBLEM_KEYWORDS]
    if unknown:
        raise TypeError(f"explain() got unknown keyword(s) {', '.join(unknown)}; a problem is described by "
                        f"{', '.join(_PROBLEM_KEYWORDS)}")
    if obj is None:
        obj = describe_problem(**problem_fields)
    elif not isinstance(obj, (Problem, type)) and callable(getattr(obj, "explain", None)):
        given = [*problem_fields, *(["device"] if device is not None else []),
                 *(["workload"] if workload is not EMPTY_WORKLOAD else []), *(["backend"] if backend != "auto" else [])]
        if given:
            raise TypeError(f"explain({type(obj).__name__}) shows the decision its plan() made; it takes no "
                            f"{', '.join(given)}")
        return obj.explain()
    elif not isinstance(obj, Problem):
        raise TypeError(f"explain(obj={obj!r:.80}): expected a wrapper after plan(), a Decision or a Problem "
                        "(or keywords that describe a problem)")
    elif problem_fields:
        raise TypeError(f"explain(problem, ...) takes no problem keywords, got {', '.join(problem_fields)}: "
                        "change the Problem with problem.with_(...)")
    device, workload = _checked(obj, device, workload, "explain")
    return explain_problem(obj, device, workload, backend)
