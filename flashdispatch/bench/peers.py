"""What we compare against: FlashInfer (when importable), PyTorch SDPA and FlexAttention.

FlashInfer has our API, so its columns reuse the builders of `decode`/`prefill` with
``mod=flashinfer``. SDPA (flash, cuDNN) and compiled FlexAttention run on single-prefill
rows only. SDPA gets K/V with the KV heads repeated to the query heads (prefill is
compute-bound, the copy is made before timing); FlexAttention uses ``enable_gqa``.
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform

import torch

from .matrix import Column, NotApplicable
from .prefill import PrefillData
from .timing import Job


@functools.cache
def import_flashinfer():
    """(flashinfer module, None) or (None, why it cannot be used)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - ImportError or a library failing to load
        return None, f"flashinfer not importable: {type(e).__name__}: {e}"
    return flashinfer, None


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment() -> dict[str, str]:
    """GPU and library versions, for the report header and JSON."""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "triton": _dist_version("triton"),
           "flashinfer": _dist_version("flashinfer-python"),
           "cudnn-frontend": _dist_version("nvidia-cudnn-frontend"),
           "cudnn": str(torch.backends.cudnn.version())}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs"
    return env


def _heads_first(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """[tokens, heads, d] -> [1, heads * repeat, tokens, d] contiguous."""
    x = x.transpose(0, 1)
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=0)
    return x.unsqueeze(0).contiguous()


def sdpa_job(kernel: str, d: PrefillData) -> Job:
    """``F.scaled_dot_product_attention`` restricted to one SDPA kernel (flash or cudnn)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = d.shape
    if (not s.single or s.window_left >= 0 or s.custom_mask or s.soft_cap or s.rope
            or (s.causal and s.qo_len != s.kv_len)):
        raise NotApplicable  # SDPA's fast kernels have no window, mask, soft cap, RoPE or bottom-right causal
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    group = s.qo_heads // s.kv_heads
    q, k, v = _heads_first(d.q), _heads_first(d.k, group), _heads_first(d.v, group)

    def run():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s.causal)
        return out[0].transpose(0, 1)

    return Job(run=run)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_job(d: PrefillData) -> Job:
    """Compiled FlexAttention with a block mask for causal / window / custom-mask rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    s = d.shape
    if not s.single or s.soft_cap or s.rope:  # (a soft cap would be a score_mod, RoPE a pass over q/k: not built)
        raise NotApplicable
    offset = s.kv_len - s.qo_len
    mask, causal, window = d.mask, s.causal, s.window_left

    def mask_mod(b, h, qi, kj):
        pos = qi + offset
        keep = kj >= 0
        if mask is not None:
            keep = keep & mask[qi, kj]
        elif causal:
            keep = keep & (kj <= pos)
        if window >= 0:
            keep = keep & (kj >= pos - window)
        return keep

    needs_mask = mask is not None or causal or window >= 0
    block_mask = (create_block_mask(mask_mod, None, None, s.qo_len, s.kv_len, device=d.q.device)
                  if needs_mask else None)
    q, k, v = _heads_first(d.q), _heads_first(d.k), _heads_first(d.v)
    flex = _compiled_flex()
    return Job(run=lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)[0].transpose(0, 1))


def torch_columns(names: list[str]) -> list[Column]:
    """Columns for the PyTorch peers named in ``names`` (sdpa-flash, sdpa-cudnn, flex)."""
    builders = {
        "sdpa-flash": lambda d: sdpa_job("flash", d),
        "sdpa-cudnn": lambda d: sdpa_job("cudnn", d),
        "flex": flex_job,
    }
    return [Column(f"torch:{n}", builders[n]) for n in names if n in builders]
