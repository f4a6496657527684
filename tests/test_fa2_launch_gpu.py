"""The bound Triton launcher on a GPU (``-m gpu``): bound launches give bitwise the plain launch's
output for decode (with split-KV merge; repeated runs launch by address) and prefill, a misaligned
view takes the normal path and is still right, and CUDA-graph capture/replay of bound launches
equals eager. (The CPU tests of the launcher: test_fa2_launch.py.)
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashdispatch.backends.fa2 import launch
from flashdispatch.backends.fa2.launch import BoundKernel


@pytest.fixture
def fresh_launchers(monkeypatch):
    """No BoundKernel (and no cached CompiledKernel) from earlier tests; restored afterwards."""
    from flashdispatch.backends.fa2 import merge
    monkeypatch.setattr(launch, "_BOUND", {})
    for cached in (merge._decode_merge_launcher, merge._merge_states_launcher):
        cached.cache_clear()
    yield
    for cached in (merge._decode_merge_launcher, merge._merge_states_launcher):
        cached.cache_clear()


def _normal_path_counter(monkeypatch, fn) -> list:
    """One entry per launch of ``fn`` through its JITFunction.run (the normal path)."""
    calls = []
    original = fn.run

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fn, "run", counting)
    return calls


def _address_launch_counter(monkeypatch) -> list:
    """One (kernel name, launched) entry per BoundKernel.launch_addresses call."""
    calls = []
    original = BoundKernel.launch_addresses

    def counting(self, *args):
        launched = original(self, *args)
        calls.append((self.fn.__name__, launched))
        return launched

    monkeypatch.setattr(BoundKernel, "launch_addresses", counting)
    return calls


def _run_twice(plan, inputs, monkeypatch, direct: bool):
    """Poison, run twice (the first may compile), return copies of (out, lse) of the second run."""
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", direct)
    for _ in range(2):
        inputs.out.fill_(float("nan"))
        if inputs.lse is not None:
            inputs.lse.fill_(float("nan"))
        plan.run(inputs)
    torch.cuda.synchronize()
    return inputs.out.clone(), None if inputs.lse is None else inputs.lse.clone()


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data starts one element past a 16-byte boundary."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16
    return out


def _assert_bitwise(a, b) -> None:
    assert not a[0].isnan().any()
    assert torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


def _check_bound_equals_plain(plan, inputs, monkeypatch, fn):
    """Plain launches, then bound ones (normal path once, then direct), bitwise equal; a q view
    off 16-byte alignment takes the normal path once and equals its plain launch; aligned again
    stays direct."""
    plain = _run_twice(plan, inputs, monkeypatch, direct=False)
    normal = _normal_path_counter(monkeypatch, fn)
    bound = _run_twice(plan, inputs, monkeypatch, direct=True)
    assert len(normal) == 1  # the first bound run compiled/launched normally, the second directly
    _assert_bitwise(bound, plain)
    misaligned = dataclasses.replace(inputs, q=_misaligned_copy(inputs.q))
    mis_plain = _run_twice(plan, misaligned, monkeypatch, direct=False)
    del normal[:]
    mis_bound = _run_twice(plan, misaligned, monkeypatch, direct=True)
    assert len(normal) == 1  # another specialization: the normal path, then cached
    _assert_bitwise(mis_bound, mis_plain)
    torch.testing.assert_close(mis_bound[0].float(), bound[0].float(), rtol=2e-2, atol=2e-2)
    del normal[:]
    _assert_bitwise(_run_twice(plan, inputs, monkeypatch, direct=True), plain)
    assert not normal


def _decode_case(seed: int):
    from oracle import make_paged_case
    case = make_paged_case("decode", kv_lens=[0, 17, 300, 2000, 5000], device="cuda", poison_unused=False,
                           num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=torch.bfloat16, seed=seed)
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("fixed_split", [None, 16], ids=["policy", "split16"])
def test_gpu_decode_bound_equals_plain(monkeypatch, fresh_launchers, fixed_split):
    from flashdispatch.backends.fa2.decode import plan_decode
    from flashdispatch.backends.fa2.decode_kernel import decode_kernel
    case = _decode_case(seed=0)
    case.params.fixed_split_size = fixed_split
    plan = plan_decode(case.problem, case.device, case.params)
    assert plan.n_merge  # the merge launch is bound too
    addressed = _address_launch_counter(monkeypatch)
    _check_bound_equals_plain(plan, case.inputs, monkeypatch, decode_kernel)
    assert addressed.count(("decode_kernel", True)) >= 2  # repeated runs pass the tensors as addresses
    if plan._merge is not None:
        assert addressed.count(("_merge_decode_kernel", True)) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_decode_of_a_combined_cache_launches_without_views(monkeypatch, fresh_launchers, layout):
    """A 5-D [pages, 2, ...] cache as the API passes it (`PagedKV.of_combined`): run() reads k's
    and v's addresses and strides from the 5-D tensor, gives bitwise the run of its two views, and
    once the kernel is kept launches by address without making the views (no unbind)."""
    from oracle import make_paged_case
    from flashdispatch.backends.base import PagedKV
    from flashdispatch.backends.fa2.decode import plan_decode
    case = make_paged_case("decode", kv_lens=[0, 17, 300, 2000, 5000], kv_layout=layout, device="cuda",
                           poison_unused=False, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                           q_dtype=torch.bfloat16, seed=3)
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    plan = plan_decode(case.problem, case.device, case.params)
    combined = torch.stack((case.inputs.kv.k, case.inputs.kv.v), 1)
    views = PagedKV(combined[:, 0], combined[:, 1], layout)
    want = _run_twice(plan, dataclasses.replace(case.inputs, kv=views), monkeypatch, direct=True)
    unbinds = []
    original = torch.Tensor.unbind

    def counting(self, *args, **kwargs):
        unbinds.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "unbind", counting)
    addressed = _address_launch_counter(monkeypatch)
    kv = PagedKV.of_combined(combined, layout)
    _assert_bitwise(_run_twice(plan, dataclasses.replace(case.inputs, kv=kv), monkeypatch, direct=True), want)
    assert not unbinds and addressed.count(("decode_kernel", True)) == 2, (unbinds, addressed)


@pytest.mark.gpu
def test_gpu_prefill_bound_equals_plain(monkeypatch, fresh_launchers):
    from oracle import make_paged_case
    from flashdispatch.backends.fa2.prefill import plan_prefill
    from flashdispatch.backends.fa2.prefill_kernels import fa2_prefill_kernel
    case = make_paged_case("prefill_paged", qo_lens=[16, 3, 128, 1], kv_lens=[3000, 1999, 4096, 1], device="cuda",
                           num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, q_dtype=torch.bfloat16,
                           mask_mode="causal", poison_unused=False, seed=2)
    case.params.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    plan = plan_prefill(case.problem, case.device, case.params)
    _check_bound_equals_plain(plan, case.inputs, monkeypatch, fa2_prefill_kernel)


@pytest.mark.gpu
def test_gpu_decode_graph_capture_of_bound_launches(monkeypatch, fresh_launchers):
    from flashdispatch.backends.fa2.decode import plan_decode
    from flashdispatch.backends.fa2.decode_kernel import decode_kernel
    case = _decode_case(seed=1)
    plan = plan_decode(case.problem, case.device, case.params)
    eager = _run_twice(plan, case.inputs, monkeypatch, direct=True)  # compiled and cached
    normal = _normal_path_counter(monkeypatch, decode_kernel)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(case.inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.inputs)
    assert not normal  # captured through the direct launch
    for _ in range(2):
        case.inputs.out.fill_(float("nan"))
        case.inputs.lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_bitwise((case.inputs.out, case.inputs.lse), eager)
