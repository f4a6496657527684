"""fa2's fp8 decode on the explicit-layout kernel (decode_gluon_kernel.py): which plans take it,
and the plan that runs it.

The kernel gives each (request, KV head) one program for its whole KV, no merge, where those
programs alone fill the GPU evenly (`gluon_layout`): an eager sm90 plan of e4m3/e5m2 KV with
16-bit q, head_dim 128, page 16, one query row a request, a GQA group of 2-8, no positional,
window, soft-cap or sink option, the default split policy (a fixed split size or
disable_split_kv asks for batch-invariant results: the Triton kernel keeps those), at least
`MIN_PROGRAMS_PER_SM` programs a SM, no more than fit on the GPU at once, and lengths within
`MIN_LENGTH_FILL` of the longest. It reads at fa2's Triton kernel's rate or above there (H200,
32/8 heads, e4m3, TB/s Triton -> Gluon, perf-notes session 50: 48x4096 3.43 -> 3.49, 64x4096
3.59 -> 3.88, 128x4096 3.90 -> 4.14, 200x1024 3.40 -> 3.61); mixed lengths lose without the
Triton plans' balancing (session 49: 128x4096:var 3.97 -> 3.63), more programs than fit at once
read no more (256x4096 4.14 -> 4.12).
`DecodeConfig.gluon_fp8_stages` sets its cp.async stages (-1: the most whose programs all fit on
the GPU at once, of 4, 3, 2) or turns it off (0). With `DecodeConfig.gluon_fp8_split_tokens`
(off by default: not measured yet), plans whose programs fill less than half a wave of the
kernel's 4 stages, equal lengths or not, split each request into chunks of equal tiles, as many
as fill that wave, and the merge kernel (merge.py) combines the chunks' partials.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from ...dispatch.problem import FP8_DTYPES, Device, Problem
from ..base import AttentionInputs, AttentionParams
from ..common import TRITON_INTERPRETED, kernel_scales, shared_per_block
from .decode_config import DecodeConfig
from .decode_workspace import carve_partials, partial_bytes, workspace_bytes
from .launch import BoundKernel, SpecKeys, bind, launch_kept
from .merge import MERGE_INFO_COLS, DecodeMerge
from .paging import decode_strides

MIN_PROGRAMS_PER_SM = 2.5  # 48x4096 (2.9 a SM on the H200) gained 2 %; fewer split on the Triton kernel
MIN_LENGTH_FILL = 0.9  # mean tokens / longest request's
MIN_SPLIT_FILL = 0.5  # a split plan's tokens / its requests x chunks x chunk tokens (the rest: idle programs)
SPLIT_STAGES = 4  # a split plan's stages (unless configured): its chunks fill one wave of them
TILE_TOKENS = 32
_STAGE_BYTES = 2 * 32 * 128  # one stage: a K and a V tile of 32 tokens, fp8 d128
_BLOCK_RESERVED = 1024  # shared memory the GPU keeps per block (sm80+)


def programs_per_sm(stages: int, shared: int) -> int:
    """Programs of ``stages`` stages one SM holds by shared memory (``shared``: per block)."""
    return (shared + _BLOCK_RESERVED) // (stages * _STAGE_BYTES + _BLOCK_RESERVED)


@functools.lru_cache(maxsize=None)
def _kernel_importable() -> bool:
    """Whether this Triton defines the kernel (Gluon is experimental: 3.6's API, as written)."""
    try:
        from . import decode_gluon_kernel  # noqa: F401
    except (ImportError, AttributeError, TypeError):
        return False
    return True


class GluonLayout(NamedTuple):
    """How a plan runs the Gluon kernel: cp.async ``stages``, ``splits`` chunks a request (1: the
    whole request a program, no merge) of ``chunk_tiles`` 32-token tiles each."""

    stages: int
    splits: int = 1
    chunk_tiles: int = 0


def gluon_layout(problem: Problem, device: Device, params: AttentionParams, cfg: DecodeConfig) -> GluonLayout | None:
    """The Gluon kernel's layout for this plan, None where it does not take it (see the module
    docstring)."""
    p = problem
    if (cfg.gluon_fp8_stages == 0 or TRITON_INTERPRETED or device.cc is None or device.cc[0] != 9
            or p.kv_dtype not in FP8_DTYPES or p.q_dtype not in (torch.float16, torch.bfloat16)
            or (p.head_dim_qk, p.head_dim_vo, p.page_size, p.q_len_per_req) != (128, 128, 16, 1)
            or p.features() - {"lse", "fp8_kv"} or p.use_cuda_graph or params.block_tables is not None
            or params.fixed_split_size is not None or params.disable_split_kv):
        return None
    group, batch, sms = p.num_qo_heads // p.num_kv_heads, params.batch_size, device.sm_count or 8
    programs = batch * p.num_kv_heads
    if not 2 <= group <= 8 or not programs or not _kernel_importable():
        return None
    shared = shared_per_block(device)
    split = _split_layout(p, params, cfg, programs, sms, shared) if cfg.gluon_fp8_split_tokens else None
    if split is not None:
        return split
    total, longest = params.kv_lens_stats()
    if programs < MIN_PROGRAMS_PER_SM * sms or total < MIN_LENGTH_FILL * longest * batch:
        return None
    if cfg.gluon_fp8_stages > 0:
        return GluonLayout(cfg.gluon_fp8_stages)
    stages = next((s for s in (4, 3, 2) if programs_per_sm(s, shared) * sms >= programs), 0)
    return GluonLayout(stages) if stages else None


def _split_layout(p: Problem, params: AttentionParams, cfg: DecodeConfig, programs: int, sms: int,
                  shared: int) -> GluonLayout | None:
    """The split layout of ``programs`` (request, KV head) pairs: as many chunks a request as fill
    one wave of `SPLIT_STAGES` (or the configured stages), none under gluon_fp8_split_tokens;
    None where that is under two (half a wave or more unsplit: the whole requests), where idle
    chunks would pass `MIN_SPLIT_FILL` or where the partials do not fit the workspace."""
    stages = cfg.gluon_fp8_stages if cfg.gluon_fp8_stages > 0 else SPLIT_STAGES
    total, longest = params.kv_lens_stats()
    longest_tiles = -(-longest // TILE_TOKENS)
    min_tiles = -(-cfg.gluon_fp8_split_tokens // TILE_TOKENS)
    splits = min(programs_per_sm(stages, shared) * sms // programs, longest_tiles // min_tiles)
    if splits < 2:
        return None
    chunk_tiles = -(-longest_tiles // splits)
    splits = -(-longest_tiles // chunk_tiles)
    batch = params.batch_size
    if (total < MIN_SPLIT_FILL * batch * splits * chunk_tiles * TILE_TOKENS
            or partial_bytes(batch * splits, p.num_qo_heads, 128) > workspace_bytes(params)):
        return None
    return GluonLayout(stages, splits, chunk_tiles)


class GluonDecodePlan:
    """A decode planned onto the Gluon fp8 kernel: one program per (request, KV head), or per
    (request, chunk, KV head) and a merge of the chunks, reading kv_indptr / kv_indices /
    kv_last_page_len as the API gives them (nothing built; a split plan uploads its merge rows
    once and keeps its partials in the float workspace)."""

    def __init__(self, problem: Problem, device: Device, params: AttentionParams, cfg: DecodeConfig,
                 layout: GluonLayout):
        from .decode_gluon_kernel import fp8_decode_gluon_kernel  # (Gluon: imported where it runs)
        self.problem, self.config, self.layout, self._device = problem, cfg, layout, device
        self.stages, self.batch = layout.stages, params.batch_size
        self.qk_scale = params.sm_scale * math.log2(math.e)  # the kernel's scores are in base 2
        self._grid = (self.batch * layout.splits * problem.num_kv_heads,)
        self._consts = dict(NUM_KV_HEADS=problem.num_kv_heads, GROUP=problem.num_qo_heads // problem.num_kv_heads,
                            STAGES=layout.stages, E5M2=problem.kv_dtype == torch.float8_e5m2,
                            SPLIT=layout.splits > 1, num_warps=1)
        self._kernel = fp8_decode_gluon_kernel
        self._launchers: dict = {}  # (WRITE_LSE, SHARED_KV, Q/K/V_SCALE_T) -> BoundKernel
        self._merge, self.workspace_bytes = None, 0
        if layout.splits > 1:
            self._place_partials(params)
        self._set_tables(params)

    def _place_partials(self, params: AttentionParams) -> None:
        """The split's partials in the float workspace ([request x chunk, heads, 128] fp32 and their
        lse) and its merge: one row a request (out row, first partial, chunks), uploaded once, its
        launch a programmatic dependent of the kernel's (which signals at its start)."""
        p, batch, splits = self.problem, self.batch, self.layout.splits
        self._plse, self._po, self.workspace_bytes = carve_partials(params, batch * splits, 1, p.num_qo_heads, 128)
        self._workspace_at = params.workspace.data_ptr()
        self._partial_strides = (p.num_qo_heads * 128, 128), (p.num_qo_heads, 1)  # out's (row, head), lse's
        rows = np.zeros((batch, MERGE_INFO_COLS), dtype=np.int32)
        rows[:, 0] = np.arange(batch)
        rows[:, 1] = rows[:, 0] * splits
        rows[:, 2] = splits
        # pageable: the copy returns once the driver has staged it, without waiting for the stream
        info = torch.from_numpy(rows.ravel()).to(params.kv_indptr.device, non_blocking=True)
        # the kernel lets the merge launch early (DecodeConfig.pdl); the interpreter has no such launch
        pdl = self.config.pdl and not TRITON_INTERPRETED
        self._merge = DecodeMerge(self._po, self._plse, info, batch, 1, p.num_qo_heads, 128, pdl)

    def _set_tables(self, params: AttentionParams) -> None:
        self._params, self._fallback_plan = params, None
        self._tables = (params.kv_indptr, params.kv_indices, params.kv_last_page_len)
        self._table_addrs = tuple(t.data_ptr() for t in self._tables)
        self._cuda_index = params.kv_indptr.device.index
        self._specs = SpecKeys()

    def refreshed(self, device: Device, params: AttentionParams) -> GluonDecodePlan | None:
        """This plan with the new tables (and chunk length) when the new lengths take the Gluon
        kernel with as many stages and chunks (a split one: into the same workspace); None
        otherwise (plan afresh)."""
        workspace = params.workspace
        if params.batch_size != self.batch or (self._merge is not None and (
                workspace is None or workspace.data_ptr() != self._workspace_at)):
            return None
        layout = gluon_layout(self.problem, device, params, self.config)
        if layout is None or layout[:2] != self.layout[:2]:
            return None
        plan = object.__new__(GluonDecodePlan)
        plan.__dict__.update(self.__dict__)
        plan.layout = layout
        plan._set_tables(params)
        return plan

    def _fallback(self):
        """The Triton kernel's plan of the same call (decode.py's `DecodePlan`), made at the first
        run() whose cache is not at 16-byte multiples (its address or a page, token or head stride):
        cp.async copies 16 bytes."""
        if self._fallback_plan is None:
            from .decode import DecodePlan
            cfg = dataclasses.replace(self.config, gluon_fp8_stages=0)
            self._fallback_plan = DecodePlan(self.problem, self._device, self._params, cfg)
        return self._fallback_plan

    def _bind(self, variant: tuple) -> BoundKernel:
        write_lse, shared_kv, q_t, k_t, v_t = variant
        launch = self._launchers[variant] = bind(self._kernel, **self._consts, SHARED_KV=shared_kv,
                                                 WRITE_LSE=write_lse, Q_SCALE_T=q_t, K_SCALE_T=k_t, V_SCALE_T=v_t)
        return launch

    def run(self, inputs: AttentionInputs) -> None:
        """Launch the kernel into inputs.out (and inputs.lse when given), or into the partials and
        then the merge."""
        if self.batch == 0:
            return
        q, kv, out, lse = inputs.q, inputs.kv, inputs.out, inputs.lse
        k_at, v_at, ks, vs, qs, os_ = decode_strides(inputs)
        if (k_at | v_at | ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & 15:
            self._fallback().run(inputs)
            return
        dummy = self._tables[0]
        q_f, q_t, q_in, k_f, k_t, k_in, v_scale, v_t, v_in = kernel_scales(inputs, dummy)
        qk_scale = self.qk_scale * q_f * k_f
        if self._merge is not None:  # the kernel writes the partials (lse too), the merge out and lse
            o_t, lse_t, write_lse = self._po, self._plse, True
            os_, ls = self._partial_strides
        else:
            o_t, write_lse = out, lse is not None
            lse_t = lse if write_lse else dummy
            ls = lse.stride() if write_lse else (0, 0)
        variant = (write_lse, ks[:3] == vs[:3], q_in, k_in, v_in)
        launch = self._launchers.get(variant) or self._bind(variant)
        inputs_at = (q.data_ptr(), k_at, v_at, o_t.data_ptr(), lse_t.data_ptr())
        scales_at = (q_t.data_ptr(), k_t.data_ptr(), v_t.data_ptr())
        scalars = (qk_scale, v_scale, kv.num_pages, self.layout.splits, self.layout.chunk_tiles, qs[0], qs[1],
                   os_[0], os_[1], *ls, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
        aligned = (inputs_at[0] | inputs_at[1] | inputs_at[2] | inputs_at[3] | inputs_at[4] | scales_at[0]
                   | scales_at[1] | scales_at[2]) & 15 == 0
        call = (variant, qs, os_, ls, ks, vs, q.dtype, kv.dtype, o_t.dtype, lse_t.dtype, q_t.dtype, k_t.dtype,
                v_t.dtype)
        launch_kept(launch, self._specs, call if aligned else None, self._cuda_index, self._grid,
                    (*inputs_at, *self._table_addrs, *scales_at, *scalars),
                    lambda: (q, kv.k, kv.v, o_t, lse_t, *self._tables, q_t, k_t, v_t, *scalars))
        if self._merge is not None:
            self._merge(out, lse)
