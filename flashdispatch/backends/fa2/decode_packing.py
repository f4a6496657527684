"""The packing choices of a fa2 decode plan (decode.py's `DecodePlan` takes them from this mixin):
whether its requests pack, into the host's pieces (`decode_split.packed_segments`, a work array) or
on the kernel's line (decode_kernel.py's LINE), under one wave of programs and past it. The plan's
attributes it reads: config, problem, batch, units, q_len, split_target, table, ``_may_pack``,
``_wave_pack``; its ``_partition`` and ``_partial_bytes``."""
from __future__ import annotations

import numpy as np

from ...dispatch.problem import Device
from ..base import AttentionParams
from .decode_config import DecodeConfig
from .decode_split import (PackedSplit, effective_lengths, line_groups, may_wave_pack, packed_segments,
                           tokens_sum, wave_pack_groups, work_fill)
from .decode_workspace import workspace_bytes


class DecodePacking:
    """Mixin of `DecodePlan`: see the module docstring."""

    def _few_packs(self, eff: np.ndarray, chunk: np.ndarray | None, params: AttentionParams | None = None) -> bool:
        """Whether an eager few-programs plan packs its requests (whole, or in chunks of ``chunk``
        tokens): they keep its target's programs less than `DecodeConfig.pack_fill` busy
        (`work_fill`; ``params``, where the caller has them, give the tokens' sum: `tokens_sum`)."""
        if not self._may_pack:
            return False
        total = None if params is None else tokens_sum(eff, params, self.problem)
        return work_fill(eff, chunk, self.split_target // self.units, total) < self.config.pack_fill

    def _takes_few_line(self, eff: np.ndarray, chunk: np.ndarray | None) -> bool:
        """Whether an eager few-programs plan of more than one request leaves the pieces to the
        kernel: requests that pack (`_few_packs`) with `DecodeConfig.few_pack_line`, or at least
        `DecodeConfig.few_line_mixed` requests of unequal lengths."""
        cfg = self.config
        if len(eff) < 2 or not self._may_pack:
            return False
        return (0 < cfg.few_line_mixed <= len(eff) and np.minimum.reduce(eff) != np.maximum.reduce(eff)) or (
            cfg.few_pack_line and self._few_packs(eff, chunk))

    def _few_line(self, device: Device, eff: np.ndarray, chunk: np.ndarray | None,
                  params: AttentionParams) -> tuple[int, int, int] | None:
        """`_line_groups` of an eager few-programs plan that takes the line (`_takes_few_line`), else None."""
        if not self._takes_few_line(eff, chunk):
            return None
        return self._line_groups(params, self.config, device.sm_count or 8)

    def _line_packs(self, device: Device, params: AttentionParams) -> bool:
        """Whether these requests still pack as this eager line plan's did: past one wave
        `_may_wave_pack`, under it `_takes_few_line`."""
        if self._wave_pack is not None:
            return self._may_wave_pack(params)
        _, _, eff, _, chunk = self._partition(device, params, effective_lengths(params, self.problem, self.q_len))
        return self._takes_few_line(eff, chunk)

    def _packed(self, eff: np.ndarray, chunk: np.ndarray | None, params: AttentionParams) -> PackedSplit | None:
        """`decode_split.packed_segments` of a few-programs plan whose requests pack (`_few_packs`),
        else None (also where the workspace cannot hold its partials: packing is a speed-up)."""
        if not self._few_packs(eff, chunk, params):
            return None
        cfg, groups = self.config, self.split_target // self.units
        packed = packed_segments(eff, groups, cfg.pack_items, cfg.min_chunk_tokens, cfg.max_splits)
        return packed if packed is not None and self._holds(packed, params) else None

    def _may_wave_pack(self, params: AttentionParams) -> bool:
        """`may_wave_pack` of these requests in a plan past one wave (``self._wave_pack`` set)."""
        return may_wave_pack(params, self.problem, self.q_len, *self._wave_pack, self.units)

    def _wave_packed(self, params: AttentionParams, eff: np.ndarray) -> tuple[int, PackedSplit] | None:
        """(split target, `packed_segments`) of a plan past one wave whose requests may pack
        (`_may_wave_pack`, checked by the caller): the first of `wave_pack_groups`' piece counts
        that packs, or None (also where the workspace cannot hold its partials)."""
        cfg, sm_count = self._wave_pack
        for groups in wave_pack_groups(params.batch_size, cfg, sm_count, self.units):
            packed = packed_segments(eff, groups, cfg.pack_items, cfg.min_chunk_tokens, cfg.max_splits)
            if packed is not None:
                return (groups * self.units, packed) if self._holds(packed, params) else None
        return None

    def _line_groups(self, params: AttentionParams, cfg: DecodeConfig,
                     sm_count: int) -> tuple[int, int, int] | None:
        """The item groups of a plan of config ``cfg`` on ``sm_count`` SMs that leaves the packing
        to the kernel (the caller checks that it may: `DecodeConfig.wave_pack_line`,
        few_pack_line, few_line_mixed, graph_few_line): without a sliding window (the line counts
        whole requests' pages) and with room in the workspace for a partial per group and request,
        `line_groups`; else None."""
        if self.problem.window_left >= 0:
            return None
        groups = line_groups(self.batch, cfg, sm_count, self.units, self.problem.use_cuda_graph or self.table)
        return groups if self._partial_bytes(groups[0] + self.batch) <= workspace_bytes(params) else None

    def _holds(self, packed: PackedSplit, params: AttentionParams) -> bool:
        """Whether the workspace holds the partials of ``packed``'s split requests."""
        segments = packed.segments
        return self._partial_bytes(int(segments[segments > 1].sum())) <= workspace_bytes(params)
