"""What the radix cache asks EvicPress about one user request's prefix: which context it
is (:meth:`RequestPlan.begin_request`), where to load it from when the device tree does
not hold it whole (:meth:`RequestPlan.plan_load`), and, once it is served, the
bookkeeping and the promotion to run after the prefill (:meth:`RequestPlan.served`).
Three calls per request; :mod:`.radix` carries the plan out (device slots, the load-back
of SGLang's host backup, the injection of a fetched copy)."""

from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence

from .config import CompressionConfig, Tier
from .context import Context


class Load(enum.Enum):
    """Where a context the device tree does not hold whole is loaded from."""

    HOST_BACKUP = "host_backup"  # SGLang's HiCache backup of its tree nodes: the scheduler loads it back
    STORED = "stored"  # a copy EvicPress stores (its own, or another server's on the shared tier)
    RECOMPUTE = "recompute"  # none: the prefill computes it, then it is stored


class RequestPlan:
    """:class:`~.manager.EvicPressManager`'s per-request methods (a mixin: they use the
    manager's lock, registry, stores and policy)."""

    def begin_request(self, rid: str, ids: Sequence[int], namespace, prompt: Sequence[int],
                      floor: Callable[[int], int]) -> Optional[tuple[Context, int]]:
        """The context ``ids`` starts with and the shared prefix length: a registered one,
        or a long prompt registered now as an automatic context (its first
        ``floor(len(prompt) - 1)`` tokens); the request counts as activity."""
        with self.lock:
            m = self.match(ids, namespace)
            n_auto = self.settings.auto_context_tokens
            if m is None and n_auto and len(prompt) - 1 >= n_auto:
                n = floor(len(prompt) - 1)
                try:
                    ctx = self.register(list(prompt[:n]), namespace=namespace, source="auto")
                    m = (ctx, min(n, len(ids)))
                except ValueError:
                    m = None
            self.note_activity(rid, True)
            return m

    def plan_load(self, ctx: Context, *, first: bool, backup_in_tree: Callable[[], bool]) -> Load:
        """Where to load ``ctx`` from. ``backup_in_tree`` says whether SGLang's tree still
        has host nodes for all of it (asked only for a host-backed context); another
        server's copy is looked for on a request's first match only."""
        with self.lock:
            if ctx.placement.tier == Tier.HOST and self.host_backed(ctx) and backup_in_tree():
                return Load.HOST_BACKUP
            if ctx.stored or (first and self.find_shared(ctx)):
                return Load.STORED
            return Load.RECOMPUTE

    def served(self, ctx: Context, tier: Optional[Tier], config: Optional[CompressionConfig],
               suffix: Sequence[int], prefix_len: int, *, promote: bool,
               blob: Optional[bytes] = None) -> Optional[Callable[[], object]]:
        """Account a request served on ``ctx`` (``tier`` None: from the device, or a miss
        when ``config`` is None); for a load from host or disk with ``promote``, the
        promotion to run once the prefill is scheduled."""
        self.on_request(ctx, tier, config, suffix, prefix_len)
        if tier is None or not promote:
            return None
        return lambda: self.after_hit(ctx, tier, blob)
