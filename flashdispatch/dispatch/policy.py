"""The selection policy: backend orders per op, rules, pins, read from YAML.

The packaged ``configs/default.yaml`` is always read; a user file (``load_config(path)``
or the file named by the environment variable ``FLASHDISPATCH_CONFIG``) is merged over
it: its ``defaults`` replace the packaged order of the ops it names, its ``rules`` and
``pins`` come before the packaged ones (first match wins), and its
``reference_fallback`` replaces the packaged one. The schema is documented in
``configs/default.yaml``. Files are UTF-8, read with a ``yaml.SafeLoader`` that refuses a key
repeated in one mapping; every mistake is a ValueError naming the file, the key and the accepted
values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

import yaml

from ..environ import env_get
from .caps import ALL_FEATURES
from .problem import DTYPE_BY_NAME, EMPTY_WORKLOAD, LAYOUTS, OPS, Device, Problem, Workload
from .registry import BACKEND_NAMES

CONFIG_ENV = "FLASHDISPATCH_CONFIG"
PACKAGED_LABEL = "configs/default.yaml"
FALLBACK_MODES = ("warn", "error", "allow")
DEVICE_TYPES = ("cpu", "cuda")

_TOP_KEYS = ("defaults", "rules", "pins", "reference_fallback")
_RULE_KEYS = ("name", "when", "order")
_PIN_KEYS = ("name", "when", "backend")


# --- the `when` conditions -----------------------------------------------------------------
class _Bad(ValueError):
    """A value error inside a file; the loader adds the file and the key."""


def _listed(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _names_in(valid) -> Callable[[Any], frozenset]:
    def parse(value):
        items = _listed(value)
        if not items or any(not isinstance(v, str) or v not in valid for v in items):
            raise _Bad(f"{value!r}: expected one of (or a list of) {', '.join(valid)}")
        return frozenset(items)
    return parse


def _ints(value: Any) -> frozenset:
    items = _listed(value)
    if not items or any(type(v) is not int or v < 0 for v in items):
        raise _Bad(f"{value!r}: expected a non-negative integer or a list of them")
    return frozenset(items)


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise _Bad(f"{value!r}: expected a non-negative integer")
    return value


def _cc(value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or any(type(v) is not int for v in value):
        raise _Bad(f"{value!r}: expected a compute capability [major, minor], e.g. [9, 0]")
    return tuple(value)


def _dtypes(value: Any) -> frozenset:
    return frozenset(DTYPE_BY_NAME[n] for n in _names_in(tuple(DTYPE_BY_NAME))(value))


_FEATURE_NAMES = tuple(sorted(ALL_FEATURES))

# key -> (parse the YAML value, test it: (value, problem, device, bucketed workload) -> bool).
# Workload keys compare against the workload rounded up to a power of two (Workload.bucket)
# and never match when the workload is unknown (batch size 0, e.g. explain of a bare problem).
_CONDITIONS: dict[str, tuple[Callable, Callable]] = {
    "device_type": (_names_in(DEVICE_TYPES), lambda v, p, d, w: d.type in v),
    "cc_min": (_cc, lambda v, p, d, w: d.cc is not None and d.cc >= v),
    "cc_max": (_cc, lambda v, p, d, w: d.cc is not None and d.cc <= v),
    "op": (_names_in(OPS), lambda v, p, d, w: p.op in v),
    "q_dtype": (_dtypes, lambda v, p, d, w: p.q_dtype in v),
    "kv_dtype": (_dtypes, lambda v, p, d, w: p.kv_dtype in v),
    "head_dim_qk": (_ints, lambda v, p, d, w: p.head_dim_qk in v),
    "page_size": (_ints, lambda v, p, d, w: p.page_size in v),
    "kv_layout": (_names_in(LAYOUTS), lambda v, p, d, w: p.kv_layout in v),
    "features_any": (_names_in(_FEATURE_NAMES), lambda v, p, d, w: bool(v & p.features())),
    "features_all": (_names_in(_FEATURE_NAMES), lambda v, p, d, w: v <= p.features()),
    "min_batch": (_count, lambda v, p, d, w: w.batch_size > 0 and w.batch_size >= v),
    "max_batch": (_count, lambda v, p, d, w: w.batch_size > 0 and w.batch_size <= v),
    "min_kv_len": (_count, lambda v, p, d, w: w.batch_size > 0 and w.max_kv_len >= v),
    "max_kv_len": (_count, lambda v, p, d, w: w.batch_size > 0 and w.max_kv_len <= v),
    "min_qo_len": (_count, lambda v, p, d, w: w.batch_size > 0 and w.max_qo_len >= v),
    "max_qo_len": (_count, lambda v, p, d, w: w.batch_size > 0 and w.max_qo_len <= v),
}
CONDITION_KEYS = tuple(_CONDITIONS)


@dataclass(frozen=True)
class Match:
    """A validated ``when``: every condition must hold (no condition: always matches)."""

    conditions: tuple[tuple[str, Any], ...]

    def matches(self, problem: Problem, device: Device, workload: Workload) -> bool:
        return all(_CONDITIONS[key][1](value, problem, device, workload) for key, value in self.conditions)


@dataclass(frozen=True)
class Rule:
    name: str
    when: Match
    order: tuple[str, ...]
    source: str

    def describe(self) -> str:
        return f"rule '{self.name}' ({self.source})"


@dataclass(frozen=True)
class Pin:
    name: str
    when: Match
    backend: str
    source: str

    def describe(self) -> str:
        return f"pin '{self.name}' ({self.source})"


@dataclass(frozen=True, eq=False)
class Policy:
    """A validated policy. Compared and hashed by identity (decisions are cached per policy)."""

    defaults: tuple[tuple[str, tuple[str, ...], str], ...]   # (op, order, source file)
    rules: tuple[Rule, ...]
    pins: tuple[Pin, ...]
    reference_fallback: str
    fallback_source: str
    files: tuple[str, ...]

    def order_for(self, problem: Problem, device: Device,
                  workload: Workload = EMPTY_WORKLOAD) -> tuple[tuple[str, ...], str]:
        """The backend order for a problem and where it came from: first matching pin
        (an order of one), else first matching rule, else the op's defaults."""
        bucket = workload.bucket()
        for pin in self.pins:
            if pin.when.matches(problem, device, bucket):
                return (pin.backend,), pin.describe()
        for rule in self.rules:
            if rule.when.matches(problem, device, bucket):
                return rule.order, rule.describe()
        for op, order, source in self.defaults:
            if op == problem.op:
                return order, f"defaults ({source})"
        raise ValueError(f"policy from {', '.join(self.files)} has no default order for op={problem.op!r}")


# --- reading files ---------------------------------------------------------------------------
def _fail(label: str, where: str, message: str) -> ValueError:
    return ValueError(f"{label}: {where}: {message}" if where else f"{label}: {message}")


def _mapping(value: Any, label: str, where: str, valid: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise _fail(label, where, f"expected a mapping with keys from {', '.join(valid)}, got {value!r}")
    for key in value:
        if key not in valid:
            raise _fail(label, f"{where}.{key}" if where else str(key),
                        f"unknown key; valid: {', '.join(valid)}")
    return value


def _backend_list(value: Any, label: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(label, where, f"expected a non-empty list of backends from {', '.join(BACKEND_NAMES)}")
    for name in value:
        if name not in BACKEND_NAMES:
            raise _fail(label, where, f"{name!r} is not a backend; valid: {', '.join(BACKEND_NAMES)}")
    if len(set(value)) != len(value):
        raise _fail(label, where, f"backend listed twice in {value!r}")
    return tuple(value)


def _name(value: Any, label: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(label, where, f"expected a non-empty string, got {value!r}")
    return value


def _match(value: Any, label: str, where: str) -> Match:
    when = _mapping({} if value is None else value, label, where, CONDITION_KEYS)
    conditions = []
    for key, raw in when.items():
        try:
            conditions.append((key, _CONDITIONS[key][0](raw)))
        except _Bad as e:
            raise _fail(label, f"{where}.{key}", str(e)) from None
    return Match(tuple(conditions))


def _rules(items: Any, label: str) -> tuple[Rule, ...]:
    if not isinstance(items, list):
        raise _fail(label, "rules", f"expected a list of mappings with keys {', '.join(_RULE_KEYS)}")
    rules, seen = [], set()
    for i, item in enumerate(items):
        where = f"rules[{i}]"
        item = _mapping(item, label, where, _RULE_KEYS)
        for key in ("name", "order"):
            if key not in item:
                raise _fail(label, f"{where}.{key}", "missing")
        name = _name(item["name"], label, f"{where}.name")
        if name in seen:
            raise _fail(label, f"{where}.name", f"rule name {name!r} used twice")
        seen.add(name)
        rules.append(Rule(name, _match(item.get("when"), label, f"{where}.when"),
                          _backend_list(item["order"], label, f"{where}.order"), label))
    return tuple(rules)


def _pins(items: Any, label: str) -> tuple[Pin, ...]:
    if not isinstance(items, list):
        raise _fail(label, "pins", f"expected a list of mappings with keys {', '.join(_PIN_KEYS)}")
    pins = []
    for i, item in enumerate(items):
        where = f"pins[{i}]"
        item = _mapping(item, label, where, _PIN_KEYS)
        if "backend" not in item:
            raise _fail(label, f"{where}.backend", "missing")
        backend = item["backend"]
        if backend not in BACKEND_NAMES:
            raise _fail(label, f"{where}.backend", f"{backend!r} is not a backend; valid: {', '.join(BACKEND_NAMES)}")
        name = _name(item.get("name", f"#{i}"), label, f"{where}.name")
        pins.append(Pin(name, _match(item.get("when"), label, f"{where}.when"), backend, label))
    return tuple(pins)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__(f"line {mark.line + 1}: key {key!r} appears twice in one mapping (each key once)")


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping (safe_load keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: SafeLoader names it
                continue
            if repeated:
                raise _DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read(text: str, label: str) -> dict:
    """Parse and validate one file; returns its parts (only the keys it has)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise ValueError(f"{label}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{label}: not valid YAML: {e}") from None
    data = _mapping({} if data is None else data, label, "", _TOP_KEYS)
    parts: dict[str, Any] = {}
    if "defaults" in data:
        defaults = _mapping(data["defaults"], label, "defaults", OPS)
        parts["defaults"] = {op: _backend_list(order, label, f"defaults.{op}") for op, order in defaults.items()}
    if "rules" in data:
        parts["rules"] = _rules(data["rules"], label)
    if "pins" in data:
        parts["pins"] = _pins(data["pins"], label)
    if "reference_fallback" in data:
        mode = data["reference_fallback"]
        if mode not in FALLBACK_MODES:
            raise _fail(label, "reference_fallback", f"{mode!r}; valid: {', '.join(FALLBACK_MODES)}")
        parts["reference_fallback"] = mode
    return parts


def _packaged_text() -> str:
    return resources.files("flashdispatch").joinpath("configs/default.yaml").read_text()


def _path_label(path) -> str:
    """``path`` (a str, bytes or os.PathLike) as a str, refusing what cannot name a file."""
    try:
        label = os.fsdecode(path)
    except TypeError:
        raise TypeError(f"path={path!r}: expected a str or os.PathLike naming a policy file (or None)") from None
    if not label or "\0" in label:
        raise ValueError(f"path={label!r}: expected a policy file's path (non-empty, without NUL bytes)")
    return label


def load_policy(path: str | os.PathLike | None = None) -> Policy:
    """The packaged policy with the file at ``path`` (if any) merged over it."""
    layers = [(_read(_packaged_text(), PACKAGED_LABEL), PACKAGED_LABEL)]
    if path is not None:
        label = _path_label(path)
        try:
            with open(label, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{label}: cannot read policy file: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{label}: not UTF-8 text ({e}); a policy file is UTF-8 YAML") from None
        layers.append((_read(text, label), label))
    defaults: dict[str, tuple[tuple[str, ...], str]] = {}
    rules: tuple[Rule, ...] = ()
    pins: tuple[Pin, ...] = ()
    fallback, fallback_source = "warn", "built-in"
    for parts, label in layers:
        defaults.update({op: (order, label) for op, order in parts.get("defaults", {}).items()})
        rules = parts.get("rules", ()) + rules
        pins = parts.get("pins", ()) + pins
        if "reference_fallback" in parts:
            fallback, fallback_source = parts["reference_fallback"], label
    missing = [op for op in OPS if op not in defaults]
    if missing:
        raise ValueError(f"{PACKAGED_LABEL}: defaults: no order for op {', '.join(missing)}; every op in "
                         f"{', '.join(OPS)} needs one")
    return Policy(
        defaults=tuple((op, *defaults[op]) for op in OPS),
        rules=rules,
        pins=pins,
        reference_fallback=fallback,
        fallback_source=fallback_source,
        files=tuple(label for _, label in layers),
    )


# --- the active policy -------------------------------------------------------------------------
_installed: Policy | None = None
_from_env: dict[str | None, Policy] = {}


def load_config(path: str | os.PathLike | None) -> Policy:
    """Make the packaged policy merged with ``path`` the active one (``None``: back to the
    packaged policy plus ``FLASHDISPATCH_CONFIG``). Returns the policy now in force."""
    global _installed
    _installed = None if path is None else load_policy(path)
    return active_policy()


def active_policy() -> Policy:
    """The policy in force: the one given to load_config(), else packaged + FLASHDISPATCH_CONFIG
    (each file is read once; call reset_policy() after editing it)."""
    if _installed is not None:
        return _installed
    path = env_get(CONFIG_ENV) or None
    policy = _from_env.get(path)
    if policy is None:
        policy = _from_env[path] = load_policy(path)
    return policy


def reset_policy() -> None:
    """Forget the policy given to load_config() and the files already read."""
    global _installed
    _installed = None
    _from_env.clear()
