"""Test set-up: on a machine without CUDA, Triton kernels run under its interpreter, which must be
switched on before any kernel is defined; GPU tests skip there with the reason."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", \
        "triton was imported before TRITON_INTERPRET could be set"
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_the_language_once_per_launch():
    """Triton 3.6's interpreter patches ``triton.language`` at each launch and again at every call of
    a ``@triton.jit`` helper inside the kernel (``_patch_lang``: `inspect.getmembers` over the
    language), although the launch's patches are still in place there and a repeat finds no builtin
    left to replace; the repeats took a quarter of the CPU suite's time (`pytest -n 2` here, session
    68: 760 s with them, 558 s without). This skips the repeat: a helper
    whose ``tl`` / ``tl.core`` are already patched gets an empty patch scope; a launch, or a helper
    that sees a module the launch did not patch, takes the interpreter's own path. Only for the
    Triton version it was read against (3.6.0); any other keeps the interpreter as it is."""
    import triton
    if triton.__version__ != "3.6.0":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    patch_lang, is_builtin = interpreter._patch_lang, tl.core.is_builtin

    def patch_unless_patched(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(is_builtin(lang.load) or is_builtin(lang.tensor.__add__) for lang in langs) \
                and not is_builtin(tl.math.exp):
            return interpreter._LangPatchScope()
        return patch_lang(fn)

    interpreter._patch_lang = patch_unless_patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    """Skip, with the reason, the GPU tests where there is no CUDA and the tests marked ``interpreted``
    (Triton kernels run on CPU tensors) where Triton's interpreter is off."""
    from flashdispatch.backends.common import TRITON_INTERPRETED
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    not_interpreted = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (CPU run of the Triton kernels)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("interpreted") is not None and not TRITON_INTERPRETED:
            item.add_marker(not_interpreted)


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Every test starts without backend overrides from the environment or earlier tests."""
    monkeypatch.delenv("FLASHDISPATCH_BACKEND", raising=False)
    monkeypatch.delenv("FLASHDISPATCH_CONFIG", raising=False)
    from flashdispatch.dispatch import policy, select
    policy.reset_policy()
    select.clear_cache()
    yield
    policy.reset_policy()
    select.clear_cache()
