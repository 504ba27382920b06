"""EvicPress's device tier: contexts the utility policy keeps on the device, as nodes of
SGLang's radix tree that EvicPress pins (holds a lock reference on) so the tree's LRU
does not evict them, with a byte budget (``--evicpress-device-size-gb``).

It is a store with the same interface as the host and disk tiers (``put``/``get``/
``delete`` of a context's blob), so the manager moves contexts in and out of the device
with the same code as between the other tiers:

* ``put`` decodes the blob onto the device. A full copy is the context's own node,
  ``ids[:n]`` in the context's namespace (when a request just computed the context the
  rows are already there and are only pinned). A token-dropped copy is a private node of
  its ``n_keep`` kept rows (``evicpress:drop:...``, see :mod:`.radix`), pinned, plus the
  kept positions (small, kept here) so it can be read back as the same blob.
* ``get`` reads the device rows back into the blob they came from (bit-exact).
* ``delete`` unpins: the rows stay in the tree as an ordinary cached prefix until the
  LRU evicts them; the policy has already put the context's copy elsewhere.

Quantized configs are not kept on the device tier (a dequantized copy saves no device
memory and would need its own namespace); they live on the host and disk tiers.

Each placed copy is recorded against its tree node (:class:`DeviceCopy`), which is how
eviction and the API see a node's compression config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import torch

from . import codec
from .tier_store import TierStore
from .codec import FullKV
from .config import CompressionConfig


class DeviceTree(Protocol):
    """What the device tier needs from the radix cache (:class:`~.radix.EvicPressRadixCache`)."""

    bytes_per_token: int

    def place_full(self, ctx: Any, kv: Optional[FullKV]) -> Optional[Any]:
        """Pin ``ctx``'s full rows (writing ``kv`` first if they are not on the device);
        returns a pin handle, or None when there is no device room."""

    def place_dropped(self, ctx: Any, config: CompressionConfig, rows: FullKV) -> Optional[Any]:
        """Load and pin the private node of a token-dropped copy; a pin handle or None."""

    def read_pinned(self, pin: Any) -> FullKV:
        """The rows of a pinned copy."""

    def unpin(self, pin: Any) -> None:
        """Release a pin (the rows become an ordinary evictable cached prefix)."""


@dataclasses.dataclass
class DeviceCopy:
    """A context's copy placed on the device tier: the tree node holding it (inside the
    pin handle), its config, its footprint, and what reading it back needs."""

    ctx_id: str
    config: CompressionConfig
    pin: Any
    slots: int  # device pool slots the copy holds
    num_tokens: int  # context tokens the copy stands for
    positions: Optional[torch.Tensor] = None  # token-dropped: kept positions [L, H, n_keep]
    nbytes: int = 0  # bytes of the blob it was placed from


@dataclasses.dataclass
class DeviceTierStats:
    puts: int = 0
    put_rejected: int = 0
    write_errors: int = 0  # always 0: a put into the pool that fails did not fit
    gets: int = 0
    deletes: int = 0


class DeviceTierStore(TierStore):
    """The device tier as a blob store over pinned radix-tree nodes."""

    def __init__(self, tree: DeviceTree, capacity_bytes: int,
                 context_of: Callable[[str], Optional[Any]]) -> None:
        self.tree = tree
        self.capacity_bytes = int(capacity_bytes)
        self._context_of = context_of  # blob key -> the manager's context
        self.copies: dict[str, DeviceCopy] = {}
        self.stats = DeviceTierStats()

    # -------------------------------------------------------------- accounting
    def footprint(self, nbytes: int) -> int:
        return int(nbytes)

    @property
    def used_bytes(self) -> int:
        return sum(c.slots for c in self.copies.values()) * self.tree.bytes_per_token

    def __contains__(self, key: str) -> bool:
        return key in self.copies

    def __len__(self) -> int:
        return len(self.copies)

    def config_of(self, key: str) -> Optional[CompressionConfig]:
        copy = self.copies.get(key)
        return None if copy is None else copy.config

    # -------------------------------------------------------------- blob store
    def put(self, key: str, blob: bytes) -> bool:
        ctx = self._context_of(key)
        if ctx is None or key in self.copies:
            return False
        config, kv, positions = codec.decode(blob)
        if config.is_quantized:
            raise ValueError(f"the device tier keeps full or token-dropped copies, not {config.label}")
        slots = kv.num_tokens
        if (self.used_bytes + slots * self.tree.bytes_per_token) > self.capacity_bytes:
            self.stats.put_rejected += 1
            return False
        if config.drops_tokens:
            pin = self.tree.place_dropped(ctx, config, kv)
            num_tokens = int(codec.blob_tokens(blob))
        else:
            pin = self.tree.place_full(ctx, kv)
            num_tokens = slots
        if pin is None:
            self.stats.put_rejected += 1
            return False
        self.copies[key] = DeviceCopy(ctx.ctx_id, config, pin, slots, num_tokens, positions, len(blob))
        ctx.device_config = config  # the form requests find on the device
        self.stats.puts += 1
        return True

    def get(self, key: str) -> Optional[bytes]:
        copy = self.copies.get(key)
        if copy is None:
            return None
        self.stats.gets += 1
        rows = self.tree.read_pinned(copy.pin)
        if copy.config.drops_tokens:
            return codec.encode_kept(rows, copy.positions, copy.config, copy.num_tokens)
        return codec.encode(rows, copy.config)

    def delete(self, key: str) -> bool:
        copy = self.copies.pop(key, None)
        if copy is None:
            return False
        self.tree.unpin(copy.pin)
        self.stats.deletes += 1
        return True

    def clear(self, tree_was_reset: bool = False) -> None:
        """Forget every copy; unpin them unless the tree was reset (its locks are gone)."""
        copies, self.copies = self.copies, {}
        if not tree_was_reset:
            for copy in copies.values():
                self.tree.unpin(copy.pin)
