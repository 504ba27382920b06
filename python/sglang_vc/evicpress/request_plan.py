"""One user request's plan for the context its prompt starts with.

The radix cache asks the manager once per match (:meth:`RequestPlanner.plan_match`) and
gets the request's :class:`ContextPlan`: which context, how many of its rows a copy
supplies, where they come from (the device tree, SGLang's host backup of the tree's
nodes, a stored copy, or nowhere: the prefill computes them), the form served, and what
is left to do once the match is done (store the exact rows the device holds, store the
rows the prefill computes, promote the copy loaded). The tree's side of the decision --
the rows it holds, loading a fetched copy into device slots -- is answered through
:class:`ContextRows`, which :class:`~.match_rows.MatchRows` implements for the request
being matched.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from . import codec
from .config import DROPPED, FULL, CompressionConfig, Tier
from .context import Context, Fetched

logger = logging.getLogger(__name__)


class Origin(enum.Enum):
    """Where a request's context rows come from."""

    UNMATCHED = "unmatched"  # not looked up yet (or the lookup failed)
    NONE = "none"  # the prompt starts with no context
    REF = "ref"  # the profiler's full-KV reference answer (kept for its variants)
    DEVICE = "device"  # the device tree: exact rows, or the device's lossy copy
    HOST = "host"  # the host tier: SGLang's HiCache backup, or a blob loaded
    DISK = "disk"  # the storage tier (ours, or another server's copy)
    MISS = "miss"  # nowhere: the prefill computes them, then they are stored


_LOADED_FROM = {Origin.HOST: Tier.HOST, Origin.DISK: Tier.DISK}


@dataclass
class ContextPlan:
    """A request's plan, kept from its first match to its release."""

    origin: Origin = Origin.UNMATCHED
    ctx: Optional[Context] = None
    lcp: int = 0  # tokens the prompt shares with the context
    usable: int = 0  # of them, the page-aligned rows a copy of the context supplies
    served: Optional[CompressionConfig] = None  # the form served (None: recomputed)
    capture_len: int = 0  # rows to store once the prefill has computed them
    t0: float = 0.0  # when the request was first matched (the prefill rate's clock)
    prefix_have: int = 0  # exact rows the device held at the latest match
    backed_hit: bool = False  # SGLang loads the HiCache backup back (promoted on release)
    # what the latest match left to do (the radix cache does it, then clears it)
    store_device_rows: bool = False  # the device holds the context exact, unstored
    promote: Optional[Callable[[], object]] = None  # run once the prefill is scheduled
    # the copy read from its tier, kept to the release: a waiting request matched again
    # after the device lost its rows loads it again without a second read from the tier
    fetched: Optional[Fetched] = None

    @property
    def active(self) -> bool:
        """Whether the request counts as user activity (noted at its first match)."""
        return self.origin not in (Origin.UNMATCHED, Origin.REF)


class ContextRows(Protocol):
    """The device tree as one request's match sees it (:class:`~.match_rows.MatchRows`)."""

    def floor(self, n: int) -> int:
        """``n`` rounded down to a whole page."""

    def exact(self, n: int) -> int:
        """Rows of the context's first ``n`` tokens the device holds in the request's own
        namespace (exact); all ``n`` serve the request from them."""

    def serve_lossy(self, ctx: Context, cfg: CompressionConfig, n: int) -> bool:
        """Serve the request from the device's lossy copy ``cfg`` of ``ctx``, if the
        tree holds it."""

    def backed_up(self, n: int) -> bool:
        """Whether the tree has host nodes (HiCache backups) for all ``n`` rows."""

    def load(self, ctx: Context, fetched: Fetched, usable: int, have: int) -> bool:
        """Put ``fetched`` on the device for the request; whether it serves it."""


class RequestPlanner:
    """:class:`~.manager.EvicPressManager`'s per-request part (``manager.requests``: it uses
    the manager's lock, registry, stores and policy, ``self.m``): the plan, the accounting
    of a request and the fetch of a stored copy."""

    # how many user requests' tiers :meth:`served` keeps (GET /evicpress/requests)
    SERVED_LOG = 8192

    def __init__(self, manager):
        self.m = manager
        # rid -> (context, where its rows came from, the form served): under concurrent
        # requests the counters cannot say which request hit which tier
        self._served: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def plan_match(self, rid: str, ids: Sequence[int], namespace, prompt: Sequence[int],
                   rows: ContextRows, plan: ContextPlan) -> None:
        """Fill request ``rid``'s ``plan`` for a match of ``ids`` (its key's tokens) in
        ``namespace``. Its first match looks the context up and accounts the request;
        a later one (a waiting request matched again) loads what the device lost."""
        first = plan.origin is Origin.UNMATCHED
        if first:
            found = self._context_of(rid, ids, namespace, prompt, rows.floor)
            plan.t0 = time.perf_counter()
            if found is None:
                plan.origin = Origin.NONE
                return
            plan.ctx, plan.lcp = found
            plan.usable = rows.floor(min(plan.lcp, len(ids)))
            plan.origin = Origin.MISS
        ctx = plan.ctx
        if ctx is None or plan.usable <= 0 or ctx.ctx_id not in self.m.contexts:
            return
        have = plan.prefix_have = rows.exact(plan.usable)
        dev_cfg = ctx.device_config
        fetched = None
        if have >= plan.usable:
            if first:
                plan.origin, plan.served = Origin.DEVICE, FULL
                plan.store_device_rows = not ctx.stored
        elif dev_cfg is not None and not dev_cfg.is_full and rows.serve_lossy(ctx, dev_cfg, plan.usable):
            if first:
                plan.origin, plan.served = Origin.DEVICE, dev_cfg
        else:
            if self._host_backup_in_tree(ctx, lambda: rows.backed_up(plan.usable)):
                # SGLang's own host hit: the scheduler loads the backup back layer-wise
                # (init_load_back); nothing for EvicPress to fetch
                if first:
                    plan.origin, plan.served, plan.backed_hit = Origin.HOST, FULL, True
                    ctx.device_config = FULL
                    # (its full KV crosses the host link too: paced like a fetch from the host)
                    nbytes = self.m.dims.bytes_per_token * plan.usable
                    self.m.count(bytes_loaded_host=nbytes, load_seconds_host=self.pace(Tier.HOST, nbytes))
            elif ctx.stored or (first and self.m.storage_copies.find_shared(ctx)):  # ours, or another server's
                fetched = plan.fetched = plan.fetched or self.fetch(ctx)
                if fetched is not None and rows.load(ctx, fetched, plan.usable, have):
                    ctx.device_config = fetched.config
                    if first:
                        plan.origin, plan.served = Origin(fetched.tier.name.lower()), fetched.config
            if first and plan.served is None:  # nowhere, corrupted or lost: recompute, then store
                plan.origin, plan.capture_len = Origin.MISS, plan.usable
        if first:
            tier = _LOADED_FROM.get(plan.origin)
            self.on_request(ctx, tier, plan.served, prompt[plan.lcp:], plan.lcp, rid=rid)
            # a load-back of SGLang's backup promotes once it is done (on release)
            if tier is not None and not plan.backed_hit:
                blob = fetched.blob if fetched is not None else None
                plan.promote = lambda: self.m.after_hit(ctx, tier, blob)

    def on_request(self, ctx: Context, tier: Optional[Tier], served: Optional[CompressionConfig],
                   suffix: Sequence[int] = (), prefix_len: int = 0, rid: Optional[str] = None) -> None:
        """Account one user request that matched ``ctx`` (``tier`` None: device hit,
        or miss when ``served`` is None)."""
        with self.m.lock:
            ctx.frequency += 1
            ctx.last_access = self.m.clock()
            name = "miss" if served is None and tier is None else ("device" if tier is None else tier.name.lower())
            ctx.hits[name] += 1
            self.m.count(**{("misses" if name == "miss" else f"hits_{name}"): 1})
            if rid is not None:
                self._served[rid] = {"rid": rid, "ctx": ctx.ctx_id, "tier": name,
                                     "config": None if served is None else served.label}
                while len(self._served) > self.SERVED_LOG:
                    self._served.popitem(last=False)
            if len(suffix):
                ctx.suffix_tokens = 0.8 * ctx.suffix_tokens + 0.2 * len(suffix)
                self.m.querylog.record(ctx.ctx_id, (int(prefix_len), [int(t) for t in suffix]))

    def served(self, rids: Optional[Sequence[str]] = None) -> list[dict]:
        """The latest user requests' tiers and forms served (those of ``rids`` only, when
        given; a rid not kept or never matched to a context is left out)."""
        with self.m.lock:
            if rids is None:
                return list(self._served.values())
            return [self._served[r] for r in rids if r in self._served]

    def fetch(self, ctx: Context) -> Optional[Fetched]:
        """Read and decode ``ctx``'s stored blob (for a load onto the device). None when
        it is not stored or its entry is corrupted (then it is dropped)."""
        with self.m.lock:
            p = ctx.placement
            if p.dropped:
                return None
            found = self.m._found.get(ctx.ctx_id)
            t0 = time.perf_counter() - (found[2] if found is not None else 0.0)  # its read time counts
            blob = self.m._read_blob(ctx, p)
            if blob is None:
                self.m._publish_usage()
                return None
            try:
                cfg, kv, positions = codec.decode(blob)
            except Exception:
                logger.exception("EvicPress: stored blob of %s does not decode; dropping it", ctx.ctx_id)
                self.m._delete_blob(ctx, p)
                self.m._set_placement(ctx, DROPPED)
                self.m.count(lost=1)
                return None
            if positions is not None and not self.m.settings.serves_dropped:
                return None  # token-dropped KV needs the lossy attention backend
            elapsed = self.pace(p.tier, len(blob), time.perf_counter() - t0)
            tier = p.tier.name.lower()
            self.m.count(**{f"bytes_loaded_{tier}": len(blob), f"load_seconds_{tier}": elapsed})
            return Fetched(kv, cfg, p.tier, len(blob), elapsed, blob, positions,
                           ctx.stored_len if positions is not None else None)

    def pace(self, tier: Tier, nbytes: int, elapsed: float = 0.0) -> float:
        """A load of ``nbytes`` from ``tier`` that took ``elapsed`` seconds, stretched to
        the tier's modelled bandwidth under ``--evicpress-throttle`` (an emulated slower
        tier: ``bench.evicpress --regime``); its seconds."""
        if self.m.settings.throttle:
            target = self.m.tier_specs[tier].load_seconds(nbytes)
            if target > elapsed:
                time.sleep(target - elapsed)
                return target
        return elapsed

    def _context_of(self, rid: str, ids: Sequence[int], namespace, prompt: Sequence[int],
                    floor: Callable[[int], int]) -> Optional[tuple[Context, int]]:
        """The context ``ids`` starts with and the shared prefix length: a registered one,
        or a long prompt registered now as an automatic context (its first
        ``floor(len(prompt) - 1)`` tokens); the request counts as activity."""
        with self.m.lock:
            m = self.m.registry.match(ids, namespace)
            n_auto = self.m.settings.auto_context_tokens
            if m is None and n_auto and len(prompt) - 1 >= n_auto:
                n = floor(len(prompt) - 1)
                try:
                    ctx = self.m.registry.register(list(prompt[:n]), namespace=namespace, source="auto")
                    m = (ctx, min(n, len(ids)))
                except ValueError:
                    m = None
            self.m.profiling.note_activity(rid, True)
            return m

    def _host_backup_in_tree(self, ctx: Context, in_tree: Callable[[], bool]) -> bool:
        """Whether ``ctx``'s host copy is SGLang's backup of its tree nodes and the tree
        still has them all (``in_tree`` is asked only then)."""
        with self.m.lock:
            return ctx.placement.tier == Tier.HOST and self.m.host_backed(ctx) and in_tree()
