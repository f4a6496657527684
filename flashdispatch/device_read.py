"""plan()'s one read of device values: small index tensors (indptr, last_page_len, ...) and the
(min, max) of the used page indices, gathered by one kernel into a pinned host buffer and read
after one stream wait (a decode plan's kernel also works out and checks the lengths:
`read_paged_lengths`). On the H200's host this took a batch-256 read from ~91 us (empty + cat +
aminmax + a blocking copy) to ~38 us (docs/perf-notes.md, "API host overhead"). `IndexRangeReader`
queues the same kernel for the page indices and does not wait (a decode plan() whose lengths
are on the host); the same launch may upload those lengths (`IndexRangeReader.start`'s
``upload``: pinned host memory the kernel reads, copied to a device buffer), in place of a
host->device copy.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .backends.fa2.launch import bind, cuda_calls

MAX_TENSORS = 3
_BLOCK = 1024
# Page indices reduced by one program (a multiple of _BLOCK). Each program's loop waits on its
# loads, so fewer per program is less GPU time inside plan()'s wait: H200, 16384 / 65536 indices,
# kernel 11.6 / 24.4 us with 65536 per program, 2.1 / 2.3 us with 2048; plan() 4-6 % faster.
_PER_PROGRAM = 2048
_I32_MAX = (1 << 31) - 1
_POINTER_ARGS = (0, 2, 4, 6, 9, 10)  # index_summary_kernel's pointers among its runtime arguments
_KEPT_VIEWS = 64  # IndexRangeReader: upload layouts whose device views it keeps
_KEPT_LAUNCHES = 16  # per thread (and per IndexRangeReader): argument sets whose summary launch is kept
_USED_AT = 8  # used_host's place among the kernel's runtime arguments
_LENGTH_STATS = 4  # what `_paged_lengths` writes after the lengths: the flag, the longest, the sum's two words
_BY_ADDRESS = frozenset({"cuda"})  # device types whose launches go by address (and are kept)


@triton.jit
def _copy(out_ptr, src_ptr, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _paged_lengths(indptr_ptr, last_ptr, batch, page_size, out_ptr, BLOCK: tl.constexpr):
    """Each request's kv_len from its pages (indptr) and last_page_len, int32 at ``out[:batch]``,
    then at ``out[batch:batch + 4]``: 1 where an entry breaks a rule `checks.paged_lengths` names
    (indptr[0] != 0, a decreasing indptr, a last_page_len outside [1, page_size], or not 0 for a
    request with no pages, a length past int32) else 0, the longest length, the lengths' sum's
    low and high 32 bits. Lengths are worked out in int64."""
    wrong = tl.zeros([BLOCK], tl.int32)
    longest = tl.zeros([BLOCK], tl.int64)
    total = tl.zeros([BLOCK], tl.int64)
    for start in range(0, batch, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < batch
        pages = (tl.load(indptr_ptr + offs + 1, mask=keep, other=0).to(tl.int64)
                 - tl.load(indptr_ptr + offs, mask=keep, other=0).to(tl.int64))
        last = tl.load(last_ptr + offs, mask=keep, other=0).to(tl.int64)
        lens = tl.where(pages > 0, (pages - 1) * page_size + last, 0)
        bad = tl.where(pages > 0, (last < 1) | (last > page_size) | (lens > 2147483647), (pages < 0) | (last != 0))
        wrong = tl.maximum(wrong, (bad & keep).to(tl.int32))
        tl.store(out_ptr + offs, lens.to(tl.int32), mask=keep)
        total += lens
        longest = tl.maximum(longest, lens)
    first_wrong = (tl.load(indptr_ptr) != 0).to(tl.int32)
    tl.store(out_ptr + batch, tl.maximum(tl.max(wrong, 0), first_wrong))
    tl.store(out_ptr + batch + 1, tl.max(longest, 0).to(tl.int32))
    whole = tl.sum(total, 0)
    tl.store(out_ptr + batch + 2, whole.to(tl.int32))  # (int64 -> int32 keeps the low bits)
    tl.store(out_ptr + batch + 3, (whole >> 32).to(tl.int32))


@triton.jit(do_not_specialize=["n_a", "n_b", "n_c", "n_indices", "used_host", "page_size"])  # one compile for any sizes
def index_summary_kernel(a_ptr, n_a, b_ptr, n_b, c_ptr, n_c, indices_ptr, n_indices, used_host, out_ptr, copy_ptr,
                         page_size, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr, USED_ON_DEVICE: tl.constexpr,
                         LENGTHS: tl.constexpr):
    """Program 0 copies a, b, c to ``copy[:n_a + n_b + n_c]`` (``copy`` may be ``out``); program
    p writes the (min, max) of ``indices[p * PER_PROGRAM:][:PER_PROGRAM]`` within the used ones
    (the first ``a[-1]`` with USED_ON_DEVICE, else ``used_host``; never past ``n_indices``) to
    ``out[n + p]`` and ``out[n + programs + p]`` (int32 max / min when it holds none). LENGTHS (a
    is an indptr, b its last_page_len): program 0 also writes `_paged_lengths` of them, of
    ``page_size``, from ``out[n + 2 * programs]`` on."""
    pid = tl.program_id(0)
    n = n_a + n_b + n_c
    if pid == 0:
        _copy(copy_ptr, a_ptr, n_a, BLOCK)
        _copy(copy_ptr + n_a, b_ptr, n_b, BLOCK)
        _copy(copy_ptr + n_a + n_b, c_ptr, n_c, BLOCK)
        if LENGTHS:
            _paged_lengths(a_ptr, b_ptr, n_b, page_size, out_ptr + n + 2 * tl.num_programs(0), BLOCK)
    if USED_ON_DEVICE:
        used = tl.load(a_ptr + n_a - 1)
    else:
        used = used_host
    used = tl.minimum(used, n_indices)
    low = tl.full([BLOCK], 2147483647, tl.int32)
    high = tl.full([BLOCK], -2147483648, tl.int32)
    for start in range(pid * PER_PROGRAM, pid * PER_PROGRAM + PER_PROGRAM, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < used
        x = tl.load(indices_ptr + offs, mask=keep, other=0)
        low = tl.where(keep, tl.minimum(low, x), low)
        high = tl.where(keep, tl.maximum(high, x), high)
    tl.store(out_ptr + n + pid, tl.min(low, 0))
    tl.store(out_ptr + n + tl.num_programs(0) + pid, tl.max(high, 0))


_streams: dict = {}  # (device index, raw stream handle) -> torch.cuda.Stream (see `current_stream`)


@functools.lru_cache(maxsize=1)
def _raw_stream_call():
    """Triton's call for a device's current raw stream handle (None: not CUDA's driver)."""
    calls = cuda_calls()
    return None if calls is None else calls[1]


def current_stream(index: int) -> torch.cuda.Stream:
    """torch's current stream on CUDA device ``index`` (what the launches went to), one Stream
    object kept per raw handle: `torch.cuda.current_stream` builds a new one at each call, ~5 us
    of plan() on the H200's host, where reading the handle (as Triton's launch does) is ~0.3."""
    raw = _raw_stream_call()
    if raw is None:
        return torch.cuda.current_stream(index)
    key = (index, raw(index))
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= 64:
            _streams.clear()
        stream = _streams[key] = torch.cuda.current_stream(index)
    return stream


class _Staging(threading.local):
    """Per thread: a pinned host buffer per device (a plan() waits for its own read before it
    returns, so the next plan() of the thread may reuse it), its numpy view, and the launches
    kept for repeated reads (`_launch_summary`)."""

    def __init__(self):
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.views: dict[torch.device, np.ndarray] = {}  # the buffers' numpy views
        self.launches: dict[tuple, _KeptLaunch] = {}

    def get(self, device: torch.device, size: int) -> torch.Tensor:
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < size:
            if buf is not None:
                self.launches.clear()  # (they hold the old buffer)
            buf = torch.empty(max(size, 1024) * 2, dtype=torch.int32, pin_memory=device.type == "cuda")
            self.buffers[device] = buf
            self.views[device] = buf.numpy()
        return buf


class _KeptLaunch(NamedTuple):
    """A summary launch made by address (`_launch_summary`), kept to be made again."""

    launcher: object  # the BoundKernel
    spec: tuple
    device: int
    grid: tuple
    args: list  # the launch's arguments, device tensors as their addresses
    result: tuple  # `_launch_summary`'s (buffer, sizes, total, programs)


_staging = _Staging()


@functools.lru_cache(maxsize=None)
def _summary_launcher(used_on_device: bool, per_program: int, lengths: bool = False):
    return bind(index_summary_kernel, BLOCK=_BLOCK, PER_PROGRAM=per_program, USED_ON_DEVICE=used_on_device,
                LENGTHS=lengths, num_warps=4)


def _summary_programs(num_indices: int) -> int:
    """Programs of `index_summary_kernel` over ``num_indices`` page indices (at least one)."""
    return max(1, -(-num_indices // _PER_PROGRAM))


def _memory_key(t: torch.Tensor | None) -> tuple | None:
    """What a summary launch reads of ``t`` by its address: where, how many, what type, flat."""
    return None if t is None else (t.data_ptr(), t.numel(), t.dtype, t.is_contiguous())


def _relaunch(launches: dict, key: tuple, used: int) -> tuple | None:
    """The launch kept in ``launches`` under ``key`` made again with ``used`` used indices; its
    `_launch_summary` result, or None when none is kept (or the kept kernel cannot take it)."""
    kept = launches.get(key)
    if kept is not None:
        args = kept.args.copy()
        args[_USED_AT] = used
        if kept.launcher.launch_addresses(kept.spec, kept.device, kept.grid, args):
            return kept.result
    return None


def _launch_summary(tensors: list[torch.Tensor], indices: torch.Tensor | None, used_host: int | None,
                    buf: torch.Tensor | None, copy_to: torch.Tensor | None = None, launches: dict | None = None,
                    key: tuple | None = None, page_size: int = 0) -> tuple[torch.Tensor, list[int], int, int]:
    """Launch `index_summary_kernel` (see `read_index_tensors`) into ``buf`` (None: this thread's
    staging buffer), the tensors copied to ``copy_to`` (None: ``buf``; else on ``indices``' GPU,
    the tensors then in pinned host memory); returns (buffer, tensor sizes, their total, programs).
    ``page_size`` > 0: the tensors are an indptr and its last_page_len, whose lengths the kernel
    works out too (LENGTHS, `read_paged_lengths`).

    A launch made by address is kept (per thread) under the memory it reads and writes: a plan()
    given the same index tensors again (a serving engine's fixed buffers) launches it again
    without working its arguments out. ``launches`` and ``key``: where to keep it instead, under
    the caller's key, which must tell apart every memory (address, entries, dtype, contiguity)
    the launch reads and writes, or the caller empties ``launches`` when one changes
    (`IndexRangeReader`: the indices' memory and the upload's size in its key, its own buffers
    dropped with their kept launches when they are replaced); such a caller makes a kept launch
    again itself (`_relaunch`) before it calls this."""
    if len(tensors) > MAX_TENSORS or (used_host is None and not tensors):
        raise ValueError(f"read_index_tensors: 1 to {MAX_TENSORS} tensors (the first an indptr when "
                         f"used_host is None), got {len(tensors)}")
    used = used_host or 0
    if launches is None:
        launches = _staging.launches
        key = (*map(_memory_key, tensors), _memory_key(indices), _memory_key(buf), _memory_key(copy_to),
               used_host is None, used > _I32_MAX, page_size)
        result = _relaunch(launches, key, used)
        if result is not None:
            return result
    given = (*tensors, indices)
    tensors = [t.contiguous() for t in tensors]  # the kernel reads flat memory (free when contiguous)
    indices = None if indices is None else indices.contiguous()
    device = (tensors[0] if tensors and copy_to is None else indices).device
    sizes = [t.numel() for t in tensors] + [0] * (MAX_TENSORS - len(tensors))
    n = sum(sizes)
    num_indices = 0 if indices is None else indices.numel()
    programs = _summary_programs(num_indices)
    if buf is None:
        buf = _staging.get(device, n + 2 * programs + (sizes[1] + _LENGTH_STATS if page_size else 0))
    first = tensors[0] if tensors else indices  # a placeholder pointer where a tensor is missing
    args = []
    for i in range(MAX_TENSORS):
        args += [tensors[i] if i < len(tensors) else first, sizes[i]]
    args += [indices if num_indices else first, num_indices, used, buf, buf if copy_to is None else copy_to, page_size]
    # Triton specialises this kernel on its pointers' dtypes and 16-byte alignment and its ints'
    # widths alone (every int is do_not_specialize): that key, shorter to work out than spec_key's
    at = [args[i].data_ptr() for i in _POINTER_ARGS]
    spec = (*[(args[i].dtype, a & 15 == 0) for i, a in zip(_POINTER_ARGS, at)], max(n, num_indices, used) > _I32_MAX)
    launcher = _summary_launcher(used_host is None, _PER_PROGRAM, page_size > 0)
    # device tensors as their addresses once the kernel is kept (BoundKernel.launch_addresses);
    # host tensors (pinned) as tensors: Triton maps pinned host memory to its device address
    addressed = list(args)
    for i, a in zip(_POINTER_ARGS, at):
        if not args[i].is_cpu:
            addressed[i] = a
    result = (buf, sizes, n, programs)
    if device.type in _BY_ADDRESS and launcher.launch_addresses(spec, device.index, (programs,), addressed):
        if all(t is c for t, c in zip(given, (*tensors, indices))):  # (no contiguous copy: addresses of their own)
            if len(launches) >= _KEPT_LAUNCHES:
                launches.clear()
            launches[key] = _KeptLaunch(launcher, spec, device.index, (programs,), addressed, result)
    else:
        launcher.launch_with_spec(spec, (programs,), args)
    return result


def _minmax(host: np.ndarray, n: int, programs: int) -> tuple[int, int]:
    """(min, max) of the programs' partials after ``n`` copied values (a few: Python's own
    min and max of their lists are quicker than numpy's reductions)."""
    return min(host[n:n + programs].tolist()), max(host[n + programs:n + 2 * programs].tolist())


def _read_back(device: torch.device, count: int) -> tuple[np.ndarray, np.ndarray]:
    """After a `_launch_summary` into this thread's staging buffer for ``device``: wait for the
    device's current stream, where the kernel went (`current_stream`; a stream wait, not an
    event: one CUDA call less), then (the buffer's int32 view, an int64 copy of its first
    ``count`` values)."""
    if device.type == "cuda":
        current_stream(device.index).synchronize()
    host = _staging.views[device]
    return host, host[:count].astype(np.int64)


def _used_range(host: np.ndarray, n: int, programs: int, used: int, num_indices: int) -> tuple[int, int] | None:
    """`_minmax` of a summary of ``used`` indices out of ``num_indices``: None when nothing is
    used, or too few indices are (the caller's check says so)."""
    return _minmax(host, n, programs) if 0 < used <= num_indices else None


def read_index_tensors(tensors: list[torch.Tensor], indices: torch.Tensor | None,
                       used_host: int | None) -> tuple[np.ndarray, tuple[int, int] | None]:
    """The 1-D int32 ``tensors`` (one device, at most `MAX_TENSORS`) concatenated on the host
    (as int64), and the (min, max) of the used ``indices`` (the first ``used_host``, or ``tensors[0][-1]``
    read on the device when ``used_host`` is None; None when no index is used or ``indices`` is
    None). One kernel launch and one wait; on the CPU (tests) the kernel runs in Triton's
    interpreter."""
    buf, sizes, n, programs = _launch_summary(tensors, indices, used_host, None)
    host, flat = _read_back((tensors[0] if tensors else indices).device, n)
    used = int(flat[sizes[0] - 1]) if used_host is None else used_host
    return flat, _used_range(host, n, programs, used, 0 if indices is None else indices.numel())


def read_paged_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor | None,
                       page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int] | None,
                                                tuple[int, int] | None]:
    """`read_index_tensors` of an indptr and its last_page_len (int32, one device), whose kernel
    also works out each request's kv_len (`_paged_lengths`): (indptr, last_page_len, kv_lens, as
    int64 host arrays; the lengths' (sum, max), or None where an entry breaks the rules of
    `checks.paged_lengths`, which the host checks then name; the (min, max) of the used indices)."""
    buf, sizes, n, programs = _launch_summary([indptr, last_page_len], indices, None, None, page_size=page_size)
    batch, at = sizes[1], n + 2 * programs
    host, flat = _read_back(indptr.device, at + batch + _LENGTH_STATS)
    wrong, longest, low, high = flat[at + batch:].tolist()
    indptr_h, used = flat[:sizes[0]], int(flat[sizes[0] - 1])
    minmax = _used_range(host, n, programs, used, 0 if indices is None else indices.numel())
    stats = None if wrong else ((high << 32) | (low & 0xFFFFFFFF), longest)
    return indptr_h, flat[sizes[0]:n], flat[at:at + batch], stats, minmax


class IndexRangeReader:
    """Reads the (min, max) of ``indices[:used]`` (a CUDA tensor, 0 < used <= its entries) without
    waiting: `start` queues the reduction on the current stream into this reader's pinned buffer,
    with an event after it; `done` asks whether it has run, `result` waits for it and ends it.
    plan() with the lengths on the host thus reads no device value before it returns. One read
    at a time: `start` needs the last one ended (a wrapper keeps one reader)."""

    def __init__(self):
        self.pending = False
        self._buf: torch.Tensor | None = None  # pinned: the upload's source, then the (min, max) partials
        self._buf_np: np.ndarray | None = None
        self._event: torch.cuda.Event | None = None
        self._dst: torch.Tensor | None = None  # the upload's device buffer
        self._views: dict = {}  # upload sizes -> views of _dst
        self._launches: dict = {}  # its summary launches made by address (`_launch_summary`), for these buffers
        self._programs = self._n = 0

    def start(self, indices: torch.Tensor, used: int, upload: list[np.ndarray] | None = None
              ) -> list[torch.Tensor] | None:
        """Queue the read; ``upload``: int arrays for the device, copied by the same launch (from
        this reader's pinned buffer to its device buffer, int32) in place of a host->device
        copy. Returns their device tensors (None without ``upload``), rewritten by the next
        `start`: on one stream, every launch queued before it has read them."""
        if self.pending:
            raise RuntimeError("IndexRangeReader.start: the last read has not ended (call result())")
        programs = _summary_programs(indices.numel())
        sizes = [a.size for a in upload] if upload else []
        n = sum(sizes)
        if self._buf is None or self._buf.numel() < n + 2 * programs:
            self._buf = torch.empty(max(2 * (n + 2 * programs), 64), dtype=torch.int32, pin_memory=True)
            self._buf_np = self._buf.numpy()
            self._event = self._event or torch.cuda.Event()
            self._launches = {}  # (they name the old buffer)
        views = None
        if n:
            if self._dst is None or self._dst.numel() < n or self._dst.device != indices.device:
                self._dst = torch.empty(max(2 * n, 64), dtype=torch.int32, device=indices.device)
                self._views, self._launches = {}, {}
            np.concatenate(upload, out=self._buf_np[:n], casting="unsafe")
            views = self._views.get(tuple(sizes))
            if views is None:
                if len(self._views) >= _KEPT_VIEWS:  # a batch size each: kept for the sizes in use
                    self._views.clear()
                views = self._views[tuple(sizes)] = list(self._dst[:n].split_with_sizes(sizes))
        # its own buffers are fixed until replaced above (which drops their kept launches): no slice, no keys of theirs
        key = (n, _memory_key(indices), used > _I32_MAX)
        if _relaunch(self._launches, key, used) is None:
            _launch_summary([self._buf[:n]] if n else [], indices, used, self._buf, self._dst if n else None,
                            self._launches, key)
        self._event.record(current_stream(indices.device.index))
        self._programs, self._n, self.pending = programs, n, True
        return views

    def done(self) -> bool:
        """Whether the queued reduction has run (never waits)."""
        return self._event.query()

    def result(self) -> tuple[int, int]:
        """(min, max) of the used indices, after waiting for the reduction if it has not run yet."""
        self._event.synchronize()
        self.pending = False
        return _minmax(self._buf_np, self._n, self._programs)

    def __del__(self):
        if self.pending:  # the GPU may still read and write the pinned buffer: not back to the allocator before
            self._event.synchronize()
