"""The bound Triton launcher (flashdispatch/backends/fa2/launch.py).

CPU: the specialization key against Triton's own native_specialize_impl, the direct/normal path
choice and the launch by address (`launch_addresses`) with a JITFunction whose compile-and-launch
is faked (a recording CompiledKernel), the interpreter path on a real kernel. The GPU tests are in
test_fa2_launch_gpu.py.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from flashdispatch.backends.fa2 import launch
from flashdispatch.backends.fa2.launch import BoundKernel, SpecKeys, bind, spec_key


# --- the key ---------------------------------------------------------------------------------

def _offset_view(n: int, dtype=torch.float16, offset: int = 1) -> torch.Tensor:
    """n elements starting ``offset`` elements into a fresh (aligned) allocation."""
    return torch.randn(n + offset).to(dtype)[offset:]


def test_key_separates_what_triton_specializes_on():
    aligned = torch.randn(64, dtype=torch.float16)
    assert aligned.data_ptr() % 16 == 0
    assert spec_key([aligned]) == spec_key([torch.randn(32, dtype=torch.float16)])  # same properties
    assert spec_key([aligned]) != spec_key([_offset_view(64)])  # data_ptr + 2 bytes
    assert spec_key([aligned]) != spec_key([aligned.float()])  # dtype
    assert spec_key([aligned]) != spec_key([aligned.to(torch.bfloat16)])
    ints = {1: "one", 2: "i32", 3: "i32", 16: "i32 D", 32: "i32 D", -16: "i32 D", 0: "i32 D",
            1 << 31: "i64 D", (1 << 31) + 1: "i64", -(1 << 31): "i32 D", -(1 << 31) - 16: "i64 D",
            1 << 63: "u64 D", (1 << 63) + 3: "u64"}
    for a, b in itertools.combinations(ints, 2):
        assert (spec_key([a]) == spec_key([b])) == (ints[a] == ints[b]), (a, b)
    assert spec_key([True]) != spec_key([1]) and spec_key([1.0]) != spec_key([1])
    assert spec_key([0.5]) == spec_key([3.0]) and spec_key([None]) != spec_key([0])
    assert spec_key([aligned, 16]) != spec_key([16, aligned])


def test_spec_keys_work_a_key_out_once_per_call_kind_up_to_the_limit():
    keys = SpecKeys(limit=2)
    x = torch.randn(4)
    assert keys.known("a") is None
    first = keys.get("a", (x, 16))
    assert first == spec_key((x, 16)) and keys.get("a", (x, 3)) is first  # the caller's kind decides
    assert keys.known("a") is first
    assert keys.get("b", (x, 3)) == spec_key((x, 3))
    assert keys.get("c", (x, 1)) == spec_key((x, 1))  # a third kind: the kept ones are dropped
    assert keys.get("a", (x, 3)) == spec_key((x, 3))


def test_key_unknown_types_take_the_normal_path():
    import numpy as np
    assert spec_key([np.int64(3)]) is None
    assert spec_key([(1, 2)]) is None
    assert spec_key([torch.randn(4), object()]) is None


def test_key_is_at_least_as_fine_as_tritons():
    """Equal keys imply equal (type, specialization) from Triton's own specializer, over a mix
    of tensors, ints, floats and bools."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    values = [torch.randn(8), torch.randn(8).half(), _offset_view(8, torch.float32), _offset_view(8, torch.float16, 8),
              1, 0, 2, 15, 16, 17, -1, -16, (1 << 31) - 16, 1 << 31, -(1 << 31), 1 << 40, (1 << 63) + 16,
              0.0, 1.0, 2.5, True, False]

    def triton_spec(v):
        return native_specialize_impl(BaseBackend, v, False, True, True)

    for a, b in itertools.product(values, repeat=2):
        if spec_key([a]) == spec_key([b]):
            assert triton_spec(a) == triton_spec(b), (a, b)


# --- the direct/normal choice, with a faked compile-and-launch -----------------------------------

def _toy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def _toy_mixed(x_ptr, BLOCK: tl.constexpr, n):
    pass


class FakeCompiled:
    """What a CompiledKernel offers the bound launcher; its launcher records each launch."""

    def __init__(self, log):
        self.function, self.packed_metadata = object(), (4, 1, 0)
        self.run = lambda *a: log.append(("direct", a))


class FakeJit:
    """A JITFunction whose normal path records the call and returns a FakeCompiled."""

    def __init__(self, fn=_toy):
        self.fn = JITFunction(fn)
        self.log = []
        self.fn.run = self._run

    def _run(self, *args, grid, warmup, **kwargs):
        self.log.append(("normal", grid, args, kwargs))
        return FakeCompiled(self.log)

    def kinds(self):
        return [entry[0] for entry in self.log]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Device 0 with stream 77; ``state["device"]`` switches the current device."""
    state = {"device": 0}
    monkeypatch.setattr(launch, "cuda_calls", lambda: (lambda: state["device"], lambda dev: 77 + dev))
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    return state


def test_first_call_normal_then_direct(fake_cuda):
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64, num_warps=4))
    x, y = torch.randn(64), torch.randn(64)
    bound((3,), x, y, 32, 0.5)
    assert jit.kinds() == ["normal"]
    assert jit.log[0][1:] == ((3,), (x, y, 32, 0.5), dict(BLOCK=64, num_warps=4))
    bound((3, 2), x, y, 48, 0.25)  # same specialization: direct
    assert jit.kinds() == ["normal", "direct"]
    g0, g1, g2, stream, function, metadata, launch_meta, enter, exit_, *args = jit.log[1][1]
    assert (g0, g1, g2, stream, launch_meta, enter, exit_) == (3, 2, 1, 77, None, None, None)
    assert args == [x, y, 48, 0.25, 64, False]  # runtime args, then constexprs (the default too)
    assert bound.cached_kernels() == 1


class FakeCudaLauncher:
    """Triton 3.6's CudaLauncher as the bound launcher sees it: scratch sizes, the flags its
    ``__call__`` passes, and a C ``launch`` (both record their calls)."""

    def __init__(self, log, scratch=0):
        self.log = log
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launch = lambda *a: log.append(("c-launch", a))

    def __call__(self, *a):
        self.log.append(("launcher", a))


@pytest.mark.parametrize("scratch", [0, 256])
def test_a_kernel_without_scratch_launches_through_the_c_launch(fake_cuda, scratch):
    """A kept kernel without scratch memory goes to its launcher's C launch with the arguments
    the launcher's ``__call__`` gives it (cooperative grid, PDL, no scratch, then the metadata);
    one with scratch to the launcher itself, which allocates it."""
    jit = FakeJit()
    compiled = FakeCompiled(jit.log)
    compiled.run = FakeCudaLauncher(jit.log, scratch)
    jit.fn.run = lambda *args, grid, warmup, **kwargs: (jit.log.append(("normal",)), compiled)[1]
    bound = BoundKernel(jit.fn, dict(BLOCK=64, num_warps=4))
    x, y = torch.randn(64), torch.randn(64)
    bound((3,), x, y, 32, 0.5)
    bound((3, 2), x, y, 48, 0.25)
    kind, call = jit.log[1]
    if scratch:
        assert kind == "launcher" and call[:6] == (3, 2, 1, 77, compiled.function, compiled.packed_metadata)
        assert call[6:] == (None, None, None, x, y, 48, 0.25, 64, False)
        return
    assert kind == "c-launch"
    assert call[:13] == (3, 2, 1, 77, compiled.function, False, True, None, None, compiled.packed_metadata,
                         None, None, None)
    assert call[13:] == (x, y, 48, 0.25, 64, False)


def test_a_tensor_on_another_gpu_launches_on_that_gpu(fake_cuda, monkeypatch):
    """Triton launches on the current device; the launcher switches to the first argument's GPU
    for the launch (and back), so a wrapper used with tensors on cuda:1 never launches on cuda:0."""
    entered = []

    class Switch:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            fake_cuda["device"] = self.index

        def __exit__(self, *exc):
            fake_cuda["device"] = 0

    monkeypatch.setattr(launch, "_cuda_index", lambda t: 1 if isinstance(t, torch.Tensor) else None)
    monkeypatch.setattr(launch, "_current_cuda_device", lambda: fake_cuda["device"])
    monkeypatch.setattr(torch.cuda, "device", Switch)
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64))
    x, y = torch.randn(64), torch.randn(64)
    bound((3,), x, y, 32, 0.5)
    bound((3,), x, y, 32, 0.5)
    assert entered == [1, 1] and fake_cuda["device"] == 0
    assert jit.kinds() == ["normal", "direct"] and jit.log[1][1][3] == 78  # stream of device 1
    monkeypatch.setattr(launch, "_cuda_index", lambda t: 0)  # already on the current GPU: no switch
    bound((3,), x, y, 32, 0.5)
    assert entered == [1, 1]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_width", "float_for_int"])
def test_other_specialization_takes_the_normal_path_and_is_kept(fake_cuda, change):
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64))
    x, y = torch.randn(64), torch.randn(64)
    bound((1,), x, y, 32, 0.5)
    other = {"misaligned": (_offset_view(64, torch.float32), y, 32, 0.5),
             "dtype": (x.half(), y, 32, 0.5), "int_one": (x, y, 1, 0.5),
             "int_width": (x, y, 1 << 32, 0.5), "float_for_int": (x, y, 32.0, 0.5)}[change]
    bound((1,), *other)
    assert jit.kinds() == ["normal", "normal"]
    bound((1,), *other)
    bound((1,), x, y, 32, 0.5)
    assert jit.kinds() == ["normal", "normal", "direct", "direct"]
    assert bound.cached_kernels() == 2


def test_device_knobs_hooks_and_globals_force_the_normal_path(fake_cuda, monkeypatch):
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=16))
    args = (torch.randn(8), torch.randn(8), 5, 1.0)
    bound((1,), *args)
    fake_cuda["device"] = 1  # one compiled kernel per device
    bound((1,), *args)
    assert jit.kinds() == ["normal", "normal"]
    bound((1,), *args)
    assert jit.log[-1][1][3] == 78  # device 1's stream

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        bound((1,), *args)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    jit.fn.pre_run_hooks.append(hook)
    bound((1,), *args)
    jit.fn.pre_run_hooks.clear()
    scope = {"G": 1}
    jit.fn.used_global_vals[("G", id(scope))] = (1, scope)
    scope["G"] = 2  # the normal path would raise "Global variable G has changed"
    bound((1,), *args)
    jit.fn.used_global_vals.clear()
    assert jit.kinds()[2:] == ["direct", "normal", "normal", "normal"]
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)  # enters Triton's options
    bound((1,), *args)
    assert jit.kinds()[-1] == "normal"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    bound((1,), *args)
    assert jit.kinds()[-1] == "normal"


def test_addresses_launch_only_a_kept_kernel(fake_cuda, monkeypatch):
    """launch_addresses launches the kernel kept for a key with the arguments as given (tensors as
    their addresses), then the constexprs, on the device's stream; where no direct launch is
    ready it launches nothing and returns False (the caller then launches the tensors)."""
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64))
    x, y = torch.randn(64), torch.randn(64)
    key = spec_key((x, y, 32, 0.5))
    addressed = (x.data_ptr(), y.data_ptr(), 48, 0.25)
    assert not bound.launch_addresses(key, 0, (2,), addressed)  # nothing compiled yet
    bound((1,), x, y, 32, 0.5)
    assert bound.launch_addresses(key, 0, (2, 3), addressed)
    assert jit.kinds() == ["normal", "direct"]
    g0, g1, g2, stream, function, metadata, launch_meta, enter, exit_, *args = jit.log[1][1]
    assert (g0, g1, g2, stream, launch_meta, enter, exit_) == (2, 3, 1, 77, None, None, None)
    assert args == [*addressed, 64, False]
    assert not bound.launch_addresses(key, 1, (2,), addressed)  # not the current device
    assert not bound.launch_addresses(spec_key((x.half(), y, 32, 0.5)), 0, (2,), addressed)  # no such kernel

    def hook(metadata):
        pass

    jit.fn.pre_run_hooks.append(hook)
    assert not bound.launch_addresses(key, 0, (2,), addressed)
    jit.fn.pre_run_hooks.clear()
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    assert not bound.launch_addresses(key, 0, (2,), addressed)
    assert jit.kinds() == ["normal", "direct"]


def test_launch_kept_keys_a_call_kind_once_then_launches_by_address(fake_cuda):
    """launch_kept: a new call kind launches the tensors with its key worked out and kept, a known
    one by address; no kind (None: a misaligned pointer) launches the tensors without a key."""
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64))
    specs = SpecKeys()
    x, y = torch.randn(64), torch.randn(64)
    tensors, addressed = (x, y, 32, 0.5), (x.data_ptr(), y.data_ptr(), 32, 0.5)
    asked = []

    def tensors_asked():
        asked.append(len(jit.log))
        return tensors

    for _ in range(2):
        launch.launch_kept(bound, specs, "kind", 0, (1,), addressed, tensors_asked)
    assert jit.kinds() == ["normal", "direct"] and jit.log[1][1][9:] == (*addressed, 64, False)
    assert asked == [0]  # the tensors only for the launch that is not by address
    assert specs.known("kind") == spec_key(tensors)
    launch.launch_kept(bound, specs, None, 0, (1,), addressed, tensors_asked)
    assert jit.kinds()[-1] == "direct" and jit.log[-1][1][9:] == (*tensors, 64, False)  # keyed at the launch


def test_launch_kept_launches_a_new_call_kind_of_a_kept_kernel_by_address(fake_cuda):
    """A call kind new to its SpecKeys (a re-plan's first run(): the plan keeps new keys) whose
    kernel the launcher keeps already goes by address with the key worked out from the tensors;
    the tensors are launched only where no kernel is kept for that key (here: another dtype)."""
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=64))
    x, y = torch.randn(64), torch.randn(64)
    launch.launch_kept(bound, SpecKeys(), "kind", 0, (1,), (x.data_ptr(), y.data_ptr(), 32, 0.5),
                       lambda: (x, y, 32, 0.5))  # compiles: the tensors
    u, v = torch.randn(64), torch.randn(64)
    specs = SpecKeys()  # as a refreshed plan's
    addressed = (u.data_ptr(), v.data_ptr(), 48, 0.25)
    launch.launch_kept(bound, specs, "kind", 0, (2,), addressed, lambda: (u, v, 48, 0.25))
    assert jit.kinds() == ["normal", "direct"] and jit.log[1][1][9:] == (*addressed, 64, False)
    assert specs.known("kind") == spec_key((u, v, 48, 0.25))
    h = torch.randn(64).half()
    launch.launch_kept(bound, specs, "half", 0, (1,), (h.data_ptr(), v.data_ptr(), 48, 0.25), lambda: (h, v, 48, 0.25))
    assert jit.kinds()[-1] == "normal" and jit.log[-1][2][0] is h and jit.log[-1][2][2:] == (48, 0.25)


def test_spec_keys_are_carried_only_to_fixed_arguments_of_the_same_key():
    import numpy as np

    def carried(previous, tensors, scalars, addresses=None):
        addresses = tuple(t.data_ptr() for t in tensors) if addresses is None else addresses
        return SpecKeys.carried(previous, tensors, addresses, scalars)

    x = torch.randn(8)
    kept = carried(None, (x,), (5,))
    assert carried(kept, (torch.randn(8),), (7,)) is kept and carried(kept, (x,), (5,)) is kept
    assert carried(kept, (x,), (16,)) is not kept and carried(kept, (x.half(),), (5,)) is not kept
    assert carried(kept, (x,), (5, 1)) is not kept and carried(kept, (x,), (5.0,)) is not kept
    unaligned = carried(kept, (x,), (5,), addresses=(x.data_ptr() + 4,))  # 16-byte alignment is keyed
    assert unaligned is not kept and carried(unaligned, (x,), (5,), addresses=(x.data_ptr() + 8,)) is unaligned
    unknown = carried(None, (x,), (np.int32(5),))  # a type spec_key does not cover: never carried
    assert unknown.fixed is None and carried(unknown, (x,), (np.int32(5),)) is not unknown


def test_unknown_argument_types_and_uncached_results(fake_cuda):
    import numpy as np
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=16))
    x = torch.randn(8)
    for _ in range(2):
        bound((1,), x, x, np.int32(5), 1.0)
    assert jit.kinds() == ["normal", "normal"] and bound.cached_kernels() == 0
    jit.fn.run = lambda *a, **k: None  # e.g. a jit_cache_hook skipped the compile: nothing to keep
    bound((1,), x, x, 5, 1.0)
    assert bound.cached_kernels() == 0


def test_non_cuda_driver_disables_direct_launches(monkeypatch):
    monkeypatch.setattr(launch, "cuda_calls", lambda: None)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    jit = FakeJit()
    bound = BoundKernel(jit.fn, dict(BLOCK=16))
    for _ in range(3):
        bound((1,), torch.randn(8), torch.randn(8), 5, 1.0)
    assert jit.kinds() == ["normal"] * 3 and bound.cached_kernels() == 0


def test_bind_checks_the_parameter_layout():
    with pytest.raises(ValueError, match="constexprs last"):
        BoundKernel(JITFunction(_toy_mixed), dict(BLOCK=16))
    with pytest.raises(ValueError, match="runtime parameters"):
        BoundKernel(JITFunction(_toy), dict(BLOCK=16, n=3))
    with pytest.raises(TypeError, match="BLOCK"):
        BoundKernel(JITFunction(_toy), dict(FLAG=True))
    assert BoundKernel(JITFunction(_toy), dict(BLOCK=16), direct=False)._direct is False


def test_bind_is_one_launcher_per_function_and_options():
    fn = JITFunction(_toy)
    assert bind(fn, BLOCK=16, num_warps=4) is bind(fn, BLOCK=16, num_warps=4)
    assert bind(fn, BLOCK=16, num_warps=4) is not bind(fn, BLOCK=32, num_warps=4)
    assert bind(fn, BLOCK=16, num_warps=4) is not bind(fn, BLOCK=16, num_warps=8)
    assert bind(fn, BLOCK=16, FLAG=True) is not bind(fn, BLOCK=16, FLAG=1)


# --- the interpreter: always the normal path ------------------------------------------------------

@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok)
    y = tl.load(y_ptr + offs, mask=ok)
    tl.store(out_ptr + offs, a * x + y, mask=ok)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")
def test_interpreter_runs_the_kernel_through_the_normal_path():
    bound = bind(_axpy_kernel, BLOCK=32, num_warps=4)
    assert not bound._direct
    x, y = torch.randn(100), torch.randn(100)
    for a in (2.0, -0.5):
        out = torch.full_like(x, float("nan"))
        bound((triton.cdiv(100, 32),), x, y, out, 100, a)
        torch.testing.assert_close(out, a * x + y)
    assert bound.cached_kernels() == 0


def test_globals_kept_by_identity_once_equal():
    """A kernel's globals compared with their compile-time copies once, then by identity: a global
    rebound to an equal object passes, to a different value fails, and a new global read is checked."""
    @dataclasses.dataclass(frozen=True)
    class Layout:
        bases: tuple

    class Fn:
        pre_run_hooks: list = []

    fn, scope = Fn(), {"L": Layout((1, 2))}
    fn.used_global_vals = {("L", id(scope)): (Layout((1, 2)), scope)}  # the compile's copy
    assert launch._direct_allowed(fn) and launch._direct_allowed(fn)
    scope["L"] = Layout((1, 2))
    assert launch._direct_allowed(fn)
    scope["L"] = Layout((2, 1))
    assert not launch._direct_allowed(fn)
    scope["L"] = Layout((1, 2))
    fn.used_global_vals[("M", id(scope))] = (3, scope)  # read by a later compile; missing from scope
    assert not launch._direct_allowed(fn)
    scope["M"] = 3
    assert launch._direct_allowed(fn)
