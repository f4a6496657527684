"""Backend name -> backend class, imported lazily (a backend's module loads on first use)."""
from __future__ import annotations

import functools
import importlib

from .reasons import Reason

# name -> module under flashdispatch.backends that defines ``BACKEND``
BACKEND_MODULES = {
    "reference": "reference",
    "fa2": "fa2",
    "fa3": "fa3",
    "cudnn": "cudnn",
    "trtllm-gen": "trtllm",
    "xqa": "xqa",
    "cutlass": "cutlass",
}
BACKEND_NAMES = tuple(BACKEND_MODULES)
REFERENCE = "reference"  # the ground truth: every feature, slow; on a GPU only the last resort


def check_backend_name(name: str, what: str = "backend") -> str:
    """Return ``name`` if it is a registered backend, else raise ValueError listing the valid ones."""
    if name not in BACKEND_MODULES:
        raise ValueError(f"{what}={name!r} is not a backend; valid: {', '.join(BACKEND_NAMES)}")
    return name


@functools.cache
def backend_class(name: str):
    """The backend class registered under ``name`` (its module is imported on first call)."""
    check_backend_name(name)
    module = importlib.import_module(f"flashdispatch.backends.{BACKEND_MODULES[name]}")
    return module.BACKEND


@functools.cache
def get_backend(name: str):
    """The shared instance of backend ``name``."""
    return backend_class(name)()


def load_failure(name: str) -> Reason | None:
    """A Reason if the backend's module itself fails to import (a bug, reported not hidden)."""
    try:
        backend_class(name)
    except Exception as e:  # noqa: BLE001 - reported to the user as the reason
        return Reason("import", f"flashdispatch.backends.{BACKEND_MODULES[name]}: {type(e).__name__}: {e}")
    return None
