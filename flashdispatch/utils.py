"""Device queries FlashInfer users import from ``flashinfer.utils``."""
from __future__ import annotations

import torch


def get_compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device; (-1, -1) for a CPU device."""
    device = torch.device(device)
    if device.type != "cuda":
        return (-1, -1)
    return torch.cuda.get_device_capability(device)


def _is_arch(device, major: int) -> bool:
    if not torch.cuda.is_available():
        return False
    return get_compute_capability(torch.device(device))[0] == major and torch.version.cuda is not None


def is_sm90a_supported(device: torch.device) -> bool:
    """True on a Hopper (sm_90) device with a CUDA build that can target sm_90a."""
    return _is_arch(device, 9)


def is_sm100a_supported(device: torch.device) -> bool:
    """True on a Blackwell (sm_100) device with a CUDA build that can target sm_100a."""
    return _is_arch(device, 10)
