"""fa2 decode's knobs: `DecodeConfig`, its defaults by problem and the overrides
(FLASHDISPATCH_FA2_DECODE_CONFIG, a plan's ``config``); the variants a plan switches to (the split
block, the wave tiles) are derived in decode_variant.py."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ...dispatch.problem import FP8_DTYPES, Problem
from ...environ import env_get
from .decode_env import CONFIG_ENV, apply_env

MAX_LINE_SEGMENT_TOKENS = 4096  # DecodeConfig.line_segment_tokens: gap x requests stays far inside int32
MAX_PACK_ITEMS = 4  # DecodeConfig.pack_items: the kernel's body is compiled that many times


@dataclass(frozen=True)
class DecodeConfig:
    """Kernel and split-policy knobs.

    block_n: tokens per inner step; num_warps / num_stages: Triton launch options;
    max_registers: per-thread register cap handed to ptxas (Triton's ``maxnreg``); 0: ptxas
    chooses. It sets how many programs fit on an SM, which bounds the KV reads in flight (sm90
    d128, 4 warps, block_n 32: ptxas gave group 4's direct-table variant and group 16's 79-80
    registers, 6 programs per SM, where 64 fits 8; see docs/perf-notes.md). Only the variant it
    was measured on takes it (`decode_variant.register_cap`: one query row per request, one 16-row
    block, no RoPE/ALiBi/soft cap, no fused merge); the others, and plans that switch to
    ``split_block_n`` (capped at split_max_registers) or the wave tiles or override block_n, run
    uncapped (under 64 they spill, or do not compile at 64 rows).
    max_block_m: most query rows per program (more rows use several row blocks);
    ctas_per_sm: programs per SM the split policy aims for; min_chunk_tokens: shortest chunk
    worth a split; max_splits: most chunks of one request (CUDA-graph grids use it);
    split_ctas_per_sm: programs per SM that a plan of fewer than ctas_per_sm x SMs programs
    splits its requests into, where its split block fits more than ctas_per_sm (0: ctas_per_sm).
    H200 fp8 32/8 d128, TB/s 64 x 3 at 4 per SM -> split block 32 x 3 at 8 per SM (session 20,
    one run): 24x8192 2.77 -> 3.28, 48x4096 2.81 -> 3.18, 64x4096 3.36 -> 3.58, 16x1024 1.45 ->
    1.53, 1x8192 0.88 -> 0.92, 1x32768 2.01 -> 1.93, 2x16384 1.94 -> 1.95; page 1 16x8192 3.08
    -> 3.23, 4x8192 2.00 -> 1.92. The 32 x 3 tile at 4 per SM read less (64x4096 3.06). fp8
    MHA d128 takes it too (session 21: +2-3 % on 1-16 requests).
    Eager plans and line plans only: a CUDA-graph grid is sized by the batch alone, and at 8 per
    SM the short requests of a replay leave half of it idle (fp8 16x1024 1.35 TB/s, 1.54 eager),
    so graph plans off the line keep ctas_per_sm and the config's own tile (`for_cuda_graph`).
    k_rows: load K as token rows and transpose in registers instead of loading K^T tiles;
    split_block_n: block_n for plans that split requests by the default policy (few requests with
    long contexts, or the wave split: fewer, longer steps pay off there); None: block_n.
    split_max_registers: the split block's register cap (0: none); RoPE plans set it from rope_split_max_registers.
    fp8_dot_dtype (fp8 KV only): "q" runs both dots in q's dtype (fp8 -> bf16 is a slow
    conversion on sm90), "fp16" runs them in fp16 with q row-scaled by powers of two (see
    decode_kernel.py for the ranges).
    heads_fastest: program order of the 1-D grid: all (kv head, row block) units of a work item
    next to each other (whole pages read together), or one unit of every item at a time.
    page_prefetch: load the next tile's page numbers one step ahead, so that K/V get
    num_stages - 1 buffers (else one buffer below num_stages 5: no copy in flight during compute).
    fp8_v_convert (fp8 KV with fp16 dots): "operand" converts V inside the dot operand layout
    (one ld.shared.b8 per value), "staged" converts it in registers and stages it as fp16 in
    shared memory (more shared memory, far fewer instructions); the interpreter runs "operand".
    Before sm89 (e5m2 KV only there) "staged" converts by byte permutes, so it runs there too.
    fused_merge_max_chunks: plans whose requests have at most this many chunks merge the partials inside the decode
    kernel (the last program of each split request to finish merges, through an arrival counter) instead of in a
    second kernel launch; 0: never. That last program merges alone, so many chunks favour the merge kernel (H200
    sweeps, TB/s unfused -> fused: 32x4096 with 2 chunks 3.70-3.75 -> 3.82-3.92, 16x8192 with 4 3.74-3.85 ->
    3.82-3.92, 1x32768 with 64 2.58-2.60 -> 2.47-2.50). A line plan (wave_pack_line) merges in the kernel whenever
    this is > 0, however many pieces a request spans (decode.py's `DecodePlan._merge_choice`).
    fused_merge_values: float32 values the fused merge loads per round, a [rows, partials, head_dim] tile (a power
    of two, >= 256): more values, fewer dependent rounds on the kernel's tail, more registers for the whole kernel
    (sm90 d128 group 4, direct split: 80 registers and 5 programs per SM at 4096, 122 and 4 at 8192). H200 bf16 32/8
    heads, TB/s 4096 -> 8192, two rounds: 4x8192 2.69 -> 2.74-2.76, 8x8192 3.39-3.40 -> 3.43, 16x8192 3.88-3.89 ->
    3.92, 32x4096 3.87-3.88 -> 3.91-3.92, 16x16384 4.20-4.21 -> 4.25; fp8 flat; MHA lost (8x8192 4.17 -> 3.01):
    default_config takes 8192 for 16-bit GQA d128 group 4 only.
    direct_table: a plan without fixed_split_size gives the kernel the API's kv_indptr and
    last_page_len instead of a work array: one program per (request, KV head, row block) reads its
    pages and length from them, so plan() builds and uploads nothing (H200 bf16 GQA d128 with
    max_registers 64, TB/s work array -> direct: 256x1024 4.15 -> 4.15, 128x2048 4.15 -> 4.15,
    256x4096 4.39 -> 4.38; batch-256 plan() ~60-100 us less host time). A plan that splits
    requests by the default policy does too when at most half of its grid would idle: a program
    per (request, chunk slot, KV head, row block) works its request's chunk out from the length,
    as plan() would (`DecodePlan._direct_split`), and a re-plan only passes the new split length.
    A CUDA-graph plan reads the wrapper's fixed buffers and splits into its grid's chunk slots,
    a function of the batch size (`DecodePlan._place_graph_direct`). default_config turns it on
    for 16-bit GQA KV up to d128 and fp8 GQA d128 and d256, where it was measured (fp8 32/8 d128,
    session 19, TB/s work array -> direct: 128x4096 3.90 -> 3.95, 256x4096 4.08 -> 4.14, 512x4096
    4.19 -> 4.22, 200x1024 2.89 -> 2.95, 16x8192 3.06 -> 3.08, 64x4096 3.47 -> 3.41, 1x32768 1.98
    -> 1.95; fp8 d256, session 21: -1 % to +3 %); MHA d128 (64x4096 4.48 -> 4.33, 24x4096 4.22 ->
    3.93) and 16-bit d256 GQA (85x4096 4.35 -> 3.97) read less with it.
    swap_ab: compute both dots transposed (S^T = K Q^T, O^T = V^T P^T; decode_kernel.py), so the
    query rows are the mma's N: row blocks start at 8 rows instead of 16 (half the padding of a
    group of 4). H200 fp8 e4m3 32/8 heads d128, one warp, 64 x 3, TB/s off -> on: 64x4096 3.37
    -> 3.48, 16x8192 2.94 -> 3.05, 128x4096 3.55 -> 3.67, MHA 64x4096 3.57 -> 3.89; bf16 (4 warps,
    already at the read ceiling) flat or lower (64x4096 4.26 -> 4.24, MHA 4.50 -> 4.24): fp8 only.
    wave_tiles: ((block_n, num_stages, programs per SM, rate), ...): a plan of at least
    ctas_per_sm x SMs programs (request x KV head x row block) under the default split policy,
    of the variant the figures were measured on (`decode_variant.plain_variant`) and not split for
    waves (wave_split_ctas; a split plan runs split_block_n, else `fastest_wave_tile`), runs
    the tile with the least predicted time for its program count (`wave_choice`): programs
    of equal work run in waves of (programs per SM x SMs), and a last, partly filled wave costs
    half a full one and more (`wave_cost`; H200 fp8, 32 x 3 tiles, 8 per SM: 1.94 waves 4.07
    TB/s, 1.45 waves 3.25). ``rate``: the tile's full-wave TB/s relative to the others;
    programs per SM from the sm90 compile (scripts/decode_registers.py). (): the config's own
    tile at any size. A config that sets block_n, num_stages, num_warps or max_registers turns
    it off. bf16 32/8 d128 (H200, session 16, TB/s 32 x 2 capped at 64 registers, 8 per SM /
    64 x 2, 5 per SM): 160x2048 3.28 / 4.32, 165x4096 3.32 / 4.48, 400x4096 4.14 / 4.55;
    264x4096 (2 waves of 8 per SM) 4.53 / 4.15.
    wave_slots: programs per SM of the config's unsplit kernel (the sm90 compile), for a config without wave_tiles;
    0: not known (a config that overrides block_n, num_stages, num_warps or max_registers resets it). Used by the
    wave split and wave_pack_below only: without either it has no effect.
    wave_split_ctas: > 0: a plan of at least ctas_per_sm x SMs programs may split its requests
    by the default policy as few requests do, into at most this many programs per SM, where
    `wave_split_choice` predicts the split grid faster than the best tile whole (`wave_choice`):
    shorter programs in more waves leave a shorter last one, each chunk costing
    split_chunk_tokens. H200, TB/s whole -> split: bf16 32/8 d128 (session 15, before the wave
    tiles, 8 per SM: 136x4096 (1.03 waves) 3.28 -> 4.25, 288x4096 3.73 -> 4.47; session 16, best
    tile -> split: 133x4096 4.19 -> 4.18, 176x4096 4.18 -> 4.28); fp8 d128 on `fastest_wave_tile`
    (210x4096 3.39 -> 3.85, 300x4096 3.65 -> 3.95, 420x4096 3.72 -> 3.96; one partly filled wave,
    session 18: 80x4096 3.02 -> 3.49, 160x4096 3.66 -> 3.86, 160x8192 3.76 -> 4.11). The MHA d128,
    page-1 and d256 defaults allow 24 per SM (their per-SM figures 4, 3, 4; MHA 24x4096 3.61 ->
    4.19, d256 85x4096 4.29 with 3 chunks). 0: no wave split.
    wave_split_slots: programs per SM of the wave split's kernel (its split tile with the fused
    merge) where they differ from its tile's figure: bf16 32/8 d128, 4 (the fused merge's 8K
    tile: 122 registers, against the 64 x 2 tile's 5); 0: the tile's figure. A config that
    overrides the tiles, split_block_n or fused_merge_values resets it.
    split_chunk_tokens: what each chunk of a wave-split request costs beyond its share of the
    request, in tokens of its work (the chunk's start and partial write, the merge). Fitted per
    default to H200 sweeps (session 18), as the value that ranks the split and whole plans of
    each measured shape as measured: fp8 d128 72 (15 shapes of one partly filled wave, 2048 to
    8192 tokens, each within 1.7 % of its best, and 300x2048 in 3 chunks, 3.43-3.53 TB/s against
    3.34 in 2; a cost in proportion to the request missed the 2048-token rows; misses: 1024-token
    batches of 199-215 requests, whole at 2.88-2.91 against 3.00-3.03 split), bf16 GQA d128 48
    (page 16: 133x2048 4.07 TB/s whole against 3.93 in 4 chunks, 266x2048 4.12 in 2 against 4.04
    whole; page 1: 150x2048 4.00 in 2 against 3.88), MHA d128 24 (20x1024 3.18 in 4 chunks
    against 3.02 in 2), d256 16 (75x1024 3.58 in 5 against 3.36 in 2).
    lone_wave_split_tokens: a single, partly filled wave of programs (within one wave of the
    most resident tile) is split for waves only where its requests hold at least this many
    tokens on average, predicted as a last partial wave (`wave_cost`); 0: never (it reads at the
    full rate). bf16's 4-warp programs keep enough loads in flight at any fill (96x4096 whole
    reads as fast as full waves): 0. fp8's one-warp programs do not: 3072 (H200, session 18, TB/s
    whole -> split: 80x4096 3.02 -> 3.49, 75x8192 2.94 -> 3.81, but 160x2048 3.46 -> 3.26,
    80x1024 2.67 -> 2.55; the others in docs/perf-notes.md).
    pack_items: > 1: a plan of fewer than ctas_per_sm x SMs programs whose requests (whole, or in
    the default policy's chunks) keep its split target's programs less than ``pack_fill`` busy
    (`decode_split.work_fill`: the tokens over the target's work items x the longest item's; the
    chunks per request are whole numbers: 48 requests of 4096 tokens, 32/8 heads, fp8 split in 2
    fill 0.73 of 132 SMs x 8, and a mix of lengths leaves a request of 1.9 chunks' tokens whole)
    lays the requests' tokens end to end and gives each of the target's programs an equal piece, up
    to this many segments of different requests in one program, one after the other, as many as its
    pieces need (`decode_split.packed_segments`: short requests side by side that crowd a piece are
    laid apart, longest, shortest, ...; the kernel's ITEMS); a work-array plan, never under CUDA
    graphs. 1: never. H200 d128, session 22, TB/s 1 -> 2 (the plain plan's fill): fp8 e4m3 32/8
    36x4096 3.14 -> 3.21 (0.82), 48x4096 3.20 -> 3.39 (0.73), 32/32 9x4096 3.12 -> 3.20 (0.82),
    12x4096 3.14 -> 3.34 (0.73); bf16 32/8 36x4096 3.27 -> 3.83 (0.55), but 20x4096 3.53 -> 3.42
    (0.91), 60x2048 3.85 -> 3.72 (0.91), 48x4096 3.95 -> 3.97 (0.73); 32/32 9x4096 3.36 -> 3.78
    (0.55), 12x4096 4.03 -> 3.93 (0.73). Mixed lengths (the bench's ``:var`` rows) need 3-4 to a
    piece: session 23, 32/8, TB/s 1 -> 4: bf16 36x4096 3.32 -> 3.77, 48x4096 3.21 -> 3.97, 64x4096
    3.39 -> 4.10, 48x2048 2.97 -> 3.52, 20x4096 3.03 -> 3.34; fp8 36x4096 2.58 -> 3.06, 48x4096 2.69
    -> 3.28, 64x4096 2.86 -> 3.54, 24x8192 3.13 -> 3.24, 16x8192 1.99 -> 2.98. Past ctas_per_sm x
    SMs programs, mixed lengths pack too (``wave_pack_spread``). At most `MAX_PACK_ITEMS`.
    pack_fill: see pack_items (fp8 0.95, 16-bit 0.65 where they pack).
    wave_pack_spread: a plan of at least ctas_per_sm x SMs programs (up to wave_pack_max_waves
    waves) under the default policy, eager (CUDA-graph and block-table plans take the line whatever
    the lengths: wave_pack_line), with pack_items > 1, whose longest request holds at least this
    many times the mean tokens (and whose pieces would hold min_chunk_tokens: `decode_split.may_wave_pack`) is
    packed too, into whole waves of the few-programs target's pieces, on the split block
    (`decode_split.wave_pack_groups`): unpacked, a long request that starts late runs on after the
    others, and with one wave of requests the longest sets the time. H200 32/8, session 24, TB/s
    unpacked -> packed (the bench's ``:var`` rows, lengths 1 .. 2 x mean - 1): d128 bf16 128x4096
    3.17 -> 4.36, 256x2048 3.69 -> 4.31, 512x1024 3.98 -> 4.18; fp8 128x4096 2.43 -> 3.88, 256x1024
    2.84 -> 3.39; d256 bf16 128x4096 3.47 -> 4.29; d64 fp8 128x4096 1.99 -> 2.96; MHA 32x4096 3.35
    -> 4.19 (docs/perf-notes.md). 0: never.
    wave_pack_below: > 0: such a plan (the kernel's line only: wave_pack_line, no sliding window)
    packs whatever its lengths where the wave model predicts its best unpacked grid (the wave tile,
    or the wave split where that beats it: `decode_waves.unpacked_fraction`) under this fraction of
    full-wave throughput: requests of equal length in a last wave partly filled. 0: by
    wave_pack_spread alone. fp8 GQA and MHA d128 0.96, fp8 d256 0.96 on its compile's 4 programs per
    SM (wave_slots), bf16 GQA d64 0.88 (wave_pack_below_tokens). H200, session 45, TB/s by spread ->
    any lengths, equal lengths (the predicted fraction): fp8 32/8 d128 200x1024 2.89 -> 3.33 (0.86),
    100x2048 3.22 -> 3.38 (0.86), 160x2048 3.42 -> 3.62 (0.86), 80x4096 3.45 -> 3.66 (0.90),
    300x2048 3.64 -> 3.87 (0.89), 400x4096 3.86 -> 4.05 (0.90), 210x4096 3.83 -> 3.98 (0.93),
    160x1024 3.20 -> 3.22 (0.86), but at 0.97-1.0: 256x1024 3.58 -> 3.55, 512x1024 3.82 -> 3.74,
    1000x512 3.68 -> 3.54, 264x4096 4.11 -> 4.07, 128x2048 3.62 -> 3.60; 32/32 17x8192 3.58 -> 3.93
    (0.89), 100x1024 3.47 -> 3.73 (0.86), 24x4096 3.60 -> 3.79 (0.92), 48x2048 3.66 -> 3.76 (0.95),
    64x4096 4.10 -> 4.03 (0.98); fp8 d256 100x2048 2.76 -> 3.49 (0.86), 200x1024 3.11 -> 3.47
    (0.86), 256x1024 3.51 -> 3.49 (0.98).
    wave_pack_below_tokens: wave_pack_below applies only to requests of at least this many tokens
    on average from the window start (0: any). bf16 GQA d64 1024, with wave_slots 5 (its direct
    table's sm90 compile) and wave_pack_below 0.88 (H200 32/8, session 46, TB/s by spread -> any
    lengths, equal lengths, the predicted fraction): 100x2048 2.97 -> 3.55 (0.76), 128x4096 3.90 ->
    4.14 (0.87), 256x1024 3.58 -> 3.71 (0.87); but 200x1024 3.54 -> 3.50 (0.89), 160x1024 3.54 ->
    3.36 (0.98), 256x256 2.79 -> 2.63 (0.87; the others in docs/perf-notes.md).
    wave_pack_tokens: > 0: such a plan (the kernel's line only: wave_pack_line, no sliding window)
    packs whatever its lengths where its requests hold at least this many tokens on average from the
    window start (0: off). fp8 d64 MHA 1024, GQA 512: one program of its 64 x 3 tile per request and
    KV head runs 8 to an SM and reads less than the line's 4 to an SM from 512 tokens a request,
    where each request's own costs weigh less than at 256 (H200 32/8, session 46, TB/s by spread ->
    any lengths: 128x4096 2.44 -> 3.11, 1000x512 2.62 -> 2.70, 1000x256 2.56 -> 2.24; perf-notes).
    wave_pack_max_waves: packing past one wave only up to this many waves of programs (ctas_per_sm
    x SMs each; 0: any): bf16 d64 4 (H200 32/8, session 27, TB/s line -> unpacked at 7.8 waves:
    512x1024:var 3.62 -> 3.86, 512x2048:var 3.96 -> 3.98; at 3.9, 256x1024:var 3.41 both).
    wave_pack_load: the mean requests' tokens to a piece that `wave_pack_groups` aims for, where
    the host packs (1.0, twice the pieces, read the same or less: d128 fp8 256x1024:var 3.27
    against 3.39) and for requests of equal length on a CUDA-graph line (`line_groups`).
    wave_pack_line: a wave-packed plan without a sliding window leaves the pieces to the kernel
    (decode_kernel.py's LINE): the requests' pages end to end as kv_indptr numbers them, one equal
    piece per item group, so plan() lays out and uploads nothing (a direct plan's host time) and a
    re-plan of the same batch size only swaps the tables. False: the host lays out the segments
    (`decode_split.packed_segments`, up to pack_items to a program) and uploads their work rows
    (394-736 us of plan() on the GPU host against the line's 165-208, session 25). On wherever the
    defaults pack: the H200 measured it within about 2 % of the host's packing or above (sessions
    25-26, TB/s host -> line: 32/8 bf16 d128 128x4096:var 4.37 -> 4.32, 512x1024:var 4.19 -> 4.11,
    fp8 d128 256x1024:var 3.37 -> 3.49, bf16 d256 4.07 -> 4.38; MHA 32/32 since session 29, for the
    host time (plan() 166-351 -> 4.5-8.7 us a re-plan, dev CPU): 64x2048:var 4.15 -> 4.12, 32x4096:var 4.17
    -> 4.13; the others in docs/perf-notes.md). Under CUDA graphs and for block tables, where the
    host cannot pack (it does not read the lengths the kernel runs), a plan that packs takes the
    line whatever this flag and the lengths (a captured grid replays any later ones): mixed lengths
    read up to 1.6x the graph's own split, equal ones 0-3 % less (docs/perf-notes.md, sessions
    27-28; wave_pack_spread 0: no packing).
    few_pack_line: an eager plan of fewer than ctas_per_sm x SMs programs of more than one request
    that packs (pack_items) leaves the pieces to the kernel as wave_pack_line does past one wave
    (plan() lays out and uploads nothing: 105-195 us against the host's 300-680, H200 session 31).
    On for fp8 d128 (H200 32/8 and 32/32, session 31, eager, TB/s host -> line: 48x4096:var
    3.28 -> 3.33-3.34, 64x2048:var 3.00 -> 3.06, 16x8192:var 2.97 -> 3.00, 48x4096 3.30-3.33 ->
    3.33-3.36, 4x8192:var 1.41 -> 1.38-1.39, MHA 4x8192:var 2.73 -> 2.89); off for 16-bit, which
    reads 0-2 % less on it (36x4096 3.91 -> 3.85, 48x4096:var 4.03-4.05 -> 3.99). A single
    request stays off the line (fp8 1x32768 1.95 -> 1.51 on it).
    graph_few_line: a CUDA-graph or block-table plan (neither knows the lengths it will run) of
    fewer than ctas_per_sm x SMs programs of more than one
    request whose config packs (pack_items > 1, wave_pack_spread > 0) takes the line too, in one
    wave of the few-programs target's pieces: the graph's own split (at most its chunk slots per
    request, a function of the batch size alone) leaves a long request of a mixed batch running
    after the others. On for d128 (H200 32/8, session 30, graphs, TB/s own split -> line): mixed
    48x4096:var 2.50 -> 3.91-3.98, 32x4096:var 2.72 -> 3.63-3.67, 16x8192:var 2.89 -> 3.67-3.73,
    8x8192:var 2.61 -> 2.99, fp8 48x4096:var 1.73 -> 3.35, 16x8192:var 1.92 -> 3.00-3.07, MHA
    12x4096:var 2.67 -> 3.82; equal lengths lose 2-8 % (2x16384 2.70 -> 2.49-2.55, 16x8192 3.85 ->
    3.72-3.76, 64x4096 4.18 -> 4.11-4.18) except fp8 48x4096 3.00 -> 3.36. On for GQA d64 and d256
    too (sessions 43-44, graphs and block tables: mixed d64 48x4096:var 2.61 -> 3.49, d256 2.72 ->
    4.25; equal lengths -9 to +8 %; the others in docs/perf-notes.md).
    few_line_mixed: an eager plan of fewer than ctas_per_sm x SMs programs of at least this many
    requests whose lengths differ takes the line (as few_pack_line) whatever its work fill, where
    its config packs (pack_items > 1); 0: off. 16 for bf16/fp16 GQA d128 (H200 32/8, session 43,
    eager, two rounds, TB/s own split or host packing -> line): 16x8192:var 3.50 -> 3.74,
    32x4096:var 3.62 -> 3.69, 24x8192:var 3.90 -> 3.91, 48x4096:var 3.96 -> 3.99, 64x4096:var
    4.09 -> 4.11; fewer requests read less on it (8x8192:var 3.10 -> 3.07, 4x8192:var 2.26 ->
    2.25, 2x16384:var 2.76 -> 2.68), as do equal lengths (64x4096 4.20 -> 4.14), which stay off.
    MHA 32/32 mixed rows -1 to +5 %: off.
    line_waves: the waves of the few-programs target's pieces (`few_programs_target` / units)
    that the kernel cuts requests of mixed lengths into on the line (`decode_split.line_groups`):
    one wave of long pieces ends together; more waves of shorter ones leave a last one partly
    filled. H200 32/8 d128, session 32, eager, TB/s at wave_pack_load 2's count (2-4 waves past
    132 requests) -> one wave: bf16 512x1024:var 4.10 -> 4.24, 1024x512:var 3.83 -> 4.11,
    2048x512:var 3.86 -> 4.21 (two waves 4.19), 256x1024:var 3.96 -> 4.04, 128x4096:var 4.33 both;
    fp8 512x1024:var 3.70 -> 3.81, 1024x512:var 3.40 -> 3.66; MHA 32/32 256x512:var 3.75 -> 3.95;
    d64 256x1024:var 3.45 -> 3.61; d256 256x1024:var 4.21 -> 4.24 (docs/perf-notes.md).
    line_align_fill: requests whose pages sum to batch x the first's (equal ones) are cut into the
    largest piece count down to this fraction of `decode_split.line_groups`' top count that
    divides the batch (1.0: that count). H200 32/8 graphs, session 28, TB/s 1.0 ->
    0.9: 256x1024 4.02 -> 4.14, 512x1024 4.17 -> 4.30, d64 3.49 -> 3.66; mixed lengths unchanged.
    line_segment_tokens: what one more segment costs a line program, in tokens' worth of reading
    (the kernel's ``line_gap``, rounded up to whole pages): the line puts this gap before each
    request, so a piece where many short requests start reads fewer pages and its program ends
    with the others. 0: pieces of equal pages. 64 (H200 32/8, session 26, TB/s 0 -> 64): fp8 d128
    128x4096:var 3.86 -> 3.91, 256x1024:var 3.42 -> 3.49, 512x1024:var 3.58 -> 3.62; fp8 d64
    256x1024:var 2.33 -> 2.38; bf16 d64, d256 and d128 within 0.5 % either way.
    line_page_prefetch: a line plan runs with page_prefetch whatever the config's own. The line's
    request body is a called function (not inlined), where ptxas issues the two-level page-table
    loads of a tile one after the other instead of together (the sm90 SASS of bf16 d128): bf16
    d128 line 128x4096:var 4.15 -> 4.32, 256x2048:var 4.16 -> 4.24 TB/s (H200 32/8, session 26);
    bf16 d64 and d256 read less with it (4.06 -> 3.31, 4.43 -> 3.34).
    table_split_slots: a block-table plan (trtllm / xqa functions: no lengths on the host, decode.py's
    `_place_table`) of fewer than ctas_per_sm x SMs programs not on the line (graph_few_line) has
    this many times the chunk slots
    per request of its bound's split, and the kernel splits each request by the policy's length
    for the requests' own total (TOTAL_SPLIT): the long requests of a mixed batch take more
    chunks. 0: the bound's split. H200 32/8 d128, session 42, `bench decode --backends fa2-fn`,
    TB/s 0 -> 1.5 (2.0): bf16 48x4096:var 2.63 -> 3.29 (3.29), 16x8192:var 2.32 -> 3.60 (3.56),
    64x4096:var 3.19 -> 3.47 (3.47); equal lengths lose 1-3.5 % (2x16384 2.73 -> 2.64, 48x8192
    4.22 -> 4.09: the split variant merges in the kernel, without the register cap). Off for fp8
    KV: 48x4096 3.21 -> 2.80, 16x8192:var 1.93 -> 1.82, 48x4096:var 1.86 -> 2.33.
    shared_kv_rows: where V's page and slot strides are K's (a 5-D cache, or a (k, v) pair laid out alike), V's
    token rows are read at K's row offsets (decode_kernel.py's SHARED_KV_ROWS). On for fp8 KV (H200 32/8, session
    47, TB/s off -> on: d64 64x4096 2.86 -> 3.00, d256 64x4096 3.57 -> 3.73, 256x4096 3.86 -> 3.96, d128 within 1
    %); off for 16-bit (d64 256x4096 4.19 -> 4.13).
    gluon_fp8_stages: stages of decode_gluon.py's fp8 kernel where a plan takes it (-1: most that fit; 0: never).
    gluon_fp8_split_tokens: its split (`decode_gluon._split_layout`): shortest chunk in tokens; 0: none (not measured).
    rope_block_n, rope_max_registers, rope_split_block_n, rope_split_max_registers: RoPE plans' block and
    its register cap, and their split block and its cap (a block 0: the config's; a cap 0: none;
    `decode_variant.rope_config`); plans of fewer programs than ctas_per_sm x SMs run the split block, as
    plain ones do. The block's cap keeps its programs per SM whether the kernel writes lse or not (sm90
    64 x 2: 145 registers, 3 per SM, without lse; 128, 4, with it). H100 bf16 32/8 d128 (perf-notes,
    sessions 60-61, TB/s at 256x1024 / 128x2048): past one wave, without lse 64 x 2 at 128 2.88 / 2.89,
    uncapped 2.83 / 2.84, 32 x 2 uncapped 2.88 / 2.89; with lse 64 x 2 2.98 / 2.99, 32 x 2 2.70 / 2.67.
    Split plans: 32 x 2 at 88 (5 per SM) 2.00-2.07 at 1x32768 against 1.74 at 64 x 2 and 1.96 at 80.
    64x4096 (512 programs, nothing split): 32 x 2 at 88 2.84-2.87 against 2.32 at 64 x 2 uncapped.
    pdl: on sm90+, a plan with a merge kernel launches it with programmatic dependent launch: every decode program
    signals at its start (griddepcontrol.launch_dependents), so the merge grid is launched while the decode grid
    runs, and each merge program waits (griddepcontrol.wait) until the decode grid has finished and its stores are
    visible. The second launch's latency leaves the critical path (H200 bf16 32/8 heads, TB/s off -> on: 1x32768
    2.66 -> 2.76, 2x16384 2.68 -> 2.75).
    """

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    max_block_m: int = 64
    ctas_per_sm: int = 4
    split_ctas_per_sm: int = 0
    min_chunk_tokens: int = 256
    max_splits: int = 64
    k_rows: bool = False
    split_block_n: int | None = None
    split_max_registers: int = 0
    fp8_dot_dtype: str = "q"
    heads_fastest: bool = True
    page_prefetch: bool = False
    fp8_v_convert: str = "operand"
    fused_merge_max_chunks: int = 16
    fused_merge_values: int = 4096
    direct_table: bool = False
    max_registers: int = 0
    pdl: bool = True
    shared_kv_rows: bool = False
    swap_ab: bool = False
    wave_tiles: tuple = ()
    wave_slots: int = 0
    wave_split_ctas: int = 0
    wave_split_slots: int = 0
    split_chunk_tokens: int = 48
    lone_wave_split_tokens: int = 0
    pack_items: int = 1
    pack_fill: float = 0.95
    wave_pack_spread: float = 1.5
    wave_pack_below: float = 0.0
    wave_pack_below_tokens: int = 0
    wave_pack_tokens: int = 0
    wave_pack_max_waves: float = 0.0
    wave_pack_load: float = 2.0
    line_waves: int = 1
    wave_pack_line: bool = False
    line_segment_tokens: int = 64
    line_page_prefetch: bool = False
    line_align_fill: float = 0.9
    few_pack_line: bool = False
    graph_few_line: bool = False
    few_line_mixed: int = 0
    table_split_slots: float = 1.5
    gluon_fp8_stages: int = -1
    gluon_fp8_split_tokens: int = 0
    rope_block_n: int = 0
    rope_split_block_n: int = 0
    rope_max_registers: int = 0
    rope_split_max_registers: int = 0

    def __post_init__(self):
        for name, v, low, unset in (("block_n", self.block_n, 16, ""), ("max_block_m", self.max_block_m, 8, ""),
                                    ("split_block_n", 16 if self.split_block_n is None else self.split_block_n, 16,
                                     " or null"), ("rope_block_n", self.rope_block_n or 16, 16, " or 0"),
                                    ("rope_split_block_n", self.rope_split_block_n or 16, 16, " or 0")):
            if not _int(v) or v < low or v & (v - 1):
                raise ValueError(f"fa2 decode config {name} must be a power of two >= {low}{unset}, "
                                 f"got {getattr(self, name)!r}")
        if not _int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"fa2 decode config num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        for name in ("num_stages", "ctas_per_sm", "min_chunk_tokens", "max_splits"):
            v = getattr(self, name)
            if not _int(v) or v < 1:
                raise ValueError(f"fa2 decode config {name} must be an int >= 1, got {v!r}")
        if self.fp8_dot_dtype not in ("q", "fp16"):
            raise ValueError(f"fp8_dot_dtype must be 'q' or 'fp16', got {self.fp8_dot_dtype!r}")
        if self.fp8_v_convert not in ("operand", "staged"):
            raise ValueError(f"fp8_v_convert must be 'operand' or 'staged', got {self.fp8_v_convert!r}")
        for name in ("k_rows", "heads_fastest", "page_prefetch", "direct_table", "pdl", "swap_ab", "wave_pack_line",
                     "line_page_prefetch", "few_pack_line", "graph_few_line", "shared_kv_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fa2 decode config {name} must be true or false, got {getattr(self, name)!r}")
        for name, low in (("fused_merge_max_chunks", 0), ("split_ctas_per_sm", 0), ("wave_slots", 0),
                          ("wave_split_ctas", 0), ("wave_split_slots", 0), ("split_chunk_tokens", 0),
                          ("lone_wave_split_tokens", 0), ("line_waves", 1), ("few_line_mixed", 0),
                          ("gluon_fp8_split_tokens", 0)):
            v = getattr(self, name)
            if not _int(v) or v < low:
                raise ValueError(f"fa2 decode config {name} must be an int >= {low}, got {v!r}")
        if not _int(self.line_segment_tokens) or not 0 <= self.line_segment_tokens <= MAX_LINE_SEGMENT_TOKENS:
            raise ValueError(f"fa2 decode config line_segment_tokens must be an int in [0, {MAX_LINE_SEGMENT_TOKENS}] "
                             f"(the kernel's positions are int32), got {self.line_segment_tokens!r}")
        if not _int(self.pack_items) or not 1 <= self.pack_items <= MAX_PACK_ITEMS:
            raise ValueError(f"fa2 decode config pack_items must be an int in [1, {MAX_PACK_ITEMS}] (the kernel "
                             f"repeats its body that many times), got {self.pack_items!r}")
        for name in ("pack_fill", "line_align_fill"):
            if not _number(getattr(self, name)) or not 0 < getattr(self, name) <= 1:
                raise ValueError(f"fa2 decode config {name} must be a number in (0, 1], got {getattr(self, name)!r}")
        if not _number(self.wave_pack_below) or not 0 <= self.wave_pack_below <= 1:
            raise ValueError("fa2 decode config wave_pack_below must be a number in [0, 1], "
                             f"got {self.wave_pack_below!r}")
        for name in ("wave_pack_below_tokens", "wave_pack_tokens"):
            if not _int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"fa2 decode config {name} must be an int >= 0, got {getattr(self, name)!r}")
        for name, low in (("wave_pack_spread", 0.0), ("wave_pack_max_waves", 0.0), ("wave_pack_load", 0.25),
                          ("table_split_slots", 0.0)):
            v = getattr(self, name)
            if not _number(v) or v < low:
                raise ValueError(f"fa2 decode config {name} must be a number >= {low}, got {v!r}")
        object.__setattr__(self, "wave_tiles", _checked_wave_tiles(self.wave_tiles))
        v = self.fused_merge_values
        if not _int(v) or v < 256 or v & (v - 1):
            raise ValueError(f"fa2 decode config fused_merge_values must be a power of two >= 256, got {v!r}")
        if not _int(self.gluon_fp8_stages) or self.gluon_fp8_stages not in (-1, 0, 2, 3, 4, 5, 6, 7, 8):
            raise ValueError(f"fa2 decode config gluon_fp8_stages must be -1, 0 or 2-8, got {self.gluon_fp8_stages!r}")
        for name in ("max_registers", "split_max_registers", "rope_max_registers", "rope_split_max_registers"):
            v = getattr(self, name)
            if not _int(v) or not (v == 0 or 24 <= v <= 255):
                raise ValueError(f"fa2 decode config {name} must be 0 (ptxas chooses) or in [24, 255], got {v!r}")


def _int(v) -> bool:
    """Whether ``v`` is an int and not a bool (JSON and YAML give true/false as bools)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    """Whether ``v`` is an int or a float and not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checked_wave_tiles(tiles) -> tuple:
    """``tiles`` as a tuple of (block_n, num_stages, programs per SM, rate) tuples (JSON gives
    lists), each value checked."""
    try:
        checked = tuple(tuple(t) for t in tiles)
    except TypeError:
        checked = None
    ok = checked is not None and all(
        len(t) == 4 and all(_int(x) and x >= 1 for x in t[:3])
        and t[0] >= 16 and not t[0] & (t[0] - 1)
        and _number(t[3]) and t[3] > 0 for t in checked)
    if not ok:
        raise ValueError("fa2 decode config wave_tiles must be a list of [block_n, num_stages, programs per SM, "
                         f"rate] (ints >= 1, block_n a power of two >= 16, rate > 0), got {tiles!r}")
    return checked


# Opt-in shared memory per block under which the sm90 fp8 tiles (50-52 KB at d128 and d256, offline
# compiles) fit few programs per SM: sm80 (163 KB) 3, sm86/89/120 (99 KB) 1. Such GPUs take
# `_small_shared_fp8_config` (`common.shared_per_block`: a described GPU by its compute capability).
FP8_SMALL_SHARED = 200 * 1024


def _small_shared_fp8_config(problem: Problem, shared: int) -> DecodeConfig:
    """fp8 KV tiles where the sm90 ones fit few programs per SM (`FP8_SMALL_SHARED`): up to d128
    the H200's best one-warp tile, 32 x 3 (its few-programs split's; offline compiles, bytes: d64
    13312, d128 26624; sm80 11 / 6 programs per SM, sm86/89 7 / 3), and two warps of 16 x 3 at
    d256 (28672; sm80 5, sm86/89 3). The split aims at the programs that fit, at most 8 per SM.
    Not measured on such a GPU (the H200's 32 x 2 tile, 1.5 more per SM there, read 0.7 of 32 x 3
    split at 12 per SM, session 22)."""
    d = problem.head_dim_qk
    if d <= 128:
        tile_bytes, tile = 208 * d, dict(block_n=32, num_warps=1, num_stages=3)
    else:
        tile_bytes, tile = 112 * d, dict(block_n=16, num_warps=2, num_stages=3)
    fit = (shared + 1024) // (tile_bytes + 1024)  # the driver reserves 1 KB per block
    return DecodeConfig(**tile, ctas_per_sm=max(1, min(8, fit)), k_rows=True, fp8_dot_dtype="fp16",
                        page_prefetch=True, fp8_v_convert="staged", swap_ab=True, table_split_slots=0.0,
                        direct_table=problem.num_qo_heads != problem.num_kv_heads and d >= 128)


def default_config(problem: Problem, shared: int = 0) -> DecodeConfig:
    """Defaults by head dim and KV dtype (tuned on an H200, see docs/perf-notes.md); ``shared``:
    the GPU's opt-in shared memory per block (`shared_per_block`; 0: an sm90-class GPU)."""
    d = problem.head_dim_qk
    # direct_table where the H200 sweeps (TB/s work array / direct) found parity or better: 16-bit GQA (session 6: group
    # 4 and 16, page 16 and 1, d64 and d128), fp8 GQA d128 (session 19: -1.5 % to +2 %, see DecodeConfig.direct_table)
    # and d256 (session 21, groups 2 and 4: -1 % to +3 %); MHA and 16-bit d256 GQA read less with it
    gqa = problem.num_qo_heads != problem.num_kv_heads
    # GQA d64 and d256 (page > 1) pack few programs, up to 4 to a program, under a work fill of
    # 0.65 (DecodeConfig.pack_items): measured on mixed lengths only (H200 32/8, session 23, TB/s
    # default -> packed: d256 bf16 36x4096:var 3.41 -> 4.09, 48x4096:var 3.22 -> 4.21, 64x4096:var
    # 3.16 -> 4.30, fp8 36x4096:var 2.60 -> 3.35, 48x4096:var 2.10 -> 3.50, 16x8192:var 2.69 -> 3.29;
    # d64 bf16 2.89 -> 3.20, 2.85 -> 3.47, 2.79 -> 3.68, fp8 2.01 -> 2.36, 1.97 -> 2.36, 2.19 -> 2.25)
    mixed = dict(pack_items=4, pack_fill=0.65) if gqa and d in (64, 256) and problem.page_size > 1 else {}
    # past one wave the kernel packs (DecodeConfig.wave_pack_line): it read within about 2 % of the
    # host's packing; CUDA-graph and block-table plans under one wave take the line too (graph_few_line)
    line = dict(wave_pack_line=True, graph_few_line=True) if mixed else {}
    if problem.kv_dtype in FP8_DTYPES and 0 < shared < FP8_SMALL_SHARED:
        return _small_shared_fp8_config(problem, shared)
    if problem.kv_dtype in FP8_DTYPES:
        if d <= 128:
            # the wave tiles' programs per SM and rates: the d128 sm90 compile and H200 sweeps (32 x 3 4.0-4.1 TB/s at
            # whole waves, 32 x 2 3.85-3.95, 64 x 3 3.65-3.75); the wave split where no tile fits, up to 64 per SM
            # (sessions 16-17, TB/s tile -> split on 32 x 3: 210x4096 3.39 -> 3.85, 200x8192 3.31 -> 3.88, 270x4096 3.34
            # -> 3.82, 300x4096 3.65 -> 3.95, 420x4096 3.72 -> 3.96), a partly filled single wave too (session 18)
            tiles = ((32, 3, 8, 1.0), (32, 2, 12, 0.96), (64, 3, 4, 0.92)) if d == 128 else ()
            # few programs: split into a wave of the 32 x 3 tile (8 per SM; DecodeConfig.split_ctas_per_sm, d128, where
            # it was measured; MHA 32/32, session 21, TB/s: 1x32768 3.11 -> 3.18, 4x8192 3.12 -> 3.21, 8x4096 3.12 ->
            # 3.19, 16x2048 3.20 -> 3.19, 16x8192 3.71 -> 3.83), packed up to 4 to a program where its chunks keep that
            # wave poorly busy (DecodeConfig.pack_items), on the kernel's line (DecodeConfig.few_pack_line; under CUDA
            # graphs graph_few_line). d64 (page > 1) packs as GQA d64 and d256 do (`mixed`, `line`), MHA too (H200
            # 32/32, session 46, TB/s default -> packed, eager: 32x4096:var 2.27 -> 2.99, 16x8192:var 2.14 -> 3.02,
            # 32x4096 2.72 -> 3.17; graphs under one wave 16x8192:var 2.15 -> 3.06; perf-notes)
            d64 = (dict(pack_items=4, pack_fill=0.65, wave_pack_line=True, graph_few_line=True)
                   if d == 64 and problem.page_size > 1 else {})
            few = (dict(split_block_n=32, split_ctas_per_sm=8, pack_items=4, wave_pack_line=True, few_pack_line=True,
                        graph_few_line=True) if d == 128 else d64)
            # past one wave, equal lengths pack where the tiles leave a last wave partly filled
            # (wave_pack_below), d64 from 512 tokens a request, MHA from 1024 (wave_pack_tokens)
            return DecodeConfig(block_n=64, num_warps=1, k_rows=True, fp8_dot_dtype="fp16", num_stages=3,
                                page_prefetch=True, fp8_v_convert="staged", swap_ab=True, wave_tiles=tiles,
                                direct_table=gqa and d == 128, **few,
                                wave_split_ctas=64 if tiles else 0, split_chunk_tokens=72,
                                lone_wave_split_tokens=3072, table_split_slots=0.0, shared_kv_rows=True,
                                wave_pack_below=0.96 if tiles else 0.0,
                                wave_pack_tokens=(0 if d != 64 or not few else 512 if gqa else 1024))
        # d256: the d128 tile's techniques on 2 warps of 32 x 3 (160-196 registers, 4 per SM; H200 32/8,
        # session 21, TB/s 4 warps of 64 x 3 -> this: 16x8192 2.30 -> 3.33, 256x4096 2.76 -> 3.84); equal
        # lengths pack where a last wave of its sm90 compile's 4 programs per SM is partly filled
        return DecodeConfig(block_n=32, num_warps=2, num_stages=3, k_rows=True, fp8_dot_dtype="fp16",
                            page_prefetch=True, fp8_v_convert="staged", swap_ab=True, direct_table=gqa, **mixed,
                            **line, table_split_slots=0.0, wave_slots=4, wave_pack_below=0.96, shared_kv_rows=True)
    # wave_slots: the sm90 programs per SM of the unsplit kernel where the wave split was measured
    # (session 15: bf16 32/32 d128, 32/8 d128 page 1, 32/8 d256 page 16; 32/8 d128 page 16 has wave tiles); 24 per SM
    # read 1-5 % more than 48 on the MHA, page-1 and d256 rows, less on the d128 GQA rows
    if problem.page_size == 1 and d <= 128:
        return DecodeConfig(block_n=128, direct_table=gqa, wave_slots=3 if gqa and d == 128 else 0,
                            wave_split_ctas=24)
    # 16-bit d128 (page > 1) packs few programs, up to 4 to a program, under a work fill of 0.65
    # (DecodeConfig.pack_items); past one wave in the kernel (wave_pack_line), GQA with the page
    # numbers loaded a step ahead there (DecodeConfig.line_page_prefetch; MHA read less with it);
    # under CUDA graphs on the line below one wave too (graph_few_line)
    pack = dict(pack_items=4, pack_fill=0.65, wave_pack_line=True, graph_few_line=True) if d == 128 else {}
    if not gqa and d <= 128:
        return DecodeConfig(block_n=64, num_stages=3, wave_slots=4 if d == 128 else 0, wave_split_ctas=24,
                            split_chunk_tokens=24, **pack)
    if d <= 64:
        # 128 x 3 (H200 32/8, session 21, TB/s 64 x 2 -> 128 x 3: 1x32768 1.99 -> 2.11, 16x8192 3.12 ->
        # 3.27, 64x4096 3.43 -> 3.82, 256x1024 3.78 -> 3.74, 256x4096 4.15 -> 4.16)
        # equal lengths from 1024 tokens pack past a wave partly filled (DecodeConfig.wave_pack_below_tokens)
        waves = dict(wave_slots=5, wave_pack_below=0.88, wave_pack_below_tokens=1024) if line else {}
        return DecodeConfig(block_n=128, num_stages=3, direct_table=True, wave_pack_max_waves=4.0, **mixed, **line,
                            **waves)
    if d <= 128:
        # the fused merge's 8K tile only where it was measured: group 4 (offline sm90, the direct
        # split with it: groups 2 and 16 152-156 registers, 3 programs per SM; group 4 122, 4)
        group = problem.num_qo_heads // problem.num_kv_heads
        # the wave tiles (any group: the sm90 compile of groups 2-16 gives the same programs per
        # SM): 32 x 2 under the register cap, 64 x 2 and 64 x 3 uncapped; rates from the H200
        # sweep at whole waves (4.53 / 4.48-4.55 / 4.47-4.50 TB/s, session 16)
        # RoPE: 64 x 2 at 128 registers past one wave, a 32 x 2 split block at 88 (DecodeConfig.rope_block_n; H100:
        # perf-notes, sessions 59-61)
        return DecodeConfig(block_n=32, split_block_n=64, max_registers=64, direct_table=True,
                            fused_merge_values=8192 if group == 4 else 4096,
                            wave_tiles=((32, 2, 8, 1.0), (64, 2, 5, 1.0), (64, 3, 4, 0.99)), wave_split_ctas=48,
                            wave_split_slots=4 if group == 4 else 0, line_page_prefetch=True, few_line_mixed=16,
                            rope_block_n=64, rope_max_registers=128, rope_split_block_n=32,
                            rope_split_max_registers=88, **pack)
    return DecodeConfig(block_n=32, wave_slots=4 if gqa and problem.page_size > 1 else 0, wave_split_ctas=24,
                        split_chunk_tokens=16, **mixed, **line)


def apply_overrides(cfg: DecodeConfig, source: dict) -> DecodeConfig:
    unknown = set(source) - {f.name for f in dataclasses.fields(DecodeConfig)}
    if unknown:
        raise ValueError(f"unknown fa2 decode config keys {sorted(unknown)}; "
                         f"known: {[f.name for f in dataclasses.fields(DecodeConfig)]}")
    if "block_n" in source:  # the split block and the register cap were chosen for the default block_n
        source = {"split_block_n": None, "max_registers": 0, **source}
    if "rope_block_n" in source:  # likewise the RoPE blocks' caps
        source = {"rope_max_registers": 0, **source}
    if "rope_split_block_n" in source:
        source = {"rope_split_max_registers": 0, **source}
    if {"block_n", "num_stages", "num_warps", "max_registers", "split_block_n", "fused_merge_values"} & set(source):
        source = {"wave_tiles": (), "wave_slots": 0, "wave_split_slots": 0, **source}  # other kernels' programs per SM
    return dataclasses.replace(cfg, **source)


@functools.lru_cache(maxsize=256)
def _base_config(head_dim: int, kv_dtype: torch.dtype, page_size: int, group: int, shared: int,
                 env: str | None) -> DecodeConfig:
    cfg = default_config(Problem("decode", torch.float16, kv_dtype, torch.float16, group, 1, head_dim, head_dim,
                                 page_size=page_size), shared)
    return apply_env(cfg, env, apply_overrides) if env else cfg


def resolve_config(problem: Problem, overrides: dict | None = None, shared: int = 0) -> DecodeConfig:
    """Defaults (for a GPU of ``shared`` bytes of shared memory per block, see `default_config`),
    then FLASHDISPATCH_FA2_DECODE_CONFIG (JSON), then ``overrides``."""
    cfg = _base_config(problem.head_dim_qk, problem.kv_dtype, problem.page_size,
                       problem.num_qo_heads // problem.num_kv_heads, shared, env_get(CONFIG_ENV))
    return apply_overrides(cfg, overrides) if overrides else cfg
