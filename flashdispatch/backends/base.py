"""The contract between the public API and the backends.

The API modules check the user's arguments, then hand a backend plain data:
at ``plan()`` an `AttentionParams` (or `MLAParams`), at ``run()`` an `AttentionInputs`
(or `MLAInputs`) whose ``out``/``lse`` tensors the backend fills in place.

Conventions every backend follows (DESIGN.md, "Semantics"):
- q rows are ragged by ``qo_indptr``; decode has ``q_len_per_req`` rows per request.
- lse is written in base 2 (``log2 sum 2^(s*log2e)``), float32; rows that see no key get
  output 0 and lse -inf.
- ``sm_scale`` already contains nothing but the softmax scale; run-time ``q_scale`` and
  ``k_scale`` multiply it, ``v_scale`` multiplies the output.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..dispatch.caps import Caps, check_caps
from ..dispatch.problem import Device, Problem
from ..dispatch.reasons import Reason

Scale = float | torch.Tensor | None


class PagedKV:
    """A paged cache as two 4-D views (any strides): NHD ``[pages, page_size, kv_heads, dim]``,
    HND ``[pages, kv_heads, page_size, dim]``.

    `PagedKV.of_combined` wraps FlashInfer's 5-D ``[pages, 2, ...]`` cache as ``combined`` and
    makes the two views only when ``k`` or ``v`` is first read: a view costs about a microsecond
    of run()'s host time, and the run() checks and fa2 decode read the 5-D tensor itself
    (`addresses`)."""

    __slots__ = ("_k", "_v", "layout", "combined")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, layout: str):
        self._k, self._v, self.layout, self.combined = k, v, layout, None

    @classmethod
    def of_combined(cls, cache: torch.Tensor, layout: str) -> PagedKV:
        """The k (``cache[:, 0]``) and v (``cache[:, 1]``) caches of a 5-D ``[pages, 2, ...]`` tensor."""
        kv = cls.__new__(cls)
        kv._k = kv._v = None
        kv.layout, kv.combined = layout, cache
        return kv

    def _views(self) -> None:
        if self._k is None:
            self._k, self._v = self.combined.unbind(1)

    @property
    def k(self) -> torch.Tensor:
        self._views()
        return self._k

    @k.setter
    def k(self, value: torch.Tensor) -> None:
        self._views()  # v stays the 5-D tensor's view; the pair is no longer one tensor
        self._k, self.combined = value, None

    @property
    def v(self) -> torch.Tensor:
        self._views()
        return self._v

    @v.setter
    def v(self, value: torch.Tensor) -> None:
        self._views()
        self._v, self.combined = value, None

    @property
    def num_pages(self) -> int:
        return (self._k if self.combined is None else self.combined).shape[0]

    @property
    def k_shape(self) -> torch.Size:
        """The k cache's 4-D shape (read from the 5-D tensor when there is one: no view made)."""
        c = self.combined
        if c is None:
            return self._k.shape
        s = c.shape
        return torch.Size((s[0], s[2], s[3], s[4]))

    @property
    def dtype(self) -> torch.dtype:
        """The k cache's dtype (the API checks that v's is the same)."""
        return (self._k if self.combined is None else self.combined).dtype

    def addresses(self) -> tuple[int, int, tuple, tuple]:
        """(k address, v address, k strides, v strides) of the two 4-D views, read from the 5-D
        tensor when there is one (no view made)."""
        c = self.combined
        if c is None:
            return self._k.data_ptr(), self._v.data_ptr(), self._k.stride(), self._v.stride()
        s, at = c.stride(), c.data_ptr()
        strides = (s[0], s[2], s[3], s[4])
        return at, at + s[1] * c.dtype.itemsize, strides, strides


@dataclass
class RaggedKV:
    """Ragged keys/values: ``k [total_kv, kv_heads, head_dim_qk]``, ``v [total_kv, kv_heads, head_dim_vo]``."""

    k: torch.Tensor
    v: torch.Tensor


class DeviceIndex:
    """A field of `AttentionParams` holding an int32 index tensor on the run device that may
    be uploaded on first read: the API builds params before the backend is chosen, and most
    plans never read some of these tensors (fa2 decode reads none), so `paged_params` marks
    what it would upload `PENDING` with `AttentionParams.defer_upload`, whose one copy fills
    them all. A backend reads them at plan time (a copy issued inside CUDA-graph capture fails)."""

    _REQUIRED = object()

    def __init__(self, default=_REQUIRED):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:  # the dataclass field's default; AttributeError: a required field
            if self.default is DeviceIndex._REQUIRED:
                raise AttributeError(self.name)
            return self.default
        value = obj.__dict__[self.slot]
        if value is PENDING:
            obj.__dict__["_upload"](obj)  # kept until it succeeds: a failed upload raises again
            del obj.__dict__["_upload"]
            value = obj.__dict__[self.slot]
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


class HostLengths:
    """A field of `AttentionParams` holding per-request lengths on the host: read, a list of
    ints; set, a list or a 1-D int64 numpy array, made a list when first read (a refreshed fa2
    decode plan reads only their count and `AttentionParams.kv_lens_stats`: plan() is host-time
    bound, and a list of 256 costs ~3 us)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:  # a required dataclass field
            raise AttributeError(self.name)
        value = obj.__dict__[self.slot]
        if not isinstance(value, list):
            value = obj.__dict__[self.slot] = value.tolist()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value
        obj.__dict__.pop("_kv_stats", None)


class _Pending:
    """The one value of a `DeviceIndex` field not uploaded yet (copies and pickles stay it)."""

    def __repr__(self) -> str:
        return "PENDING"

    def __reduce__(self) -> str:
        return "PENDING"


PENDING = _Pending()


@dataclass
class AttentionParams:
    """Plan-time data of a batch attention problem (decode, paged or ragged prefill).

    Index tensors are int32 on the run device (`DeviceIndex`: uploaded when first read);
    the ``*_host`` lists are the same lengths on the host, read once at plan time.
    qo_indptr:        [batch + 1] query row offsets.
    kv_indptr:        [batch + 1] page offsets (paged) or token offsets (ragged).
    kv_indices:       page ids (paged only).
    kv_last_page_len: [batch] entries in each request's last page (paged only).
    kv_lens:          [batch] KV length of each request.
    packed_mask:      uint8 custom mask, per request the row-major [qo_len, kv_len] bits
                      packed with ``bitorder="little"``, requests concatenated.
    mask_indptr:      [batch + 1] byte offsets of each request's bits in packed_mask.
    workspace:        the user's float workspace buffer (uint8): scratch for run() only (split-KV
                      partials); wrappers may share it, so a plan keeps nothing there.
    int_workspace:    the wrapper's own buffer (uint8, 8 MiB) for plan metadata a captured CUDA
                      graph reads: a re-plan rewrites it in place at the same addresses.
    indices_checked:  plan() checked the used kv_indices (none negative; run() checks the largest
                      against the cache) before returning, so no launch can read an unchecked one.
    block_tables:     [batch, width] int32 page ids of a block-table call planned without reading
                      its lengths (`Backend.reads_block_tables`): kv_lens is then the caller's
                      seq_lens on the device, kv_indptr / kv_indices / kv_last_page_len are None,
                      and kv_lens_host is the planning bound (every request at the caller's
                      max_seq_len), not the lengths.
    """

    qo_indptr: torch.Tensor = DeviceIndex()
    kv_indptr: torch.Tensor = DeviceIndex()
    kv_lens: torch.Tensor = DeviceIndex()
    qo_lens_host: list[int]
    kv_lens_host: list[int] = HostLengths()
    sm_scale: float
    kv_indices: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = DeviceIndex(None)
    packed_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    fixed_split_size: int | None = None
    disable_split_kv: bool = False
    workspace: torch.Tensor | None = None
    int_workspace: torch.Tensor | None = None
    indices_checked: bool = False
    block_tables: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.__dict__["_kv_lens_host"])  # (list or array: `HostLengths`)

    def kv_lens_array(self) -> np.ndarray:
        """kv_lens_host as an int64 numpy array: the array given, itself, when one was (read it,
        do not write it)."""
        value = self.__dict__["_kv_lens_host"]
        return np.asarray(value, dtype=np.int64)

    def kv_lens_stats(self) -> tuple[int, int]:
        """(sum, max) of kv_lens_host (max 0 with no request), worked out once; a caller that
        has them already may give them (`set_kv_lens_stats`)."""
        stats = self.__dict__.get("_kv_stats")
        if stats is None:
            lens = self.kv_lens_array()
            stats = self.__dict__["_kv_stats"] = (int(lens.sum()), int(lens.max(initial=0)))
        return stats

    def set_kv_lens_stats(self, total: int, longest: int) -> None:
        """Give `kv_lens_stats` (the sum and max of kv_lens_host, as the caller worked them out)."""
        self.__dict__["_kv_stats"] = (total, longest)

    def defer_upload(self, upload) -> None:
        """Let the `PENDING` index fields be filled by ``upload(self)`` when one is first read."""
        self.__dict__["_upload"] = upload


@dataclass
class AttentionInputs:
    """Run-time tensors. The backend writes ``out`` ([total_q, qo_heads, head_dim_vo]) and,
    when not None, ``lse`` ([total_q, qo_heads], float32, base 2).

    sinks: [qo_heads] float32 logits (natural-log units, like scaled scores) that join each
    row's softmax denominator without a value.
    """

    q: torch.Tensor
    kv: PagedKV | RaggedKV
    out: torch.Tensor
    lse: torch.Tensor | None = None
    q_scale: Scale = None
    k_scale: Scale = None
    v_scale: Scale = None
    sinks: torch.Tensor | None = None


@dataclass
class MLAParams:
    """Plan-time data of MLA paged attention: kv_indptr [batch + 1] (pages) and kv_indices on the
    run device; the query and KV token counts of each request on the host (a backend builds its
    own device tables from them)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_lens_host: list[int]
    kv_lens_host: list[int]
    sm_scale: float
    causal: bool = False
    workspace: torch.Tensor | None = None
    int_workspace: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens_host)


@dataclass
class MLAInputs:
    """Run-time MLA tensors: q_nope [total_q, heads, ckv], q_pe [total_q, heads, kpe],
    ckv_cache [pages, page_size, ckv], kpe_cache [pages, page_size, kpe]. The backend writes
    ``out`` [total_q, heads, ckv] and ``lse`` (base 2) when not None; ``v_scale`` multiplies
    the output."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None = None
    v_scale: Scale = None


@dataclass
class MergeInputs:
    """merge_states: v [seq, num_states, heads, dim], s [seq, num_states, heads] (base-2 lse);
    the backend writes v_out [seq, heads, dim] and s_out [seq, heads]."""

    v: torch.Tensor
    s: torch.Tensor
    v_out: torch.Tensor
    s_out: torch.Tensor


DEFAULT_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
    torch.float8_e4m3fn: 8e-2,
    torch.float8_e5m2: 1.5e-1,
}


class Backend:
    """A backend: capabilities as class data, plus plan() and run().

    Subclasses set ``name``, ``caps``, ``packages`` (importable module names it needs, installed
    by the pyproject extra ``extra``) and
    may override ``tolerance`` (max ||out - ref|| / ||ref|| per KV dtype),
    ``_availability()`` and ``extra_checks()``.
    """

    name: ClassVar[str]
    caps: ClassVar[Caps | dict[str, Caps]]
    packages: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str | None] = None  # the pyproject extra that installs ``packages`` (default: name)
    tolerance: ClassVar[dict[torch.dtype, float]] = DEFAULT_TOLERANCE

    @classmethod
    @functools.cache
    def availability(cls) -> tuple[Reason, ...]:
        """Reasons this backend cannot run at all on this machine (cached; empty: available)."""
        reasons = []
        for pkg in cls.packages:
            try:
                importlib.import_module(pkg)
            except Exception as e:  # ImportError, or a library that fails to load
                reasons.append(Reason("package", f"{pkg} not importable: {type(e).__name__}: {e}",
                                      f"pip install 'flashdispatch[{cls.extra or cls.name}]'"))
        return tuple(reasons or cls._availability())

    @classmethod
    def _availability(cls) -> list[Reason]:
        """Further reasons (device, library versions); called only when ``packages`` import."""
        return []

    @classmethod
    def version(cls) -> str | None:
        """Version of the library behind the backend, if any."""
        return None

    @classmethod
    def extra_checks(cls, problem: Problem, device: Device) -> list[Reason]:
        """Checks of combinations that `Caps` cannot express."""
        return []

    @classmethod
    def caps_for(cls, op: str) -> Caps:
        """The declared capabilities for ``op``: ``caps`` is one `Caps` or a dict op -> Caps."""
        if isinstance(cls.caps, dict):
            return cls.caps.get(op, Caps(ops=frozenset()))
        return cls.caps

    @classmethod
    def supports(cls, problem: Problem, device: Device) -> list[Reason]:
        """All reasons this backend cannot run ``problem`` on ``device`` (empty: it can).

        For a described device (not this machine's), only missing kernels count of availability.
        """
        reasons = [r for r in cls.availability() if not device.described or r.code == "not_implemented"]
        reasons += check_caps(cls.caps_for(problem.op), problem, device)
        if not reasons:
            reasons += cls.extra_checks(problem, device)
        return reasons

    @classmethod
    def tolerance_for(cls, dtype: torch.dtype) -> float:
        return cls.tolerance.get(dtype, 2e-2)

    # --- computing -----------------------------------------------------------------------
    def plan(self, problem: Problem, device: Device, params: AttentionParams | MLAParams) -> Any:
        """Build this backend's plan object (grids, split-KV partition, graphs). Called once
        per wrapper.plan(); run() must not decide anything that plan() could."""
        raise NotImplementedError(f"{self.name} does not plan {problem.op}")

    def replan(self, plan: Any, problem: Problem, device: Device, params: AttentionParams | MLAParams) -> Any | None:
        """``plan`` for the new lengths and index tensors of ``params``, of a re-plan with the same
        problem, device, batch size and scalar arguments (a wrapper's next plan()), or None to plan
        afresh. Here: always None; a backend whose plan holds little that depends on the lengths
        refreshes only that."""
        return None

    def replan_mask(self, plan: Any, problem: Problem, device: Device, params: AttentionParams) -> Any:
        """``plan`` for the new custom mask in ``params.packed_mask`` (same lengths and mask
        layout as planned: a kept single-request plan called with another mask). Here: planned
        again; a backend that derives little from the mask refreshes only that."""
        return self.plan(problem, device, params)

    @classmethod
    def clamps_page_indices(cls, problem: Problem) -> bool:
        """Whether this backend's kernels for ``problem`` clamp every page index they read into the
        cache, so an index the API has not checked yet cannot read outside it: plan() may then
        check the page indices without waiting for the GPU (the error comes at a later call).
        Here: no, plan() checks them before it returns."""
        return False

    @classmethod
    def reads_block_tables(cls, problem: Problem) -> bool:
        """Whether this backend plans ``problem`` from a block table and device seq_lens that it
        never reads on the host (`AttentionParams.block_tables`): the block-table entry points then
        make no host read, and may be captured in a CUDA graph. Its kernels must clamp each length
        to the table's row and each page index to the cache. Here: no, the API converts the table
        to kv_indptr / kv_indices on the host first."""
        return False

    def run(self, plan: Any, inputs: AttentionInputs | MLAInputs) -> None:
        """Compute into inputs.out (and inputs.lse when not None)."""
        raise NotImplementedError(f"{self.name} has no run for this plan")

    def merge_states(self, inputs: MergeInputs) -> None:
        """Combine partial attention states by their lse (op ``merge``)."""
        raise NotImplementedError(f"{self.name} does not merge states")


class KernelLessBackend(Backend):
    """A registered backend whose kernels flashdispatch does not have (or call) yet: it declares
    its `Caps` so selection and explain() can name it, says why it cannot run, never computes.

    Subclasses set ``device_hint`` (the GPU it needs), ``missing`` (what is not there yet),
    ``alternative`` (what to use instead) and ``version_dist`` (the package whose version to show).
    """

    device_hint: ClassVar[str]
    missing: ClassVar[str]
    alternative: ClassVar[str]
    version_dist: ClassVar[str]

    @classmethod
    def availability(cls) -> tuple[Reason, ...]:
        """Missing packages and GPU, and always: the kernels are not there yet."""
        reasons = list(super().availability())
        if not torch.cuda.is_available():
            reasons.append(Reason("device", "no CUDA device", f"{cls.name} needs {cls.device_hint}"))
        return tuple(reasons + [Reason("not_implemented", cls.missing, cls.alternative)])

    @classmethod
    def version(cls) -> str | None:
        v = package_version(cls.version_dist)
        return f"{cls.version_dist} {v}" if v else None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
