"""Quantized payloads in pool slots leased for them (:mod:`.pool_lease`).

A request quantized with KIVI (or SpeCache's 1-2 bit copy) frees the slots of the tokens it
quantized and keeps their packed codes, scales and zeros. Those live in a lease of the
pool's own slots taken when the request is compressed and given back when it ends: layer
``l``'s K fields in the lease's rows of layer ``l``'s K buffer, its V fields in its V
buffer's, each field a contiguous tensor sized for ``capacity`` tokens and read as its
first ``num_quantized`` rows (a decode tail quantized later is written after them while
the capacity lasts). Nothing is set aside at start-up: a server whose requests are not
quantized has SGLang's pool, every slot of it. A request whose payload finds no run of
free slots is not quantized into a payload (the runtime's fallback, counted).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from sglang_vc.compress.base import QuantizedKV

from . import pool_lease
from .pool_lease import PoolLease, aligned

K_FIELDS = ("k_payload", "k_scales", "k_zeros")
V_FIELDS = ("v_payload", "v_scales", "v_zeros")


@dataclasses.dataclass(eq=False)
class PayloadHome:
    """One request's payload fields, every layer, for up to ``capacity`` tokens."""

    lease: PoolLease
    capacity: int
    views: dict  # layer_id -> field -> tensor of ``capacity`` tokens' rows

    def put(self, q: QuantizedKV) -> QuantizedKV:
        """``q`` (its first ``num_quantized`` tokens) copied into its layer's views: the
        same payload, read from the lease."""
        fields = self.views[q.layer_idx]
        rows = {f: getattr(q, f).shape[0] for f in K_FIELDS + V_FIELDS}
        for f, n in rows.items():
            fields[f][:n].copy_(getattr(q, f))
        return dataclasses.replace(q, **{f: fields[f][:n] for f, n in rows.items()})

    def append(self, q: QuantizedKV, tail: QuantizedKV) -> QuantizedKV:
        """``q`` (in this home) followed by ``tail``'s quantized tokens, written after it."""
        fields = self.views[q.layer_idx]
        out = {}
        for f in K_FIELDS + V_FIELDS:
            a, b = getattr(q, f).shape[0], getattr(tail, f).shape[0]
            fields[f][a : a + b].copy_(getattr(tail, f))
            out[f] = fields[f][: a + b]
        return dataclasses.replace(q, num_tokens=q.num_tokens + tail.num_quantized,
                                   num_quantized=q.num_quantized + tail.num_quantized, **out)

    def holds(self, num_quantized: int) -> bool:
        return num_quantized <= self.capacity


def _rows_for(q: QuantizedKV, field: str, capacity: int) -> int:
    """Rows ``field`` takes for ``capacity`` tokens (codes one per token, key scales one per
    group of tokens)."""
    return capacity * getattr(q, field).shape[0] // q.num_quantized


def _layout(q: QuantizedKV, capacity: int, fields: tuple) -> tuple[list, int]:
    """``(field, offset, shape, dtype)`` of each field in its region, and the bytes used."""
    out, offset = [], 0
    for f in fields:
        t = getattr(q, f)
        shape = (_rows_for(q, f, capacity), *t.shape[1:])
        out.append((f, offset, shape, t.dtype))
        offset += aligned(_numel(shape) * t.element_size())
    return out, offset


class PayloadStore:
    """Leases for payloads, over SGLang's allocator and KV pool."""

    def __init__(self, allocator, kv_pool, evict: Optional[Callable[[int], object]] = None):
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.evict = evict
        self.leased_slots = 0
        self.peak_slots = 0

    def home(self, like: QuantizedKV, capacity: int) -> Optional[PayloadHome]:
        """A home for every layer's payload shaped like ``like`` (a quantized layer of the
        request), ``capacity`` tokens (a multiple of its group size), or None: no run of
        free slots for it."""
        k_layout, k_bytes = _layout(like, capacity, K_FIELDS)
        v_layout, v_bytes = _layout(like, capacity, V_FIELDS)
        n = pool_lease.slots_for(self.kv_pool, k_bytes, v_bytes)
        lease = pool_lease.take(self.allocator, self.kv_pool, n, self.evict)
        if lease is None:
            return None
        views = {}
        for lid in lease.k:
            fields = {}
            for kind, layout in (("k", k_layout), ("v", v_layout)):
                region = lease.region(lid, kind)
                for f, offset, shape, dtype in layout:
                    nbytes = _numel(shape) * dtype.itemsize
                    fields[f] = region[offset : offset + nbytes].view(dtype).view(shape)
            views[lid] = fields
        self.leased_slots += n
        self.peak_slots = max(self.peak_slots, self.leased_slots)
        return PayloadHome(lease, capacity, views)

    def release(self, home: Optional[PayloadHome]) -> int:
        """Give ``home``'s slots back; the number of slots."""
        if home is None:
            return 0
        pool_lease.give_back(self.allocator, home.lease)
        self.leased_slots -= home.lease.size
        return home.lease.size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
