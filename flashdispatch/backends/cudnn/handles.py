"""One cuDNN handle per CUDA device, pointed at the caller's current stream before each use."""
from __future__ import annotations

import threading

import torch

_HANDLES: dict[int, object] = {}
_LOCK = threading.Lock()


def handle_for(device_index: int):
    """The process-wide cuDNN handle of CUDA device ``device_index`` (created on first use)."""
    handle = _HANDLES.get(device_index)
    if handle is None:
        import cudnn

        with _LOCK:
            handle = _HANDLES.get(device_index)
            if handle is None:
                with torch.cuda.device(device_index):
                    handle = cudnn.create_handle()
                _HANDLES[device_index] = handle
    return handle


def handle_on_current_stream(device_index: int):
    """The device's handle, set to torch's current stream on that device (cheap when unchanged)."""
    import cudnn

    handle = handle_for(device_index)
    cudnn.set_stream(handle, torch.cuda.current_stream(device_index).cuda_stream)
    return handle
