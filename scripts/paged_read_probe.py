"""Does a TMA page load with an L2 evict_first hint read a decode's paged KV faster under the
bench's write flush (docs/perf-notes.md, session 13)? Reads a 1x32768-like NHD cache
[2048 pages, 2, 16, 8, 128] bf16 in random page order, 8 heads x 64 chunks = 512 programs, each
one head's K and V page tiles of its 32 pages, fed to dots as the decode's are:
  ptr:  pointer loads of [16, 128] page tiles (Triton pipelines them as cp.async, no hint)
  tma:  a 3-D descriptor [pages*32, 8, 128], block [16, 1, 128], one load per page tile
  tma+hint: the same with `.L2::cache_hint` + an evict_first policy added to its PTX (stages hook)
Each variant in its own process (own Triton cache: the hook is not in Triton's cache key):
  python scripts/paged_read_probe.py ptr|tma|tma+hint
  TRITON_INTERPRET=1 python scripts/paged_read_probe.py ptr|tma --check-small   (CPU: the sums only)
The hint is a PTX rewrite in a Triton stages hook, an experiment: nothing in flashdispatch uses it."""
import os
import re
import statistics
import sys
import tempfile

MODE = sys.argv[1]
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
def paged_ptr_sum(cache_ptr, idx_ptr, out_ptr, per_prog, HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    """Program (chunk c, head h): out[pid] = the column sums of h's K and V rows over its pages."""
    pid = tl.program_id(0)
    h, c = pid % HEADS, pid // HEADS
    rows = tl.arange(0, PAGE)[:, None] * (HEADS * D) + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE, D], tl.float32)
    for i in tl.range(c * per_prog, c * per_prog + per_prog, num_stages=3):
        page = tl.load(idx_ptr + i).to(tl.int64)
        base = cache_ptr + page * (2 * PAGE * HEADS * D) + h * D
        k = tl.load(base + rows)
        v = tl.load(base + PAGE * HEADS * D + rows)
        ones = tl.full([PAGE, PAGE], 1.0, k.dtype)
        acc = tl.dot(ones, k, acc)  # the tiles feed dots, as in the decode: Triton pipelines them
        acc = tl.dot(ones, v, acc)
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.sum(acc, 0) / PAGE)


@triton.jit
def paged_tma_sum(cache_ptr, idx_ptr, out_ptr, per_prog, n_rows, HEADS: tl.constexpr, D: tl.constexpr,
                  PAGE: tl.constexpr):
    """`paged_ptr_sum` with one descriptor load per page tile."""
    pid = tl.program_id(0)
    h, c = pid % HEADS, pid // HEADS
    desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, HEADS, D], strides=[HEADS * D, D, 1],
                                     block_shape=[PAGE, 1, D])
    acc = tl.zeros([PAGE, D], tl.float32)
    for i in tl.range(c * per_prog, c * per_prog + per_prog, num_stages=3):
        row = tl.load(idx_ptr + i) * (2 * PAGE)
        k = desc.load([row, h, 0]).reshape(PAGE, D)
        v = desc.load([row + PAGE, h, 0]).reshape(PAGE, D)
        ones = tl.full([PAGE, PAGE], 1.0, k.dtype)
        acc = tl.dot(ones, k, acc)
        acc = tl.dot(ones, v, acc)
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.sum(acc, 0) / PAGE)


def main():
    """Check the sums against torch, then (GPU) time 50 calls after each kind of L2 flush."""
    small = "--check-small" in sys.argv
    dev = "cpu" if small else "cuda"
    heads, d, page = (2, 16, 16) if small else (8, 128, 16)
    pages, chunks = (12, 3) if small else (2048, 64)  # 1x32768: 2048 pages of 16; 64 chunks x 8 heads
    per = pages // chunks
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float16 if small else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    cache = torch.randn(pages, 2, page, heads, d, generator=g, device=dev, dtype=dtype)
    idx = torch.randperm(pages, generator=g, device=dev).to(torch.int32)
    out = torch.empty(chunks * heads, d, device=dev, dtype=torch.float32)
    grid = (chunks * heads,)
    if MODE == "ptr":
        run = lambda: paged_ptr_sum[grid](cache, idx, out, per, HEADS=heads, D=d, PAGE=page, num_warps=4)
    else:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
        run = lambda: paged_tma_sum[grid](cache, idx, out, per, pages * 2 * page, HEADS=heads, D=d, PAGE=page,
                                          num_warps=4)
    run()
    c = cache.float()
    want = torch.stack([(c[idx[ci * per:(ci + 1) * per].long(), :, :, h, :]).sum((0, 1, 2))
                        for ci in range(chunks) for h in range(heads)])
    err = float((out - want).abs().max() / want.abs().max())
    print(f"{MODE}: max rel err {err:.1e}", flush=True)
    if small:
        assert err < 1e-3
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from flashdispatch.bench.timing import L2Flusher, device_times_ms
    for mode in ("write", "read"):
        ms = statistics.median(device_times_ms(run, 50, L2Flusher(cache.device, mode=mode)))
        print(f"{MODE:9} flush {mode}: {ms * 1e3:6.1f} us  {cache.numel() * 2 / ms / 1e9:5.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
