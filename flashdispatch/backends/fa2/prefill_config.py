"""fa2 prefill tile configs: `PrefillConfig`, the per-GPU and per-problem defaults
(`default_config`, measured on an H200, see docs/perf-notes.md "fa2 prefill") and the
FLASHDISPATCH_FA2_PREFILL_CONFIG override (`config_from_env`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ...dispatch.problem import Device, Problem
from ...environ import env_get
from ..common import shared_per_block
from .prefill_tma import tma_unused_reason

CONFIG_ENV = "FLASHDISPATCH_FA2_PREFILL_CONFIG"


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch parameters of the prefill kernel, and the split-KV policy knobs:
    ctas_per_sm (programs per SM the policy aims for), min_chunk_tokens (shortest KV chunk it
    cuts), max_splits (most chunks of one query tile). tma: load K/V tiles through tensor
    descriptors where that applies (ragged KV on sm90+, 16-bit, see prefill_tma.py); elsewhere
    the knob is ignored and the pointer path is planned (``PrefillPlan.tma_reason`` says why)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 2
    min_chunk_tokens: int = 512
    max_splits: int = 32
    tma: bool = False

    def validate(self) -> "PrefillConfig":
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"fa2 prefill {name}={v}: must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"fa2 prefill config {self}: num_warps in {{1,2,4,8,16}}, num_stages >= 1")
        for name in ("ctas_per_sm", "min_chunk_tokens", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"fa2 prefill {name}={getattr(self, name)}: must be >= 1")
        if not isinstance(self.tma, bool):
            raise ValueError(f"fa2 prefill tma={self.tma!r}: must be a bool")
        return self


_BOOL_FIELDS = frozenset({"tma"})
_BOOL_TEXT = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _config_value(name: str, text: str):
    """One key=value of FLASHDISPATCH_FA2_PREFILL_CONFIG: a bool field takes 1/0, true/false,
    yes/no, on/off; the others an int."""
    if name not in _BOOL_FIELDS:
        return int(text)
    value = _BOOL_TEXT.get(text.strip().lower())
    if value is None:
        raise ValueError(f"{name}={text!r}: expected 1/0, true/false, yes/no or on/off")
    return value


# the features whose d<=128 kernel fits 128x128 tiles with 3 stages in shared memory
_LIGHT_FEATURES = frozenset({"causal", "sliding_window", "lse", "cuda_graph", "fp8_kv"})


# The default tiles need up to 163840 B of shared memory per block on the sm80-class pipeliner
# (d128 128x128x3, d256 RoPE 64x64x4x2; sm80/87 have 166912, sm90/100 232448). GPUs with less take
# `_small_shared_config`; where the device does not say (a described GPU), its compute capability
# does (`common.shared_per_block`: sm86/89/120 99 KB).
_DEFAULT_TILES_SHARED = 163840


def _small_shared(device: Device) -> bool:
    """Whether the default tiles would not fit in the device's shared memory per block."""
    return 0 < shared_per_block(device) < _DEFAULT_TILES_SHARED


def _small_shared_config(problem: Problem) -> PrefillConfig:
    """16-bit tiles within 99 KB of shared memory (offline sm86 compiles, bytes: d128 98304, with
    a custom mask 100352, RoPE at 2 stages 98304; d192 RoPE 128x32 90112; d256 64x32 69632, RoPE
    98304). Not measured on such a GPU."""
    rope = problem.pos_encoding_mode == "ROPE_LLAMA"
    if problem.head_dim_qk <= 128:
        return PrefillConfig(128, 64, 8, 2 if rope else 3)
    if problem.head_dim_qk <= 192:
        return PrefillConfig(128, 32 if rope else 64, 8, 2)
    return PrefillConfig(64, 32, 4, 2)


# 128-row query tiles (summed over requests and query heads) up to which ragged prefills with TMA
# loads take 64x64 tiles on sm90: H200, same run, single causal 4096 (1024 such tiles) 412 -> 434
# TFLOP/s, non-causal 4096 465 -> 474, but causal 16384 (4096 tiles) 512 -> 489
_FEW_QUERY_TILES = 2048


def _few_query_tiles(problem: Problem, qo_lens: Sequence[int]) -> bool:
    """Whether the prefill has at most `_FEW_QUERY_TILES` 128-row query tiles in all (counted as
    the rows over 128 plus one partial tile per request: a bound, summed at C speed)."""
    tiles = (sum(qo_lens) + 127 * len(qo_lens)) // 128
    return tiles * problem.num_qo_heads <= _FEW_QUERY_TILES


def _small_tiles_pay(problem: Problem, tma: bool, qo_lens: Sequence[int] | None) -> bool:
    """Whether an sm90 d<=128 problem without a custom mask (``tma``: ragged K/V TMA loads apply)
    takes 64x64 tiles on 4 warps: short KV loops per query tile or few query tiles, where two
    programs share an SM (about 112 KB of Q and K/V stages each), so one tile's prologue and
    epilogue overlap another's loop (a 128-row tile runs alone).

    Sliding windows (H200, bf16 d128 32/8 heads, same run, TFLOP/s, default -> 64x64x4x3): ragged
    with TMA 4096:w256 131 -> 175, 4096:w1024 290 -> 343, 16384:w4096 454 -> 506; paged, page 16,
    8x512/8192:w256 133 -> 147, w1024 280 -> 286, but w4096 393 -> 376 (so paged windows from 2048
    on keep the default). Without a window: ragged with TMA and `_few_query_tiles`, given the
    lengths and not under CUDA graphs (whose kernel must not change with them). Ragged rows the TMA
    path cannot take and pages of 64 keys and more were not measured: they keep the default."""
    window = problem.window_left
    if window >= 0:
        return window <= 4096 if tma else 0 < problem.page_size < 64 and window < 2048
    return tma and qo_lens is not None and not problem.use_cuda_graph and _few_query_tiles(problem, qo_lens)


def default_config(problem: Problem, device: Device, qo_lens: Sequence[int] | None = None) -> PrefillConfig:
    """Tile sizes per head dim (measured on an H200, see docs/perf-notes.md "fa2 prefill");
    ``qo_lens`` (the query rows per request; not under CUDA graphs, whose kernel must not change
    with the lengths) lets small ragged problems take smaller tiles."""
    if not device.is_cuda:  # interpreter: small tiles so tiny tests still cross tiles and pages
        return PrefillConfig(32, 16, 4, 1)
    if problem.q_dtype == torch.float32:
        return PrefillConfig(32 if problem.head_dim_qk > 128 else 64, 32, 4, 1)
    if problem.head_dim_qk <= 64:
        return PrefillConfig(128, 64, 4, 3)
    if _small_shared(device):
        return _small_shared_config(problem)
    if problem.head_dim_qk <= 128:
        sm90 = device.cc is not None and device.cc[0] == 9
        features = problem.features()
        custom = "custom_mask" in features
        if sm90 and not custom:
            tma = tma_unused_reason(problem, device, 3, False) is None
            if _small_tiles_pay(problem, tma, qo_lens):
                return PrefillConfig(64, 64, 4, 3, tma=tma)
        # RoPE keeps 64-wide KV tiles (chosen when its second, permuted K load did not fit at 128;
        # rotated from K's halves since session 57, 128x128 fits: not measured); with a custom
        # mask's bitmaps they fit on sm90 only (228 KB, partial tiles unpipelined): H200, same
        # run, 128x64 -> 128x128 TFLOP/s: single 4096 mask 360 -> 397, paged 8x512/8192 mask 443 -> 482
        wide = features - {"custom_mask"} <= _LIGHT_FEATURES and (not custom or sm90)
        # pages under 64 keys: 64-key tiles (H200, same run, 128x128 -> 128x64 TFLOP/s, page 16:
        # 16x2048/2048 316 -> 346, 8x512/8192 452 -> 463, window 1024 269 -> 281; page 1: 294 -> 328,
        # 437 -> 427, 241 -> 240; page 64: 320 -> 313, 458 -> 395); a custom mask keeps 128 (460/449)
        wide = wide and not (0 < problem.page_size < 64 and not custom)
        # TMA K/V loads where they apply (ragged, sm90+, see prefill_tma.py): H200 single 4096 rows,
        # same run, pointer -> TMA TFLOP/s: window 1024 269 -> 289, causal 412 -> 414, non-causal
        # 468 -> 469, 16384 513 -> 518; with a custom mask at 128x128 pointer loads are faster
        # (397 against 382)
        return PrefillConfig(128, 128 if wide else 64, 8, 3, tma=sm90 and not custom)
    if problem.head_dim_qk <= 192:
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 64, 4, 2)


def config_from_env(base: PrefillConfig) -> PrefillConfig:
    """Apply FLASHDISPATCH_FA2_PREFILL_CONFIG: ``block_m=128,block_n=64,num_warps=8,num_stages=3``
    (any subset of the fields, split knobs and ``tma=1`` included) or the four numbers ``128,64,8,3``.
    A subset changes ``base``, the problem's default, which on sm90 depends on the window and, for
    small ragged prefills, on the lengths (``block_n=128`` on a 64x64 default gives 64x128); the
    four numbers replace it whole (TMA off)."""
    text = (env_get(CONFIG_ENV) or "").strip()
    if not text:
        return base
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if all("=" not in p for p in parts) and len(parts) == 4:
            return PrefillConfig(*(int(p) for p in parts)).validate()
        changes = {k.strip(): _config_value(k.strip(), v) for k, v in (p.split("=", 1) for p in parts)}
        return replace(base, **changes).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{CONFIG_ENV}={text!r}: {e}; expected e.g. "
                         "'block_m=128,block_n=64,num_warps=8,num_stages=3'") from e
