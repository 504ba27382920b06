"""Device memory taken from SGLang's KV pool while it is needed, and given back after.

Compressed-KV serving keeps data the pool's token rows do not describe: a quantized
request's packed payload (:mod:`.payload_store`). Rather than a share of SGLang's KV budget
set aside at start-up (a smaller pool for every request, used or not), it leases a
contiguous run of the pool's own token slots: ``n`` slots ``[start, start + n)`` are ``n``
contiguous rows of every layer's K and V buffer, so the lease is ``2 * layers`` contiguous
byte regions that tensors can view. While leased the slots are out of SGLang's free list,
so its admission counts them as used; given back, they are free slots again.

A run is found over the allocator's sorted free list with tensor ops (one host read per
lease: a lease is taken when a request is compressed, never per iteration), at the highest
free addresses, since SGLang's allocator hands out the lowest first. Only SGLang's
token-granular allocator (``--page-size 1``) with the standard ``[slot, heads, dim]`` buffers
leases; anything else has no room (the caller's fallback, counted by the caller).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

ALIGN = 256  # bytes: every view starts at a multiple (any dtype's alignment, coalesced reads)


def aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


@dataclasses.dataclass(eq=False)
class PoolLease:
    """Slots ``[start, start + size)`` of the pool, out of SGLang's free list."""

    start: int
    size: int
    k: dict  # layer_id -> the lease's rows of that layer's K buffer, ``[size, H, D]``
    v: dict  # layer_id -> ... of its V buffer

    def region(self, layer_id: int, kind: str) -> torch.Tensor:
        """The lease's bytes of one layer's K (``kind == "k"``) or V buffer, flat uint8."""
        rows = (self.k if kind == "k" else self.v)[layer_id]
        return rows.view(-1).view(torch.uint8)

    def slots(self, device=None) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.size, dtype=torch.int64, device=device)


def slots_for(kv_pool, k_bytes: int, v_bytes: int) -> int:
    """Slots a lease needs to hold ``k_bytes`` in each layer's K region and ``v_bytes`` in
    each layer's V region."""
    k0 = kv_pool.get_key_buffer(kv_pool.start_layer)
    v0 = kv_pool.get_value_buffer(kv_pool.start_layer)
    per_k = k0[0].numel() * k0.element_size()
    per_v = v0[0].numel() * v0.element_size()
    return max(-(-int(k_bytes) // per_k), -(-int(v_bytes) // per_v), 1)


def _leasable(allocator, kv_pool) -> bool:
    k0 = kv_pool.get_key_buffer(kv_pool.start_layer)
    return (getattr(allocator, "page_size", 1) == 1 and k0.dim() == 3 and k0.is_contiguous()
            and getattr(allocator, "free_group", None) is None
            and isinstance(getattr(allocator, "free_pages", None), torch.Tensor))


def _take_run(allocator, n: int) -> Optional[int]:
    """The first slot of ``n`` contiguous free slots, taken out of the free list, or None.
    Reads SGLang 0.5.23's ``TokenToKVPoolAllocator`` lists (``free_pages``, and
    ``release_pages`` merged by its own ``merge_and_sort_free``): it has no call that hands
    out contiguous slots."""
    allocator.merge_and_sort_free()
    free = allocator.free_pages
    if free.numel() < n:
        return None
    free = torch.sort(free).values  # sorted already where SGLang sorts; a no-op order otherwise
    # run i..i+n-1 is contiguous iff its ends are n - 1 apart (the list has no duplicates)
    hits = torch.nonzero(free[n - 1 :] - free[: free.numel() - n + 1] == n - 1)
    if hits.numel() == 0:
        return None
    i = int(hits[-1, 0])  # the highest run: SGLang's allocator takes from the lowest
    start = int(free[i])
    allocator.free_pages = torch.cat((free[:i], free[i + n :]))
    return start


def take(allocator, kv_pool, n: int, evict: Optional[Callable[[int], object]] = None) -> Optional[PoolLease]:
    """A lease of ``n`` contiguous slots, or None where the pool has no such run even after
    ``evict(n)`` (the radix tree's unreferenced prefixes) made room."""
    if n <= 0 or not _leasable(allocator, kv_pool):
        return None
    start = _take_run(allocator, n)
    if start is None and evict is not None:
        evict(n)
        start = _take_run(allocator, n)
    if start is None:
        return None
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    return PoolLease(start, n, {lid: kv_pool.get_key_buffer(lid)[start : start + n] for lid in layers},
                     {lid: kv_pool.get_value_buffer(lid)[start : start + n] for lid in layers})


def give_back(allocator, lease: PoolLease) -> None:
    """The lease's slots are free slots of SGLang's allocator again (stream-ordered like
    any free: later writes to them run after what read the lease before)."""
    allocator.free(lease.slots(allocator.free_pages.device))
