"""The quantized payloads of a forward's requests as one table per layer, so that a kernel
attends every request's payload in one launch (``sgl_kernel_ext.PayloadBatch``).

Each request keeps its own payload tensors; the table holds their addresses. A payload's
rows of addresses (every layer's six) are built once, on its first use -- a payload is
replaced, never changed in place, when its tail is quantized -- and a forward's table
reaches the device in one non-blocking copy for all its layers. Built once per forward,
read by every layer: no host synchronisation inside a layer. Requests whose payloads
differ in layout (bits, groups) go in separate tables (:func:`group_by_layout`).

The launches are sized by ``max_tokens``, the longest member's rows rounded up to a
bucket (:func:`sgl_kernel_ext.bucket`: four per doubling): batches whose lengths fall in one bucket
launch the same grids over the same shapes (one CUDA graph per bucket); the kernels read
each member's true rows from ``num_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext.payload_batch import addresses, layout, to_device

from .index import CompressedKVIndex

ROWS_BUCKET = 256  # the smallest bucket of payload rows


@dataclasses.dataclass
class PayloadTable:
    """One forward's requests with a payload, one row each, for every layer."""

    ptrs: torch.Tensor  # [L, B, 6] int64 on the device
    num_tokens: torch.Tensor  # [B] int32 on the device
    max_tokens: int  # the launches' rows: the longest member's, bucketed
    like: dict  # layer_id -> the first request's Payload of that layer (layout, dtypes)
    index: dict  # layer_id -> its index in ptrs

    @property
    def layout(self) -> tuple:
        """What the members share and the launches are compiled for (bits, groups, heads,
        dtypes, strides): part of a launch shape."""
        return layout(next(iter(self.like.values())))

    def layer(self, layer_id: int) -> ext.PayloadBatch:
        return ext.PayloadBatch((self.like[layer_id],), self.ptrs[self.index[layer_id]], self.num_tokens,
                                self.max_tokens)


def _layer_ids(entry: CompressedKVIndex) -> list[int]:
    return sorted(entry.payload.layers)


def _address_rows(runtime, entry: CompressedKVIndex, layer_ids: list[int]) -> torch.Tensor:
    payload = entry.payload
    if payload.addresses is None:
        payload.addresses = torch.tensor([addresses(runtime.packed_payload(entry, lid)) for lid in layer_ids],
                                         dtype=torch.int64)
    return payload.addresses


def group_by_layout(runtime, entries: Sequence[CompressedKVIndex]) -> list[list[int]]:
    """Indices of ``entries`` (each with a payload) grouped by payload layout: one table
    (one launch per layer) per group; a server has one group unless requests ask for
    different bits."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(entries):
        first = _layer_ids(e)[0]
        groups.setdefault((first, layout(runtime.packed_payload(e, first))), []).append(i)
    return list(groups.values())


def build(runtime, entries: Sequence[CompressedKVIndex], device) -> PayloadTable:
    """The table of ``entries`` (one layout, each with a payload)."""
    layer_ids = _layer_ids(entries[0])
    rows = torch.stack([_address_rows(runtime, e, layer_ids) for e in entries], dim=1)  # [L, B, 6]
    n = [e.num_payload_rows for e in entries]
    like = {lid: runtime.packed_payload(entries[0], lid) for lid in layer_ids}
    return PayloadTable(to_device(rows, device), to_device(torch.tensor(n, dtype=torch.int32), device),
                        ext.bucket(max(n), ROWS_BUCKET), like, {lid: i for i, lid in enumerate(layer_ids)})
