"""A Gluon (explicit-layout) fp8 decode kernel beside the fa2 decode, on the bench's data: a probe.

Session 48's profile put the fa2 fp8 decode's token loop at 503 instructions per 32 tokens, with
the staged V (fp8 -> fp16 in registers, through shared memory, back with transposing loads) and
Q^T reloaded each step as Triton's layout choices. This kernel fixes every layout itself
(`triton.experimental.gluon`): one warp per (request, KV head, chunk), 32-token tiles (two pages
of 16) copied with cp.async into swizzled buffers that no load conflicts on, and two mma.sync
dots with their operands loaded straight from the fp8 tiles in 16-byte rows:

- S^T = K Q^T: K's head dims are permuted (``_k_index``) so that each lane's 16 bytes of a token
  are its A-operand k slots; Q^T is loaded once, in the B-operand layout, with the same
  permutation;
- O^T = V^T P^T: V^T's rows (head dims) are permuted (``_v_index``, undone at the store) so each
  lane's 16 bytes of a token are its A-operand rows; neighbouring tokens are paired by a byte
  permute before the fp8 -> fp16 conversion; P^T comes from S^T's accumulator by shuffles.

Scope: e4m3 KV, 16-bit q (the dots in fp16, as the fa2 fp8 path), head_dim 128, page 16, NHD
5-D cache, GQA group <= 8, no positional or logit options; split chunks write partial states
that ``merge_states`` joins. Not part of the library.

    python scripts/gluon_fp8_decode_probe.py --offline            # compile for sm90: registers, loop SASS
    python3 scripts/gluon_fp8_decode_probe.py --shapes 64x4096:fp8,200x1024:fp8   # on the GPU
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

os.environ.pop("TRITON_INTERPRET", None)  # Gluon has no interpreter
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

# one warp; mma.sync m16n8k16, fp16 operands (k_width 2), fp32 accumulators
MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
OP_A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
OP_B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
# cp.async of one [2 pages, 16 tokens, 128 d] fp8 tile: 16 bytes a lane, a row (128 B) per 8 lanes
COPY: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 4, 0], [0, 8, 0], [1, 0, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0]], warp_bases=[], block_bases=[],
    shape=[2, 16, 128])
# K as the first dot's A operand, logical [token, k] with d = pi_k(k) (see _k_index); registers
# ordered so each row's 16 bytes are one 16-byte shared load
K_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [8, 0], [0, 64], [16, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[32, 128])
# V^T as the second dot's A operand, logical [m, token] with d = pi_v(m)
V_PAIRS: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [16, 0], [32, 0], [64, 0], [0, 8], [0, 16]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[128, 32])
V_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [16, 0], [32, 0], [64, 0], [0, 1], [0, 8], [0, 16]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[128, 32])


def swizzled_layout():
    """The K and V buffers' shared layout ([stages, 2 pages, 16 tokens, 128 d]; the stage dim
    implied): no bank conflicts for the cp.async stores and either operand's 16-byte loads."""
    # offset bits -> [page, token, d]; the 16-byte chunk of row r sits at chunk ^ f(r),
    # f(1) = 4, f(2) = 2, f(4) = 4, f(8) = 1, f(16) = 0 (row r = page * 16 + token)
    bases = [[0, 0, 1 << i] for i in range(7)]
    f = {1: 4, 2: 2, 4: 4, 8: 1}
    for i in range(4):
        bases.append([0, 1 << i, 16 * f[1 << i]])
    bases.append([1, 0, 0])
    return gl.SharedLinearLayout(offset_bases=bases)


@gluon.jit
def _fp8_to_f16(x):
    """e4m3 -> fp16 (exact), four values a register, one cvt.rn.f16x2.e4m3x2 per pair."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(gl.uint8, bitcast=True)], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _k_view(buf):
    """A tile buffer as the first dot's A operand K [token, k] (d = _k_index(k))."""
    # [2, 16, 128] physical -> [32 token, 128 k], d bits (d0..d6) = (k0, k3, k4, k5, k1, k2, k6)
    v = buf.reshape([32, 2, 2, 2, 2, 2, 2, 2])  # token, d6, d5, d4, d3, d2, d1, d0
    v = v.permute([0, 1, 4, 5, 6, 2, 3, 7])      # token, k6..k0 = d6, d3, d2, d1, d5, d4, d0
    return v.reshape([32, 128])


@gluon.jit
def _v_view(buf):
    """A tile buffer as the second dot's A operand V^T [m, token] (d = _v_index(m))."""
    # [2, 16, 128] physical -> [128 m, 32 token], d bits (d0..d6) = (m3, m4, m5, m6, m0, m1, m2)
    v = buf.reshape([32, 2, 2, 2, 2, 2, 2, 2])  # token, d6, d5, d4, d3, d2, d1, d0
    v = v.permute([4, 5, 6, 7, 1, 2, 3, 0])      # m6..m0 = d3, d2, d1, d0, d6, d5, d4; token
    return v.reshape([128, 32])


@gluon.jit
def _k_index(k):
    return (k & 1) | (((k >> 3) & 7) << 1) | (((k >> 1) & 3) << 4) | (k & 64)


@gluon.jit
def _v_index(m):
    return ((m >> 3) & 15) | ((m & 7) << 4)


@gluon.jit
def _issue(k_buf, v_buf, k_head, v_head, table_row, c_page, row_off, c_row, tile, kv_len, stride_page,
           MASKED: gl.constexpr):
    """cp.async of tile ``tile`` (two pages) of K and V into their buffers."""
    slot = tile * 2 + c_page
    if MASKED:
        page = gl.load(table_row + slot, mask=slot * 16 < kv_len, other=0)
    else:
        page = gl.load(table_row + slot)
    page_off = (page.to(gl.int64) * stride_page)[:, None, None]
    if MASKED:
        ok = tile * 32 + c_row < kv_len
        cp.async_copy_global_to_shared(k_buf, (k_head + page_off) + row_off, mask=ok)
        cp.async_copy_global_to_shared(v_buf, (v_head + page_off) + row_off, mask=ok)
    else:
        cp.async_copy_global_to_shared(k_buf, (k_head + page_off) + row_off)
        cp.async_copy_global_to_shared(v_buf, (v_head + page_off) + row_off)


@gluon.jit
def _step(k_buf, v_buf, q_t, m_i, l_i, acc, qk_scale, offs_t, i, kv_len, STAGES: gl.constexpr, MASKED: gl.constexpr):
    """One 32-token tile: S^T = K Q^T, the online softmax over tokens, O^T += V^T P^T."""
    cp.wait_group(STAGES - 1)
    gl.thread_barrier()
    k8 = _k_view(k_buf).load(K_LOAD)
    k16 = gl.convert_layout(_fp8_to_f16(k8), OP_A)
    s_t = mma_v2(k16, q_t, gl.full([32, 8], 0.0, gl.float32, layout=MMA)) * qk_scale
    if MASKED:
        s_t = gl.where((i * 32 + offs_t < kv_len)[:, None], s_t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s_t - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    p_b = gl.convert_layout(p.to(gl.float16), OP_B)
    v8 = _v_view(v_buf).load(V_LOAD)
    v16 = _fp8_to_f16(gl.convert_layout(v8, V_PAIRS))
    acc = mma_v2(gl.convert_layout(v16, OP_A), p_b, acc * alpha[None, :])
    gl.thread_barrier()
    return m_new, l_i, acc


@gluon.jit
def fp8_decode_probe_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, qk_scale, v_scale,
                            stride_page, table_stride, chunk_tiles,
                            stride_tok: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                            SMEM: gl.constexpr, SPLIT: gl.constexpr):
    """One (request, KV head, chunk of ``chunk_tiles`` 32-token tiles) per program, one warp."""
    pid = gl.program_id(0)
    split = gl.program_id(1)
    num_splits = gl.num_programs(1)
    req = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    kv_len = gl.load(lens_ptr + req)
    t0 = split * chunk_tiles
    t1 = gl.minimum(t0 + chunk_tiles, gl.cdiv(kv_len, 32))
    n_tiles = gl.maximum(t1 - t0, 0)

    # Q^T [128 k, 8 heads] as the B operand, loaded once (d = pi_k(k))
    offs_k = gl.arange(0, 128, layout=gl.SliceLayout(1, OP_B))
    offs_n = gl.arange(0, 8, layout=gl.SliceLayout(0, OP_B))
    q_rows = (req * NUM_KV_HEADS * GROUP + kvh * GROUP + offs_n).to(gl.int64) * 128
    q_t = gl.load(q_ptr + q_rows[None, :] + _k_index(offs_k)[:, None], mask=(offs_n < GROUP)[None, :], other=0.0)
    q_t = q_t.to(gl.float16)

    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2, 16, 128], SMEM)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2, 16, 128], SMEM)

    c_page = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    c_tok = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY)))
    c_d = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    row_off = c_tok[None, :, None] * stride_tok + c_d[None, None, :]
    c_row = (c_page * 16)[:, None, None] + c_tok[None, :, None] + 0 * c_d[None, None, :]
    table_row = table_ptr + req.to(gl.int64) * table_stride
    k_head = k_ptr + kvh * 128
    v_head = v_ptr + kvh * 128
    n_full = gl.maximum(gl.minimum(kv_len // 32, t1) - t0, 0)  # tiles of this chunk with 32 tokens

    for s in gl.static_range(STAGES - 1):
        if s < n_full:
            _issue(k_bufs.index(s), v_bufs.index(s), k_head, v_head, table_row, c_page, row_off, c_row,
                   t0 + s, kv_len, stride_page, False)
        elif s < n_tiles:
            _issue(k_bufs.index(s), v_bufs.index(s), k_head, v_head, table_row, c_page, row_off, c_row,
                   t0 + s, kv_len, stride_page, True)
        cp.commit_group()

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.full([8], 0.0, gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.full([128, 8], 0.0, gl.float32, layout=MMA)
    offs_t = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    steady = gl.maximum(n_full - (STAGES - 1), 0)
    for i in range(steady):  # every tile issued here and computed here is full
        nxt = i + STAGES - 1
        nb = nxt % STAGES
        _issue(k_bufs.index(nb), v_bufs.index(nb), k_head, v_head, table_row, c_page, row_off, c_row,
               t0 + nxt, kv_len, stride_page, False)
        cp.commit_group()
        m_i, l_i, acc = _step(k_bufs.index(i % STAGES), v_bufs.index(i % STAGES), q_t, m_i, l_i, acc, qk_scale,
                              offs_t, t0 + i, kv_len, STAGES, False)
    for i in range(steady, n_tiles):
        nxt = i + STAGES - 1
        nb = nxt % STAGES
        if nxt < n_tiles:
            _issue(k_bufs.index(nb), v_bufs.index(nb), k_head, v_head, table_row, c_page, row_off, c_row,
                   t0 + nxt, kv_len, stride_page, True)
        cp.commit_group()
        m_i, l_i, acc = _step(k_bufs.index(i % STAGES), v_bufs.index(i % STAGES), q_t, m_i, l_i, acc, qk_scale,
                              offs_t, t0 + i, kv_len, STAGES, True)
    cp.wait_group(0)

    l_safe = gl.where(l_i == 0, 1.0, l_i)
    o = acc * (v_scale / l_safe)[None, :]
    offs_m = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    offs_h = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    # one split: out [batch, qo_heads, 128]; several: partial out [batch, splits, qo_heads, 128]
    # (float32) and lse [batch, splits, qo_heads] (base 2)
    row = ((req * num_splits + split) * NUM_KV_HEADS * GROUP + kvh * GROUP + offs_h).to(gl.int64)
    gl.store(out_ptr + row[None, :] * 128 + _v_index(offs_m)[:, None], o.to(out_ptr.dtype.element_ty),
             mask=(offs_h < GROUP)[None, :])
    if SPLIT:
        gl.store(lse_ptr + row, gl.where(l_i == 0, float("-inf"), m_i + gl.log2(l_safe)), mask=offs_h < GROUP)


KERNEL_ARGS = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "table_ptr": "*i32", "lens_ptr": "*i32",
               "out_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32", "stride_page": "i32",
               "table_stride": "i32", "chunk_tiles": "i32"}


def offline(stages: int) -> None:
    """Compile for sm90 (no GPU): registers, spills, shared memory, each loop's SASS mix."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from offline_compile import ptxas_usage  # scripts/, the script's own folder

    const = {"stride_tok": 1024, "NUM_KV_HEADS": 8, "GROUP": 4, "STAGES": stages, "SMEM": swizzled_layout(),
             "SPLIT": False}
    sig = {**KERNEL_ARGS, **{name: "constexpr" for name in const}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in KERNEL_ARGS
             if n.endswith("_ptr") or n.startswith("stride") or n == "table_stride"}
    kernel = triton.compile(GluonASTSource(fp8_decode_probe_kernel, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    regs, spill = ptxas_usage(kernel.asm["ptx"])
    print(f"sm90, {stages} stages: {regs} registers, {spill} B spilled, {kernel.metadata.shared} B shared")
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(lines)
        instr = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if instr:
            lines.append(instr.group(1))
    for end, instr in enumerate(lines):
        branch = re.search(r"BRA `\(\.(L_x_\d+)\)", instr)
        start = labels.get(branch.group(1), end + 1) if branch else end + 1
        if start < end:  # a loop: its body, opcodes without predicates or modifiers
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
                                      for x in lines[start:end + 1])
            print(f"loop of {end + 1 - start} instructions:",
                  ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


def gpu_table(shapes: str, reps: int) -> None:
    """Each row: fa2 `auto` (eager, as the bench) and the probe (CUDA-graph replays, so the merge's
    launch costs no host time) at every stage count and a few split counts; TB/s, best four."""
    import torch

    import flashdispatch as fd
    from flashdispatch.bench.decode import kv_bytes, make_decode_data, parse_decode_shapes, wrapper_job
    from flashdispatch.bench.timing import Job, L2Flusher, device_times_ms, graphed

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = L2Flusher(torch.device("cuda"))
    print(f"TB/s, median of {reps}, write flush; probe: sN = N stages, xS = S chunks a request")
    for shape in parse_decode_shapes(shapes):
        if shape.kv_dtype != torch.float8_e4m3fn or shape.head_dim != 128 or shape.page_size != 16:
            raise SystemExit(f"{shape.label}: the probe reads e4m3 KV, head_dim 128, page 16 only")
        d = make_decode_data(shape)
        ours = wrapper_job(fd, "auto", d)
        ours.plan()
        ref = ours.run().float()
        tb = kv_bytes(shape) / 1e12
        fa2 = [tb * 1e3 / statistics.median(device_times_ms(ours.run, reps, flush))]
        results = []
        pairs = shape.batch * shape.kv_heads
        for stages in (2, 3, 4):
            slots = (227 * 1024 // (stages * 8192 + 1024)) * sms  # programs resident at once, by shared memory
            for splits in sorted({1, 2, 3, 4, math.ceil(slots / pairs)}):
                if splits > 1 and pairs >= 2 * slots:
                    continue
                run, real = _probe_run(d, stages, splits, fd, torch)
                run = graphed(Job(run=run)).run
                err = (run().float() - ref).abs().max().item()
                ms = statistics.median(device_times_ms(run, reps, flush))
                results.append((tb * 1e3 / ms, stages, real, err))
        fa2.append(tb * 1e3 / statistics.median(device_times_ms(ours.run, reps, flush)))
        results.sort(reverse=True)
        best = ", ".join(f"s{st} x{sp} {r:.2f}" for r, st, sp, _ in results[:4])
        print(f"{shape.label:<18} fa2 {fa2[0]:.2f} / {fa2[1]:.2f}  probe {best}  "
              f"(max |probe - fa2| {max(e for *_, e in results):.1e})", flush=True)


def _probe_run(d, stages: int, splits: int, fd, torch):
    """(run, splits): a call of the probe on the bench's data; several chunks a request write
    partial states that ``fd.merge_states`` joins."""
    s = d.shape
    k, v = d.cache[:, 0], d.cache[:, 1]
    max_tiles = -(-d.max_kv_len // 32)
    chunk = -(-max_tiles // splits)
    splits = -(-max_tiles // chunk)
    dev = d.q.device
    if splits == 1:
        out, lse = torch.empty_like(d.q), torch.empty(1, dtype=torch.float32, device=dev)
    else:
        out = torch.empty(s.batch, splits, s.qo_heads, 128, dtype=torch.float32, device=dev)
        lse = torch.empty(s.batch, splits, s.qo_heads, dtype=torch.float32, device=dev)
    grid = (s.batch * s.kv_heads, splits)
    args = (d.q, k, v, d.block_tables, d.seq_lens, out, lse, d.sm_scale * math.log2(math.e), 1.0, k.stride(0),
            d.block_tables.stride(0), chunk, k.stride(1), s.kv_heads, s.qo_heads // s.kv_heads, stages,
            swizzled_layout(), splits > 1)

    def run():
        fp8_decode_probe_kernel[grid](*args, num_warps=1)
        return out if splits == 1 else fd.merge_states(out, lse)[0]
    return run, splits


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", action="store_true", help="compile for sm90 only (no GPU)")
    ap.add_argument("--stages", type=int, default=2, help="cp.async stages of the offline compile")
    ap.add_argument("--shapes", default="64x4096:fp8,48x4096:fp8,16x8192:fp8,128x4096:fp8,256x1024:fp8,"
                    "256x4096:fp8,512x1024:fp8,200x1024:fp8,128x4096:var:fp8", help="decode shapes, as the bench's")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.stages < 2:
        ap.error(f"--stages {args.stages}: at least 2")
    if args.offline:
        offline(args.stages)
    else:
        gpu_table(args.shapes, args.reps)


if __name__ == "__main__":
    main()
