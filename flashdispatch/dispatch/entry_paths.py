"""What a ``backend`` name means to FlashInfer's plan-less entry points that have a path of their
own: the decision lives here, with the other backend-name rules, so that the entry points
compare no backend names themselves."""
from __future__ import annotations

# FlashInfer's cuDNN flavours of cudnn_batch_prefill_with_kv_cache (None: its default)
CUDNN_DIRECT_NAMES = (None, "cudnn", "cubin")


def selects_cudnn_direct(backend: str | None) -> bool:
    """Whether ``backend`` given to `cudnn_batch_prefill_with_kv_cache` runs cuDNN straight from the
    caller's device metadata (no host read); any other name runs the same attention through the
    dispatcher, which reads the lengths on the host."""
    return backend in CUDNN_DIRECT_NAMES
