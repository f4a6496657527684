"""How the reference walks a batch: requests grouped into padded chunks that fit a memory budget.

Requests are sorted by (qo_len, kv_len) and packed greedily into `KVGroup`s: the keys and values
of a group are gathered once into a padded [requests, keys, kv_heads, dim] float32 tensor. Each
group's query rows are cut into `RowBlock`s whose score tensor [requests, heads, rows, keys]
stays under the budget too, so a long single prefill runs in slices of rows.
Everything here is built at plan time, on the run device, from the host-side lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .positions import visible_keys

# Float32 elements one padded K/V gather or score tensor may hold.
ELEMENT_BUDGET = {"cpu": 1 << 24, "cuda": 1 << 27}


@dataclass
class RowBlock:
    """A slice of query rows of every request of a group (padded to ``rows.shape[1]``)."""

    rows: torch.Tensor      # [nb, qc] q row of each slot (0 for padding)
    pos: torch.Tensor       # [nb, qc] position of each slot: i + kv_len - qo_len
    visible: torch.Tensor   # [nb, qc, kc] keys each slot attends to
    src: torch.Tensor       # [n] flat slots (in nb * qc) holding real rows ...
    dest: torch.Tensor      # [n] ... and the output rows they go to


@dataclass
class KVGroup:
    """Requests whose keys are gathered together, padded to ``kc`` keys (at least 1)."""

    kv_len: torch.Tensor        # [nb]
    kc: int
    token: torch.Tensor | None  # [nb, kc] page id (paged) or KV row (ragged); None: no keys at all
    slot: torch.Tensor | None   # [nb, kc] slot within the page (paged)
    blocks: list[RowBlock]


@dataclass(frozen=True)
class BatchShape:
    """What grouping needs to know about a batch (lengths from the host, index tensors on device)."""

    qo_lens: list[int]
    kv_lens: list[int]
    kv_indptr: torch.Tensor          # tokens (ragged) or pages (paged), on device
    kv_indices: torch.Tensor | None  # page ids (paged)
    page_size: int                   # 0: ragged
    num_qo_heads: int
    kv_elems_per_token: int          # kv_heads * (head_dim_qk + head_dim_vo)


def _partition(shape: BatchShape, budget: int) -> list[list[int]]:
    """Requests with rows, sorted by size, packed greedily under the K/V gather budget."""
    order = sorted((b for b, q in enumerate(shape.qo_lens) if q > 0),
                   key=lambda b: (shape.qo_lens[b], shape.kv_lens[b]))
    per_key = max(shape.kv_elems_per_token, shape.num_qo_heads)
    groups: list[list[int]] = []
    kmax = 0
    for b in order:
        k = max(kmax, shape.kv_lens[b], 1)
        if groups and (len(groups[-1]) + 1) * k * per_key <= budget:
            groups[-1].append(b)
        else:
            groups.append([b])
            k = max(shape.kv_lens[b], 1)
        kmax = k
    return groups


def _token_index(shape: BatchShape, req: torch.Tensor, kv_len: torch.Tensor, kc: int):
    """(token, slot) [nb, kc] for a group's keys; padding points at a real token (masked later)."""
    j = torch.arange(kc, device=req.device)[None, :]
    valid = j < kv_len[:, None]
    start = shape.kv_indptr[req].long()[:, None]
    if shape.page_size == 0:
        return torch.where(valid, start + j, 0), None
    page_pos = torch.where(valid, start + j // shape.page_size, 0)
    return shape.kv_indices[page_pos].long(), j.expand_as(page_pos) % shape.page_size


def unpack_mask_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n] -> bool [8n], bit i of byte n at 8n + i (bitorder little)."""
    shifts = torch.arange(8, device=packed.device)
    return ((packed.long()[:, None] >> shifts) & 1).bool().flatten()


def plan_groups(shape: BatchShape, device: torch.device, *, causal: bool, window_left: int,
                mask_bits: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None
                ) -> list[KVGroup]:
    """The groups and row blocks of a batch. ``mask_bits`` (unpacked custom mask) with
    ``mask_indptr`` (byte offset of each request) replaces ``causal`` when given."""
    budget = ELEMENT_BUDGET.get(device.type, ELEMENT_BUDGET["cuda"])
    q_start = [0]
    for q in shape.qo_lens:
        q_start.append(q_start[-1] + q)
    groups = []
    for members in _partition(shape, budget):
        req = torch.tensor(members, device=device)
        q_len_h = torch.tensor([shape.qo_lens[b] for b in members])
        kv_len_h = torch.tensor([shape.kv_lens[b] for b in members])
        q_len, kv_len = q_len_h.to(device), kv_len_h.to(device)
        kmax, qmax = int(kv_len_h.max()), int(q_len_h.max())
        kc = max(kmax, 1)
        token, slot = _token_index(shape, req, kv_len, kc) if kmax > 0 else (None, None)
        qc = max(1, min(qmax, budget // (len(members) * shape.num_qo_heads * kc)))
        first_row = torch.tensor([q_start[b] for b in members])
        blocks = []
        for i0 in range(0, qmax, qc):
            i = torch.arange(i0, min(i0 + qc, qmax))
            real = i[None, :] < q_len_h[:, None]
            rows = torch.where(real, first_row[:, None] + i[None, :], 0)
            src = real.flatten().nonzero().squeeze(1)
            i_dev, real_dev = i.to(device), real.to(device)
            pos = i_dev[None, :] + (kv_len - q_len)[:, None]
            custom = None
            if mask_bits is not None and kmax > 0:
                j = torch.arange(kc, device=device)
                bit = (mask_indptr[req].long() * 8)[:, None, None] + i_dev[None, :, None] * kv_len[:, None, None] + j
                in_range = real_dev[:, :, None] & (j < kv_len[:, None, None])
                custom = mask_bits[torch.where(in_range, bit, 0)] & in_range
            visible = visible_keys(pos, kv_len, kc, causal and mask_bits is None, window_left, custom)
            blocks.append(RowBlock(rows.to(device), pos, visible, src.to(device),
                                   rows.flatten()[src].to(device)))
        groups.append(KVGroup(kv_len, kc, token, slot, blocks))
    return groups


def gather_keys(cache: torch.Tensor, group: KVGroup, layout: str) -> torch.Tensor:
    """float32 [nb, kc, ...] entries of a group's tokens. ``layout``: ``"ragged"`` ([tokens, ...]),
    ``"NHD"`` ([pages, page_size, ...]) or ``"HND"`` ([pages, heads, page_size, dim]); any strides.
    Zeros (one padding key) when the group has no keys."""
    if group.token is None:
        if layout == "ragged":
            rest = cache.shape[1:]
        elif layout == "HND":
            rest = (cache.shape[1], cache.shape[3])
        else:
            rest = cache.shape[2:]
        return torch.zeros(group.kv_len.shape[0], 1, *rest, dtype=torch.float32, device=cache.device)
    if layout == "ragged":
        picked = cache[group.token]
    elif layout == "HND":
        picked = cache[group.token, :, group.slot]
    else:
        picked = cache[group.token, group.slot]
    return picked.to(torch.float32)
