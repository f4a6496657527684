"""The block-table entry points (TensorRT-LLM / XQA style: block_tables + seq_lens, no plan):
the page table they build, and fa2 on requests long enough to split, whose partials go to the
caller's workspace_buffer."""
import numpy as np
import pytest
import torch

import flashdispatch as fi
from flashdispatch.page import block_table_to_indptr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_to_indptr_takes_each_requests_pages_in_use(device):
    """Each request's first ceil(len / page) table entries, end to end, from a strided table with
    negative entries past the pages in use (never read); the pages' (min, max) checked and read."""
    torch.manual_seed(4)
    wide = torch.randint(-50, 0, (5, 16), dtype=torch.int32)
    lens = torch.tensor([9, 0, 40, 1, 17], dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        wide[b, :2 * (-(-n // 8))] = torch.randperm(100)[: 2 * (-(-n // 8))].int()
    tables = wide[:, ::2].to(device)  # [5, 8], stride 2: the gather reads a view as it is
    indptr, indices, last, kv_lens, max_page = block_table_to_indptr(tables, lens.to(device), 8)
    pages = [-(-n // 8) for n in lens.tolist()]
    want = torch.cat([wide[b, ::2][:p] for b, p in enumerate(pages)])
    assert indptr.tolist() == [0, *np.cumsum(pages).tolist()] and indptr.device.type == "cpu"
    assert indices.device == tables.device and torch.equal(indices.cpu(), want)
    assert last.tolist() == [1, 0, 8, 1, 1] and kv_lens.tolist() == lens.tolist()
    assert max_page == int(want.max())
    assert block_table_to_indptr(tables, lens, 8, check_indices=False).max_page is None
    empty = block_table_to_indptr(tables, torch.zeros(5, dtype=torch.int32), 8)
    assert empty.indices.numel() == 0 and empty.max_page == -1 and empty.indptr.tolist() == [0] * 6
    tables[3, 0] = -6  # request 3 uses its first page
    with pytest.raises(ValueError, match="block_tables holds a negative page index -6"):
        block_table_to_indptr(tables, lens, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_trtllm_and_xqa_decode_on_fa2_split_long_requests_in_the_callers_workspace(device):
    """A request long enough for fa2 to split: its partials go to workspace_buffer (it was passed
    on as no workspace, and such a call raised 'float_workspace_buffer too small: 0 bytes')."""
    torch.manual_seed(5)
    page, hq, hkv, d = 16, 4, 2, 64
    lens = torch.tensor([700, 5], dtype=torch.int32)
    tables = torch.randperm(100)[:90].int().view(2, 45)  # request 1 reads its first page only
    cache = torch.randn(100, 2, hkv, page, d).half()  # HND
    q = torch.randn(2, hq, d).half()
    args = [t.to(device) for t in (q, cache)]
    outs = {}
    for backend in ("fa2", "reference"):
        ws = torch.full((1 << 20,), 255, dtype=torch.uint8, device=device)
        outs[backend] = fi.trtllm_batch_decode_with_kv_cache(*args, ws, tables.to(device), lens.to(device), 720,
                                                             bmm1_scale=d ** -0.5, backend=backend)
        assert (ws != 255).any() == (backend == "fa2")  # fa2 split: partials in the caller's workspace
    assert rel(outs["fa2"], outs["reference"]) < 4e-3
    out = torch.empty(2, 1, hq, d, dtype=torch.float16, device=device)
    ws = torch.full((1 << 20,), 255, dtype=torch.uint8, device=device)
    nhd = cache.to(device).transpose(2, 3)  # [pages, 2, page, heads, d] views
    with fi.use_backends(["fa2"]):
        fi.xqa(args[0][:, None], nhd[:, 0], nhd[:, 1], tables.to(device), lens[:, None].to(device), out, ws, None,
               hkv, page)
    assert (ws != 255).any()
    assert rel(out[:, 0], outs["reference"]) < 4e-3


@pytest.mark.parametrize("device", DEVICES)
def test_trtllm_decode_calls_refresh_the_last_plan_for_new_tables(device, monkeypatch):
    """Calls of one problem and batch size refresh the last call's plan for their own lengths and
    tables (fa2 refreshes what it can, plans afresh otherwise): each equals the reference; a call
    with another workspace plans into that one."""
    from flashdispatch.dispatch.registry import get_backend
    backend = get_backend("fa2")
    real, refreshed = backend.replan, []
    monkeypatch.setattr(backend, "replan", lambda *a: refreshed.append(real(*a)) or refreshed[-1])
    torch.manual_seed(6)
    page, hq, hkv, d = 16, 4, 2, 64
    cache = torch.randn(100, 2, hkv, page, d).half().to(device)
    q = torch.randn(2, hq, d).half().to(device)
    workspaces = [torch.full((1 << 20,), 255, dtype=torch.uint8, device=device) for _ in range(2)]
    for i, lens in enumerate(([700, 5], [30, 400], [1, 17], [690, 9], [700, 5])):
        tables = torch.randperm(100)[:90].int().view(2, 45).to(device)
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        ws = workspaces[i == 4]
        outs = [fi.trtllm_batch_decode_with_kv_cache(q, cache, w, tables, seq, 720, bmm1_scale=d ** -0.5,
                                                     backend=b) for b, w in (("fa2", ws), ("reference", ws))]
        assert rel(outs[0], outs[1]) < 4e-3, lens
    assert any(p is not None for p in refreshed)  # at least one call took the last plan, refreshed
    assert (workspaces[1] != 255).any()  # the last call's split went to its own workspace


def test_a_workspace_buffer_that_is_not_a_tensor_on_the_querys_device_is_refused():
    q, cache = torch.randn(2, 4, 64).half(), torch.randn(10, 2, 2, 16, 64).half()
    tables, lens = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([5, 20], dtype=torch.int32)
    with pytest.raises(TypeError, match="workspace_buffer must be a torch.Tensor, got NoneType"):
        fi.trtllm_batch_decode_with_kv_cache(q, cache, None, tables, lens, 32, backend="fa2")
    with pytest.raises(ValueError, match="workspace_buffer is on meta, but the planned device is cpu"):
        fi.trtllm_batch_decode_with_kv_cache(q, cache, torch.zeros(16, dtype=torch.uint8, device="meta"), tables,
                                             lens, 32, backend="fa2")
