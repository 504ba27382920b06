"""A finished request's full KV that the radix tree takes once the pool has room.

A plain server's finished request leaves its KV in the tree: its own slots become tree
nodes, nothing is allocated. A VERICACHE request offloaded to the host has no slots for
its compressed span, so its full KV can enter the tree only through new ones. Where the
pool binds (the requests still running hold every slot, the tree has nothing left to
evict) there are none at its end; without this module its KV would be lost, and the next
request with its prefix (a second turn, an agent's next step) would prefill it again.

:class:`HeldForTree` keeps such a request's full KV of its own positions on the host,
under the key the tree would have inserted (the request's tenant namespace: its
``extra_key`` and ``cache_salt``), and inserts it when a request's release frees slots
(:meth:`HeldForTree.insert_into`, called by the ``vc`` radix cache). Oldest first; past
``limit`` held tokens the oldest are dropped (counted), as a full tree evicts its least
recently used.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_vc import stats

from . import kernels

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HeldRows:
    """Full KV of key positions ``[start, start + n)`` of one finished request on the host
    (layer id -> ``[n, H, D]``); positions below ``start`` are the tree prefix it borrowed."""

    start: int
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return next(iter(self.k.values())).shape[0] if self.k else 0


class HeldForTree:
    """Finished requests' full KV waiting for pool room, oldest first."""

    def __init__(self, limit: int):
        self.limit = limit  # tokens held at most
        self.held: collections.deque[tuple[RadixKey, HeldRows]] = collections.deque()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.held)

    def add(self, key: RadixKey, rows: HeldRows) -> None:
        self.held.append((key, rows))
        self.tokens += rows.num_tokens
        stats.add("vericache", finished_kv_held=1, finished_kv_held_tokens=rows.num_tokens)
        while self.tokens > self.limit and self.held:
            self._drop("the held KV passed its bound")

    def clear(self) -> None:
        self.held.clear()
        self.tokens = 0

    def insert_into(self, cache, kv_pool) -> None:
        """Insert what fits into ``cache`` (a ``RadixCache``), oldest first; stops at the
        first that finds no room (a later release tries again)."""
        while self.held:
            key, rows = self.held[0]
            have, node = _match(cache, key)
            end = rows.start + rows.num_tokens
            if have >= end:  # an identical request put it there meanwhile
                self._pop()
                continue
            if have < rows.start:  # the prefix it borrowed was evicted: the rows alone do not key
                self._drop("the tree evicted the prefix it borrowed")
                continue
            if not _insert(cache, kv_pool, key[:end], rows, have, node):
                return
            self._pop()
            stats.add("vericache", finished_kv_kept=1, finished_kv_kept_later=1,
                      finished_kv_kept_tokens=end - have)

    def _pop(self) -> HeldRows:
        _, rows = self.held.popleft()
        self.tokens -= rows.num_tokens
        return rows

    def _drop(self, why: str) -> None:
        rows = self._pop()
        logger.info("VERICACHE: a finished request's %d held tokens of full KV are dropped: %s",
                    rows.num_tokens, why)
        stats.add("vericache", finished_kv_not_kept=1)


def _match(cache, key: RadixKey):
    r = cache.match_prefix(MatchPrefixParams(key=key))
    return int(r.device_prefix_len), r.last_device_node


def _insert(cache, kv_pool, key: RadixKey, rows: HeldRows, have: int, node) -> bool:
    """Positions ``[have, len(key))`` of ``rows`` into new slots and the tree, under a
    lock on the matched prefix (so the eviction that makes room spares it)."""
    n = len(key) - have
    lock = cache.lock(node) if have else None
    try:
        allocator = cache.token_to_kv_pool_allocator
        slots = allocator.alloc(n)
        if slots is None:
            evict_from_tree_cache(cache, n)
            slots = allocator.alloc(n)
        if slots is None:
            return False
        dev = kv_pool.get_key_buffer(next(iter(rows.k))).device
        at = slots.to(dev, torch.int64)
        skip = have - rows.start
        for layer_id in rows.k:  # host to device, once per layer
            kernels.write_rows(kv_pool.get_key_buffer(layer_id), at, rows.k[layer_id][skip:].to(dev))
            kernels.write_rows(kv_pool.get_value_buffer(layer_id), at, rows.v[layer_id][skip:].to(dev))
        prefix = cache.path_device_indices(node)[:have] if have else slots[:0]
        value = torch.cat([prefix.to(torch.int64), slots.to(torch.int64)])
        done = cache.insert(InsertParams(key=key, value=value, inserted_len=have)).prefix_len
        if done > have:  # the tree already held some of them: those new slots are duplicates
            allocator.free(slots[: done - have])
        return True
    finally:
        if lock is not None:
            cache.unlock(lock)
