"""Bit packing for custom masks: ``packbits`` and ``segment_packbits`` (FlashInfer's API).

Masks are consumed with ``bitorder="little"``: bit ``i`` of byte ``k`` is element ``8k + i``.
"""
from __future__ import annotations

import torch

from .checks import check_tensor

_BITORDERS = ("big", "little")


def _check_bitorder(bitorder: str) -> None:
    if not isinstance(bitorder, str) or bitorder not in _BITORDERS:
        raise ValueError(f"bitorder={bitorder!r} not in {list(_BITORDERS)}")


def _check_bits(x, name: str = "x") -> None:
    """``x``: a 1-D tensor of bool or integer dtype (numpy.packbits' input types; float is refused).
    Its values are not read: as in numpy, any nonzero element packs as a 1 bit."""
    check_tensor(x, name, ndim=1)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"{name}.dtype={str(x.dtype).replace('torch.', '')} is not accepted; expected bool or an "
                        "integer dtype holding 0/1")


def _weights(bitorder: str, device) -> torch.Tensor:
    """uint8 [8]: the value of bit j of a byte (``bitorder`` already checked)."""
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    return w if bitorder == "little" else w.flip(0)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack the elements of a binary-valued 1-D tensor into bits of a uint8 tensor.

    Parameters
    ----------
    x : torch.Tensor
        The 1-D binary-valued tensor to pack: bool, or an integer dtype (nonzero packs as 1).
    bitorder : str
        ``"big"`` (first element in the most significant bit, numpy's default) or ``"little"``.

    Returns
    -------
    torch.Tensor
        uint8 tensor of ``ceil(x.numel() / 8)`` bytes; the last byte is zero-padded.
    """
    _check_bits(x)
    _check_bitorder(bitorder)
    w = _weights(bitorder, x.device)
    flat = (x != 0).view(torch.uint8)  # one byte per element, 0 or 1
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * w).sum(-1, dtype=torch.uint8)  # at most 255: exact in uint8


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big") -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately into whole bytes.

    Parameters
    ----------
    x : torch.Tensor
        The 1-D binary-valued tensor (bool, or integers: nonzero packs as 1) holding all segments.
    indptr : torch.Tensor
        int32/int64 offsets of the segments in ``x``, shape ``[num_segments + 1]``.
    bitorder : str
        ``"big"`` or ``"little"`` (see `packbits`).

    Returns
    -------
    (y, new_indptr)
        ``y``: uint8 concatenation of the packed segments; ``new_indptr``: int32 byte offsets of
        each segment in ``y``, shape ``[num_segments + 1]``.
    """
    _check_bits(x)
    check_tensor(indptr, "indptr", ndim=1, dtypes=(torch.int32, torch.int64))
    _check_bitorder(bitorder)
    ip = indptr.to(device=x.device, dtype=torch.int64)
    if ip.numel() == 0:
        raise ValueError("indptr must have at least one entry (num_segments + 1)")
    seg_len = ip[1:] - ip[:-1]
    seg_bytes = (seg_len + 7) // 8
    new_indptr = torch.zeros_like(ip)
    new_indptr[1:] = torch.cumsum(seg_bytes, 0)
    # one read of the device values: the checks and the output size
    first, descending, last, total = torch.stack([ip[0], (seg_len < 0).any().long(), ip[-1], new_indptr[-1]]).tolist()
    if first < 0 or descending or last > x.numel():
        raise ValueError(f"indptr must start at >= 0, be non-decreasing and end within x ({x.numel()} elements); "
                         f"got indptr[0]={first}, indptr[-1]={last}")
    if x.is_cuda:  # one Triton kernel, no index tensors (bitpack.py)
        from .bitpack import pack_segments
        return pack_segments(x, ip, new_indptr, total, bitorder), new_indptr.to(torch.int32)
    if bool((seg_len % 8 == 0).all()):  # every segment is whole bytes: one packbits over all of them
        return packbits(x[first:last], bitorder), new_indptr.to(torch.int32)
    seg_of_byte = torch.repeat_interleave(torch.arange(seg_len.numel(), device=x.device), seg_bytes)
    byte_in_seg = torch.arange(total, device=x.device) - new_indptr[seg_of_byte]
    bit = byte_in_seg[:, None] * 8 + torch.arange(8, device=x.device)
    valid = bit < seg_len[seg_of_byte][:, None]
    src = (ip[seg_of_byte][:, None] + bit).clamp(max=max(x.numel() - 1, 0))
    flat = (x != 0).view(torch.uint8)
    bits = torch.where(valid, flat[src] if flat.numel() else torch.zeros_like(src, dtype=torch.uint8), 0)
    return (bits * _weights(bitorder, x.device)).sum(-1, dtype=torch.uint8), new_indptr.to(torch.int32)
