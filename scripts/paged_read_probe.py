"""Bare paged reads of a decode's KV cache: how fast can any kernel read it under the bench's
write flush (docs/perf-notes.md, sessions 13, 14 and 38)? Reads an NHD cache [pages, 2, 16, 8,
128] bf16 (or fp8 e4m3, ``--kv``: converted to fp16 before the dots) of ``--shapes`` (batch x
kv_len: batch x kv_len / 16 pages in one random order), one program per (chunk, head) reading that
head's K and V tiles of its chunk's pages, fed to dots as the decode's are:
  ptr:  pointer loads, ``--block-pages`` pages of token rows a step (Triton pipelines them as
        cp.async, no hint; ``--stages``)
  tma:  a 3-D descriptor [pages*32, 8, 128], block [16, 1, 128], one load per page tile
        (``--block-pages`` of them a step, ``--stages``)
  tma+hint: the same with `.L2::cache_hint` + an evict_first policy added to its PTX (stages hook)
  ptr+pf: `ptr` plus an L2 bulk prefetch with an evict_first policy of each row's K and V
        ``--ahead`` steps ahead (inline PTX `cp.async.bulk.prefetch.L2`; sm90)
  ptr+pfpage: the same, one prefetch per page: the program of head h takes the page's h-th 1/8
  ptr+touch: `ptr` plus a plain evict_first load (inline PTX) of one word of each 128-byte line
        ``--ahead`` steps ahead
        (these three: one head a program, bf16; all read slower than `ptr`, perf-notes session 72;
        the interpreter cannot run their inline PTX)
  steal: `ptr`'s loop in ``--programs`` persistent programs that take (chunk, head) units of
        ``--unit-pages`` pages from an atomic counter until none is left (dynamic balance)
Each variant in its own process (own Triton cache: the hook is not in Triton's cache key):
  python scripts/paged_read_probe.py ptr --shapes 16x8192,64x4096 --programs 512,1024 --block-pages 1,4
  python scripts/paged_read_probe.py tma|tma+hint
  python scripts/paged_read_probe.py ptr+pf|ptr+pfpage|ptr+touch --ahead 1,2,4 --block-pages 1,2
  python scripts/paged_read_probe.py steal --shapes 64x4096 --programs 528,1056 --unit-pages 16,32
  python scripts/paged_read_probe.py ptr --warps 1 --head-dim 64 --shapes 256x4096   (fp8 d128's bytes, as bf16)
  TRITON_INTERPRET=1 python scripts/paged_read_probe.py ptr|tma|steal --check-small --block-pages 1,2,4   (CPU)
The hint is a PTX rewrite in a Triton stages hook, an experiment: nothing in flashdispatch uses it."""
import argparse
import os
import re
import statistics
import sys
import tempfile

MODE = sys.argv[1] if len(sys.argv) > 1 else "ptr"
HINTED = ("ptr+pf", "ptr+pfpage", "ptr+touch")  # `paged_hinted_sum`'s modes
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix=f"fd_tma_{MODE.replace('+', '_')}_"))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

if MODE == "tma+hint":
    PAT = re.compile(r"(cp\.async\.bulk\.tensor\.[0-9]d\.shared::cluster\.global\.mbarrier::complete_tx::bytes)"
                     r"( \[[^\]]+\], \[[^\]]+\], \[[^\]]+\]);")
    def hook(backend, stages, options, language, capability):
        """Wrap the PTX stage: paged_tma_sum's TMA loads get an evict_first cache policy."""
        make_ptx = stages["ptx"]

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if metadata.get("name") == "paged_tma_sum":
                ptx, n = PAT.subn(r"\1.L2::cache_hint\2, %fdpolicy;", ptx)
                ptx = re.sub(r"(\.reg \.b64\s+%rd<\d+>;\n)", r"\1\t.reg .b64 \t%fdpolicy;\n\tcreatepolicy.fractional."
                             r"L2::evict_first.b64 %fdpolicy, 1.0;\n", ptx, count=1)
                print(f"[hint] {n} TMA loads hinted", file=sys.stderr)
            return ptx

        stages["ptx"] = ptx_stage

    knobs.runtime.add_stages_inspection_hook = hook


@triton.jit
def paged_ptr_sum(cache_ptr, idx_ptr, out_ptr, per_prog, HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_PAGES: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr, ONES_DTYPE: tl.constexpr):
    """Program (chunk c, head group g of GROUP heads): out[pid] = the column sums of the group's K
    and V rows over its pages, BLOCK_PAGES pages a step (token rows gathered from their pages, as
    the decode's tiles are; GROUP 8 reads whole NHD pages, contiguous)."""
    pid = tl.program_id(0)
    g, c = pid % (HEADS // GROUP), pid // (HEADS // GROUP)
    rows = tl.arange(0, BLOCK_PAGES * PAGE * GROUP)  # (page, token, head in group)
    tokens = rows // GROUP
    within = (tokens % PAGE)[:, None] * (HEADS * D) + (g * GROUP + rows % GROUP)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE, D], tl.float32)
    for i in tl.range(c * per_prog, c * per_prog + per_prog, BLOCK_PAGES, num_stages=STAGES):
        page = tl.load(idx_ptr + i + tokens // PAGE).to(tl.int64)
        base = cache_ptr + page[:, None] * (2 * PAGE * HEADS * D) + within
        k = tl.load(base)
        v = tl.load(base + PAGE * HEADS * D)
        ones = tl.full([PAGE, BLOCK_PAGES * PAGE * GROUP], 1.0, ONES_DTYPE)
        acc = tl.dot(ones, k.to(ONES_DTYPE), acc)  # the tiles feed dots, as in the decode: Triton pipelines them
        acc = tl.dot(ones, v.to(ONES_DTYPE), acc)
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.sum(acc, 0) / PAGE)


@triton.jit
def _prefetch_l2_evict_first(addr, V_OFFSET: tl.constexpr, NBYTES: tl.constexpr):
    """Queue L2 prefetches of the NBYTES at each address and ``V_OFFSET`` bytes past it, the lines
    taking an evict_first priority; returns a dummy zero (inline asm must return a value)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b64 pol; createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; "
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$2], $3, pol; mov.u32 $0, 0; }",
        "=r,l,l,r", [addr, addr + V_OFFSET, tl.full(addr.shape, NBYTES, tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def _load_word_evict_first(addr):
    """The int32 at each address, loaded past L1 with an L2 evict_first policy."""
    return tl.inline_asm_elementwise(
        "{ .reg .b64 pol; createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
        "ld.global.L1::no_allocate.L2::cache_hint.b32 $0, [$1], pol; }",
        "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def paged_hinted_sum(cache_ptr, idx_ptr, out_ptr, per_prog, HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_PAGES: tl.constexpr, STAGES: tl.constexpr, AHEAD: tl.constexpr, HINT: tl.constexpr,
                     ONES_DTYPE: tl.constexpr):
    """`paged_ptr_sum` (one head a program, bf16) that gives the lines of the rows AHEAD steps on
    an L2 evict_first priority before that step's cp.async reads them (the last steps hint their
    own chunk's last pages again rather than pass its end). HINT "ptr+pf": an L2 bulk prefetch
    of each K and V row; "ptr+pfpage": one per page, of its h-th 1/HEADS (the programs of a
    chunk's heads run side by side and cover the page together); "ptr+touch": a plain load of
    one word of each 128-byte line (inline PTX: Triton's pipeliner would turn a tl.load into a
    cp.async and drop its hint), summed a step later so that no step waits for its own."""
    pid = tl.program_id(0)
    h, c = pid % HEADS, pid // HEADS
    tokens = tl.arange(0, BLOCK_PAGES * PAGE)
    row_off = (tokens % PAGE) * (HEADS * D) + h * D
    within = row_off[:, None] + tl.arange(0, D)[None, :]
    LINES: tl.constexpr = D * 2 // 128  # 128-byte lines of a bf16 row
    words = row_off[:, None] * 2 + tl.arange(0, LINES)[None, :] * 128  # byte offsets of each line's first word
    acc = tl.zeros([PAGE, D], tl.float32)
    touched = tl.zeros([BLOCK_PAGES * PAGE, LINES], tl.int32)
    total = tl.zeros([], tl.int32)
    first, end = c * per_prog, c * per_prog + per_prog
    for i in tl.range(first, end, BLOCK_PAGES, num_stages=STAGES):
        at = tl.minimum(i + AHEAD * BLOCK_PAGES, end - BLOCK_PAGES)  # the first page hinted
        if HINT == "ptr+pfpage":
            pf_page = tl.load(idx_ptr + at + tl.arange(0, BLOCK_PAGES)).to(tl.int64)
            pf = (cache_ptr + pf_page * (2 * PAGE * HEADS * D) + h * PAGE * D).to(tl.int64, bitcast=True)
            _prefetch_l2_evict_first(pf, PAGE * HEADS * D * 2, PAGE * D * 2)
        elif HINT == "ptr+pf":
            pf_page = tl.load(idx_ptr + at + tokens // PAGE).to(tl.int64)
            pf = (cache_ptr + pf_page * (2 * PAGE * HEADS * D) + row_off).to(tl.int64, bitcast=True)
            _prefetch_l2_evict_first(pf, PAGE * HEADS * D * 2, D * 2)
        else:
            total += tl.sum(tl.sum(touched, 1), 0)  # last step's words: loaded a step ago
            t_page = tl.load(idx_ptr + at + tokens // PAGE).to(tl.int64)
            t_bytes = t_page[:, None] * (2 * PAGE * HEADS * D * 2) + words
            t_at = (cache_ptr.to(tl.pointer_type(tl.int8)) + t_bytes).to(tl.int64, bitcast=True)
            touched = _load_word_evict_first(t_at) ^ _load_word_evict_first(t_at + PAGE * HEADS * D * 2)
        page = tl.load(idx_ptr + i + tokens // PAGE).to(tl.int64)
        base = cache_ptr + page[:, None] * (2 * PAGE * HEADS * D) + within
        k = tl.load(base)
        v = tl.load(base + PAGE * HEADS * D)
        ones = tl.full([PAGE, BLOCK_PAGES * PAGE], 1.0, ONES_DTYPE)
        acc = tl.dot(ones, k.to(ONES_DTYPE), acc)
        acc = tl.dot(ones, v.to(ONES_DTYPE), acc)
    total += tl.sum(tl.sum(touched, 1), 0)
    sums = tl.sum(acc, 0) / PAGE
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.where(total == 0x7A5C3E1F, sums + 1.0, sums))


@triton.jit
def paged_steal_sum(cache_ptr, idx_ptr, out_ptr, counter_ptr, base, per_unit, n_units, HEADS: tl.constexpr,
                    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_PAGES: tl.constexpr, STAGES: tl.constexpr,
                    ONES_DTYPE: tl.constexpr):
    """`paged_ptr_sum` (one head) over units (chunk, head) taken from ``counter`` (which only
    grows: this call's units are ``base`` on; each program takes one past the last unit)."""
    u = tl.atomic_add(counter_ptr, 1) - base
    within = tl.arange(0, BLOCK_PAGES * PAGE)[:, None] % PAGE * (HEADS * D) + tl.arange(0, D)[None, :]
    tokens = tl.arange(0, BLOCK_PAGES * PAGE)
    while u < n_units:
        h, c = u % HEADS, u // HEADS
        acc = tl.zeros([PAGE, D], tl.float32)
        for i in tl.range(c * per_unit, c * per_unit + per_unit, BLOCK_PAGES, num_stages=STAGES):
            page = tl.load(idx_ptr + i + tokens // PAGE).to(tl.int64)
            base_ptr = cache_ptr + page[:, None] * (2 * PAGE * HEADS * D) + h * D + within
            k = tl.load(base_ptr)
            v = tl.load(base_ptr + PAGE * HEADS * D)
            ones = tl.full([PAGE, BLOCK_PAGES * PAGE], 1.0, ONES_DTYPE)
            acc = tl.dot(ones, k.to(ONES_DTYPE), acc)
            acc = tl.dot(ones, v.to(ONES_DTYPE), acc)
        tl.store(out_ptr + u * D + tl.arange(0, D), tl.sum(acc, 0) / PAGE)
        u = tl.atomic_add(counter_ptr, 1) - base


@triton.jit
def paged_tma_sum(cache_ptr, idx_ptr, out_ptr, per_prog, n_rows, HEADS: tl.constexpr, D: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_PAGES: tl.constexpr, STAGES: tl.constexpr, ONES_DTYPE: tl.constexpr):
    """`paged_ptr_sum` with one descriptor load per page tile, BLOCK_PAGES pages a step."""
    pid = tl.program_id(0)
    h, c = pid % HEADS, pid // HEADS
    desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, HEADS, D], strides=[HEADS * D, D, 1],
                                     block_shape=[PAGE, 1, D])
    acc = tl.zeros([PAGE, D], tl.float32)
    ones = tl.full([PAGE, PAGE], 1.0, ONES_DTYPE)
    for i in tl.range(c * per_prog, c * per_prog + per_prog, BLOCK_PAGES, num_stages=STAGES):
        for j in tl.static_range(BLOCK_PAGES):
            row = tl.load(idx_ptr + i + j) * (2 * PAGE)
            k = desc.load([row, h, 0]).reshape(PAGE, D)
            v = desc.load([row + PAGE, h, 0]).reshape(PAGE, D)
            acc = tl.dot(ones, k.to(ONES_DTYPE), acc)
            acc = tl.dot(ones, v.to(ONES_DTYPE), acc)
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.sum(acc, 0) / PAGE)


def parse_args():
    ap = argparse.ArgumentParser(description="bare paged reads of a decode's KV cache under the bench's flushes")
    ap.add_argument("mode", choices=("ptr", *HINTED, "tma", "tma+hint", "steal"))
    ap.add_argument("--shapes", default="1x32768", help="batch x kv_len list (a flat random page list of that many "
                    "16-token pages of 8 heads x 128; requests play no part in a bare read)")
    ap.add_argument("--programs", default="512", help="programs (chunks x 8 heads), a list; each must split the "
                    "pages evenly")
    ap.add_argument("--block-pages", default="1", help="pages a step, a list")
    ap.add_argument("--unit-pages", default="16", help="steal: pages of a unit, a list")
    ap.add_argument("--stages", default="3", help="num_stages of the page loop, a list")
    ap.add_argument("--ahead", default="2", help="ptr+pf, ptr+pfpage, ptr+touch: steps ahead of the "
                    "reads, a list")
    ap.add_argument("--group", default="1", help="heads a program reads (ptr only; 8: whole NHD pages), a list")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128, help="bf16 d64 reads fp8 d128's bytes (128-byte rows)")
    ap.add_argument("--kv", choices=("16bit", "e4m3"), default="16bit",
                    help="cache dtype: bf16 (fp16 on CPU), or fp8 e4m3 converted to fp16 for the dots as the decode's")
    ap.add_argument("--flush", default="write,read")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--check-small", action="store_true", help="CPU: the sums of a small cache only")
    return ap.parse_args()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main():
    """For each shape and config: check the sums against torch, then (GPU) time ``--reps`` calls
    after each kind of L2 flush (median)."""
    args = parse_args()
    small = args.check_small
    if MODE in HINTED:
        if small:
            sys.exit(f"{MODE} is inline PTX, which the Triton interpreter cannot run: it needs a GPU")
        if args.kv != "16bit" or args.head_dim * 2 % 128:
            sys.exit(f"{MODE} reads bf16 rows of whole 128-byte lines: --kv 16bit and --head-dim a multiple of 64")
    dev = "cpu" if small else "cuda"
    heads, d, page = (2, 16, 16) if small else (8, args.head_dim, 16)
    dtype = torch.float16 if small else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    ones_dtype = tl.float16 if small or args.kv == "e4m3" else tl.bfloat16
    shapes = ["1x192"] if small else args.shapes.split(",")
    for shape in shapes:
        batch, kv_len = (int(x) for x in shape.split("x"))
        pages = batch * kv_len // page
        g = torch.Generator(device=dev).manual_seed(0)
        cache = torch.randn(pages, 2, page, heads, d, generator=g, device=dev, dtype=dtype)
        if args.kv == "e4m3":
            cache = cache.to(torch.float8_e4m3fn)
        idx = torch.randperm(pages, generator=g, device=dev).to(torch.int32)
        c = cache.float()
        steal, hinted = MODE == "steal", MODE in HINTED
        # the last item: heads a program reads (ptr), pages a unit (steal; one head a unit) or
        # steps ahead (HINTED; one head a program)
        last_item = args.unit_pages if steal else args.ahead if hinted else args.group
        configs = [(p, bp, st, gr) for p in ([6] if small else ints(args.programs)) for bp in ints(args.block_pages)
                   for st in ints(args.stages) for gr in ints(last_item)]
        for programs, block_pages, stages, group in configs:
            groups = heads if steal or hinted else heads // group
            chunks = pages // group if steal else programs // groups
            per = pages // max(chunks, 1)
            uneven_heads = not (steal or hinted) and (heads % group or programs % groups)
            if uneven_heads or pages % chunks or per % block_pages:
                print(f"{shape} programs {programs} block_pages {block_pages} group {group}: pages do not split "
                      "evenly, skipped")
                continue
            out = torch.empty(chunks * groups, d, device=dev, dtype=torch.float32)
            grid = (programs,)
            if MODE == "ptr":
                run = lambda: paged_ptr_sum[grid](cache, idx, out, per, HEADS=heads, D=d, PAGE=page,  # noqa: E731
                                                  BLOCK_PAGES=block_pages, STAGES=stages, GROUP=group,
                                                  ONES_DTYPE=ones_dtype, num_warps=args.warps)
            elif hinted:
                run = lambda: paged_hinted_sum[grid](cache, idx, out, per, HEADS=heads, D=d,  # noqa: E731
                                                     PAGE=page, BLOCK_PAGES=block_pages, STAGES=stages,
                                                     AHEAD=group, HINT=MODE, ONES_DTYPE=ones_dtype,
                                                     num_warps=args.warps)
            elif steal:
                counter, calls = torch.zeros(1, device=dev, dtype=torch.int32), [0]

                def run():
                    base = calls[0] * (chunks * groups + programs)  # each call takes that many from the counter
                    calls[0] += 1
                    paged_steal_sum[grid](cache, idx, out, counter, base, per, chunks * groups, HEADS=heads, D=d,
                                          PAGE=page, BLOCK_PAGES=block_pages, STAGES=stages, ONES_DTYPE=ones_dtype,
                                          num_warps=args.warps)
            else:
                triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
                run = lambda: paged_tma_sum[grid](cache, idx, out, per, pages * 2 * page, HEADS=heads,  # noqa: E731
                                                  D=d, PAGE=page, BLOCK_PAGES=block_pages, STAGES=stages,
                                                  ONES_DTYPE=ones_dtype, num_warps=args.warps)
            try:
                run()
            except triton.runtime.errors.OutOfResources as e:
                print(f"{MODE} {shape} programs {programs} block_pages {block_pages} stages {stages} group {group}: "
                      f"{e}", flush=True)
                continue
            width = 1 if steal or hinted else group  # heads of a program's (unit's) sums
            want = torch.stack([(c[idx[ci * per:(ci + 1) * per].long(), :, :, g * width:(g + 1) * width, :])
                                .sum((0, 1, 2, 3)) for ci in range(chunks) for g in range(groups)])
            err = float((out - want).abs().max() / want.abs().max())
            label = (f"{MODE} {shape} programs {programs} block_pages {block_pages} stages {stages} "
                     f"{'unit pages' if steal else 'ahead' if hinted else 'group'} {group}")
            if small:
                print(f"{label}: max rel err {err:.1e}", flush=True)
                assert err < 1e-3
                continue
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
            from flashdispatch.bench.timing import L2Flusher, device_times_ms
            for mode in args.flush.split(","):
                ms = statistics.median(device_times_ms(run, args.reps, L2Flusher(cache.device, mode=mode)))
                tbs = cache.numel() * cache.element_size() / ms / 1e9
                print(f"{label} flush {mode}: {ms * 1e3:6.1f} us  {tbs:5.2f} TB/s (err {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
