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
