"""What the offline-compile scripts share (no GPU and no CUDA toolkit needed): compiling a kernel
the way a launch specializes it, ptxas -v on its PTX (sm_90a unless told) with the ptxas
bundled in the Triton wheel (register and spill figures), and the instruction mix of the
cubin's main loop (the bundled nvdisasm)."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Callable

import triton
from triton._C.libtriton import ir
from triton.compiler import ASTSource, make_backend


def _launch_source(kernel, const: dict, arg_type: Callable[[str], str], source=ASTSource) -> ASTSource:
    """``kernel`` with the constexprs ``const`` and every other argument typed by ``arg_type(name)``
    (e.g. "*bf16", "i32", "fp32"), pointers and ``stride_*`` marked divisible by 16 as a launch on
    contiguous tensors specializes them (without that, Triton 3.6 emits no cp.async at all and the
    shared memory figure is not a launch's). ``source``: the class of source, e.g. Gluon's
    GluonASTSource for a @gluon.jit kernel."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in const:
            sig[name] = "constexpr"
            continue
        sig[name] = arg_type(name)
        if sig[name].startswith("*") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return source(fn=kernel, signature=sig, constexprs=const, attrs=attrs)


def compile_like_launch(kernel, const: dict, arg_type: Callable[[str], str], target, options: dict,
                        source=ASTSource):
    """The CompiledKernel of ``kernel`` as a launch specializes it (`_launch_source`)."""
    return triton.compile(_launch_source(kernel, const, arg_type, source), target=target, options=options)


def frontend_like_launch(kernel, const: dict, arg_type: Callable[[str], str], target, options: dict) -> str:
    """The TTIR of ``kernel`` as a launch specializes it: Triton's code generation, where its type
    checks run, and the TTIR passes, without the layouts, LLVM and ptxas of a whole compile (the
    decode kernel's packed variants: ~0.3 s against ~4-6 s)."""
    backend = make_backend(target)
    opts = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = _launch_source(kernel, const, arg_type)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    return str(stages["ttir"](module, {}))


def ptxas_usage(ptx: str, gpu: str = "sm_90a") -> tuple[int | None, int | None]:
    """(registers, spill-store bytes) of the PTX's kernel assembled for ``gpu``; None where ptxas
    printed no figure."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")


def sass_loops(cubin: bytes) -> list[tuple[int, list[tuple[str, int]]]]:
    """Each loop of the cubin's SASS (nvdisasm, bundled with Triton), in code order, as
    (instructions, [(opcode, count), ...] most frequent first): the range of each backward branch.
    Opcodes without their modifiers (HMMA.16816.F32: HMMA)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    labels, ops, pending = {}, [], None
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        ins = _SASS_LINE.search(line)
        if ins:
            at, text = int(ins.group(1), 16), ins.group(2).strip()
            if pending:
                labels[pending], pending = at, None
            ops.append((at, re.sub(r"^@!?U?P\w+\s+", "", text).split()[0], text))
    loops = [(labels[m.group(1)], at) for at, op, text in ops if op.startswith("BRA")
             for m in [_BRANCH_TARGET.search(text)] if m and labels.get(m.group(1), at) < at]
    result = []
    for first, last in sorted(loops):
        mix = collections.Counter(op.split(".")[0] for at, op, _ in ops if first <= at <= last)
        result.append((sum(mix.values()), mix.most_common()))
    return result


def sass_loop_mix(cubin: bytes) -> tuple[int, list[tuple[str, int]]]:
    """(instructions, [(opcode, count), ...]) of the cubin's longest loop (`sass_loops`): what one
    step of a kernel's main loop issues; (0, []) where the SASS has no loop."""
    return max(sass_loops(cubin), key=lambda loop: loop[0], default=(0, []))
