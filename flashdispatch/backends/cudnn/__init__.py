"""cudnn: cuDNN SDPA graphs through nvidia-cudnn-frontend (package ``cudnn``).

Paged decode, paged prefill and ragged prefill; fp16/bf16; bottom-right causal and sliding
windows through the diagonal band; GQA natively; lse converted to base 2. Graphs are built
per shape bucket and cached (graphs.py); one handle per device (handles.py); the plan owns
the device metadata and the run (plan.py); FlashInfer's plan-less entry points
(cudnn_batch_decode/prefill_with_kv_cache) run from the caller's device metadata alone, with
no host read (direct.py).
"""
from __future__ import annotations

import functools

import torch

from ...dispatch.caps import Caps
from ...dispatch.problem import Device, Problem, dtype_name
from ...dispatch.reasons import Reason
from ..base import AttentionInputs, AttentionParams, Backend, package_version
from .plan import CudnnPlan

MIN_CUDNN = 90500          # paged K/V (block tables) and ragged offsets in SDPA forward
DTYPES = frozenset({torch.float16, torch.bfloat16})
HEAD_DIMS = frozenset({(d, d) for d in range(8, 257, 8)} | {(192, 128)})
PAGE_SIZES = frozenset(2**i for i in range(11))     # cuDNN containers take power-of-two blocks
FEATURES = frozenset({"causal", "sliding_window", "lse", "cuda_graph"})


def _caps(op: str, paged: bool) -> Caps:
    return Caps(ops=frozenset({op}), min_cc=(8, 0), q_dtypes=DTYPES, kv_dtypes=DTYPES, o_dtypes=DTYPES,
                head_dims=HEAD_DIMS, page_sizes=PAGE_SIZES if paged else None,
                layouts=frozenset({"NHD", "HND"}), features=FEATURES, max_q_len_per_req=1)


@functools.cache
def backend_version() -> int | None:
    """cuDNN version the frontend loaded (e.g. 91900), None without the frontend or libcudnn."""
    try:
        import cudnn

        return int(cudnn.backend_version())
    except Exception:  # noqa: BLE001 - no frontend or no libcudnn: reported by availability()
        return None


def _fmt(v: int | None) -> str:
    return "none" if v is None else f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


class CudnnBackend(Backend):
    """cuDNN SDPA through nvidia-cudnn-frontend: paged decode, paged and ragged prefill."""

    name = "cudnn"
    packages = ("cudnn",)
    caps = {
        "decode": _caps("decode", paged=True),
        "prefill_paged": _caps("prefill_paged", paged=True),
        "prefill_ragged": _caps("prefill_ragged", paged=False),
    }

    @classmethod
    def _availability(cls) -> list[Reason]:
        import cudnn

        reasons = []
        if not torch.cuda.is_available():
            reasons.append(Reason("device", "no CUDA device", "cudnn runs on NVIDIA GPUs (sm80+)"))
        try:
            loaded = int(cudnn.backend_version())
        except Exception as e:  # noqa: BLE001 - the library is missing or broken
            reasons.append(Reason("library", f"cudnn-frontend cannot load the cuDNN library: {type(e).__name__}: {e}",
                                  "install PyTorch's CUDA build (it ships libcudnn) or nvidia-cudnn-cu12/cu13"))
            return reasons
        torch_cudnn = torch.backends.cudnn.version()
        if torch_cudnn != loaded:
            reasons.append(Reason("version", f"cudnn-frontend loaded cuDNN {_fmt(loaded)} but torch uses cuDNN "
                                  f"{_fmt(torch_cudnn)}", "make both load the same libcudnn (LD_LIBRARY_PATH)"))
        if loaded < MIN_CUDNN:
            reasons.append(Reason("version", f"cuDNN {_fmt(loaded)} < {_fmt(MIN_CUDNN)}",
                                  "paged SDPA needs cuDNN 9.5 or newer"))
        return reasons

    @classmethod
    def version(cls) -> str | None:
        """The frontend's version and the cuDNN it loaded (and torch's), or None without the frontend."""
        fe = package_version("nvidia-cudnn-frontend")
        if fe is None:
            return None
        try:
            loaded = backend_version()
        except Exception:  # noqa: BLE001 - frontend not importable
            loaded = None
        torch_cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return f"cudnn-frontend {fe}, cuDNN {_fmt(loaded)} (torch: cuDNN {_fmt(torch_cudnn)})"

    @classmethod
    def extra_checks(cls, problem: Problem, device: Device) -> list[Reason]:
        """What the caps cannot say: one dtype for q/kv/o, head dims by architecture, the
        loaded cuDNN version."""
        reasons = []
        if not problem.q_dtype == problem.kv_dtype == problem.o_dtype:
            reasons.append(Reason("dtype", f"q/kv/o dtypes {dtype_name(problem.q_dtype)}/{dtype_name(problem.kv_dtype)}"
                                  f"/{dtype_name(problem.o_dtype)} differ; cuDNN SDPA needs one of fp16/bf16 for all"))
        cc = device.cc or (0, 0)
        dims = (problem.head_dim_qk, problem.head_dim_vo)
        if dims == (192, 128) and cc < (9, 0):
            reasons.append(Reason("head_dim", f"(head_dim_qk, head_dim_vo)={dims} needs sm_90+, "
                                  f"device is sm_{cc[0]}{cc[1]}"))
        if problem.op == "decode" and max(dims) > 128 and cc != (9, 0):
            reasons.append(Reason("head_dim", f"head_dim={max(dims)} > 128 in cuDNN decode on sm_{cc[0]}{cc[1]} "
                                  f"(only Hopper decodes up to 256)"))
        loaded = backend_version()
        if loaded is not None and loaded < MIN_CUDNN:
            reasons.append(Reason("version", f"cuDNN {_fmt(loaded)} < {_fmt(MIN_CUDNN)}"))
        return reasons

    def plan(self, problem: Problem, device: Device, params: AttentionParams) -> CudnnPlan:
        """A `CudnnPlan`: the bucket's graph options and the device metadata, written without a sync."""
        if problem.op not in self.caps:
            raise NotImplementedError(f"cudnn does not plan {problem.op}")
        return CudnnPlan(problem, device, params)

    def run(self, plan: CudnnPlan, inputs: AttentionInputs) -> None:
        """Run ``plan`` on ``inputs`` (`CudnnPlan.run`)."""
        plan.run(inputs)


BACKEND = CudnnBackend
