"""Combine partial attention results by their lse: ``merge_state``, ``merge_states``,
``merge_state_in_place``, and the cascade wrappers built on them (FlashInfer's ``flashinfer.cascade``).

lse values are base 2. A state of lse -inf is empty: it adds nothing, whatever its v holds, and
merging only empty states gives v 0 and lse -inf. An lse of +inf or NaN gives NaN (not checked:
that would read the values back from the device).
"""
from __future__ import annotations

import torch

from .backends.base import MergeInputs
from .checks import check_disjoint, check_in_place, check_positive_int, check_tensor, unpack_paged_kv_cache
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .dispatch.problem import Problem, device_of
from .dispatch.registry import get_backend
from .dispatch.select import select
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _merge(v: torch.Tensor, s: torch.Tensor, v_out=None, s_out=None):
    """v [seq, states, heads, dim], s [seq, states, heads] -> merged (v_out, s_out)."""
    check_tensor(v, "v", ndim=4, dtypes=_V_DTYPES)
    check_tensor(s, "s", dtypes=(torch.float32,), device=v.device, shape=list(v.shape[:3]))
    seq, states, heads, dim = v.shape
    if heads < 1 or dim < 1:
        raise ValueError(f"v has shape {list(v.shape)}: num_heads and head_dim must be at least 1")
    if v_out is None:
        v_out = torch.empty(seq, heads, dim, dtype=v.dtype, device=v.device)
    if s_out is None:
        s_out = torch.empty(seq, heads, dtype=torch.float32, device=v.device)
    if states == 0:  # nothing merged: the empty state
        v_out.zero_()
        s_out.fill_(float("-inf"))
        return v_out, s_out
    problem = Problem("merge", v.dtype, v.dtype, v.dtype, heads, heads, dim, dim, return_lse=False)
    decision = select(problem, device_of(v.device), requested="auto")
    get_backend(decision.backend).merge_states(MergeInputs(v, s, v_out, s_out))
    return v_out, s_out


def _check_states(v_a, s_a, v_b, s_b, names: tuple[str, str, str, str]) -> None:
    """Two states of the same [seq_len, num_heads, head_dim] shape, with float32 lse [seq_len, num_heads]."""
    check_tensor(v_a, names[0], ndim=3, dtypes=_V_DTYPES)
    if v_a.shape[1] < 1 or v_a.shape[2] < 1:
        raise ValueError(f"{names[0]} has shape {list(v_a.shape)}: num_heads and head_dim must be at least 1")
    check_tensor(v_b, names[2], dtypes=(v_a.dtype,), device=v_a.device, shape=list(v_a.shape))
    for name, lse in ((names[1], s_a), (names[3], s_b)):
        check_tensor(lse, name, dtypes=(torch.float32,), device=v_a.device, shape=list(v_a.shape[:2]))


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two attention states.

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        Attention outputs of two KV segments, shape ``[seq_len, num_heads, head_dim]``.
    s_a, s_b : torch.Tensor
        Their base-2 logsumexp, float32, shape ``[seq_len, num_heads]`` (-inf: an empty segment;
        +inf gives NaN).

    Returns
    -------
    (V, S) : the merged output ``[seq_len, num_heads, head_dim]`` and lse ``[seq_len, num_heads]``.
    """
    _check_states(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    return _merge(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v, v_other : ``[seq_len, num_heads, head_dim]``; s, s_other : float32 ``[seq_len, num_heads]``
        (lse -inf: an empty state; +inf gives NaN). v and s must not share memory with each other
        or within themselves, nor be autograd leaves that require grad.
    mask : optional bool ``[seq_len]``; rows where it is False are left unchanged.
    """
    _check_states(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    check_in_place(v, "v")
    check_in_place(s, "s")
    check_disjoint((v, s), ("v", "s"))
    if mask is not None:
        check_tensor(mask, "mask", dtypes=(torch.bool,), device=v.device, shape=[v.shape[0]])
    v_new, s_new = _merge(torch.stack([v, v_other], 1), torch.stack([s, s_other], 1))
    if mask is not None:
        v_new = torch.where(mask[:, None, None], v_new, v)
        s_new = torch.where(mask[:, None], s_new, s)
    v.copy_(v_new)
    s.copy_(s_new)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Merge several attention states.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``.
    s : torch.Tensor
        float32 base-2 lse, ``[seq_len, num_states, num_heads]`` (-inf: an empty state; +inf gives NaN).

    Returns
    -------
    (V, S) : ``[seq_len, num_heads, head_dim]`` and ``[seq_len, num_heads]``.
    """
    return _merge(v, s)


def _per_level(values, name: str, num_levels: int) -> list:
    """``values`` as a list of one entry per level."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of one tensor per level, got {type(values).__name__}")
    if len(values) != num_levels:
        raise ValueError(f"{name} has {len(values)} entries, expected num_levels={num_levels}")
    return list(values)


def _merged_output(states) -> torch.Tensor:
    """The output of (out, lse) ``states`` of the same queries merged by lse."""
    return _merge(torch.stack([o for o, _ in states], 1), torch.stack([lse for _, lse in states], 1))[0]


class MultiLevelCascadeAttentionWrapper:
    """Cascade attention over a paged KV cache in levels (e.g. a prefix shared by all requests,
    then each request's own pages): one paged prefill per level, merged by lse.

    Parameters
    ----------
    num_levels : int
        The number of levels.
    float_workspace_buffer : torch.Tensor
        Workspace shared by the levels (128 MB recommended), on the inputs' device.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Keep each level's index arrays in its ``*_buf_arr`` buffers so ``run()`` can be captured.
    qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr, paged_kv_last_page_len_buf_arr : list
        One CUDA-graph buffer per level (see `BatchPrefillWithPagedKVCacheWrapper`), needed with
        use_cuda_graph.
    backend : str
        ``"auto"`` or a backend name (flashdispatch extension).
    """

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None, backend: str = "auto") -> None:
        check_positive_int(num_levels, "num_levels")
        bufs = [(None,) * 4] * num_levels
        if use_cuda_graph:
            arrays = {"qo_indptr_buf_arr": qo_indptr_buf_arr, "paged_kv_indptr_buf_arr": paged_kv_indptr_buf_arr,
                      "paged_kv_indices_buf_arr": paged_kv_indices_buf_arr,
                      "paged_kv_last_page_len_buf_arr": paged_kv_last_page_len_buf_arr}
            bufs = list(zip(*(_per_level(a, name, num_levels) for name, a in arrays.items())))
        self._wrappers = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph, *b,
                                                              backend=backend) for b in bufs]
        for w in self._wrappers:
            w._DEFAULT_VARIANT = num_levels > 1  # plan() plans the variant run() uses: lse when merged
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers) -> None:
        """Replace the float workspace and each level's int workspace (a list, one per level)."""
        for w, int_ws in zip(self._wrappers, _per_level(int_workspace_buffers, "int_workspace_buffers",
                                                        self._num_levels)):
            w.reset_workspace_buffer(float_workspace_buffer, int_ws)

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None) -> None:
        """Plan every level: ``qo_indptr_arr``, ``paged_kv_indptr_arr``, ``paged_kv_indices_arr`` and
        ``paged_kv_last_page_len`` hold one int32 tensor per level, as the arguments of
        `BatchPrefillWithPagedKVCacheWrapper.plan`; every level's ``qo_indptr[-1]`` is the number of
        queries. ``causal`` applies to the last level only; the other arguments to every level."""
        tables = [_per_level(a, name, self._num_levels) for name, a in (
            ("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
            ("paged_kv_indices_arr", paged_kv_indices_arr), ("paged_kv_last_page_len", paged_kv_last_page_len))]
        rows = []
        for level, (w, *table) in enumerate(zip(self._wrappers, *tables)):
            w.plan(*table, num_qo_heads, num_kv_heads, head_dim, page_size,
                   causal=causal and level == self._num_levels - 1, pos_encoding_mode=pos_encoding_mode,
                   use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)
            rows.append(w._planned.total_q)
        if len(set(rows)) > 1:
            raise ValueError(f"qo_indptr_arr: the levels' qo_indptr[-1] differ ({rows}); every level holds all queries")

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        """Cascade attention of ``q`` ``[qo_indptr[-1], num_qo_heads, head_dim]`` against
        ``paged_kv_cache`` (5-D ``[pages, 2, ...]`` or a (k, v) tuple, the pages of all levels).
        Returns the output ``[qo_indptr[-1], num_qo_heads, head_dim]``."""
        if self._num_levels == 1:
            return self._wrappers[0].run(q, paged_kv_cache)
        return _merged_output([w.run(q, paged_kv_cache, return_lse=True) for w in self._wrappers])

    forward = run

    def explain(self) -> str:
        """Each level's selection table (after plan())."""
        return "\n".join(f"level {i}:\n{w.explain()}" for i, w in enumerate(self._wrappers))


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper:
    """Batch decode with a prefix shared by all requests, held in its own k/v tensors, and each
    request's own suffix in a paged cache: the prefix attended by one single-request prefill of
    all queries, the suffixes by a batch decode, merged by lse.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Workspace (128 MB recommended), on the inputs' device.
    kv_layout : str
        ``"NHD"`` or ``"HND"``, of the shared k/v and of the paged cache.
    backend : str
        ``"auto"`` or a backend name (flashdispatch extension).
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto") -> None:
        self._decode = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, backend=backend)
        self._decode._DEFAULT_VARIANT = (1, True)  # plan() plans the variant forward() runs: with lse
        self._kv_layout = kv_layout
        self._backend = backend
        self._planned = False

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer) -> None:
        """Replace the workspace buffers; takes effect at the next begin_forward()."""
        self._decode.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(self, unique_kv_indptr: torch.Tensor, unique_kv_indices: torch.Tensor,
                      unique_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int, data_type="float16") -> None:
        """Plan the suffixes' decode: ``unique_kv_indptr`` [batch+1], ``unique_kv_indices``
        [unique_kv_indptr[-1]] and ``unique_kv_last_page_len`` [batch] (int32) as in
        `BatchDecodeWithPagedKVCacheWrapper.plan`; ``data_type`` of q and the caches."""
        self._planned = False
        self._decode.plan(unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len, num_qo_heads, num_kv_heads,
                          head_dim, page_size, pos_encoding_mode="NONE", data_type=data_type)
        self._planned = True

    def forward(self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
                unique_kv_cache) -> torch.Tensor:
        """Decode of ``q`` ``[batch_size, num_qo_heads, head_dim]`` against the shared prefix
        ``k_shared``/``v_shared`` (``[shared_prefix_len, num_kv_heads, head_dim]`` NHD, heads first
        HND) and ``unique_kv_cache`` (5-D ``[pages, 2, ...]`` or a (k, v) tuple). Returns
        ``[batch_size, num_qo_heads, head_dim]``."""
        if not self._planned:
            raise ValueError(f"{type(self).__name__}.forward() called before begin_forward()")
        unique = self._decode.run(q, unique_kv_cache, return_lse=True)
        shared = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                              backend=self._backend, return_lse=True)
        return _merged_output([shared, unique])


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper:
    """Batch prefill/append with a prefix shared by all requests, held in its own k/v tensors, and
    each request's own suffix in a paged cache: the prefix attended by one single-request prefill
    of all queries (no mask), the suffixes by a paged batch prefill, merged by lse.

    Parameters as `BatchDecodeWithSharedPrefixPagedKVCacheWrapper`.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto") -> None:
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, backend=backend)
        self._prefill._DEFAULT_VARIANT = True  # plan() plans the variant forward() runs: with lse
        self._kv_layout = kv_layout
        self._backend = backend
        self._tables: tuple | None = None
        self._planned_key: tuple | None = None

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer) -> None:
        """Replace the workspace buffers; the next forward() plans again to take them."""
        self._prefill.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._planned_key = None

    def begin_forward(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
                      paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int) -> None:
        """Plan the suffixes' prefill; the arguments as in `BatchPrefillWithPagedKVCacheWrapper.plan`.
        ``forward()`` plans again when its dtypes, ``causal`` or scales differ from the last plan's."""
        self._tables = None
        self._plan((qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                    head_dim, page_size), (torch.float16, torch.float16, False, None, None, None))

    def _plan(self, tables: tuple, key: tuple) -> None:
        q_dtype, kv_dtype, causal, sm_scale, rope_scale, rope_theta = key
        self._planned_key = None
        self._prefill.plan(*tables, causal=causal, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                           q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._tables, self._planned_key = tables, key

    def forward(self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, unique_kv_cache,
                causal: bool = False, use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                rope_scale: float | None = None, rope_theta: float | None = None) -> torch.Tensor:
        """Prefill of ``q`` ``[qo_indptr[-1], num_qo_heads, head_dim]`` against the shared prefix
        ``k_shared``/``v_shared`` (``[shared_prefix_len, num_kv_heads, head_dim]`` NHD, heads first
        HND; every query sees all of it) and ``unique_kv_cache`` (5-D ``[pages, 2, ...]`` or a (k, v)
        tuple; ``causal`` masks it, bottom-right aligned). Returns ``[qo_indptr[-1], num_qo_heads,
        head_dim]``."""
        if self._tables is None:
            raise ValueError(f"{type(self).__name__}.forward() called before begin_forward()")
        check_tensor(q, "q")
        kv_dtype = unpack_paged_kv_cache(unique_kv_cache, self._kv_layout, "unique_kv_cache").k.dtype
        key = (q.dtype, kv_dtype, bool(causal), sm_scale, rope_scale, rope_theta)
        if key != self._planned_key:
            self._plan(self._tables, key)
        unique = self._prefill.run(q, unique_kv_cache, return_lse=True)
        shared = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                              use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
                                              rope_scale=rope_scale, rope_theta=rope_theta, backend=self._backend,
                                              return_lse=True)
        return _merged_output([shared, unique])
