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
  steal: `ptr`'s loop in ``--programs`` persistent programs that take (chunk, head) units of
        ``--unit-pages`` pages from an atomic counter until none is left (dynamic balance)
Each variant in its own process (own Triton cache: the hook is not in Triton's cache key):
  python scripts/paged_read_probe.py ptr --shapes 16x8192,64x4096 --programs 512,1024 --block-pages 1,4
  python scripts/paged_read_probe.py tma|tma+hint
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
    ap.add_argument("mode", choices=("ptr", "tma", "tma+hint", "steal"))
    ap.add_argument("--shapes", default="1x32768", help="batch x kv_len list (a flat random page list of that many "
                    "16-token pages of 8 heads x 128; requests play no part in a bare read)")
    ap.add_argument("--programs", default="512", help="programs (chunks x 8 heads), a list; each must split the "
                    "pages evenly")
    ap.add_argument("--block-pages", default="1", help="pages a step, a list")
    ap.add_argument("--unit-pages", default="16", help="steal: pages of a unit, a list")
    ap.add_argument("--stages", default="3", help="num_stages of the page loop, a list")
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
        steal = MODE == "steal"
        # the last item: heads a program reads (ptr), or pages a unit (steal; one head a unit)
        configs = [(p, bp, st, gr) for p in ([6] if small else ints(args.programs)) for bp in ints(args.block_pages)
                   for st in ints(args.stages) for gr in ints(args.unit_pages if steal else args.group)]
        for programs, block_pages, stages, group in configs:
            groups = heads if steal else heads // group
            chunks = pages // group if steal else programs // groups
            per = pages // max(chunks, 1)
            if (not steal and (heads % group or programs % groups)) or pages % chunks or per % block_pages:
                print(f"{shape} programs {programs} block_pages {block_pages} group {group}: pages do not split "
                      "evenly, skipped")
                continue
            out = torch.empty(chunks * groups, d, device=dev, dtype=torch.float32)
            grid = (programs,)
            if MODE == "ptr":
                run = lambda: paged_ptr_sum[grid](cache, idx, out, per, HEADS=heads, D=d, PAGE=page,  # noqa: E731
                                                  BLOCK_PAGES=block_pages, STAGES=stages, GROUP=group,
                                                  ONES_DTYPE=ones_dtype, num_warps=args.warps)
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
            width = 1 if steal else group  # heads of a program's (unit's) sums
            want = torch.stack([(c[idx[ci * per:(ci + 1) * per].long(), :, :, g * width:(g + 1) * width, :])
                                .sum((0, 1, 2, 3)) for ci in range(chunks) for g in range(groups)])
            err = float((out - want).abs().max() / want.abs().max())
            label = (f"{MODE} {shape} programs {programs} block_pages {block_pages} stages {stages} "
                     f"{'unit pages' if steal else 'group'} {group}")
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
