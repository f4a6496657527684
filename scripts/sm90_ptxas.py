"""ptxas -v on a kernel's PTX for sm_90a, with the ptxas bundled in the Triton wheel (no GPU and
no CUDA toolkit needed): the offline-compile scripts' register and spill figures."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton


def ptxas_usage(ptx: str) -> tuple[int | None, int | None]:
    """(registers, spill-store bytes) of the PTX's kernel; None where ptxas printed no figure."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)
