"""The engine under every wrapper: select a backend for a Problem, plan once, run many times.

`PlannedAttention` holds what plan() decided (problem, decision, the backend's plan object and
what run() needs to check tensors without a device synchronisation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import checks
from .backends.base import AttentionInputs, AttentionParams, MLAInputs, MLAParams, PagedKV, RaggedKV
from .dispatch.problem import Device, Problem, Workload, device_of
from .dispatch.reasons import Unsupported
from .dispatch.registry import get_backend
from .dispatch.select import Decision, check_requested, select


def workload_of(qo_lens: list[int], kv_lens: list[int]) -> Workload:
    return Workload(len(kv_lens), sum(qo_lens), max(qo_lens, default=0), sum(kv_lens), max(kv_lens, default=0))


@dataclass
class PlannedAttention:
    """A planned problem: the decision, the backend's plan and the facts run() checks against."""

    problem: Problem
    device: Device
    torch_device: torch.device
    decision: Decision
    params: Any
    plan: Any
    total_q: int
    max_page_index: int = -1
    total_kv: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def backend(self):
        return get_backend(self.decision.backend)

    def explain(self) -> str:
        return self.decision.explain()


def plan_problem(problem: Problem, torch_device: torch.device, params, requested: str, *,
                 total_q: int, max_page_index: int = -1, total_kv: int = 0) -> PlannedAttention:
    """Select the backend for ``problem`` and let it plan; raises `Unsupported` with every reason."""
    device = device_of(torch_device)
    workload = workload_of(params.qo_lens_host, params.kv_lens_host)
    decision = select(problem, device, workload, requested)
    backend = get_backend(decision.backend)
    backend_plan = backend.plan(problem, device, params)
    return PlannedAttention(problem, device, torch_device, decision, params, backend_plan, total_q,
                            max_page_index, total_kv)


def require_plan(planned: PlannedAttention | None, wrapper: str) -> PlannedAttention:
    if planned is None:
        raise ValueError(f"{wrapper}.run() called before plan(): call plan() first")
    return planned


def _outputs(planned: PlannedAttention, out, lse, return_lse: bool, rows: int, heads: int, dim: int):
    p, dev = planned.problem, planned.torch_device
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=p.o_dtype, device=dev)
    else:
        checks.check_out(out, "out", (rows, heads, dim), p.o_dtype, dev)
    if return_lse:
        if not p.return_lse:
            raise Unsupported("return_lse=True, but this problem was planned without lse")
        if lse is None:
            lse = torch.empty(rows, heads, dtype=torch.float32, device=dev)
        else:
            checks.check_out(lse, "lse", (rows, heads), torch.float32, dev)
    else:
        lse = None
    return out, lse


def run_attention(planned: PlannedAttention, q: torch.Tensor, kv: PagedKV | RaggedKV, *, out=None, lse=None,
                  return_lse: bool = False, q_scale=None, k_scale=None, v_scale=None, sinks=None):
    """Check the run tensors against the plan, then launch. Returns out or (out, lse)."""
    p, dev = planned.problem, planned.torch_device
    checks.check_tensor(q, "q", dtypes=(p.q_dtype,), device=dev,
                        shape=(planned.total_q, p.num_qo_heads, p.head_dim_qk))
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last (head_dim) dimension")
    if isinstance(kv, PagedKV):
        checks.check_paged_kv(kv, num_kv_heads=p.num_kv_heads, page_size=p.page_size, head_dim_qk=p.head_dim_qk,
                              head_dim_vo=p.head_dim_vo, dtype=p.kv_dtype, device=dev,
                              max_page_index=planned.max_page_index)
    else:
        checks.check_tensor(kv.k, "k", dtypes=(p.kv_dtype,), device=dev,
                            shape=(planned.total_kv, p.num_kv_heads, p.head_dim_qk))
        checks.check_tensor(kv.v, "v", dtypes=(p.kv_dtype,), device=dev,
                            shape=(planned.total_kv, p.num_kv_heads, p.head_dim_vo))
    if sinks is not None:
        if not p.sinks:
            raise Unsupported("sinks were passed to run(), but the problem was planned without sinks")
        checks.check_tensor(sinks, "sinks", dtypes=(torch.float32,), device=dev, shape=(p.num_qo_heads,))
    elif p.sinks:
        raise ValueError("the problem was planned with sinks, but run() got sinks=None")
    out, lse = _outputs(planned, out, lse, return_lse, planned.total_q, p.num_qo_heads, p.head_dim_vo)
    inputs = AttentionInputs(q, kv, out, lse,
                             checks.check_run_scale(q_scale, "q_scale", dev),
                             checks.check_run_scale(k_scale, "k_scale", dev),
                             checks.check_run_scale(v_scale, "v_scale", dev), sinks)
    planned.backend.run(planned.plan, inputs)
    return (out, lse) if return_lse else out


def run_mla(planned: PlannedAttention, q_nope, q_pe, ckv_cache, kpe_cache, *, out=None, lse=None,
            return_lse: bool = False, v_scale=None):
    """Check MLA run tensors against the plan, then launch. Returns out or (out, lse) (lse base 2)."""
    p, dev = planned.problem, planned.torch_device
    h, ckv, kpe = p.num_qo_heads, p.head_dim_vo, p.head_dim_kpe
    checks.check_tensor(q_nope, "q_nope", dtypes=(p.q_dtype,), device=dev, shape=(planned.total_q, h, ckv))
    checks.check_tensor(q_pe, "q_pe", dtypes=(p.q_dtype,), device=dev, shape=(planned.total_q, h, kpe))
    checks.check_tensor(ckv_cache, "ckv_cache", dtypes=(p.kv_dtype,), device=dev, shape=(None, p.page_size, ckv))
    checks.check_tensor(kpe_cache, "kpe_cache", dtypes=(p.kv_dtype,), device=dev,
                        shape=(ckv_cache.shape[0], p.page_size, kpe))
    if planned.max_page_index >= ckv_cache.shape[0]:
        raise ValueError(f"kv_indices reference page {planned.max_page_index}, but ckv_cache has only "
                         f"{ckv_cache.shape[0]} pages")
    out, lse = _outputs(planned, out, lse, return_lse, planned.total_q, h, ckv)
    inputs = MLAInputs(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, checks.check_run_scale(v_scale, "v_scale", dev))
    planned.backend.run(planned.plan, inputs)
    return (out, lse) if return_lse else out


def paged_params(qo_indptr_h, kv_indptr, kv_indices, kv_last_page_len, kv_lens_h, device, **kw) -> AttentionParams:
    """AttentionParams for a paged problem from checked host arrays and the device index tensors."""
    qo_lens = (qo_indptr_h[1:] - qo_indptr_h[:-1]).tolist()
    return AttentionParams(
        qo_indptr=qo_indptr_h.to(device=device, dtype=torch.int32),
        kv_indptr=kv_indptr.to(device), kv_lens=kv_lens_h.to(device=device, dtype=torch.int32),
        qo_lens_host=qo_lens, kv_lens_host=kv_lens_h.tolist(), kv_indices=kv_indices.to(device),
        kv_last_page_len=kv_last_page_len.to(device), **kw)


INT_WORKSPACE_BYTES = 8 << 20


class WrapperBase:
    """What every plan()/run() wrapper shares: workspace, layout, backend request, the last plan."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None, jit_kwargs=None):
        checks.check_tensor(float_workspace_buffer, "float_workspace_buffer")
        if jit_args is not None or jit_kwargs is not None:
            raise Unsupported("jit_args/jit_kwargs: custom JIT attention variants are not supported by flashdispatch")
        self._float_workspace_buffer = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = checks.check_layout(kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = check_requested(backend)
        self._planned: PlannedAttention | None = None  # the plan run() used last (explain() shows it)
        self._base_plan: tuple | None = None
        self._variants: dict = {}
        self._int_workspace_buffer: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def decision(self) -> Decision:
        """The backend decision of the last plan() (raises before plan())."""
        return require_plan(self._planned, type(self).__name__).decision

    def explain(self) -> str:
        """The selection table of the last plan(): every backend, its verdict and why."""
        return self.decision.explain()

    def _set_plan(self, problem: Problem, params, **plan_kw) -> None:
        """Record what plan() checked and built, and plan the variant without lse now (errors
        surface at plan()); a run() asking for lse plans that variant once (see `_variant`)."""
        self._base_plan = (problem, params, plan_kw)
        self._variants = {}
        self._variant(False)

    def _variant(self, return_lse: bool) -> PlannedAttention:
        """The plan with or without lse: lse is a capability (cuDNN's GQA decode lacks it), so a
        backend is chosen for it only when a run() asks for it; each variant is planned once."""
        if self._base_plan is None:
            require_plan(None, type(self).__name__)
        if return_lse not in self._variants:
            problem, params, plan_kw = self._base_plan
            self._variants[return_lse] = plan_problem(problem.with_(return_lse=return_lse), self._device, params,
                                                      self._backend, **plan_kw)
        self._planned = self._variants[return_lse]
        return self._planned

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Replace the workspace buffer(s); takes effect at the next plan()."""
        checks.check_tensor(float_workspace_buffer, "float_workspace_buffer", device=self._device)
        self._float_workspace_buffer = float_workspace_buffer
        if int_workspace_buffer is not None:
            checks.check_tensor(int_workspace_buffer, "int_workspace_buffer", device=self._device)
            self._int_workspace_buffer = int_workspace_buffer

    def _workspace(self) -> torch.Tensor:
        return self._float_workspace_buffer.view(torch.uint8).reshape(-1)

    def _int_workspace(self) -> torch.Tensor:
        """This wrapper's own metadata buffer (8 MiB, allocated at the first plan, as FlashInfer does)."""
        if self._int_workspace_buffer is None:
            self._int_workspace_buffer = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
        return self._int_workspace_buffer.view(torch.uint8).reshape(-1)


def fixed_buffer(buf, data: torch.Tensor, name: str) -> torch.Tensor:
    """Copy ``data`` into the front of a user's CUDA-graph buffer and return that view."""
    checks.check_tensor(buf, name, ndim=1, dtypes=(data.dtype,))
    if buf.numel() < data.numel():
        raise ValueError(f"{name} holds {buf.numel()} entries, but this plan needs {data.numel()}")
    view = buf[: data.numel()]
    view.copy_(data, non_blocking=True)
    return view


__all__ = ["WrapperBase", "check_requested", "fixed_buffer", "PlannedAttention", "plan_problem", "run_attention", "run_mla", "require_plan", "paged_params",
           "MLAParams", "workload_of"]
