"""The plan's device reads (`device_read`, `checks.host_arrays`): small index tensors and the used
page indices' (min, max) in one kernel and one wait, as the host reads them; the current stream;
repeated reads by address."""
from __future__ import annotations

import pytest
import torch

from flashdispatch import checks
from test_api_host import table


@pytest.mark.parametrize("lens, garbage", [
    ([5, 17, 0, 33], ()), ([5, 17, 0, 33], (-1, -7, 10 ** 6)), ([0, 0], ()), ([0, 0], (-3,)), ([], ()),
])
@pytest.mark.parametrize("on_host", [(False, False), (True, False), (False, True), (True, True)])
def test_one_copy_reader_matches_host_reader(lens, garbage, on_host):
    indptr, indices, last = table(lens, 8, garbage)
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    got, got_minmax = checks.read_in_one_copy([indptr, last], on_host, indices)
    assert all((g == w).all() and g.dtype == w.dtype for g, w in zip(got, want))
    assert got_minmax == want_minmax
    if int(indptr[-1]):
        used = indices[: int(indptr[-1])]
        assert want_minmax == (int(used.min()), int(used.max()))
    else:
        assert want_minmax is None


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["all", "indptr_on_host", "small_on_host"])
@pytest.mark.parametrize("garbage", [(), (-1, 10 ** 6)])
def test_cuda_tables_read_in_one_copy(where, garbage):
    indptr, indices, last = table([5, 17, 0, 33], 8, garbage=garbage)
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    dev_indptr = indptr if where != "all" else indptr.cuda()
    dev_last = last if where == "small_on_host" else last.cuda()
    got, got_minmax = checks.host_arrays([dev_indptr, dev_last], indices.cuda())
    assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax


@pytest.mark.gpu
def test_cuda_tables_read_waits_for_the_current_stream():
    """The read's kernel and its wait go to the current stream: tables written on a side stream
    behind a long kernel read as written, not as whatever the buffers held."""
    indptr, indices, last = table([5, 17, 0, 33], 8)
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    src = [t.cuda() for t in (indptr, last, indices)]
    dev = [torch.zeros_like(t) for t in src]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the tables are written
        for d, t in zip(dev, src):
            d.copy_(t)
        got, got_minmax = checks.host_arrays(dev[:2], dev[2])
    assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax


@pytest.mark.gpu
def test_current_stream_is_torchs_kept_per_handle():
    """device_read.current_stream is torch's current stream, inside a side stream's block too,
    one object per stream (kept: torch builds a new one at each call)."""
    from flashdispatch.device_read import current_stream
    main = current_stream(0)
    assert main == torch.cuda.current_stream(0) and current_stream(0) is main
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(0) == side and current_stream(0) is current_stream(0)
    assert current_stream(0) is main


@pytest.mark.gpu
def test_cuda_tables_read_again_by_address(monkeypatch):
    """Repeated reads launch the kept kernel with the device tensors as their addresses
    (BoundKernel.launch_addresses) and read the same, the plan's one read and the deferred
    page-index reader alike."""
    from flashdispatch import device_read
    from flashdispatch.backends.fa2.launch import BoundKernel
    addressed = []
    original = BoundKernel.launch_addresses

    def counting(self, *args):
        addressed.append(original(self, *args))
        return addressed[-1]

    monkeypatch.setattr(BoundKernel, "launch_addresses", counting)
    indptr, indices, last = table([5, 17, 0, 33], 8)
    want, want_minmax = checks.host_arrays([indptr, last], indices)
    dev = [t.cuda() for t in (indptr, last, indices)]
    for _ in range(3):
        got, got_minmax = checks.host_arrays(dev[:2], dev[2])
        assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax
    reader = device_read.IndexRangeReader()
    for _ in range(3):
        reader.start(dev[2], int(indptr[-1]))
        assert reader.result() == want_minmax
    assert addressed.count(True) >= 4, addressed


@pytest.mark.gpu
def test_kept_summary_launch_reads_what_the_tensors_hold_now():
    """A read repeated on the same index tensors makes the launch kept for their memory, and reads
    what they hold at that call: values rewritten in place (a new used count among them), a
    strided view of the same memory (its own launch, never kept), a smaller tensor at the same
    address (another key)."""
    from flashdispatch import device_read
    lens = [[5, 17, 0, 33], [40, 0, 8, 1], [0, 0, 0, 0], [64, 64, 64, 64]]
    tables = [table(n, 8, garbage=(7,) * (33 - sum(-(-x // 8) for x in n))) for n in lens]
    dev = [t.cuda() for t in tables[0]]
    device_read._staging.launches.clear()
    for i, (indptr, indices, last) in enumerate(tables * 2):
        for d, t in zip(dev, (indptr, indices, last)):
            d.copy_(t)
        want, want_minmax = checks.host_arrays([indptr, last], indices)
        got, got_minmax = checks.host_arrays([dev[0], dev[2]], dev[1])
        assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax, i
    assert len(device_read._staging.launches) == 1
    strided = torch.arange(2 * 33, dtype=torch.int32, device="cuda").flip(0)[::2]  # 64, 62, ..., 0
    whole = strided.contiguous()
    indptr = torch.tensor([0, 20, 33], dtype=torch.int32, device="cuda")
    last = torch.tensor([3, 8], dtype=torch.int32, device="cuda")
    for _ in range(2):
        got, got_minmax = checks.host_arrays([indptr, last], strided)
        assert got_minmax == (int(whole.min()), int(whole.max()))
        got, got_minmax = checks.host_arrays([indptr[:2], last[:1]], whole)
        assert got[0].tolist() == [0, 20] and got_minmax == (int(whole[:20].min()), int(whole[:20].max()))
    assert len(device_read._staging.launches) == 2  # the slices' kept too; the strided view's never is


@pytest.mark.parametrize("used", [0, 1, 2500, 4096, 5000])
@pytest.mark.parametrize("used_on_device", [True, False])
def test_device_read_reduces_only_the_used_indices_over_several_programs(monkeypatch, used, used_on_device):
    """Index reads split over several programs (1024 indices each here) agree with numpy, count
    only the first ``used`` indices, and report none when too few indices exist."""
    from flashdispatch import device_read
    monkeypatch.setattr(device_read, "_PER_PROGRAM", 1024)
    g = torch.Generator().manual_seed(used)
    indices = torch.randint(0, 10 ** 6, (4096,), generator=g, dtype=torch.int32)
    indptr = torch.tensor([0, used // 2, used], dtype=torch.int32)
    last = torch.randint(1, 17, (2,), generator=g, dtype=torch.int32)
    tensors = [indptr, last] if used_on_device else [last]
    flat, minmax = device_read.read_index_tensors(tensors, indices, None if used_on_device else used)
    assert flat.tolist() == torch.cat(tensors).tolist()
    if 0 < used <= indices.numel():
        assert minmax == (int(indices[:used].min()), int(indices[:used].max()))
    else:
        assert minmax is None


def test_strided_index_tensors_read_like_the_host():
    """Index tensors that are strided views (a column of a table, every other page) read the
    same through the device path as on the host."""
    table_ = torch.tensor([[0, 5], [2, 1], [5, 7], [9, 3]], dtype=torch.int32)
    indptr, last = table_[:, 0], table_[1:, 1]
    indices = torch.arange(40, dtype=torch.int32).flip(0)[::4]
    want, want_minmax = checks.host_arrays([indptr.contiguous(), last.contiguous()], indices.contiguous())
    for on_host in [(False, False), (True, False), (False, True)]:
        got, got_minmax = checks.read_in_one_copy([indptr, last], on_host, indices)
        assert all((g == w).all() for g, w in zip(got, want)) and got_minmax == want_minmax, on_host


@pytest.mark.parametrize("used", [0, 3, 40])
def test_summary_copies_to_its_own_destination(used):
    """With ``copy_to`` the launch copies the tensors there (the host lengths' upload) and leaves
    the (min, max) partials in the buffer after them, as `IndexRangeReader` reads them."""
    from flashdispatch import device_read
    g = torch.Generator().manual_seed(used)
    indices = torch.randint(-5, 10 ** 6, (40,), generator=g, dtype=torch.int32)
    src = torch.randint(0, 1000, (9,), generator=g, dtype=torch.int32)
    dst = torch.full((16,), -1, dtype=torch.int32)
    buf = torch.zeros(64, dtype=torch.int32)
    _, _, n, programs = device_read._launch_summary([src], indices, used, buf, copy_to=dst)
    assert n == 9 and dst[:9].tolist() == src.tolist() and (dst[9:] == -1).all()
    if used:
        assert device_read._minmax(buf.numpy(), n, programs) == (int(indices[:used].min()), int(indices[:used].max()))


@pytest.mark.gpu
def test_range_reader_uploads_host_arrays_with_its_launch():
    """`IndexRangeReader.start` with ``upload``: the arrays arrive on the GPU as int32 (the same
    tensors again for the same sizes, new ones for new sizes) and the (min, max) reads as without."""
    import numpy as np
    from flashdispatch import device_read
    indices = torch.randint(0, 10 ** 6, (5000,), dtype=torch.int32, device="cuda")
    reader = device_read.IndexRangeReader()
    seen = []
    for sizes, used in [((5, 4), 100), ((5, 4), 4999), ((300, 299), 5000), ((5, 4), 7)]:
        arrays = [np.random.default_rng(used).integers(0, 1 << 30, n) for n in sizes]
        got = reader.start(indices, used, arrays)
        assert reader.result() == (int(indices[:used].min()), int(indices[:used].max()))
        assert [t.dtype for t in got] == [torch.int32] * 2 and all(t.is_cuda for t in got)
        assert all(t.cpu().tolist() == a.tolist() for t, a in zip(got, arrays))
        seen.append(got[0])
    assert seen[1] is seen[0] and seen[2] is not seen[1]


@pytest.mark.gpu
def test_range_reader_makes_its_kept_launch_again_with_what_its_inputs_hold_now(monkeypatch):
    """`IndexRangeReader.start` keeps its launches under its own key (the upload's size, the
    indices' memory, the used count's width): a start like an earlier one makes that launch again
    without `_launch_summary`, and it reads what the indices and the upload hold now; other
    indices and another upload size launch afresh, and so does every key after its pinned
    buffer (more programs) or its device buffer (a larger upload) grew."""
    import numpy as np
    from flashdispatch import device_read
    fresh = []
    summary = device_read._launch_summary
    monkeypatch.setattr(device_read, "_launch_summary", lambda *args: fresh.append(1) or summary(*args))
    gen = torch.Generator(device="cuda").manual_seed(3)
    a, b, c = (torch.randint(0, 10 ** 6, (n,), dtype=torch.int32, device="cuda", generator=gen)
               for n in (5000, 9000, 150000))
    reader = device_read.IndexRangeReader()
    reader.start(a, 10)  # compiles the kernel (a process's first launch is not kept), under another key
    reader.result()
    rng = np.random.default_rng(0)
    # (indices, used, upload sizes, launched afresh); the third rewrites a in place first; c's 74
    # programs grow the pinned buffer (64 -> 314 entries), the upload of 200 the device one (64 -> 400)
    steps = [(a, 100, (5, 4), True), (a, 4000, (5, 4), False), (a, 4000, (5, 4), False), (b, 9000, (5, 4), True),
             (a, 50, (5, 4), False), (c, 150000, (5, 4), True), (a, 50, (5, 4), True), (a, 60, (100, 100), True),
             (a, 60, (5, 4), True), (a, 70, (5, 4), False)]
    for i, (indices, used, sizes, afresh) in enumerate(steps):
        if i == 2:
            a.random_(0, 10 ** 6, generator=gen)
        arrays = [rng.integers(0, 1 << 30, n) for n in sizes]
        before = len(fresh)
        got = reader.start(indices, used, arrays)
        assert reader.result() == (int(indices[:used].min()), int(indices[:used].max())), i
        assert [t.cpu().tolist() for t in got] == [x.tolist() for x in arrays], i
        assert (len(fresh) > before) == afresh, i


@pytest.mark.gpu
def test_range_reader_keeps_the_views_of_a_few_upload_sizes(monkeypatch):
    """A reader keeps device views for at most `_KEPT_VIEWS` upload layouts (batch sizes); past
    them it starts again, and every upload still arrives whole."""
    import numpy as np
    from flashdispatch import device_read
    monkeypatch.setattr(device_read, "_KEPT_VIEWS", 2)
    indices = torch.randint(0, 1000, (600,), dtype=torch.int32, device="cuda")
    reader = device_read.IndexRangeReader()
    for batch in (3, 4, 5, 3, 9):
        arrays = [np.arange(batch + 1) * 7, np.full(batch, batch)]
        got = reader.start(indices, 600, arrays)
        reader.result()
        assert [t.cpu().tolist() for t in got] == [a.tolist() for a in arrays]
        assert len(reader._views) <= 2


def test_kept_summary_launches_pass_what_a_fresh_launch_would(monkeypatch):
    """Whenever `_launch_summary` launches a kept argument list, that list is the one it would
    work out afresh for the same call: same kernel key, grid and arguments (each tensor's memory,
    sizes, the used count), over the same tensors rewritten, a new used count, slices, a strided
    view (never kept), a new tensor of other sizes, the lengths' page size. Runs on the CPU with the launcher recorded
    and CPU launches let through the by-address path (on a GPU they are the CUDA ones)."""
    from flashdispatch import device_read

    class Recorder:
        def __init__(self):
            self.calls = []

        def launch_addresses(self, spec, device, grid, args):
            self.calls.append((spec, grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]))
            return True

        def launch_with_spec(self, spec, grid, args):
            raise AssertionError("every launch goes by address here")

    recorder = Recorder()
    monkeypatch.setattr(device_read, "_summary_launcher", lambda *a: recorder)
    monkeypatch.setattr(device_read, "_BY_ADDRESS", frozenset({"cpu"}))
    monkeypatch.setattr(device_read, "_PER_PROGRAM", 1024)
    monkeypatch.setattr(device_read._staging, "launches", {})
    indptr = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    last = torch.tensor([5, 0, 2], dtype=torch.int32)
    indices = torch.arange(3000, dtype=torch.int32)
    base = torch.arange(6000, dtype=torch.int32)
    head, strided = base[:3000], base[::2]  # the same address and entries, one of them strided
    calls = [([indptr, last], indices, None), ([indptr, last], indices, None), ([last], indices, 7),
             ([last], indices, 2999), ([indptr[:3], last[:2]], indices, None), ([indptr, last], head, None),
             ([indptr, last], strided, None), ([indptr, last], strided, None), ([indptr, last], indices[:2000], None),
             ([indptr], None, None), ([indptr, last], indices, None)]
    calls = [(*c, 0) for c in calls] + [([indptr, last], indices, None, 16), ([indptr, last], indices, None, 8)]
    kept_launches = 0
    for i, (tensors, idx, used, page_size) in enumerate(calls * 2):
        if i == len(calls):
            indptr.copy_(torch.tensor([0, 1, 2, 2], dtype=torch.int32))  # rewritten in place: same memory
        kept = device_read._staging.launches.get(
            (*map(device_read._memory_key, tensors), device_read._memory_key(idx), None, None, used is None,
             False, page_size))
        kept_launches += kept is not None
        device_read._launch_summary(tensors, idx, used, None, page_size=page_size)
        got = recorder.calls[-1]
        saved = device_read._staging.launches
        monkeypatch.setattr(device_read._staging, "launches", {})
        device_read._launch_summary(tensors, idx, used, None, page_size=page_size)  # worked out afresh
        monkeypatch.setattr(device_read._staging, "launches", saved)
        fresh = recorder.calls[-1]
        if idx is strided:  # read from a contiguous copy, whose address is its own each time
            assert got[2][6] != strided.data_ptr(), i
            got, fresh = (got[0], got[1], got[2][:6] + got[2][7:]), (fresh[0], fresh[1], fresh[2][:6] + fresh[2][7:])
        assert got == fresh, i
    assert kept_launches == 14, kept_launches  # 3 in the first round, then every call but the strided ones
    assert not any(device_read._memory_key(strided) in key for key in device_read._staging.launches)
