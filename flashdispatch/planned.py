"""The engine under every wrapper: select a backend for a Problem, plan once, run many times.

`PlannedAttention` holds what plan() decided (problem, decision, the backend's plan object and
what run() needs to check tensors without a device synchronisation).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import checks
from .backends.base import PENDING, AttentionInputs, AttentionParams, MLAInputs, MLAParams, PagedKV, RaggedKV
from .dispatch.problem import Device, Problem, Workload, device_of
from .dispatch.reasons import Unsupported
from .dispatch.registry import get_backend
from .dispatch.select import Decision, check_requested, on_clear_cache, select, selection_context


def host_workload(qo_lens_h, kv_lens_h) -> Workload:
    """The `Workload` of the query and kv lengths per request (numpy arrays or lists)."""
    qo_lens_h, kv_lens_h = np.asarray(qo_lens_h), np.asarray(kv_lens_h)
    if kv_lens_h.size == 0:
        return Workload(0, 0, 0, 0, 0)
    return Workload(kv_lens_h.size, int(qo_lens_h.sum()), int(qo_lens_h.max()), int(kv_lens_h.sum()),
                    int(kv_lens_h.max()))


@dataclass
class PlannedAttention:
    """A planned problem: the decision, the backend's plan and the facts run() checks against
    (expected shapes worked out once here, so run() compares tuples)."""

    problem: Problem
    device: Device
    torch_device: torch.device
    decision: Decision
    params: object
    plan: object
    backend: object  # the selected backend's instance
    total_q: int
    max_page_index: int = -1
    total_kv: int = 0

    def __post_init__(self) -> None:
        p = self.problem
        self.q_shape = (self.total_q, p.num_qo_heads, p.head_dim_qk)
        self.out_shape = (self.total_q, p.num_qo_heads, p.head_dim_vo)
        self.lse_shape = (self.total_q, p.num_qo_heads)
        self.k_rows = (self.total_kv, p.num_kv_heads, p.head_dim_qk)  # ragged k and v
        self.v_rows = (self.total_kv, p.num_kv_heads, p.head_dim_vo)
        if p.kv_layout == "NHD":
            self.k_tail = (p.page_size, p.num_kv_heads, p.head_dim_qk)
            self.v_tail = (p.page_size, p.num_kv_heads, p.head_dim_vo)
        else:
            self.k_tail = (p.num_kv_heads, p.page_size, p.head_dim_qk)
            self.v_tail = (p.num_kv_heads, p.page_size, p.head_dim_vo)

    def explain(self) -> str:
        return self.decision.explain()

    def replan_mask(self, packed_mask: torch.Tensor) -> None:
        """Take a new packed custom mask of the planned lengths (a kept single-request plan)."""
        self.params.packed_mask = packed_mask
        self.plan = self.backend.replan_mask(self.plan, self.problem, self.device, self.params)


def plan_problem(problem: Problem, torch_device: torch.device, params, requested: str, *, total_q: int,
                 max_page_index: int = -1, total_kv: int = 0, device: Device | None = None,
                 workload: Workload | None = None, previous: PlannedAttention | None = None) -> PlannedAttention:
    """Select the backend for ``problem`` and let it plan; raises `Unsupported` with every reason.

    ``previous``: the plan of the same problem from a wrapper's last plan(), made with the same
    device, batch size and scalar arguments; when the same backend is selected it may refresh that
    plan for the new lengths and tables (`Backend.replan`) instead of planning afresh."""
    device = device_of(torch_device) if device is None else device
    if workload is None:
        workload = host_workload(params.qo_lens_host, params.kv_lens_host)
    decision = select(problem, device, workload, requested)
    backend = get_backend(decision.backend)
    backend_plan = None
    if previous is not None and previous.backend is backend and (previous.problem is problem
                                                                 or previous.problem == problem):
        backend_plan = backend.replan(previous.plan, problem, device, params)
    if backend_plan is None:
        backend_plan = backend.plan(problem, device, params)
    return PlannedAttention(problem, device, torch_device, decision, params, backend_plan, backend, total_q,
                            max_page_index, total_kv)


def require_plan(planned: PlannedAttention | None, wrapper: str, method: str = "run()") -> PlannedAttention:
    """``planned``, else ValueError: ``wrapper``.``method`` needs a plan() first."""
    if planned is None:
        raise ValueError(f"{wrapper}.{method} called before plan(): call plan() first")
    return planned


def _is(t, dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """The fast path of the run() checks: a tensor of exactly this dtype, shape and device,
    contiguous in its last dimension (anything else goes through the checks that explain)."""
    return (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.device == device
            and t.stride(-1) == 1)


def _outputs(planned: PlannedAttention, out, lse, return_lse: bool):
    p, dev = planned.problem, planned.torch_device
    if out is None:
        out = torch.empty(planned.out_shape, dtype=p.o_dtype, device=dev)
    elif not (isinstance(out, torch.Tensor) and out.dtype == p.o_dtype and out.shape == planned.out_shape
              and out.device == dev and 0 not in out.stride()):
        checks.check_out(out, "out", planned.out_shape, p.o_dtype, dev)
    if return_lse:
        if not p.return_lse:
            raise Unsupported("return_lse=True, but this problem was planned without lse")
        if lse is None:
            lse = torch.empty(planned.lse_shape, dtype=torch.float32, device=dev)
        elif not (isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == planned.lse_shape
                  and lse.device == dev and 0 not in lse.stride()):
            checks.check_out(lse, "lse", planned.lse_shape, torch.float32, dev)
    else:
        lse = None
    return out, lse


def _check_q(planned: PlannedAttention, q) -> None:
    p, dev = planned.problem, planned.torch_device
    if not _is(q, p.q_dtype, planned.q_shape, dev):
        checks.check_tensor(q, "q", dtypes=(p.q_dtype,), device=dev, shape=planned.q_shape)
        if q.stride(-1) != 1:
            raise ValueError("q must be contiguous in its last (head_dim) dimension")


def _check_paged(planned: PlannedAttention, kv: PagedKV) -> None:
    p, dev = planned.problem, planned.torch_device
    c = kv.combined
    if c is not None:  # a 5-D [pages, 2, ...] cache: its two views are alike
        s = c.shape
        fits = (kv.layout == p.kv_layout and (s[2], s[3], s[4]) == planned.k_tail == planned.v_tail
                and c.dtype == p.kv_dtype and c.device == dev and c.stride(-1) == 1 and planned.max_page_index < s[0])
    else:
        k, v = kv.k, kv.v
        fits = (kv.layout == p.kv_layout and k.shape[1:] == planned.k_tail and v.shape[1:] == planned.v_tail
                and k.dtype == p.kv_dtype and v.dtype == p.kv_dtype and k.device == dev and v.device == dev
                and k.stride(-1) == 1 and v.stride(-1) == 1 and planned.max_page_index < k.shape[0])
    if not fits:
        checks.check_paged_kv(kv, num_kv_heads=p.num_kv_heads, page_size=p.page_size, head_dim_qk=p.head_dim_qk,
                              head_dim_vo=p.head_dim_vo, dtype=p.kv_dtype, device=dev,
                              max_page_index=planned.max_page_index)


def run_attention(planned: PlannedAttention, q: torch.Tensor, kv: PagedKV | RaggedKV, *, out=None, lse=None,
                  return_lse: bool = False, q_scale=None, k_scale=None, v_scale=None, sinks=None):
    """Check the run tensors against the plan, then launch. Returns out or (out, lse)."""
    p, dev = planned.problem, planned.torch_device
    _check_q(planned, q)
    if isinstance(kv, PagedKV):
        _check_paged(planned, kv)
    else:
        if not _is(kv.k, p.kv_dtype, planned.k_rows, dev):
            checks.check_tensor(kv.k, "k", dtypes=(p.kv_dtype,), device=dev, shape=planned.k_rows)
        if not _is(kv.v, p.kv_dtype, planned.v_rows, dev):
            checks.check_tensor(kv.v, "v", dtypes=(p.kv_dtype,), device=dev, shape=planned.v_rows)
    if sinks is not None:
        if not p.sinks:
            raise Unsupported("sinks were passed to run(), but the problem was planned without sinks")
        checks.check_tensor(sinks, "sinks", dtypes=(torch.float32,), device=dev, shape=(p.num_qo_heads,))
        sinks = sinks.contiguous()  # the kernels read [num_qo_heads] flat
    elif p.sinks:
        raise ValueError("the problem was planned with sinks, but run() got sinks=None")
    if p.use_cuda_graph and dev.type == "cuda":
        _check_capture_addresses(q, kv)
    out, lse = _outputs(planned, out, lse, return_lse)
    if q_scale is not None or k_scale is not None or v_scale is not None:
        q_scale, k_scale, v_scale = (checks.check_run_scale(s, n, dev) for s, n in (
            (q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale")))
        checks.check_score_scale(planned.params.sm_scale, q_scale, k_scale)
    inputs = AttentionInputs(q, kv, out, lse, q_scale, k_scale, v_scale, sinks)
    planned.backend.run(planned.plan, inputs)
    return (out, lse) if return_lse else out


def _check_capture_addresses(q: torch.Tensor, kv: PagedKV | RaggedKV) -> None:
    """A CUDA graph captured on an empty q (or ragged k/v) would replay a null pointer after a
    re-plan with rows (torch's data_ptr() of an empty tensor is 0): refused while capturing."""
    empty = "q" if q.numel() == 0 else "k and v" if isinstance(kv, RaggedKV) and kv.k.numel() == 0 else None
    if empty and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"use_cuda_graph: run() is being captured with an empty {empty} (a plan of no "
                         f"{'query' if empty == 'q' else 'key'} rows): an empty tensor has no address, so the "
                         f"graph's replays after a re-plan with rows would read through a null pointer; capture "
                         f"a plan with at least one row, on views of the buffers later plans use")


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
    out, lse = _outputs(planned, out, lse, return_lse)
    inputs = MLAInputs(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, checks.check_run_scale(v_scale, "v_scale", dev))
    planned.backend.run(planned.plan, inputs)
    return (out, lse) if return_lse else out


def on_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device`` and contiguous, as the kernels read index tensors and masks (itself when
    it already is; a host tensor is copied without a sync)."""
    if t is None:
        return None
    return (t if t.device == device else t.to(device, non_blocking=True)).contiguous()


def device_int32(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """int32 copies of host arrays on ``device``, in one host->device transfer (views of one buffer)."""
    if device.type == "cpu":
        return [torch.from_numpy(a.astype(np.int32)) for a in arrays]
    return _upload_int32(device, arrays)


def _upload_int32(device: torch.device, arrays) -> list[torch.Tensor]:
    """`device_int32` on a GPU: the arrays concatenated, uploaded once, split into views."""
    if len(arrays) == 1:
        return [torch.from_numpy(arrays[0].astype(np.int32)).to(device, non_blocking=True)]
    flat = torch.from_numpy(np.concatenate(arrays, dtype=np.int32, casting="unsafe")).to(device, non_blocking=True)
    return list(flat.split_with_sizes([a.size for a in arrays]))  # (one call: slicing is ~1 us a view)


def user_workspace(buf: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A caller's float workspace buffer as the flat bytes the backends carve run() scratch
    from (split-KV partials), checked to be a contiguous tensor on ``device``."""
    checks.check_tensor(buf, name, device=device, contiguous=True)  # (reshape would copy a strided one)
    return buf.reshape(-1).view(torch.uint8)


def paged_params(qo_indptr: np.ndarray | torch.Tensor, kv_lens_h: np.ndarray, kv_indptr, kv_indices,
                 kv_last_page_len, device, qo_lens_host: list[int], kv_stats: tuple[int, int] | None = None,
                 **kw) -> AttentionParams:
    """AttentionParams for a paged problem from checked host arrays (int64 numpy) and the index
    tensors. ``qo_indptr`` is a host array or an int32 tensor; ``kv_stats``, when the caller has
    them, the (sum, max) of ``kv_lens_h`` (`AttentionParams.kv_lens_stats`). The kv lengths,
    every host array and every small host tensor (qo_indptr, kv_indptr, kv_last_page_len) are
    left `PENDING`, to go to ``device`` in one host->device transfer if the backend reads one of
    them (`DeviceIndex`); the page indices and a tensor on another device are moved now."""
    small = {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_last_page_len": kv_last_page_len}
    host = {name: a if isinstance(a, np.ndarray) else a.numpy() for name, a in small.items()
            if isinstance(a, np.ndarray) or (a is not None and a.is_cpu and a.device != device)}
    fields = {name: PENDING if name in host else on_device(t, device) for name, t in small.items()}
    params = AttentionParams(kv_lens=PENDING, qo_lens_host=qo_lens_host, kv_lens_host=kv_lens_h,
                             kv_indices=on_device(kv_indices, device), **fields, **kw)
    if kv_stats is not None:
        params.set_kv_lens_stats(*kv_stats)
    params.defer_upload(functools.partial(_upload_pending, device, {"kv_lens": kv_lens_h, **host}))
    return params


def _upload_pending(device: torch.device, arrays: dict[str, np.ndarray], params: AttentionParams) -> None:
    """Fill ``params``' `PENDING` fields named in ``arrays`` with one host->device copy."""
    for name, t in zip(arrays, _upload_int32(device, list(arrays.values()))):
        setattr(params, name, t)


INT_WORKSPACE_BYTES = 8 << 20
SCRATCH_WORKSPACE_BYTES = 32 << 20


@functools.lru_cache(maxsize=None)
def scratch_workspace(device: torch.device) -> torch.Tensor:
    """The float workspace of the single-request functions (split-KV partials of a long KV), one
    per device for the process, as FlashInfer keeps one (calls on one device share it: run them
    on one stream)."""
    return torch.empty(SCRATCH_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


# --- the single-request functions' plans ---------------------------------------------------------
SINGLE_PLANS = 64  # plans the single-request functions keep (the least recently used goes first)
BLOCK_TABLE_PLANS = 8  # last plans the block-table entry points keep, each holding its workspace
_PLAIN = frozenset({type(None), bool, int, float, str, torch.dtype})  # immutable argument types


class PlanCache:
    """A bounded LRU of `PlannedAttention` for the single-request functions, whose whole problem
    is known from tensor shapes: a call with the same key runs the kept plan (checks + launch).

    A kept plan holds what plan() made from the key: index arrays on the device and views of the
    device's `scratch_workspace` (split-KV partials, written at run); a backend's run() may also
    refresh per-call state of its plan (cuDNN rewrites its row offsets and scale for the strides
    of the call). out and lse are allocated per call, so results never alias. Stream and thread
    assumption, as for FlashInfer's workspace buffer: single-request calls on one device run on
    one CUDA stream from one thread at a time (or the caller orders them): calls on two streams
    at once would share that scratch, two threads could interleave a plan's refresh and launch,
    and a plan's arrays are uploaded (without a sync) on the stream of the call that built it.
    Memory: a kept fa2/cuDNN plan is a few small arrays; a kept reference plan also holds its
    visibility masks (about qo_len x kv_len bools). `dispatch.select.clear_cache()` drops them all.
    """

    def __init__(self, size: int):
        self.size = size
        self._plans: collections.OrderedDict[tuple, PlannedAttention] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple | None, build) -> PlannedAttention:
        """The plan kept for ``key``, else ``build()`` (kept unless ``key`` is None; errors are not)."""
        return self.lookup(key) or self.keep(key, build())

    def lookup(self, key: tuple | None) -> PlannedAttention | None:
        """The plan kept for ``key`` (now the most recently used), or None."""
        if key is None:
            return None
        with self._lock:
            planned = self._plans.get(key)
            if planned is not None:
                self._plans.move_to_end(key)
            return planned

    def keep(self, key: tuple | None, planned: PlannedAttention) -> PlannedAttention:
        """Keep ``planned`` under ``key`` (nothing when ``key`` is None); returns it."""
        if key is None:
            return planned
        with self._lock:
            self._plans[key] = planned
            if len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return planned

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


single_plans = PlanCache(SINGLE_PLANS)
on_clear_cache(single_plans.clear)
# the block-table entry points' last plan per problem (kept to be refreshed, `plan_refreshing`)
block_table_plans = PlanCache(BLOCK_TABLE_PLANS)
on_clear_cache(block_table_plans.clear)


def plan_refreshing(problem: Problem, torch_device: torch.device, params, requested: str, *, keep: bool = True,
                    **plan_kw) -> PlannedAttention:
    """`plan_problem` for a call of a block-table entry point, given the last call's plan of the
    same problem, device, batch size, sm_scale, workspace and requested backend to refresh for
    the new lengths and tables, as a wrapper's next plan() does; the new plan is kept in its
    place unless ``keep`` is False (a call whose plan is its own, such as a custom mask's). The
    kept plan holds the workspace it carved, so that workspace's address in the key stays its own."""
    ws = params.workspace
    key = (problem, torch_device, params.batch_size, params.sm_scale, ws.data_ptr(), ws.numel(), requested) if keep \
        else None
    planned = plan_problem(problem, torch_device, params, requested, previous=block_table_plans.lookup(key),
                           **plan_kw)
    return block_table_plans.keep(key, planned)


def single_key(tensors: tuple, scalars: tuple, backend: str) -> tuple | None:
    """The plan key of a single-request call: each tensor's shape, dtype and device, the scalar
    arguments with their types (``True`` is not ``1``), the requested backend and, for "auto",
    the selection context; None (plan this call, keep nothing) when an argument is not a tensor
    or a scalar not immutable."""
    types = tuple(map(type, scalars))
    if not _PLAIN.issuperset(types) or type(backend) is not str:
        return None
    meta = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return None
        meta += (t.shape, t.dtype, t.device)
    return (*meta, *scalars, types, backend, selection_context() if backend == "auto" else None)


def refuse_runs_after_failure(plan):
    """Decorate a wrapper's plan(): when it raises, every run() raises too (naming that error)
    until a plan() succeeds, instead of running on the last plan's tables."""
    @functools.wraps(plan)
    def planning(self, *args, **kwargs) -> None:
        self._refused_plan = None
        try:
            plan(self, *args, **kwargs)
        except BaseException as e:
            self._refused_plan = f"the last plan() raised {type(e).__name__}: {e}"
            raise
    return planning


class WrapperBase:
    """What every plan()/run() wrapper shares: workspace, layout, backend request, the last plan,
    and what stays the same from one plan() to the next (device, scalar arguments' checks)."""

    _refused_plan: str | None = None  # why run() refuses the current plan (a failed plan(), a negative index)

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None, jit_kwargs=None):
        checks.check_tensor(float_workspace_buffer, "float_workspace_buffer")
        if jit_args is not None or jit_kwargs is not None:
            raise Unsupported("jit_args/jit_kwargs: custom JIT attention variants are not supported by flashdispatch")
        self._device = float_workspace_buffer.device
        self._device_info = device_of(self._device)
        self._set_workspace(float_workspace_buffer)
        self._kv_layout = checks.check_layout(kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = check_requested(backend)
        self._planned: PlannedAttention | None = None  # the plan run() used last (explain() shows it)
        self._base_plan: tuple | None = None
        self._variants: dict = {}
        self._refreshable: dict = {}  # variant -> its plan from the last plan(), when refreshable
        self._int_workspace_buffer: torch.Tensor | None = None  # the user's, from reset_workspace_buffer()
        self._int_workspaces: dict = {}  # plan variant -> its own metadata buffer (graph mode)
        self._scalar_key: tuple | None = None
        self._scalar_value = None
        self._problems: tuple[Problem | None, dict] = (None, {})

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def decision(self) -> Decision:
        """The backend decision of the last plan() (raises before plan())."""
        return require_plan(self._planned, type(self).__name__, "decision").decision

    def explain(self) -> str:
        """The selection table of the last plan(): every backend, its verdict and why."""
        return require_plan(self._planned, type(self).__name__, "explain()").decision.explain()

    def _scalars(self, key: tuple, build):
        """``build()`` (the checked scalar arguments: Problem, scales), reused while ``key`` (the
        raw scalar arguments, compared with their types) stays what the last plan() got."""
        key += tuple(map(type, key))
        if key != self._scalar_key:
            self._scalar_value = build()
            self._scalar_key = key
        return self._scalar_value

    def _problem(self, base: Problem, variant, **changes) -> Problem:
        """``base.with_(**changes)`` for plan variant ``variant`` (what decides ``changes``),
        remembered per base problem (a plan asks for the same few)."""
        if self._problems[0] is not base:
            self._problems = (base, {})
        problem = self._problems[1].get(variant)
        if problem is None:
            problem = self._problems[1][variant] = base.with_(**changes)
        return problem

    def _plan(self, problem: Problem, params, **plan_kw) -> PlannedAttention:
        return plan_problem(problem, self._device, params, self._backend, device=self._device_info, **plan_kw)

    # --- plan variants: what a run() may ask beyond the plan (lse; for decode, q_len_per_req) ---
    _DEFAULT_VARIANT = False  # the key of the variant plan() makes; here: return_lse

    def _set_plan(self, problem: Problem, params, **plan_kw) -> None:
        """Record what plan() checked and built, then plan the variants (see `_plan_variants`)."""
        self._base_plan = (problem, params, plan_kw)
        self._plan_variants()

    def _plan_variants(self, refresh: bool = False) -> None:
        """Plan the default variant now (errors surface at plan()); a run() asking for another
        plans that one once (see `_variant`). In graph mode every variant used before is planned
        again now, into its own metadata buffer, so a graph captured on any of them replays the
        new plan. ``refresh``: this plan() has the last one's batch size, scalar arguments and
        workspace, so the last plans of the variants may be refreshed (`plan_problem`'s
        ``previous``, which a wrapper passes from ``_refreshable``)."""
        self._refreshable = self._variants if refresh else {}
        self._variants = {}
        default = self._DEFAULT_VARIANT
        if self._use_cuda_graph:
            for key in [k for k in self._int_workspaces if k != default]:
                self._variant(key)
        self._variant(default)

    def _variant(self, key) -> PlannedAttention:
        """The plan of variant ``key``, planned once per plan() and made the current one. A variant
        that fails its first plan keeps no metadata buffer (graph mode re-plans every variant
        that has one at each plan()). Raises while run() is refused (`refuse_runs_after_failure`)."""
        if self._refused_plan:
            raise ValueError(f"run() refused until a plan() succeeds: {self._refused_plan}")
        planned = self._variants.get(key)
        if planned is None:
            known = key in self._int_workspaces
            try:
                planned = self._variants[key] = self._build_variant(key)
            except BaseException:
                if not known:
                    self._int_workspaces.pop(key, None)
                raise
        self._planned = planned
        return planned

    def _build_variant(self, return_lse: bool) -> PlannedAttention:
        """The plan with or without lse: lse is a capability (cuDNN's GQA decode lacks it), so a
        backend is chosen for it only when a run() asks for it."""
        if self._base_plan is None:
            require_plan(None, type(self).__name__)
        problem, params, plan_kw = self._base_plan
        if self._use_cuda_graph:
            params = dataclasses.replace(params, int_workspace=self._int_workspace(return_lse))
        return self._plan(self._problem(problem, return_lse, return_lse=return_lse), params, **plan_kw)

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Replace the workspace buffer(s); takes effect at the next plan()."""
        self._set_workspace(float_workspace_buffer)
        if int_workspace_buffer is not None:
            # (contiguous: a graph reads its metadata in place)
            checks.check_tensor(int_workspace_buffer, "int_workspace_buffer", device=self._device, contiguous=True)
            self._int_workspace_buffer = int_workspace_buffer
            self._int_workspaces = {}

    def _set_workspace(self, float_workspace_buffer: torch.Tensor) -> None:
        """Check ``float_workspace_buffer`` (on the wrapper's device) and take it as the workspace."""
        self._workspace_bytes = user_workspace(float_workspace_buffer, "float_workspace_buffer", self._device)
        self._float_workspace_buffer = float_workspace_buffer

    def _workspace(self) -> torch.Tensor:
        return self._workspace_bytes

    def _fixed_buffers(self, writes) -> list[torch.Tensor]:
        """Copy each ``(buf, data, name)``'s ``data`` into the front of ``buf``, a user's CUDA-graph
        buffer on the wrapper's device (a captured graph reads it in place), and return those views.
        Every buffer is checked before any is written: a plan() refused here leaves all of them as
        the last plan() wrote them (never one table beside another's counts; a plan() refused after
        this, by the backend's selection or plan, leaves the new tables, all of them, as FlashInfer
        does). No copy where ``data`` already is that front (an engine that writes its tables into
        the buffers and passes views)."""
        writes = list(writes)
        for buf, data, name in writes:
            checks.check_tensor(buf, name, ndim=1, dtypes=(data.dtype,), device=self._device, contiguous=True)
            if buf.numel() < data.numel():
                raise ValueError(f"{name} holds {buf.numel()} entries, but this plan needs {data.numel()}")
        return [_write_front(buf, data) for buf, data, _ in writes]

    def _int_workspace(self, variant) -> torch.Tensor:
        """The metadata buffer of plan variant ``variant`` (8 MiB, as FlashInfer's int workspace):
        each variant has its own, kept for the wrapper's life, so a graph captured on a variant
        reads its metadata at the same address after any re-plan. The user's int workspace
        (reset_workspace_buffer) serves the first variant."""
        buf = self._int_workspaces.get(variant)
        if buf is None:
            if not self._int_workspaces and self._int_workspace_buffer is not None:
                buf = self._int_workspace_buffer
            else:
                buf = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
            buf = self._int_workspaces[variant] = buf.view(torch.uint8).reshape(-1)
        return buf


def _write_front(buf: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` copied into the front of ``buf`` (checked to hold it), as a view of ``buf``."""
    if data.numel() == 0:
        # an empty view has no address (torch's data_ptr() is 0 then), and a graph captured on it
        # would replay a null pointer after a re-plan that uses entries: the first entry instead,
        # which nothing reads while the plan uses none
        return buf[:1]
    view = buf[: data.numel()]
    if data.data_ptr() != buf.data_ptr() or data.device != buf.device or data.stride() != view.stride():
        view.copy_(data, non_blocking=True)
    return view


__all__ = ["WrapperBase", "check_requested", "device_int32", "host_workload", "on_device",
           "PlannedAttention", "plan_problem", "run_attention", "run_mla", "require_plan", "paged_params", "MLAParams",
           "user_workspace", "plan_refreshing", "refuse_runs_after_failure"]
