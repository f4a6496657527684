"""Bound Triton launches: repeat launches of a kernel skip `JITFunction.run`'s per-call work.

`bind(fn, num_warps=4, BLOCK=64, ...)` returns the process-wide `BoundKernel` of one @triton.jit
function with those constexprs and launch options fixed; `bound(grid, *args)` takes the kernel's
other (runtime) parameters, in order. A call whose specialization key is new goes through the
normal ``fn[grid](*args, **constexprs, **options)`` (compile if needed, launch) and keeps the
CompiledKernel it returns; a later call with the same key launches that kernel through its
low-level launcher, the call `JITFunction.run` makes at its end (triton 3.6 runtime/jit.py):

    kernel.run(grid0, grid1, grid2, stream, kernel.function, kernel.packed_metadata,
               launch_metadata, launch_enter_hook, launch_exit_hook, *every kernel argument)

(constexpr arguments included: the CUDA launcher skips them). With no launch hooks, the metadata
and both hooks are None, which the launcher skips too. That launcher's ``__call__`` allocates the
kernel's scratch memory and calls its C ``launch``; a kernel without scratch is launched through
that C function directly (`_kept_launch`). For each tensor argument that launcher
calls ``data_ptr()`` and asks the driver whether the GPU can reach the memory
(cuPointerGetAttribute); an int it passes on as it is. `BoundKernel.launch_addresses` launches a
kept kernel with the tensors given as their addresses, for callers that hold them already and
whose tensors' device the API has checked (decode run(): 17 pointers; on the H200's host run()
went from 1.15 to 0.99-1.08x FlashInfer's, docs/perf-notes.md).

What Triton 3.6 specializes on (native_specialize_impl, specialize.cc): a tensor's dtype and
whether its data_ptr() is a multiple of 16; an int's value == 1 (it becomes a constexpr), its
divisibility by 16 and its width (i32, i64, u64); floats (fp32) and bools (u1) by type only;
None is a constexpr. `spec_key` holds all of these for every argument, finer than Triton where a
parameter is `do_not_specialize` (harmless: one more normal call). The cache key adds the current
device (one CompiledKernel per device) and the two knobs that enter Triton's launch options
(runtime.debug, compilation.instrumentation_mode).

The normal path runs instead: under the interpreter (TRITON_INTERPRET=1: no JITFunction), on a
Triton version whose launch call was not checked (`VERIFIED_TRITON`) or a non-CUDA driver, while
a launch enter/exit hook is set, when the function has pre-run hooks, when a global the kernel
reads has changed (the normal path raises), or when an argument is of another type (numpy
scalar, tuple, tensor descriptor). CUDA graphs: the direct launch is the same cuLaunchKernelEx
on the current stream, so it is captured like the normal one.

FLASHDISPATCH_FA2_DIRECT_LAUNCH=0 (or ``DIRECT_LAUNCH = False`` at run time) sends every launch
through the normal path, to rule the bound launcher out or to time the plain launch.
"""
from __future__ import annotations

import functools
import operator
import os
from typing import Callable

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

VERIFIED_TRITON = ((3, 6),)  # (major, minor) whose JITFunction.run / CudaLauncher call was read
DIRECT_LAUNCH = os.environ.get("FLASHDISPATCH_FA2_DIRECT_LAUNCH", "1") != "0"

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_MISSING = object()
# id(fn) -> (how many globals fn reads, ((scope, name, object found equal to its compile-time value),
# ...)): identity tests from then on (the compile keeps copies, and a Gluon layout's == takes ~1 us).
# A global rebound is compared again; one mutated in place is not (the kernels' globals are frozen).
_EQUAL_GLOBALS: dict = {}


def spec_key(args, _Tensor=torch.Tensor, _int=int, _float=float, _bool=bool) -> tuple | None:
    """What Triton's specialization of ``args`` depends on, as a hashable tuple; None when an
    argument is of a type this key does not cover (the caller then takes the normal path).

    Tensor: its dtype, then whether data_ptr() is a multiple of 16; int: 1 for the value 1, else
    2 * width class (i32 1, i64 2, u64 3) + divisible by 16; float, bool, None: their type.
    (The keyword defaults are local aliases: this runs on every launch.)"""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is _int:
            if a == 1:
                add(1)
            else:
                width = 1 if _I32_MIN <= a <= _I32_MAX else 2 if _I64_MIN <= a <= _I64_MAX else 3
                add(2 * width + (a & 15 == 0))
        elif t is _Tensor or isinstance(a, _Tensor):
            add(a.dtype)
            add(a.data_ptr() & 15 == 0)
        elif t is _float or t is _bool or a is None:
            add(t)
        else:
            return None
    return tuple(key)


class SpecKeys:
    """`spec_key` results kept per kind of call (``call``: whatever the caller knows the key
    depends on beyond its fixed arguments, e.g. strides and dtypes), at most ``limit`` kinds (strides
    that change at every call: the oldest are dropped all at once). The caller's contract: its
    call kind determines the specialisation of every argument but the fixed ones (the same
    tensors and scalars, at the same positions, in every call) and ``do_not_specialize``
    parameters; ``fixed`` is what the fixed arguments' specialisation depends on where `carried`
    made these keys."""

    def __init__(self, limit: int = 64, fixed: tuple | None = None):
        self.limit = limit
        self.fixed = fixed
        self.scalars: tuple | None = None  # (values, types) of the fixed scalars `carried` made these keys for
        self._keys: dict = {}

    @classmethod
    def carried(cls, previous: SpecKeys | None, tensors: tuple, addresses: tuple, scalars: tuple) -> SpecKeys:
        """The keys of calls whose fixed arguments are ``tensors`` (at ``addresses``, their
        data_ptr()s) then ``scalars`` (a plan's own): ``previous`` where it was made for fixed
        arguments that specialise alike (the same dtypes and 16-byte alignment, scalars of the
        same `spec_key`; then every kind it holds has the same key here), else new ones (so too
        where a scalar's type has no `spec_key`). A re-plan that keeps them launches its first
        run() by address with no key to work out (decode: `DecodePlan._set_tables`;
        docs/perf-notes.md, session 71). Scalars of the same values and types as ``previous``' take
        its key as they are."""
        dtypes = tuple([t.dtype for t in tensors])
        aligned = not functools.reduce(operator.or_, addresses, 0) & 15
        tensor_key = (dtypes, True if aligned else tuple([a & 15 == 0 for a in addresses]))
        types = tuple(map(type, scalars))
        if previous is not None and previous.fixed is not None and previous.scalars == (scalars, types):
            scalar_key = previous.fixed[1]
        else:
            scalar_key = spec_key(scalars)
        fixed = None if scalar_key is None else (tensor_key, scalar_key)
        if fixed is not None and previous is not None and previous.fixed == fixed:
            return previous
        keys = cls(fixed=fixed)
        keys.scalars = (scalars, types)
        return keys

    def known(self, call) -> tuple | None:
        """The key kept for ``call``, or None when none is (then `get` works it out)."""
        return self._keys.get(call)

    def get(self, call, args: tuple) -> tuple | None:
        """The key of ``args``, worked out once per ``call``."""
        key = self._keys.get(call)
        if key is None:
            if len(self._keys) >= self.limit:
                self._keys.clear()
            key = self._keys[call] = spec_key(args)
        return key


def _version_verified() -> bool:
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) in VERIFIED_TRITON


def cuda_calls():
    """(current device, current stream of a device): the calls JITFunction.run makes, or None
    when the active Triton driver is not CUDA's (its launcher's call was not checked)."""
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver
    active = driver.active
    if not isinstance(active, CudaDriver):
        return None
    return active.get_current_device, active.get_current_stream


def _cuda_index(t) -> int | None:
    """The CUDA device index of ``t`` when it is a CUDA tensor, else None."""
    return t.get_device() if isinstance(t, torch.Tensor) and t.is_cuda else None


def _current_cuda_device() -> int:
    """torch's current CUDA device index (where Triton launches)."""
    return torch.cuda.current_device()


def _hook_idle(hook) -> bool:
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)


def _direct_allowed(fn) -> bool:
    """No launch hook set, no pre-run hook, no changed global (per call: they can change)."""
    rt = knobs.runtime
    if not (_hook_idle(rt.launch_enter_hook) and _hook_idle(rt.launch_exit_hook)) or fn.pre_run_hooks:
        return False
    used = fn.used_global_vals
    kept = _EQUAL_GLOBALS.get(id(fn))
    if kept is not None and kept[0] == len(used):
        for scope, name, obj in kept[1]:
            if scope.get(name, _MISSING) is not obj:
                break
        else:
            return True
    found = []
    for (name, _), (value, scope) in used.items():
        current = scope.get(name, _MISSING)
        if current != value:
            return False
        found.append((scope, name, current))
    _EQUAL_GLOBALS[id(fn)] = (len(used), tuple(found))
    return True


class BoundKernel:
    """One Triton kernel with fixed constexprs and launch options (see the module docstring).

    ``direct``: launch cached kernels directly (default: ``fn`` is a JITFunction and the Triton
    version is verified); False always takes the normal path."""

    def __init__(self, fn, kwargs: dict, direct: bool | None = None):
        self.fn = fn
        self._kwargs = dict(kwargs)
        if direct is None:
            direct = isinstance(fn, JITFunction) and _version_verified()
        self._direct = direct
        self._kernels: dict = {}  # (device, debug, instrumentation, spec_key) -> `_kept_launch`
        self._calls = None  # (current device, current stream), looked up at the first direct call
        if direct:
            self._tail, self._num_runtime = self._layout(fn, kwargs)

    @staticmethod
    def _layout(fn, kwargs: dict) -> tuple[tuple, int]:
        """(constexpr values in parameter order, number of runtime parameters); the constexpr
        parameters must come after all runtime ones."""
        names = {p.name for p in fn.params}
        constexpr = [p for p in fn.params if p.is_constexpr]
        runtime = [p for p in fn.params if not p.is_constexpr]
        if runtime and constexpr and constexpr[0].num < runtime[-1].num:
            raise ValueError(f"bind({fn}): constexpr parameter {constexpr[0].name!r} comes before runtime "
                             f"parameter {runtime[-1].name!r}; a bound launch needs the constexprs last")
        bad = [k for k in kwargs if k in names and k not in {p.name for p in constexpr}]
        if bad:
            raise ValueError(f"bind({fn}): {bad} are runtime parameters, pass them at each call")
        tail = []
        for p in constexpr:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"bind({fn}): constexpr parameter {p.name!r} has no value")
        return tuple(tail), len(runtime)

    def __call__(self, grid: tuple, *args) -> None:
        """Launch on ``grid`` (a tuple of 1 to 3 ints) with the runtime arguments ``args``, on the
        GPU of the first argument (Triton launches on the current device: a tensor on another
        GPU would be read through a pointer that GPU does not own)."""
        self.launch_with_spec(None, grid, args)

    def launch_with_spec(self, spec: tuple | None, grid: tuple, args: tuple) -> None:
        """`__call__` with ``spec`` = ``spec_key(args)`` already known (None: work it out): a
        caller that launches the same arguments' kinds again keeps the key (a wrong key launches
        a kernel specialised for other arguments: keep it only while everything it covers holds)."""
        index = _cuda_index(args[0]) if args else None
        if index is not None and index != _current_cuda_device():
            with torch.cuda.device(index):
                self._launch(grid, args, spec, index)
            return
        self._launch(grid, args, spec, index)

    def _launch(self, grid: tuple, args: tuple, key: tuple | None = None, device: int | None = None) -> None:
        """Launch on the current CUDA device (``device``: its index, when the caller knows it)."""
        if not (self._direct and DIRECT_LAUNCH):
            self.fn[grid](*args, **self._kwargs)
            return
        if self._calls is None:
            self._calls = cuda_calls()
            if self._calls is None:
                self._direct = False
                self.fn[grid](*args, **self._kwargs)
                return
        current_device, current_stream = self._calls
        if key is None:
            key = spec_key(args)
        if key is None:
            self.fn[grid](*args, **self._kwargs)
            return
        if device is None:
            device = current_device()
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, key)
        hit = self._kernels.get(key)
        if hit is not None and _direct_allowed(self.fn):
            self._run(hit, current_stream(device), grid, args)
            return
        kernel = self.fn[grid](*args, **self._kwargs)
        if hit is None and len(args) == self._num_runtime and getattr(kernel, "packed_metadata", None) is not None:
            self._kernels[key] = _kept_launch(kernel)

    def _run(self, hit: tuple, stream: int, grid: tuple, args: tuple) -> None:
        call, function, head = hit
        n = len(grid)
        call(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, *head, None, None, None,
             *args, *self._tail)

    def launch_addresses(self, spec: tuple, device: int, grid: tuple, args: tuple) -> bool:
        """Launch the kernel kept for ``spec`` (the `spec_key` of the same arguments as tensors) on
        CUDA device ``device`` with ``args`` whose tensors are given as their addresses (ints,
        ``data_ptr()``), which Triton's launcher passes on as they are: a tensor costs it a
        ``data_ptr()`` call and a driver query (cuPointerGetAttribute) each, the query being also
        its check that the memory is the GPU's. The caller vouches for that instead: every address
        must be of memory on ``device``. Returns False, having launched nothing, when no direct
        launch is ready (no kernel compiled for this key on that device yet, ``device`` not the
        current one, a launch hook set, ...): the caller then launches the tensors
        (`launch_with_spec`)."""
        if not (self._direct and DIRECT_LAUNCH) or self._calls is None:
            return False
        current_device, current_stream = self._calls
        if device != current_device():
            return False
        hit = self._kernels.get((device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, spec))
        if hit is None or not _direct_allowed(self.fn):
            return False
        self._run(hit, current_stream(device), grid, args)
        return True

    def cached_kernels(self) -> int:
        """How many compiled kernels this launcher launches directly (all devices)."""
        return len(self._kernels)


def _kept_launch(kernel) -> tuple:
    """(call, function, head) of a compiled kernel for `BoundKernel._run`, which calls ``call(grid,
    stream, function, *head, None, None, None, *args)``. Where its launcher (triton 3.6's
    CudaLauncher) allocates no scratch memory for the kernel, its own C launch, with the flags
    the launcher's ``__call__`` passes it (cooperative grid, PDL, no scratch); else the launcher."""
    launcher = kernel.run
    if getattr(launcher, "global_scratch_size", None) == 0 and getattr(launcher, "profile_scratch_size", None) == 0:
        return launcher.launch, kernel.function, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                                                  kernel.packed_metadata)
    return launcher, kernel.function, (kernel.packed_metadata,)


def launch_kept(launch: BoundKernel, specs: SpecKeys, call, device: int | None, grid: tuple, addressed: tuple,
                tensors: Callable[[], tuple]) -> None:
    """Launch the arguments of the call kind ``call`` (None: no key may be kept, e.g. a pointer off
    16-byte alignment): by address (`BoundKernel.launch_addresses` with ``addressed``, the
    arguments with each tensor as its ``data_ptr()``) when ``launch`` keeps the kernel of the
    kind's key on CUDA device ``device``, the key kept in ``specs`` or, for a kind ``specs`` does
    not hold yet, worked out now from the tensors (``tensors()``: the same arguments, called at
    most once, only for a new kind or a launch of the tensors: a caller may make views for it;
    see `SpecKeys`); else with the tensors and that key.
    (A tensor costs Triton's launcher a ``data_ptr()`` call and a driver query: a new kind of an
    already compiled kernel, e.g. a fresh plan's first run(), goes by address too.)"""
    if call is None:
        launch.launch_with_spec(None, grid, tensors())
        return
    spec, args = specs.known(call), None
    if spec is None:
        args = tensors()
        spec = specs.get(call, args)
    if spec is not None and launch.launch_addresses(spec, device, grid, addressed):
        return
    launch.launch_with_spec(spec, grid, tensors() if args is None else args)


_BOUND: dict = {}


def bind(fn, **kwargs) -> BoundKernel:
    """The process-wide BoundKernel of ``fn`` with these constexprs and launch options
    (num_warps, num_stages, ...). Plans re-bind at each plan(); the compiled kernels stay.
    Values are told apart by type too (True and 1 are different constexprs to Triton); the
    launcher keeps ``fn`` alive, so its id stays its own."""
    key = (id(fn), tuple((name, type(value), value) for name, value in kwargs.items()))
    bound = _BOUND.get(key)
    if bound is None:
        bound = _BOUND[key] = BoundKernel(fn, kwargs)
    return bound
