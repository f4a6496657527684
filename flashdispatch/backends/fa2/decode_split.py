"""fa2 decode's split-KV policy on the host: the tokens each request's chunks hold, and how many
programs a plan aims for (the few-programs target and the wave split, decode_waves.py's wave
model). decode.py partitions with these; the kernel's own split (`DecodeConfig.direct_table`)
repeats `chunk_tokens`' arithmetic on the device."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ...dispatch.problem import Problem
from ..base import AttentionParams
from .decode_config import DecodeConfig
from .decode_waves import unpacked_fraction, wave_choice, wave_split_choice


def balanced_chunks(eff: np.ndarray, n: np.ndarray, block_n: int) -> np.ndarray:
    """Chunk length per request for ``n`` chunks each: equal shares, rounded up to whole blocks
    (at least one)."""
    blocks = -(-eff // (np.maximum(n, 1) * block_n))  # (ceil(ceil(eff / n) / block_n), in one division)
    return np.maximum(blocks, 1) * block_n


def chunk_counts(eff: np.ndarray, chunk: np.ndarray | None) -> np.ndarray:
    """Chunks per request of ``chunk`` tokens (`chunk_tokens`; None: each request whole)."""
    return np.ones_like(eff) if chunk is None else np.maximum(1, -(-eff // chunk))


def split_target(batch: int, cfg: DecodeConfig, units: int, sm_count: int, tokens: float,
                  choice: tuple | None = None) -> int | None:
    """The programs the default split policy aims for (`chunk_tokens`), or None: none needed.
    Fewer programs than ctas_per_sm x SMs aim for `few_programs_target`; more, where `wave_split_choice`
    predicts a split of requests of ``tokens`` tokens on average faster than the best tile whole
    (`wave_choice`; `DecodeConfig.wave_split_ctas`), its chunks per request. ``choice``:
    `wave_choice` of these programs where the caller has it already."""
    sms = max(sm_count, 1)
    programs = batch * units
    if programs < sms * cfg.ctas_per_sm:
        return few_programs_target(cfg, sms)
    if not cfg.wave_split_ctas:
        return None
    if choice is None:
        choice = wave_choice(cfg, programs, sms)
    if choice is None or choice[1] >= 1.0:
        return None
    chunks, predicted = wave_split_choice(cfg, programs, sms, tokens)
    return programs * chunks if chunks > 1 and predicted > choice[1] else None


def few_programs_target(cfg: DecodeConfig, sm_count: int) -> int:
    """The programs that a plan of fewer than ctas_per_sm x SMs programs splits into
    (`DecodeConfig.split_ctas_per_sm`)."""
    return max(sm_count, 1) * (cfg.split_ctas_per_sm or cfg.ctas_per_sm)


def effective_lengths(params: AttentionParams, problem: Problem, q_len: int) -> tuple:
    """(kv lengths, window starts, tokens from there) of ``params``' requests (int64 arrays)."""
    lens = params.kv_lens_array()
    if problem.window_left < 0:
        return lens, np.zeros(len(lens), np.int64), lens
    lo = np.maximum(lens - q_len - problem.window_left, 0)
    return lens, lo, lens - lo


def window_stats(params: AttentionParams, problem: Problem, q_len: int) -> tuple[int, int]:
    """(sum, max) of each request's KV tokens from its window start; without a window
    `AttentionParams.kv_lens_stats`, which the decode wrapper gives (no pass over the requests:
    plan() and its refresh are host-time bound)."""
    if problem.window_left < 0:
        return params.kv_lens_stats()
    tokens = np.minimum(params.kv_lens_array(), q_len + problem.window_left)
    return int(tokens.sum()), int(tokens.max(initial=0))


def tokens_sum(eff: np.ndarray, params: AttentionParams, problem: Problem) -> int:
    """The sum of ``eff``, `effective_lengths`' tokens of ``params``' requests: without a window
    `AttentionParams.kv_lens_stats`' (no pass over the requests where the wrapper gave it)."""
    return params.kv_lens_stats()[0] if problem.window_left < 0 else int(np.add.reduce(eff))


def mean_tokens(params: AttentionParams, problem: Problem, q_len: int) -> float:
    """Mean KV tokens per request from its window start (0.0: none)."""
    batch = params.batch_size
    return window_stats(params, problem, q_len)[0] / batch if batch else 0.0


def may_wave_pack(params: AttentionParams, problem: Problem, q_len: int, cfg: DecodeConfig, sm_count: int,
                  units: int) -> bool:
    """Whether a plan past one wave may pack these requests: its longest request holds at least
    `DecodeConfig.wave_pack_spread` x the mean tokens from the window start, or (on the kernel's
    line) the requests pack whatever their lengths (`_any_lengths_pack`); and the first pieces
    `wave_pack_groups` tries hold min_chunk_tokens (`window_stats`)."""
    total, longest = window_stats(params, problem, q_len)
    batch = params.batch_size
    if not total:
        return False
    if longest * batch < cfg.wave_pack_spread * total and not _any_lengths_pack(cfg, problem, batch * units,
                                                                                sm_count, total / batch):
        return False
    return total >= wave_pack_groups(batch, cfg, sm_count, units)[0] * cfg.min_chunk_tokens


def _any_lengths_pack(cfg: DecodeConfig, problem: Problem, programs: int, sm_count: int, tokens: float) -> bool:
    """Whether ``programs`` programs of requests of ``tokens`` mean tokens pack on the line whatever
    their lengths: they reach `DecodeConfig.wave_pack_tokens`, or (from `DecodeConfig.wave_pack_below_tokens`)
    the wave model predicts their unpacked grid under `DecodeConfig.wave_pack_below`."""
    if not cfg.wave_pack_line or problem.window_left >= 0:
        return False
    if cfg.wave_pack_tokens and tokens >= cfg.wave_pack_tokens:
        return True
    if not cfg.wave_pack_below or tokens < cfg.wave_pack_below_tokens:
        return False
    fraction = unpacked_fraction(cfg, programs, sm_count, tokens)
    return fraction is not None and fraction < cfg.wave_pack_below


def packs_these_waves(cfg: DecodeConfig, programs: int, sm_count: int) -> bool:
    """Whether a plan of ``programs`` programs (past one wave) may pack: at most
    `DecodeConfig.wave_pack_max_waves` waves of ctas_per_sm x SMs (0: any)."""
    return not cfg.wave_pack_max_waves or programs <= cfg.wave_pack_max_waves * cfg.ctas_per_sm * sm_count


def wave_pieces(cfg: DecodeConfig, sm_count: int, units: int) -> int:
    """Work items (pieces) in one wave of the few-programs target's programs, ``units`` each."""
    return max(few_programs_target(cfg, sm_count) // max(units, 1), 1)


def wave_pack_groups(batch: int, cfg: DecodeConfig, sm_count: int, units: int) -> tuple[int, int]:
    """The work items (pieces) that a packed plan past one wave tries, in order
    (`DecodeConfig.wave_pack_spread`): whole waves of pieces (`wave_pieces`), as many as give each
    piece about ``wave_pack_load`` requests' tokens, then one wave more (fewer requests to a piece,
    where the first crowds one)."""
    wave = wave_pieces(cfg, sm_count, units)
    waves = max(1, math.ceil(batch / (cfg.wave_pack_load * wave)))
    return waves * wave, (waves + 1) * wave


def line_groups(batch: int, cfg: DecodeConfig, sm_count: int, units: int,
                any_lengths: bool) -> tuple[int, int, int]:
    """(item groups, mixed groups, even groups) of a line plan (`DecodeConfig.wave_pack_line`). The
    kernel cuts requests of mixed lengths into ``line_waves`` waves of pieces (`wave_pieces`),
    and requests as long as the first one into the largest count from ``top`` down to
    line_align_fill x it that divides the batch (else ``top``): then each piece holds whole
    requests, none cut across two (256 requests: 128 pieces of two each, where 132 would cut 124
    of them). ``top`` is the first of `wave_pack_groups` for ``any_lengths`` (CUDA graphs, whose
    replay may bring either kind of lengths, and block tables, whose lengths plan() does not read:
    equal ones read ~1 % more in about two requests to a piece than in one wave), else the mixed
    count. The grid holds the larger count; the programs past a count
    idle."""
    mixed = cfg.line_waves * wave_pieces(cfg, sm_count, units)
    top = wave_pack_groups(batch, cfg, sm_count, units)[0] if any_lengths else mixed
    low = max(1, math.ceil(cfg.line_align_fill * top))
    even = next((g for g in range(top, low - 1, -1) if batch % g == 0), top)
    return max(mixed, even), mixed, even


def never_split(batch: int, params: AttentionParams, target: int | None) -> bool:
    """Whether `chunk_tokens` splits no request whatever the lengths: split-KV off, no request,
    or (the policy's split) no split ``target`` (`split_target`)."""
    if params.disable_split_kv or batch == 0:
        return True
    return params.fixed_split_size is None and target is None


def chunk_tokens(eff: np.ndarray, problem: Problem, params: AttentionParams, cfg: DecodeConfig,
                  units: int, target: int | None, total: int | None = None) -> np.ndarray | None:
    """Chunk length in tokens per request, or None: no request is split. ``target``: the
    policy's split target for this batch (`split_target`); ``total``: the sum of ``eff`` where
    the caller has it."""
    if params.disable_split_kv or len(eff) == 0:
        return None
    if params.fixed_split_size is not None:
        return np.full_like(eff, max(1, params.fixed_split_size) * problem.page_size)
    if target is None:
        return None
    # Chunks per request rounded down: the grid stays within the target (one more chunk each
    # would start a second, mostly idle wave: 32 x 4096 ran at 3.06 TB/s with 3 chunks, 3.73 with 2).
    total = int(np.add.reduce(eff)) if total is None else total
    n = np.minimum(np.maximum(eff // policy_tokens(total, cfg, units, target), 1), cfg.max_splits)
    return balanced_chunks(eff, n, cfg.block_n) if np.maximum.reduce(n) > 1 else None


def policy_tokens(total: int, cfg: DecodeConfig, units: int, target: int) -> int:
    """The split policy's chunk length before balancing, for requests of ``total`` tokens: the
    tokens that give each of the ``target`` programs (`split_target`) an equal share (rounded
    down, so that requests of equal length get target / programs chunks each), at least
    ``min_chunk_tokens``."""
    return max(cfg.min_chunk_tokens, total * units // target)


def work_fill(eff: np.ndarray, chunk: np.ndarray | None, groups: int, total: int | None = None) -> float:
    """How busy ``groups`` work items keep their programs on average in a plan whose longest item
    (a request whole, or one of its chunks of ``chunk`` tokens, `chunk_tokens`) sets its time:
    the requests' tokens (``total``, the sum of ``eff`` where the caller has it) over ``groups`` x
    that item's (1.0: none is longer than the mean)."""
    longest = int(np.maximum.reduce(eff if chunk is None else np.minimum(eff, chunk), initial=0))
    if not longest:
        return 1.0
    return (int(np.add.reduce(eff)) if total is None else total) / (max(groups, 1) * longest)


class PackedSplit(NamedTuple):
    """`packed_segments`' result: the requests in the order they are laid out (``line``; None:
    their own), and per segment, in that order: its request's position in ``line``, its first and
    end token (both from the request's window start) and work row; the work rows (programs x
    ``used``, a row without a segment idle), ``used`` (the most segments a program holds) and the
    segment count of each request in ``line``."""

    line: np.ndarray | None
    pos: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    n_rows: int
    used: int
    segments: np.ndarray


def packed_segments(eff: np.ndarray, groups: int, items: int, min_chunk: int,
                    max_splits: int) -> PackedSplit | None:
    """A packed split (`DecodeConfig.pack_items`): the requests' tokens from their window starts
    laid end to end and cut into ``groups`` equal pieces, each one program's work of up to
    ``items`` segments (one per request it touches), so that every program reads the same number
    of tokens however the requests' lengths divide. The empty requests go to the end of the line,
    each a segment of no tokens, ``used`` to a program after the pieces' (it writes its zero
    output and -inf lse). Where the requests in their own order put more than ``items`` on some
    piece (short requests side by side), they are laid longest, shortest, second longest, ...
    instead (`interleaved`).

    Returns a `PackedSplit` (``used`` <= ``items``; the segments of a request side by side), or
    None where every request is empty, a piece is shorter than ``min_chunk`` tokens, or in both
    orders a piece touches more than ``items`` requests or a request gets more than
    ``max_splits`` segments."""
    empty = eff <= 0
    full = np.flatnonzero(~empty) if empty.any() else None  # the requests with tokens, where some have none
    line = eff if full is None else eff[full]
    if line.size == 0:
        return None
    order = None
    packed = _packed_line(line, groups, items, min_chunk, max_splits)
    if packed is None and line.size >= 3:
        order = interleaved(line)
        packed = _packed_line(line[order], groups, items, min_chunk, max_splits)
    if packed is None:
        return None
    if full is not None:
        order = full if order is None else full[order]
    if order is not None:
        packed = packed._replace(line=order)
    return packed if full is None else _with_empty(packed, np.flatnonzero(empty))


def _with_empty(packed: PackedSplit, empty: np.ndarray) -> PackedSplit:
    """``packed`` (of the requests with tokens) with the ``empty`` requests at the end of its
    line, a segment of no tokens each, ``used`` to a program after the pieces'."""
    rank, zeros = np.arange(empty.size), np.zeros(empty.size, dtype=packed.lo.dtype)
    used = packed.used
    return PackedSplit(np.concatenate([packed.line, empty]), np.concatenate([packed.pos, packed.segments.size + rank]),
                       np.concatenate([packed.lo, zeros]), np.concatenate([packed.hi, zeros]),
                       np.concatenate([packed.rows, packed.n_rows + rank]),
                       packed.n_rows + -(-empty.size // used) * used, used,
                       np.concatenate([packed.segments, np.ones_like(empty)]))


def interleaved(eff: np.ndarray) -> np.ndarray:
    """The requests longest, shortest, second longest, second shortest, ... (indices): on a line
    in this order no two short requests are neighbours."""
    by_length = np.argsort(-eff, kind="stable")
    half = (eff.size + 1) // 2
    order = np.empty_like(by_length)
    order[0::2], order[1::2] = by_length[:half], by_length[half:][::-1]
    return order


def _packed_line(eff: np.ndarray, groups: int, items: int, min_chunk: int, max_splits: int) -> PackedSplit | None:
    """`packed_segments` of requests with tokens, in the order of ``eff``."""
    total = int(eff.sum())
    piece = -(-total // max(groups, 1))
    if piece < min_chunk:
        return None
    req_end = eff.cumsum()
    req_start = req_end - eff
    first = req_start // piece  # the piece of each request's first token
    count = (req_end - 1) // piece - first + 1  # segments per request
    used = _most_to_a_piece(req_start, first, piece, total)
    if count.max() > max_splits or used > items:
        return None
    n_seg = int(count.sum())
    req = np.arange(eff.size).repeat(count)
    seg = np.arange(n_seg)
    group = first[req] + seg - (count.cumsum() - count)[req]  # nondecreasing: the pieces in order
    slot = seg - np.searchsorted(group, group)
    base = req_start[req]
    start = group * piece
    lo = np.maximum(base, start) - base
    hi = np.minimum(req_end[req], start + piece) - base
    return PackedSplit(None, req, lo, hi, group * used + slot, (int(group[-1]) + 1) * used, used, count)


def _most_to_a_piece(start: np.ndarray, first: np.ndarray, piece: int, total: int) -> int:
    """The most requests a piece of ``piece`` tokens touches on a line of ``total`` tokens, from
    the requests' first tokens (``start``, all with tokens) and their pieces (``first``): the
    requests starting in it, and one begun before it unless one starts on its first token
    (cheap: a crowded line is refused before its segments are laid out)."""
    pieces = (total - 1) // piece + 1
    segments = np.bincount(first, minlength=pieces) + 1
    segments[first[start % piece == 0]] -= 1
    return int(segments.max())
