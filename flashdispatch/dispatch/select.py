"""Choosing the backend that runs a problem: `select()` -> `Decision`.

Where the order of candidates comes from, highest first: the explicit ``requested``
backend (not "auto"), the innermost active ``use_backends([...])`` block, the environment
variable ``FLASHDISPATCH_BACKEND`` (a name or a comma list), then the policy's pins, its
first matching rule and its defaults. Every registered backend's ``supports()`` runs and
all reasons are kept; the first candidate in the order with none is chosen. On a CUDA
device the PyTorch reference is tried last whatever its place in the order.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..environ import env_get
from . import registry
from .policy import Policy, active_policy
from .problem import EMPTY_WORKLOAD, Device, Problem, Workload
from .reasons import Reason, Unsupported

BACKEND_ENV = "FLASHDISPATCH_BACKEND"
REFERENCE = registry.REFERENCE
SELECTED = "selected"
LAST_RESORT = "last resort on a GPU"
NOT_IN_ORDER = "not in order"
REFUSED = "refused: reference_fallback is error"


class ReferenceFallbackWarning(UserWarning):
    """A GPU problem runs on the PyTorch reference because every faster backend rejected it."""


@dataclass(frozen=True)
class Decision:
    """The outcome of a selection, with everything explain() prints.

    backend:      the chosen backend's name, or None when nothing may run (see ``failure``).
    candidates:   (name, reasons, note) for every registered backend: those in the order
                  first, in order, then the others with note "not in order". ``reasons`` is
                  empty when the backend can run the problem.
    order_source: where the order came from, e.g. "rule 'hopper-decode' (configs/default.yaml)".
    """

    problem: Problem
    device: Device
    workload: Workload
    backend: str | None
    candidates: tuple[tuple[str, tuple[Reason, ...], str], ...]
    order_source: str
    failure: str = ""

    def reasons(self, name: str) -> tuple[Reason, ...]:
        """The reasons that rejected backend ``name`` (empty if it can run the problem)."""
        for candidate, reasons, _ in self.candidates:
            if candidate == name:
                return reasons
        raise KeyError(f"{name!r} is not a candidate of this decision; candidates: "
                       f"{', '.join(c for c, _, _ in self.candidates)}")

    def rejected(self) -> dict[str, list[Reason]]:
        """Reasons of every backend in the order that cannot run the problem."""
        return {n: list(r) for n, r, note in self.candidates if r and note != NOT_IN_ORDER}

    def explain(self) -> str:
        from .explain import format_decision
        return format_decision(self)

    def for_workload(self, workload: Workload) -> Decision:
        """This decision shown with ``workload`` (one of the same bucket): a copy made without the
        frozen dataclass's __init__ (a decision cached per bucket is re-labelled at every plan())."""
        decision = object.__new__(Decision)
        decision.__dict__.update(self.__dict__, workload=workload)
        return decision


# --- scoped overrides ------------------------------------------------------------------------
_use_backends: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "flashdispatch_use_backends", default=None)


def _backend_names(names: str | Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(names, str):
        items = [names]
    elif isinstance(names, Iterable) and not isinstance(names, (bytes, bytearray)):
        items = list(names)
    else:
        raise TypeError(f"{what}: backends={names!r}: expected a backend name (str) or an iterable of names "
                        f"from {', '.join(registry.BACKEND_NAMES)}")
    out: list[str] = []
    for name in items:
        if name not in registry.BACKEND_NAMES:
            raise ValueError(f"{what}: {name!r} is not a backend; valid: {', '.join(registry.BACKEND_NAMES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"{what}: give at least one backend from {', '.join(registry.BACKEND_NAMES)}")
    return tuple(out)


@contextlib.contextmanager
def use_backends(backends: str | Iterable[str]) -> Iterator[tuple[str, ...]]:
    """Inside this block, ``auto`` selection considers only ``backends``, in this order.

    Blocks nest; the innermost one applies. The setting is per thread / per async task.
    An explicit ``backend=`` argument still wins over it.
    """
    names = _backend_names(backends, "use_backends")
    token = _use_backends.set(names)
    try:
        yield names
    finally:
        _use_backends.reset(token)


def active_backends() -> tuple[str, ...] | None:
    """The backends of the innermost active use_backends() block, or None."""
    return _use_backends.get()


def _env_order(value: str | None) -> tuple[str, ...] | None:
    if value is None or value.strip() in ("", "auto"):
        return None
    return _backend_names([n.strip() for n in value.split(",") if n.strip()], BACKEND_ENV)


def check_requested(requested: str) -> str:
    """Return ``requested`` if it is "auto" or a backend name, else raise ValueError."""
    if requested != "auto" and requested not in registry.BACKEND_NAMES:
        raise ValueError(f"backend={requested!r} is not a backend; valid: auto, {', '.join(registry.BACKEND_NAMES)}")
    return requested


# --- deciding ----------------------------------------------------------------------------
def _supports(name: str, problem: Problem, device: Device) -> tuple[Reason, ...]:
    failure = registry.load_failure(name)
    if failure is not None:
        return (failure,)
    try:
        return tuple(registry.backend_class(name).supports(problem, device))
    except Exception as e:  # noqa: BLE001 - a broken check is shown as the backend's reason
        return (Reason("supports_error", f"{name}.supports() raised {type(e).__name__}: {e}"),)


def _order(problem, device, workload, requested, scoped, env_order, policy) -> tuple[tuple[str, ...], str]:
    if requested != "auto":
        return (requested,), "backend= argument"
    if scoped is not None:
        order, source = scoped, "use_backends"
    elif env_order is not None:
        order, source = env_order, BACKEND_ENV
    else:
        order, source = policy.order_for(problem, device, workload)
    if device.is_cuda and REFERENCE in order:
        order = tuple(n for n in order if n != REFERENCE) + (REFERENCE,)
    return order, source


def _decide(problem, device, workload, requested, scoped, env_order, policy: Policy) -> Decision:
    order, source = _order(problem, device, workload, requested, scoped, env_order, policy)
    verdicts = {name: _supports(name, problem, device) for name in registry.BACKEND_NAMES}
    chosen = next((n for n in order if not verdicts[n]), None)
    failure = ""
    faster_rejected = [n for n in order if n != REFERENCE and verdicts[n]]
    gpu_last_resort = device.is_cuda and chosen == REFERENCE and requested == "auto" and bool(faster_rejected)
    if chosen is None:
        if requested != "auto":
            failure = f"backend {requested!r} was requested (backend= argument) but cannot run {problem.describe()}"
        else:
            failure = f"no backend in the order ({source}) can run {problem.describe()}"
        failure += f" on {device.describe()}"
    elif gpu_last_resort and policy.reference_fallback == "error":
        failure = (f"on {device.describe()} only the PyTorch reference can run {problem.describe()}, and "
                   f"{policy.fallback_source} says reference_fallback: error")
        chosen = None
    candidates = []
    for name in order + tuple(n for n in registry.BACKEND_NAMES if n not in order):
        notes = []
        if name not in order:
            notes.append(NOT_IN_ORDER)
        elif name == chosen:
            notes.append(SELECTED)
        if name == REFERENCE and device.is_cuda and name in order and requested == "auto":
            notes.append(REFUSED if failure and gpu_last_resort else LAST_RESORT)
        candidates.append((name, verdicts[name], ", ".join(notes)))
    return Decision(problem, device, workload, chosen, tuple(candidates), source, failure)


_CACHE_LIMIT = 4096
_cache: dict[tuple, Decision] = {}
_warned: set[tuple[Problem, Device]] = set()
_clear_hooks: list = []


def clear_cache() -> None:
    """Forget cached decisions, which reference-fallback warnings were already given, and what
    the hooks of `on_clear_cache` forget (the single-request functions' plans)."""
    _cache.clear()
    _warned.clear()
    for hook in _clear_hooks:
        hook()


def on_clear_cache(hook) -> None:
    """Call ``hook()`` at every `clear_cache` (caches built on decisions register here)."""
    _clear_hooks.append(hook)


def selection_context() -> tuple:
    """What a decision depends on besides its arguments: the innermost use_backends() block,
    FLASHDISPATCH_BACKEND and the active policy (a cache of plans keys on it)."""
    return _use_backends.get(), env_get(BACKEND_ENV), active_policy()


def _bucket_key(w: Workload) -> tuple[int, ...]:
    """``w.bucket()`` as a tuple of exponents (equal exactly when the buckets are), without
    building a Workload: decisions are cached per bucket."""
    return tuple([(int(v) - 1).bit_length() + 1 if v > 0 else 0
                  for v in (w.batch_size, w.total_qo_len, w.max_qo_len, w.total_kv_len, w.max_kv_len)])


def decide(problem: Problem, device: Device, workload: Workload = EMPTY_WORKLOAD,
           requested: str = "auto", policy: Policy | None = None) -> Decision:
    """The Decision for a problem, without raising when nothing can run (explain() uses it).
    Cached per (problem, device, workload bucket, requested, use_backends, env, policy)."""
    check_requested(requested)
    policy = active_policy() if policy is None else policy
    scoped = _use_backends.get()
    env_value = env_get(BACKEND_ENV)
    key = (problem, device, _bucket_key(workload), requested, scoped, env_value, policy)
    decision = _cache.get(key)
    if decision is None:
        decision = _decide(problem, device, workload, requested, scoped, _env_order(env_value), policy)
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = decision
    elif decision.workload != workload:  # the same decision, shown with this plan's exact workload
        decision = decision.for_workload(workload)
    return decision


def select(problem: Problem, device: Device, workload: Workload = EMPTY_WORKLOAD,
           requested: str = "auto", policy: Policy | None = None) -> Decision:
    """Choose the backend for ``problem`` on ``device``.

    Raises Unsupported (with every rejected backend's reasons) when the requested backend
    cannot run the problem or nothing in the order can; warns once per (problem, device)
    when a GPU problem falls back to the reference (ReferenceFallbackWarning).
    """
    policy = active_policy() if policy is None else policy
    decision = decide(problem, device, workload, requested, policy)
    if decision.backend is None:
        raise Unsupported(decision.failure, decision.rejected())
    if decision.backend == REFERENCE and device.is_cuda and requested == "auto":
        faster = {n: r for n, r in decision.rejected().items() if n != REFERENCE}
        if faster and policy.reference_fallback == "warn" and (problem, device) not in _warned:
            _warned.add((problem, device))
            warnings.warn(_fallback_message(decision, faster, policy), ReferenceFallbackWarning, stacklevel=2)
    return decision


def _fallback_message(decision: Decision, faster: dict[str, list[Reason]], policy: Policy) -> str:
    lines = [f"flashdispatch: {decision.problem.describe()} on {decision.device.describe()} runs on the "
             f"slow PyTorch reference; every faster backend in the order ({decision.order_source}) "
             f"rejected it:"]
    lines += [f"  {name}: {reason}" for name, reasons in faster.items() for reason in reasons]
    lines.append(f"(set reference_fallback: allow or error in a FLASHDISPATCH_CONFIG file; now from "
                 f"{policy.fallback_source})")
    return "\n".join(lines)
