"""How fast does an H200 convert fp8 e4m3 to fp16 (docs/perf-notes.md, session 14)? A register loop
per variant, 16 programs per SM, the results xor-folded so that nothing is dropped:
  cvt:  two cvt.rn.f16x2.e4m3x2 per 32-bit register (what the fp8 decode kernel uses)
  bits: a bit trick, per pair one prmt, shr, and, add (fp16 bits of the value x 2^-8; the e4m3
        NaN codes become +-480)
  none: the loop alone (its time is not subtracted: the figures are lower bounds)
First it checks both conversions against torch on all 256 codes.
    python scripts/fp8_convert_probe.py
"""
import torch
import triton
import triton.language as tl

CVT = ("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 a, lo; "
       "cvt.rn.f16x2.e4m3x2 b, hi; xor.b32 $0, a, b; }")
BITS = ("{ .reg .b32 a, b, t; prmt.b32 a, $1, 0, 0x1404; prmt.b32 b, $1, 0, 0x3424; shr.b32 a, a, 1; "
        "and.b32 t, a, 0x40004000; add.u32 a, a, t; shr.b32 b, b, 1; and.b32 t, b, 0x40004000; add.u32 b, b, t; "
        "xor.b32 $0, a, b; }")
NONE = "{ xor.b32 $0, $1, 0x5a5a5a5a; }"
CLOCK_HZ = 1.98e9  # the H200's SM clock (nvidia-smi clocks.sm, at max during the run)


@triton.jit
def convert_loop(out_ptr, iters, ASM: tl.constexpr):
    """``iters`` rounds of ASM over 1024 int32 words (4 fp8 codes each) per program."""
    pid = tl.program_id(0)
    x = tl.arange(0, 1024) * 40503 + pid * 7919
    acc = tl.zeros([1024], tl.int32)
    for i in range(iters):
        acc = acc ^ tl.inline_asm_elementwise(ASM, "=r,r", [x ^ i], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(out_ptr + pid * 1024 + tl.arange(0, 1024), acc)


@triton.jit
def convert_codes(x_ptr, cvt_ptr, bits_ptr):
    """The fp16 bits of both conversions of 64 words (all 256 codes)."""
    offs = tl.arange(0, 64)
    x = tl.load(x_ptr + offs)
    c = tl.inline_asm_elementwise("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                                  "cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r", [x], dtype=(tl.int32, tl.int32),
                                  is_pure=True, pack=1)
    b = tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424; "
                                  "shr.b32 $0, $0, 1; and.b32 t, $0, 0x40004000; add.u32 $0, $0, t; "
                                  "shr.b32 $1, $1, 1; and.b32 t, $1, 0x40004000; add.u32 $1, $1, t; }",
                                  "=r,=r,r", [x], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    tl.store(cvt_ptr + offs * 2, c[0])
    tl.store(cvt_ptr + offs * 2 + 1, c[1])
    tl.store(bits_ptr + offs * 2, b[0])
    tl.store(bits_ptr + offs * 2 + 1, b[1])


def main():
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    cvt, bits = torch.empty(128, dtype=torch.int32, device="cuda"), torch.empty(128, dtype=torch.int32, device="cuda")
    convert_codes[(1,)](codes.view(torch.int32), cvt, bits)
    want = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want)
    print("cvt exact:", bool((cvt.view(torch.float16).float()[finite] == want[finite]).all()),
          " bits x 256 exact:", bool((bits.view(torch.float16).float()[finite] * 256 == want[finite]).all()))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs, iters = sms * 16, 2000
    out = torch.empty(programs * 1024, dtype=torch.int32, device="cuda")
    for warps in (4, 8):
        for name, asm, values in (("none", NONE, 0), ("cvt", CVT, 4), ("bits", BITS, 4)):
            convert_loop[(programs,)](out, iters, ASM=asm, num_warps=warps)  # compile
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            convert_loop[(programs,)](out, iters, ASM=asm, num_warps=warps)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) * 1e-3
            rate = programs * 1024 * iters * values / seconds / sms / CLOCK_HZ
            print(f"{warps} warps  {name:5} {seconds * 1e3:7.3f} ms  {rate:5.1f} values/clk/SM")


if __name__ == "__main__":
    main()
