"""fa2 decode's wave model: how long a plan's programs of equal work take on the SMs, in waves of
the programs resident at once (`DecodeConfig.wave_tiles`, `wave_slots`), which tile runs a plan past
one wave fastest, and whether splitting its requests (`DecodeConfig.wave_split_ctas`) beats it."""
from __future__ import annotations

import functools
import math

from .decode_config import DecodeConfig
from .decode_variant import with_split_block, with_tile

# A last wave partly filled with programs costs this much of a full wave, plus the rest in
# proportion to its fill (fitted to the H200 fp8 sweeps of session 15, docs/perf-notes.md).
PARTIAL_WAVE_COST = 0.5


def wave_cost(programs: int, slots: int) -> float:
    """The time of ``programs`` programs of equal work on ``slots`` resident at once, in full
    waves: the whole waves, and a last partial one at PARTIAL_WAVE_COST + (1 -
    PARTIAL_WAVE_COST) x its fill."""
    full, rest = divmod(programs, max(slots, 1))
    return full + (PARTIAL_WAVE_COST + (1 - PARTIAL_WAVE_COST) * rest / slots if rest else 0)


def wave_choice(cfg: DecodeConfig, programs: int, sm_count: int) -> tuple[tuple[int, int], float] | None:
    """((block_n, num_stages), predicted fraction of full-wave throughput) of the tile with the
    least predicted time for ``programs`` programs of equal work on ``sm_count`` SMs, or None
    where the config carries no programs-per-SM figures. The tiles: `DecodeConfig.wave_tiles`,
    else the config's own at `wave_slots` per SM; each costs `wave_cost` in waves of per-SM x
    SMs programs, each wave its programs' work over the tile's rate."""
    tiles = _wave_figures(cfg)
    if not tiles:
        return None
    sms = max(sm_count, 1)

    def predicted(tile):
        slots = tile[2] * sms
        return wave_cost(programs, slots) * slots / tile[3]
    best = min(tiles, key=predicted)
    return (best[0], best[1]), programs / predicted(best) if programs > 0 else 1.0


def _wave_figures(cfg: DecodeConfig) -> tuple:
    """The config's (block_n, num_stages, programs per SM, rate) figures: its wave tiles, else its
    own tile at `wave_slots` (rate 1.0), else none."""
    if cfg.wave_tiles or not cfg.wave_slots:
        return cfg.wave_tiles
    return ((cfg.block_n, cfg.num_stages, cfg.wave_slots, 1.0),)


def _tile_figure(cfg: DecodeConfig, block_n: int, num_stages: int) -> tuple | None:
    """The config's (block_n, num_stages, programs per SM, rate) figure of the tile block_n x
    num_stages (`_wave_figures`), or None where it holds none for it."""
    return next((t for t in _wave_figures(cfg) if t[:2] == (block_n, num_stages)), None)


def wave_split_config(cfg: DecodeConfig) -> DecodeConfig:
    """The config a wave-split plan's grid runs: the split block (`with_split_block`), else the
    tile of the best full-wave rate (`fastest_wave_tile`)."""
    return with_split_block(cfg) if cfg.split_block_n else with_tile(cfg, *fastest_wave_tile(cfg))


def wave_split_choice(cfg: DecodeConfig, programs: int, sm_count: int, tokens: float) -> tuple[int, float]:
    """(chunks per request, predicted fraction of full-wave throughput) of the best wave split of
    ``programs`` unsplit programs whose requests hold ``tokens`` tokens on average (rounded to
    1/32 of an octave in the cost: the answers are cached, plan() and its refresh are host-time
    bound): of 2 up to wave_split_ctas x SMs / programs chunks, the count of the least predicted
    time on the split grid's kernel (`DecodeConfig.wave_split_slots`, else the figure of the tile
    of `wave_split_config`, and that tile's rate): `wave_cost` of its programs, each program's
    work tokens / chunks + split_chunk_tokens (fewer chunks on a tie). (1, 0.0): no split, where
    fewer than 2 chunks fit, the requests are empty, the kernel has no figure, or the programs
    fit one wave of the most resident tile and their requests are shorter than
    `DecodeConfig.lone_wave_split_tokens`."""
    if tokens <= 0:
        return 1, 0.0
    lone_splits = 0 < cfg.lone_wave_split_tokens <= tokens
    return _wave_split_choice(cfg, programs, sm_count, round(math.log2(tokens) * 32), lone_splits)


@functools.lru_cache(maxsize=1024)
def wave_split_ceiling(cfg: DecodeConfig, programs: int, sm_count: int) -> float:
    """The most `wave_split_choice` predicts for ``programs`` programs at any mean length (its
    chunks free of cost); 0.0 where it splits them at no length. A plan whose best tile reads
    at least this much skips the mean length (plan() and its refresh are host-time bound)."""
    return _wave_split_choice(cfg, programs, sm_count, None, cfg.lone_wave_split_tokens > 0)[1]


@functools.lru_cache(maxsize=1024)
def _wave_split_choice(cfg: DecodeConfig, programs: int, sm_count: int, octave32: int | None,
                       lone_splits: bool) -> tuple[int, float]:
    """`wave_split_choice` at a mean length of 2 ** (octave32 / 32) tokens (None: unbounded), a
    single partly filled wave split only where ``lone_splits``."""
    chunk_cost = 0.0 if octave32 is None else cfg.split_chunk_tokens / 2.0 ** (octave32 / 32)
    sms = max(sm_count, 1)
    most = cfg.wave_split_ctas * sms // max(programs, 1)
    split = wave_split_config(cfg)
    figure = _tile_figure(cfg, split.block_n, split.num_stages)
    lone = programs <= max((t[2] for t in _wave_figures(cfg)), default=0) * sms
    if most < 2 or figure is None or lone and not lone_splits:
        return 1, 0.0
    slots = (cfg.wave_split_slots or figure[2]) * sms

    def predicted(n):  # in durations of one whole request's program at the full rate
        return wave_cost(programs * n, slots) * slots / figure[3] * (1 / n + chunk_cost)
    chunks = min(range(2, most + 1), key=predicted)
    return chunks, programs / predicted(chunks)


def unpacked_fraction(cfg: DecodeConfig, programs: int, sm_count: int, tokens: float) -> float | None:
    """The predicted fraction of full-wave throughput of a plan of ``programs`` programs of equal
    work past one wave, unpacked: its best wave tile (`wave_choice`), or its wave split where that
    predicts more (`wave_split_choice`, requests of ``tokens`` tokens on average); None where the
    config carries no programs-per-SM figures (`DecodeConfig.wave_pack_below`)."""
    choice = wave_choice(cfg, programs, sm_count)
    if choice is None:
        return None
    chunks, split = wave_split_choice(cfg, programs, sm_count, tokens)
    return max(choice[1], split if chunks > 1 else 0.0)


def fastest_wave_tile(cfg: DecodeConfig) -> tuple[int, int]:
    """(block_n, num_stages) of the wave tile with the best full-wave rate (the config's own
    without wave tiles): the tile of a wave-split plan without a split block, whose many short
    programs run in many waves (H200 fp8, split at 48 per SM, TB/s 64 x 3 -> 32 x 3: 270x4096
    3.49 -> 3.80, 300x4096 3.53 -> 3.89; 32 x 2 read 3.33 / 3.46)."""
    if not cfg.wave_tiles:
        return cfg.block_n, cfg.num_stages
    best = max(cfg.wave_tiles, key=lambda t: t[3])
    return best[0], best[1]
