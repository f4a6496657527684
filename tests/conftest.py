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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
