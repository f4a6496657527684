"""How the reference walks a batch: requests grouped into padded chunks that fit a memory budget.

Requests are sorted by (qo_len, kv_len) and packed greedily into `KVGroup`s: the keys and values
of a group are gathered once into a padded [requests, keys, kv_heads, dim] float32 tensor. Each
group's query rows are cut into `RowBlock`s whose score tensor [requests, heads, rows, keys]
stays under the budget too, so a long single prefill runs in slices of rows.
Plan time builds only the groups (O(batch), from the host-side lengths); key indices and row
blocks are made at run time, one group and one block at a time, so no plan holds memory in
proportion to the lengths it was given.
"""
from __future__ import annotations

from collections.abc import Iterator
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


@dataclass(frozen=True)
class Visibility:
    """Which keys a query row sees: causal, a left window, or a custom mask replacing causal."""

    causal: bool
    window_left: int
    mask_bits: torch.Tensor | None = None    # unpacked custom mask (bool, flat)
    mask_indptr: torch.Tensor | None = None  # byte offset of each request's mask


@dataclass
class KeyIndex:
    """Where a group's keys are: [nb, kc] page id (paged) or KV row (ragged), and slot in the page."""

    token: torch.Tensor
    slot: torch.Tensor | None   # None: ragged


@dataclass
class KVGroup:
    """Requests whose keys are gathered together, padded to ``kc`` keys (at least 1), with query
    rows taken ``qc`` at a time."""

    shape: BatchShape
    visibility: Visibility
    req: torch.Tensor           # [nb] request ids, on device
    kv_len: torch.Tensor        # [nb] on device
    q_len_host: torch.Tensor    # [nb]
    first_row: torch.Tensor     # [nb] host: first q row of each request
    kc: int
    qc: int
    has_keys: bool              # False: no request of the group has a key (kc is 1 padding key)

    def token_index(self) -> KeyIndex | None:
        """Where the group's keys are (None when it has none); padding points at a real token."""
        if not self.has_keys:
            return None
        shape = self.shape
        j = torch.arange(self.kc, device=self.req.device)[None, :]
        valid = j < self.kv_len[:, None]
        start = shape.kv_indptr[self.req].long()[:, None]
        if shape.page_size == 0:
            return KeyIndex(torch.where(valid, start + j, 0), None)
        page_pos = torch.where(valid, start + j // shape.page_size, 0)
        return KeyIndex(shape.kv_indices[page_pos].long(), j.expand_as(page_pos) % shape.page_size)

    def row_blocks(self) -> Iterator[RowBlock]:
        """The group's query rows, ``qc`` at a time, with the keys each row sees."""
        device, vis = self.req.device, self.visibility
        kc, q_len_host = self.kc, self.q_len_host
        q_len, qmax = q_len_host.to(device), int(q_len_host.max())
        custom_bits = vis.mask_bits if self.has_keys else None
        for i0 in range(0, qmax, self.qc):
            i = torch.arange(i0, min(i0 + self.qc, qmax))
            real = i[None, :] < q_len_host[:, None]
            rows = torch.where(real, self.first_row[:, None] + i[None, :], 0)
            src = real.flatten().nonzero().squeeze(1)
            i_dev, real_dev = i.to(device), real.to(device)
            pos = i_dev[None, :] + (self.kv_len - q_len)[:, None]
            custom = None
            if custom_bits is not None:
                j = torch.arange(kc, device=device)
                bit = ((vis.mask_indptr[self.req].long() * 8)[:, None, None]
                       + i_dev[None, :, None] * self.kv_len[:, None, None] + j)
                in_range = real_dev[:, :, None] & (j < self.kv_len[:, None, None])
                custom = custom_bits[torch.where(in_range, bit, 0)] & in_range
            visible = visible_keys(pos, self.kv_len, kc, vis.causal, vis.window_left, custom)
            yield RowBlock(rows.to(device), pos, visible, src.to(device), rows.flatten()[src].to(device))


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


def unpack_mask_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n] -> bool [8n], bit i of byte n at 8n + i (bitorder little)."""
    shifts = torch.arange(8, device=packed.device)
    return ((packed.long()[:, None] >> shifts) & 1).bool().flatten()


def plan_groups(shape: BatchShape, device: torch.device, visibility: Visibility) -> list[KVGroup]:
    """The groups of a batch, each with the row count ``qc`` that keeps its scores under the budget."""
    budget = ELEMENT_BUDGET.get(device.type, ELEMENT_BUDGET["cuda"])
    q_start = [0]
    for q in shape.qo_lens:
        q_start.append(q_start[-1] + q)
    groups = []
    for members in _partition(shape, budget):
        kv_len_host = torch.tensor([shape.kv_lens[b] for b in members])
        q_len_host = torch.tensor([shape.qo_lens[b] for b in members])
        kmax = int(kv_len_host.max())
        kc = max(kmax, 1)
        qc = max(1, min(int(q_len_host.max()), budget // (len(members) * shape.num_qo_heads * kc)))
        groups.append(KVGroup(shape, visibility, torch.tensor(members, device=device), kv_len_host.to(device),
                              q_len_host, torch.tensor([q_start[b] for b in members]), kc, qc, kmax > 0))
    return groups


def gather_keys(cache: torch.Tensor, group: KVGroup, index: KeyIndex | None, layout: str) -> torch.Tensor:
    """float32 [nb, kc, ...] entries of a group's tokens at ``index`` (`KVGroup.token_index`).
    ``layout``: ``"ragged"`` ([tokens, ...]), ``"NHD"`` ([pages, page_size, ...]) or ``"HND"``
    ([pages, heads, page_size, dim]); any strides. Zeros (one padding key) when ``index`` is None."""
    if index is None:
        if layout == "ragged":
            rest = cache.shape[1:]
        elif layout == "HND":
            rest = (cache.shape[1], cache.shape[3])
        else:
            rest = cache.shape[2:]
        return torch.zeros(group.kv_len.shape[0], 1, *rest, dtype=torch.float32, device=cache.device)
    if layout == "ragged":
        picked = cache[index.token]
    elif layout == "HND":
        picked = cache[index.token, :, index.slot]
    else:
        picked = cache[index.token, index.slot]
    return picked.to(torch.float32)
