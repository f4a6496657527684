"""fa2 paged batch decode: split-KV planning and the launcher (kernel in decode_kernel.py).

plan() decides on the host with numpy: it clips each request's tokens to the window, cuts them
into chunks so that (chunks x KV heads) fills the GPU, and copies one int32 array (work rows +
merge rows) to the device, unless the kernel reads the API's page table itself
(`DecodeConfig.direct_table`: then it also derives its chunk of the policy's split from the
length). A request with one chunk is written to out/lse by the decode kernel; the partials of a
split request go to the workspace and the merge kernel (merge.py) combines them. run() only
launches. A re-plan of the same batch size whose lengths keep the plan's layout refreshes it
(`DecodePlan.refreshed`): a direct plan swaps the tables, one row per request rebuilds the rows.

Fused merge (DecodeConfig.fused_merge_max_chunks): when no request has more chunks than that (a
line plan: whenever it is on), the decode kernel merges in place of the merge kernel, one launch
in all. Work column 7 holds each split item's merge row; the last program to arrive at a (merge
row, KV head, row block) int32 counter merges those rows and zeroes the counter
(decode_kernel.py). The counters, n_merge x kv_heads x row_blocks, follow the plan arrays in the
same int32 copy (at the next 256-byte boundary), zeros from the host, so the plan's one
stream-ordered copy zeroes them (no memset, no host sync). Without CUDA graphs that copy is a
tensor the plan owns. With them it is the wrapper's int workspace: the counters' offset is the
plan arrays' size, work rows (batch x graph-splits, or a line's pieces) + batch merge rows, fixed
by the batch size as the grid a captured graph replays is, so every re-plan zeroes them at the
same address. The kernel's own split and the line (direct table) have no work rows: the merge
row is the request, and its counters are a tensor of the plan (under CUDA graphs: the work array
layout's place in the int workspace) zeroed when the plan is made (a refreshed plan keeps them:
each launch leaves them at zero).

CUDA graphs: the grid is fixed by the batch size (batch x chunk slots programs, idle ones
exit) and the plan arrays live at fixed offsets of the wrapper's int workspace, updated in place,
so a graph captured once replays correctly after a later plan() of the same batch size. With
`DecodeConfig.direct_table` there are no plan arrays: the kernel reads the wrapper's fixed
indptr / last_page_len buffers and splits each request into the slots itself; its merge rows and
counters take the work array layout's places in the int workspace. Past one wave, a config that
packs (`DecodeConfig.pack_items`) takes the line whatever the lengths, and under one wave too with
`DecodeConfig.graph_few_line` (d128, GQA d64 and d256): its pieces are a function of the batch
size too.

Block-table calls (`AttentionParams.block_tables`): the kernel reads seq_lens and the table's
rows (TABLE); plan() reads neither, so its grid, like a CUDA graph's, must serve any lengths: the
line where a CUDA-graph plan of the batch size takes it (the line's positions summed from seq_lens
in the kernel), else a grid sized from a bound on the lengths (`_place_table`).

Past one wave, mixed lengths pack (`DecodeConfig.wave_pack_spread`): with
`DecodeConfig.wave_pack_line` (every default that packs) the kernel cuts the pages as kv_indptr
numbers them into one wave of pieces (`DecodeConfig.line_waves`; requests of equal length into the
largest count that holds them whole, `decode_split.line_groups`) and finds its own
(decode_kernel.py's LINE): such a plan builds nothing, and a re-plan of the same batch size only
swaps the tables. Otherwise the host
lays the requests' tokens end to end and uploads the work rows of equal pieces
(`decode_split.packed_segments`). Under one wave the host packs too (`DecodeConfig.pack_items`),
or with `DecodeConfig.few_pack_line` (and for enough mixed requests, `DecodeConfig.few_line_mixed`)
the kernel does, as on the line.

fp8 KV on sm90 where one program per (request, KV head) alone fills the GPU evenly (or, with
`DecodeConfig.gluon_fp8_split_tokens`, where equal chunks of the requests do): `plan_decode`
returns decode_gluon.py's plan (an explicit-layout kernel) instead.

Tuning: `DecodeConfig` (decode_config.py) fields can be overridden per plan
(``plan_decode(..., config={...})``) or through
FLASHDISPATCH_FA2_DECODE_CONFIG='{"block_n": 64, "num_stages": 3, ...}'.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ...dispatch.caps import Caps
from ...dispatch.problem import FP8_DTYPES, Device, Problem
from ...dispatch.reasons import Reason, Unsupported
from ..base import AttentionInputs, AttentionParams
from ..common import (TRITON_INTERPRETED, alibi_slopes, kernel_scales, kernel_window, shared_per_block,
                      triton_fp8_kv_reasons)
from .decode_config import DecodeConfig, resolve_config
from .decode_gluon import GluonDecodePlan, gluon_layout
from .decode_kernel import WORK_COLS, decode_kernel
from .decode_packing import DecodePacking
from .decode_split import (PackedSplit, balanced_chunks, chunk_counts, chunk_tokens, effective_lengths,
                           few_programs_target, mean_tokens, packs_these_waves, never_split, policy_tokens,
                           split_target, tokens_sum)
from .decode_variant import (for_cuda_graph, kernel_constants, line_variant, plain_variant, rope_config, rope_variant,
                             row_block, with_split_block, with_tile, without_waves)
from .decode_waves import wave_choice, wave_split_ceiling, wave_split_config
from .decode_work import work_array
from .decode_workspace import carve_partials, counters_offset, int_workspace_ints, partial_bytes, workspace_bytes
from .launch import BoundKernel, SpecKeys, bind, launch_kept
from .merge import MERGE_INFO_COLS, DecodeMerge
from .paging import decode_strides
from .trig import rope_kernel_variant, rope_scalars

_HALF = frozenset({torch.float16, torch.bfloat16})

DECODE_CAPS = Caps(
    ops=frozenset({"decode"}),
    device_types=frozenset({"cuda", "cpu"}) if TRITON_INTERPRETED else frozenset({"cuda"}),
    min_cc=(8, 0),
    q_dtypes=_HALF,
    kv_dtypes=_HALF | frozenset(FP8_DTYPES),
    o_dtypes=_HALF | {torch.float32},
    head_dims=frozenset({(64, 64), (128, 128), (256, 256)}),
    page_sizes=None,
    layouts=frozenset({"NHD", "HND"}),
    features=frozenset({"causal", "sliding_window", "soft_cap", "alibi", "rope", "lse", "cuda_graph",
                        "fp8_kv", "sinks", "q_len_per_req"}),
    max_q_len_per_req=64,
)

class DecodePlan(DecodePacking):
    """A planned decode: the work array on the device, the grid, and the launch options."""

    def __init__(self, problem: Problem, device: Device, params: AttentionParams, cfg: DecodeConfig):
        """``cfg``: the problem's config on this device (`plan_decode` resolves it)."""
        p = problem
        self.q_len = p.q_len_per_req
        self.group = p.num_qo_heads // p.num_kv_heads
        self.block_m, self.row_blocks = row_block(self.q_len * self.group, cfg)
        if not plain_variant(p, self.block_m):
            cfg = without_waves(cfg)  # other variants use other registers: their programs per SM are not known
        if rope_variant(p, self.block_m):
            cfg = rope_config(cfg)
        policy_splits = not params.disable_split_kv and params.fixed_split_size is None
        self.table = params.block_tables is not None  # a block-table call: `_place_table`
        self.total_split = False
        sm_count = device.sm_count or 8
        self.problem, self.units = problem, self.row_blocks * p.num_kv_heads  # units: programs per work item
        programs = params.batch_size * self.units
        few = programs < sm_count * cfg.ctas_per_sm
        # past one wave of programs, lengths spread wide pack too (`DecodeConfig.wave_pack_spread`)
        packing = policy_splits and cfg.pack_items > 1 and cfg.wave_pack_spread > 0
        wave_pack = (cfg, sm_count) if packing and not few and packs_these_waves(cfg, programs, sm_count) else None
        self.batch = params.batch_size
        if p.use_cuda_graph or self.table:
            # a grid for any lengths (a captured one replays later lengths; a block table's are not
            # read): the kernel's line whatever they are, under one wave too
            # (`DecodeConfig.graph_few_line`), where there are requests to pack
            any_line = wave_pack is not None or few and packing and cfg.graph_few_line and self.batch > 1
            line = self._line_groups(params, cfg, sm_count) if any_line else None
            self._wave_pack, packs = None, line is not None
            if p.use_cuda_graph and not line:
                cfg = for_cuda_graph(cfg)  # (the line runs as the eager line does)
        else:
            self._wave_pack = wave_pack
            packs = wave_pack is not None and self._may_wave_pack(params)
            line = self._line_groups(params, cfg, sm_count) if packs and cfg.wave_pack_line else None  # kernel packs
        lengths = effective_lengths(params, p, self.q_len) if packs and not line else None
        if line:
            wave_packed = (line[0] * self.units, None)
        else:
            wave_packed = self._wave_packed(params, lengths[2]) if lengths is not None else None
        # past ctas_per_sm x SMs programs under the default policy, the wave model's tile (a
        # function of the batch size: fixed_split_size / disable_split_kv stay batch-invariant)
        choice = None if few or wave_packed is not None or not policy_splits else wave_choice(cfg, programs, sm_count)
        tiled = cfg if choice is None else with_tile(cfg, *choice[0])
        # the default policy's split target (few programs: a function of the batch size; the wave
        # split's, where one may beat the best tile: of the mean length too, which a refresh
        # checks); CUDA-graph grids split by the batch size alone, never for waves
        waves = choice is not None and not p.use_cuda_graph and wave_split_ceiling(cfg, programs, sm_count) > choice[1]
        self._wave_policy = (cfg, sm_count, choice) if waves else None
        tokens = mean_tokens(params, p, self.q_len) if waves else 0.0  # 0.0: no wave split
        self.split_target = (split_target(params.batch_size, cfg, self.units, sm_count, tokens, choice)
                             if wave_packed is None else wave_packed[0])
        self.wave_split = waves and self.split_target is not None
        # a wave-split plan runs the split block, or (fp8: none) the tile of the best full-wave
        # rate, and the wave tile where its partition splits nothing after all (short requests,
        # or the workspace fallback; `_build`); few programs keep the split block whatever the
        # lengths (as the ANCHORS rows under one wave were measured), as do packed plans and RoPE
        # ones (64x4096:rope read 2.32 TB/s on its unsplit block, 2.87 on the split one; session 61)
        self._unsplit_config = None
        if self.wave_split:
            self._unsplit_config = tiled
            cfg = wave_split_config(cfg)
        elif (few or wave_packed is not None) and cfg.split_block_n and policy_splits:
            cfg = with_split_block(cfg)
        else:
            cfg = tiled
        self.config = cfg = line_variant(cfg) if line else cfg
        # griddepcontrol is sm90+ PTX; the interpreter has no launch to overlap
        self.pdl_capable = cfg.pdl and not TRITON_INTERPRETED and device.cc is not None and device.cc >= (9, 0)
        self.sm_scale = params.sm_scale
        self.rope = rope_scalars(params.rope_scale, params.rope_theta)
        self.rope_kind = rope_kernel_variant(p.pos_encoding_mode, params.rope_scale, params.rope_theta, p.head_dim_qk)
        self.kv_indices = params.block_tables if self.table else params.kv_indices
        run_device = self.kv_indices.device
        self.slopes = alibi_slopes(p.num_qo_heads, run_device) if p.pos_encoding_mode == "ALIBI" else None
        self.split_tokens, self.split_slots = 0, 1  # the kernel's own split (`_place_direct`): none
        self.whole_rows = False  # a work array of one row per request (`_build`)
        # work rows per program (`DecodeConfig.pack_items`): a few-programs split may pack
        self.items, self._may_pack = 1, few and policy_splits and not p.use_cuda_graph and cfg.pack_items > 1
        self.kernel_max_splits = cfg.max_splits  # the kernel's cap on its own split's chunks
        # the kernel's line_gap (`DecodeConfig.line_segment_tokens`), mixed and even groups (`line_groups`)
        self.line, self.line_gap, self.line_groups, self.line_even_groups = False, 0, 0, 0
        if line:
            self._place_direct(params, run_device, line=line)
        elif self.table:
            self._place_table(device, params, run_device, few)
        elif p.use_cuda_graph and cfg.direct_table and params.fixed_split_size is None:
            self._place_graph_direct(device, params, run_device)
        else:
            self._build(device, params, run_device, lengths or effective_lengths(params, p, self.q_len),
                        wave_packed and wave_packed[1])

    def refreshed(self, device: Device, params: AttentionParams) -> DecodePlan | None:
        """This plan for the new lengths and index tensors of ``params`` (same problem, device,
        batch size and scalars): when the kernel reads the page table directly and the new lengths
        keep its layout (no request split, the kernel's own split with as many chunk slots, or
        its line of as many pieces, `wave_pack_line`; a CUDA-graph line plan any) and the wave split's
        target (`split_target` of the new mean length), only the tables and
        the split length change (a copy of the plan with the new ones, its config too:
        FLASHDISPATCH_FA2_DECODE_CONFIG is read when a plan is made afresh); None otherwise, to
        plan afresh (so too an eager plan under one wave whose new lengths take the line or pack, and
        lengths that take the Gluon fp8 kernel). A work-array plan of one row per request
        (``whole_rows``: no split, no packing) whose new lengths keep that layout only rebuilds
        and uploads those rows (`_with_rows`)."""
        if not (self.direct or self.whole_rows) or params.batch_size != self.batch:
            return None
        if gluon_layout(self.problem, device, params, self.config) is not None:
            return None  # these lengths take the Gluon fp8 kernel
        if self.table:  # (the caller keeps a block-table plan per planning length)
            return self._with_tables(params, self.split_tokens)
        if self.line:  # the same pieces (a function of the batch size and workspace): only the tables change
            if not self.problem.use_cuda_graph and not self._line_packs(device, params):
                return None
            return self._with_tables(params, 0)
        if self._wave_pack and self._may_wave_pack(params):
            return None  # these lengths may pack (`_wave_packed`)
        if self._wave_policy is not None:
            cfg, sm_count, choice = self._wave_policy
            tokens = mean_tokens(params, self.problem, self.q_len)
            if split_target(self.batch, cfg, self.units, sm_count, tokens, choice) != self.split_target:
                return None
        split, lengths = (0, 1), None
        if self.problem.use_cuda_graph:  # `_place_graph_direct`: a function of the batch size alone
            split = (self.split_tokens, self.split_slots)
        else:
            splits = not never_split(self.batch, params, self.split_target)
            if splits or self._may_pack:
                lengths = effective_lengths(params, self.problem, self.q_len)
                _, _, eff, _, chunk = self._partition(device, params, lengths)
                if self._may_pack and (self._takes_few_line(eff, chunk)
                                       or self._packed(eff, chunk, params) is not None):
                    return None  # these lengths take the line or pack (a work array): as `_build` plans them
                if splits and chunk is not None:
                    split = self._direct_split(eff, chunk, params) if self.direct else None
        if split is None or split[1] != self.split_slots:
            return None
        return self._with_tables(params, split[0]) if self.direct else self._with_rows(params, lengths)

    def _copy_for(self, params: AttentionParams) -> DecodePlan:
        """A shallow copy of this plan with the index tensors of ``params`` (the refreshes' base)."""
        plan = object.__new__(DecodePlan)  # (copy.copy takes the slower __reduce_ex__ path)
        plan.__dict__.update(self.__dict__)
        plan.kv_indices = params.block_tables if self.table else params.kv_indices
        return plan

    def _with_tables(self, params: AttentionParams, split_tokens: int) -> DecodePlan:
        """`_copy_for` ``params`` of this direct plan, with the kernel's own split length
        ``split_tokens`` (`refreshed`)."""
        plan = self._copy_for(params)
        plan.work, plan.last = self._direct_tables(params)
        if plan.n_merge == 0:
            plan.plse = plan.po = plan.work
        plan.split_tokens = split_tokens
        plan._set_tables()
        return plan

    def _with_rows(self, params: AttentionParams, lengths: tuple | None) -> DecodePlan:
        """`_copy_for` ``params`` of this ``whole_rows`` plan with the work rows of ``lengths`` (their
        `effective_lengths`; None: worked out here), uploaded as `_place` uploads them (`refreshed`)."""
        lens, lo, eff = lengths or effective_lengths(params, self.problem, self.q_len)
        meta = work_array(lens, lo, eff, self.problem.page_size, self.q_len, 0, None, None, None).meta
        plan = self._copy_for(params)
        plan.work = plan.plse = plan.po = self._upload(meta, params)  # (no partial: never written)
        plan.info = plan.work[meta.size:]
        plan._set_tables()
        return plan

    # --- planning --------------------------------------------------------------------------
    def _partition(self, device: Device, params: AttentionParams, lengths: tuple):
        """(kv lengths, window starts, tokens from there, graph splits, chunk tokens per request or
        None) of ``params``' requests, whose `effective_lengths` are ``lengths``: the split-KV
        partition (see `chunk_tokens`, `_graph_splits`; a wave split whose partials the
        workspace cannot hold is left out)."""
        p, cfg = self.problem, self.config
        lens, lo, eff = lengths
        batch = len(lens)
        if not p.use_cuda_graph:
            splits, chunk = 0, chunk_tokens(eff, p, params, cfg, self.units, self.split_target,
                                            tokens_sum(eff, params, p))
            if chunk is not None and self.wave_split:
                nsplit = chunk_counts(eff, chunk)  # work items, or the kernel's own request x slots
                n_partial = max(int(nsplit.sum()), batch * int(nsplit.max()))
                if self._partial_bytes(n_partial) > workspace_bytes(params):
                    chunk = None  # the wave split is a speed-up: not where the workspace cannot hold its partials
        else:  # the grid's chunks per request are fixed by the batch size: the policy's split does not apply
            splits = self._graph_splits(batch, self.units, device.sm_count or 8, params)
            if params.fixed_split_size is not None:
                chunk = chunk_tokens(eff, p, params, cfg, self.units, self.split_target)
            elif splits > 1:
                chunk = balanced_chunks(eff, np.minimum(-(-eff // cfg.min_chunk_tokens), splits), cfg.block_n)
            else:
                chunk = None
        return lens, lo, eff, splits, chunk

    def _direct_split(self, eff: np.ndarray, chunk: np.ndarray, params: AttentionParams) -> tuple[int, int] | None:
        """(split tokens, chunk slots per request) when the kernel derives the policy's split of
        these requests itself from the tables (`DecodeConfig.direct_table`, no fixed_split_size, no
        CUDA graph) and idles at most half of its requests x slots grid; else None (the host
        builds the work array). ``chunk``: `chunk_tokens`' result."""
        if not self.config.direct_table or self.problem.use_cuda_graph or params.fixed_split_size is not None:
            return None
        nsplit = chunk_counts(eff, chunk)
        slots = int(np.maximum.reduce(nsplit))
        if len(eff) * slots > 2 * int(np.add.reduce(nsplit)):
            return None
        return policy_tokens(tokens_sum(eff, params, self.problem), self.config, self.units, self.split_target), slots

    def _build(self, device: Device, params: AttentionParams, run_device: torch.device, lengths: tuple,
               packed: PackedSplit | None = None) -> None:
        """Partition (or, given ``packed``, lay out those segments), then place the direct table or
        the work array."""
        p, cfg = self.problem, self.config
        if packed is None:
            lens, lo, eff, splits, chunk = self._partition(device, params, lengths)
            line = self._few_line(device, eff, chunk, params) if not splits else None
            if line is not None:
                self.config = line_variant(cfg)
                self._place_direct(params, run_device, line=line)
                return
            packed = None if splits else self._packed(eff, chunk, params)
        else:  # (the policy's chunks do not apply)
            (lens, lo, eff), splits, chunk = lengths, 0, None
        self.batch = len(lens)
        unsplit = chunk is None and splits <= 1 and packed is None  # one work item per request, nothing to merge
        if unsplit and self._unsplit_config is not None:
            self.config = cfg = self._unsplit_config
        if unsplit and cfg.direct_table and not p.use_cuda_graph:
            self._place_direct(params, run_device)
            return
        if not unsplit and not splits and packed is None:
            split = self._direct_split(eff, chunk, params)
            if split is not None:
                self._place_direct(params, run_device, *split)
                return
        work = work_array(lens, lo, eff, p.page_size, self.q_len, splits, chunk, packed, params.fixed_split_size)
        # one row per request: a refresh may rebuild the rows alone where it partitions with this
        # config, not the unsplit one a wave split swapped in (`refreshed`)
        self.whole_rows = unsplit and self._unsplit_config is None
        self.n_work, self.n_merge, self.max_chunks, self.items = work.n_work, work.n_merge, work.max_chunks, work.items
        self._place(work.meta, work.n_work, work.n_partial, params)

    def _merge_choice(self) -> tuple[int, bool]:
        """(the most chunks a request can have, whether the kernel merges them) of a direct plan
        that splits (`_place_direct`): the fused merge up to fused_merge_max_chunks chunks; a line
        plan's whenever the fused merge is on (fused_merge_max_chunks > 0), however many pieces a
        request spans (at most all of them): its variant with the merge kernel keeps fewer programs
        per SM (H200 32/8 d128, eager, session 27, TB/s merge kernel -> fused: bf16 128x4096:var
        3.25 -> 4.32, 256x2048 with one 131072-token request (~30 pieces) 3.92 -> 4.33; fp8
        128x4096:var 3.56 -> 3.90)."""
        cfg = self.config
        if self.line:
            return self.n_work, cfg.fused_merge_max_chunks > 0
        return self.split_slots, self.split_slots <= cfg.fused_merge_max_chunks

    def _graph_splits(self, batch: int, units: int, sm_count: int, params: AttentionParams) -> int:
        """Chunks per request in a CUDA-graph grid: a function of the batch size alone."""
        if params.disable_split_kv:
            return 1
        target = few_programs_target(self.config, sm_count)
        return max(1, min(self.config.max_splits, target // max(batch * units, 1)))

    def _place_graph_direct(self, device: Device, params: AttentionParams, run_device: torch.device) -> None:
        """CUDA graphs with `DecodeConfig.direct_table`: the kernel reads the wrapper's fixed
        indptr / last_page_len buffers and splits each request itself into at most the graph
        grid's chunk slots (`_graph_splits`, a function of the batch size) of at least
        min_chunk_tokens, so a replay after any later plan() of this batch size splits by the new
        lengths; plan() reads no length and builds nothing (`_place_direct`)."""
        self.batch = params.batch_size
        slots = self._graph_splits(self.batch, self.units, device.sm_count or 8, params)
        self.kernel_max_splits = slots
        self._place_direct(params, run_device, self.config.min_chunk_tokens if slots > 1 else 0, slots)

    def _place_table(self, device: Device, params: AttentionParams, run_device: torch.device, few: bool) -> None:
        """A block-table call (`AttentionParams.block_tables`) not on the line: the kernel reads
        seq_lens and the table itself (TABLE), and plan() reads neither. The policy's partition of the planning
        lengths (every request at the caller's bound) sets the grid: whole requests, or the kernel's
        own split (`_place_direct`) into as many chunk slots as the bound takes, of the policy's
        chunk length, which each program applies to its request's own length. Under one wave
        of programs the kernel works that length out from the requests' own total (TOTAL_SPLIT),
        in `DecodeConfig.table_split_slots` times the slots where the workspace holds their
        partials (``few``: fewer programs than that): the longer requests of a mixed batch take
        more chunks than the bound's."""
        cfg = self.config
        _, _, eff, _, chunk = self._partition(device, params, effective_lengths(params, self.problem, self.q_len))
        slots = int(chunk_counts(eff, chunk).max(initial=1)) if chunk is not None else 1
        if few and cfg.table_split_slots > 0 and not never_split(self.batch, params, self.split_target):
            wide = min(cfg.max_splits, max(slots, math.ceil(cfg.table_split_slots * slots)))
            slots = wide if self._partial_bytes(self.batch * wide) <= workspace_bytes(params) else slots
            self.total_split = slots > 1
        if slots == 1 and self._unsplit_config is not None:
            self.config = self._unsplit_config
        self.kernel_max_splits = slots  # a request past the bound: its chunks balanced over the slots
        if slots == 1:
            self._place_direct(params, run_device)
        else:  # (the kernel's total split: at least min_chunk_tokens)
            self._place_direct(params, run_device, cfg.min_chunk_tokens if self.total_split else
                               policy_tokens(tokens_sum(eff, params, self.problem), cfg, self.units,
                                             self.split_target), slots)

    def _direct_tables(self, params: AttentionParams) -> tuple:
        """The kernel's (work_ptr, last_ptr): (kv_indptr, kv_last_page_len), or a table's (seq_lens, None)."""
        return (params.kv_lens, None) if self.table else (params.kv_indptr, params.kv_last_page_len)

    def _place_direct(self, params: AttentionParams, run_device: torch.device, split_tokens: int = 0,
                      split_slots: int = 1, line: tuple[int, int, int] | None = None) -> None:
        """`DecodeConfig.direct_table`: the kernel reads kv_indptr / last_page_len (on the run
        device: a host one is uploaded here, with the API's other host arrays) for its request.
        ``split_slots`` > 1: each request has that many work items (chunk slots) and the kernel
        splits it as `chunk_tokens` would (see `_direct_split`); its partials take slots
        request x split_slots + chunk. ``line``: (groups, mixed groups, even groups) of `line_groups`:
        that many work items, as many of them as the lengths take each a piece of the requests'
        pages end to end (`DecodeConfig.wave_pack_line`), partial slots piece + request.
        Split, the fused merge's counters are zeroed here once (the merging program resets its
        own), else the kernel writes the merge kernel's info row per request."""
        self.direct, self.line = True, line is not None
        self.work, self.last = self._direct_tables(params)
        split = split_slots > 1
        self.split_tokens, self.split_slots = (split_tokens if split else 0), split_slots
        self.info = self.counters = None
        if split or self.line:
            if self.line:
                (self.n_work, self.line_groups, self.line_even_groups), n_partial = line, line[0] + self.batch
                self.line_gap = -(-self.config.line_segment_tokens // self.problem.page_size)  # in pages
            else:
                self.n_work = n_partial = self.batch * split_slots
            self.max_chunks, self.fused_merge = self._merge_choice()
            self.n_merge = self.batch
            n_info, n_counters = self.batch * MERGE_INFO_COLS, self.batch * self.units
            if self.problem.use_cuda_graph:
                # the int workspace, after n_work work rows' room (as a work-array graph plan lays
                # them out): fixed by the batch size, the addresses a captured graph replays
                info_at = self.n_work * WORK_COLS
                counters_at = counters_offset(info_at + n_info)
                table = int_workspace_ints(params, counters_at + n_counters)
                self.info = table[info_at:info_at + n_info]
                self.counters = table[counters_at:counters_at + n_counters]
                if self.fused_merge:
                    self.counters.zero_()
            elif self.fused_merge:
                self.counters = torch.zeros(n_counters, dtype=torch.int32, device=run_device)
            else:
                self.info = torch.empty(n_info, dtype=torch.int32, device=run_device)
            plse, po, self.workspace_bytes = self._carve(n_partial, params)
            # (no partial at all, a graph plan of no request: never written)
            self.plse, self.po = (plse, po) if self.workspace_bytes else (self.work, self.work)
        else:  # one work item per request (a policy split of one chunk a request too)
            self.n_work, self.n_merge, self.max_chunks = self.batch, 0, 1
            self.fused_merge = False
            self.plse = self.po = self.work  # never written: no request is split
            self.workspace_bytes = 0
        self._launch_constants()

    def _partial_bytes(self, n_partial: int) -> int:
        """Workspace bytes of ``n_partial`` of this plan's partials (`partial_bytes`)."""
        return partial_bytes(n_partial, self.q_len * self.problem.num_qo_heads, self.problem.head_dim_vo)

    def _carve(self, n_partial: int, params: AttentionParams) -> tuple:
        """`carve_partials`: ``n_partial`` of this plan's partials in the float workspace."""
        p = self.problem
        return carve_partials(params, n_partial, self.q_len, p.num_qo_heads, p.head_dim_vo)

    def _place(self, meta: np.ndarray, n_work: int, n_partial: int, params: AttentionParams) -> None:
        """Copy the plan arrays (and the fused merge's zeroed counters after them) to the device
        and carve the partials out of the workspace."""
        self.direct, self.last = False, None
        self.fused_merge = self.n_merge > 0 and self.max_chunks <= self.config.fused_merge_max_chunks
        n_meta = meta.size
        if self.fused_merge:
            counters_at = counters_offset(n_meta)
            meta = np.concatenate([meta, np.zeros(counters_at - n_meta + self.n_merge * self.units, np.int32)])
        plse, po, need = self._carve(n_partial, params)
        dst = self._upload(meta, params)
        self.work = dst[:n_work * WORK_COLS]
        self.info = dst[n_work * WORK_COLS:n_meta]
        self.counters = dst[counters_at:] if self.fused_merge else None
        # never written when no request is split
        self.plse, self.po = (plse, po) if need else (self.work, self.work)
        self.workspace_bytes = need
        self._launch_constants()

    def _upload(self, meta: np.ndarray, params: AttentionParams) -> torch.Tensor:
        """``meta`` on the run device: in graph mode into the wrapper's own int workspace (same
        addresses at every re-plan, never shared), else a new tensor."""
        host = torch.from_numpy(meta)  # pageable: a copy returns once the driver has staged it
        if self.problem.use_cuda_graph:
            dst = int_workspace_ints(params, meta.size)
            dst.copy_(host, non_blocking=True)
            return dst
        return host.to(self.kv_indices.device, non_blocking=True)

    # --- running ----------------------------------------------------------------------------
    def _launch_constants(self) -> None:
        """Everything of the decode launch that run() does not learn from the inputs."""
        p = self.problem
        self._grid = (self.n_work // self.items * p.num_kv_heads * self.row_blocks,)
        merge_kernel = self.n_merge > 0 and not self.fused_merge
        self.pdl = self.pdl_capable and merge_kernel
        self._merge = (DecodeMerge(self.po, self.plse, self.info, self.n_merge, self.q_len, p.num_qo_heads,
                                   p.head_dim_vo, self.pdl) if merge_kernel else None)
        self._consts = kernel_constants(p, self.config, self.block_m, self.row_blocks, self.fused_merge,
                                        self.direct, self.split_slots > 1, self.pdl, self.items, self.line,
                                        self.table, self.total_split, self.rope_kind)
        self._launchers: dict = {}  # (WRITE_LSE, Q/K/V_SCALE_T, SHARED_KV_ROWS) -> BoundKernel
        self._set_tables()

    def _set_tables(self) -> None:
        """The plan's tensors and scalars in the launch's order (what a `refreshed` plan changes),
        and the launch keys (`SpecKeys.carried`: the last plan's while these specialise alike)."""
        p, dummy = self.problem, self.plse
        self._tables = (self.po, self.plse, self.info if self.info is not None else dummy,
                        self.counters if self.fused_merge else dummy, self.work,
                        self.last if self.last is not None else dummy, self.kv_indices,
                        self.slopes if self.slopes is not None else dummy)
        self._plan_scalars = (max(kernel_window(p.window_left), 0), p.logits_soft_cap or 1.0, *self.rope,
                              self.split_tokens, self.split_slots, self.kernel_max_splits, *self._table_scalars(),
                              self.batch, self.line_gap,
                              self.line_groups, self.line_even_groups)
        # the tables' addresses, for launches that pass the tensors as ints (run()), on their GPU
        self._table_addrs = tuple([t.data_ptr() for t in self._tables])
        self._specs = SpecKeys.carried(self.__dict__.get("_specs"), self._tables, self._table_addrs, self._plan_scalars)
        self._cuda_index = self.kv_indices.device.index if self.kv_indices.is_cuda else None

    def _table_scalars(self) -> tuple[int, int, int]:
        """TABLE's row stride and tokens a row holds, TOTAL_SPLIT's target programs (0: unused)."""
        if not self.table:
            return 0, 0, 0
        t = self.kv_indices
        return t.stride(0), t.shape[1] * self.problem.page_size, self.split_target if self.total_split else 0

    def _bind(self, variant: tuple[bool, bool, bool, bool, bool]) -> BoundKernel:
        write_lse, q_t, k_t, v_t, shared_rows = variant
        launch = self._launchers[variant] = bind(decode_kernel, **self._consts, WRITE_LSE=write_lse, Q_SCALE_T=q_t,
                                                 K_SCALE_T=k_t, V_SCALE_T=v_t, SHARED_KV_ROWS=shared_rows)
        return launch

    def run(self, inputs: AttentionInputs) -> None:
        """Launch decode (and merge when some request is split, unless the kernel fuses the merge)
        into inputs.out / inputs.lse."""
        if self.n_work == 0:
            return
        q, kv, out, lse = inputs.q, inputs.kv, inputs.out, inputs.lse
        k_at, v_at, ks, vs, qs, os_ = decode_strides(inputs)
        dummy = self.plse
        q_f, q_t, q_in, k_f, k_t, k_in, v_scale, v_t, v_in = kernel_scales(inputs, dummy)
        qk_scale = self.sm_scale * q_f * k_f
        sinks = inputs.sinks
        if sinks is None:
            if self.problem.sinks:
                raise ValueError("the plan has sinks: run() needs inputs.sinks")
            sinks = dummy
        write_lse = lse is not None
        lse_t = lse if write_lse else dummy
        variant = (write_lse, q_in, k_in, v_in, self.config.shared_kv_rows and ks[:2] == vs[:2])
        launch = self._launchers.get(variant) or self._bind(variant)
        ls = lse.stride() if write_lse else (0, 0)
        inputs_at = (q.data_ptr(), k_at, v_at, out.data_ptr(), lse_t.data_ptr())
        scales_at = (sinks.data_ptr(), q_t.data_ptr(), k_t.data_ptr(), v_t.data_ptr())
        scalars = (qk_scale, v_scale, *self._plan_scalars, kv.num_pages, qs[0], qs[1], os_[0], os_[1], *ls,
                   ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
        # Triton's specialisation of these arguments, kept per call kind: the plan's own tensors
        # are fixed, the scalars' types too; what varies is keyed here (all pointers 16-byte
        # aligned, as nearly always; otherwise spec_key works it out for each call). Once a kind's
        # kernel is kept, the tensors go to it as their addresses (the API checked their device).
        aligned = (inputs_at[0] | inputs_at[1] | inputs_at[2] | inputs_at[3] | inputs_at[4] | scales_at[0]
                   | scales_at[1] | scales_at[2] | scales_at[3]) & 15 == 0
        call = (variant, qs, os_, ls, ks, vs, q.dtype, kv.dtype, out.dtype, lse_t.dtype, sinks.dtype, q_t.dtype,
                k_t.dtype, v_t.dtype)
        launch_kept(launch, self._specs, call if aligned else None, self._cuda_index, self._grid,
                    (*inputs_at, *self._table_addrs, *scales_at, *scalars),
                    lambda: (q, kv.k, kv.v, out, lse_t, *self._tables, sinks, q_t, k_t, v_t, *scalars))
        if self._merge is not None:
            self._merge(out, lse)


def decode_extra_checks(problem: Problem, device: Device) -> list[Reason]:
    """Combinations Caps cannot express: an fp8 KV type this GPU's Triton converts."""
    return triton_fp8_kv_reasons(problem.kv_dtype, device.cc)


def plan_decode(problem: Problem, device: Device, params: AttentionParams,
                config: dict | None = None) -> DecodePlan | GluonDecodePlan:
    """Plan a paged batch decode (see the module docstring; fp8 plans whose programs fill the GPU
    evenly run decode_gluon.py's kernel); ``config`` overrides `DecodeConfig`."""
    reasons = decode_extra_checks(problem, device)
    if reasons:
        raise Unsupported("fa2 decode cannot run this problem", {"fa2": reasons})
    cfg = resolve_config(problem, config, shared_per_block(device))
    layout = gluon_layout(problem, device, params, cfg)
    if layout is not None:
        return GluonDecodePlan(problem, device, params, cfg, layout)
    return DecodePlan(problem, device, params, cfg)
