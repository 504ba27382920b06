"""EvicPress's runtime state: contexts, their placement across tiers, and the real moves.

The manager is the SGLang-independent half of the radix-cache backend (:mod:`.radix`
is the other): it owns

* the **context registry** -- a context is a token prefix (a document, a system prompt,
  a conversation history) registered through the API or seen as a long prompt; it
  carries its query set, access frequency, quality profile (config -> quality) and its
  **placement** (config, tier) among the tiers it manages, host and disk; registering,
  matching and forgetting are :class:`~.context_registry.ContextRegistry`'s;
* the **stores** -- the host tier (:mod:`.host_tier`, slots of SGLang's HiCache host
  pool) and the disk tier (:class:`~.disk_tier.DiskTierStore`), one blob per context
  (:mod:`.codec`);
* the **policy** (:mod:`.policy`) and the execution of its moves on the real blobs:
  compress (re-encode), demote (host -> disk), promote, drop;
* the **profiling state** -- which contexts need (re-)profiling, the online query log,
  sampled observations of served answers and the drift tracker (:mod:`.profiler`); its
  methods are :class:`~.profile_state.ProfileState`'s;
* the **storage copies** of every computed context on the shared storage tier
  (:class:`~.storage_copies.StorageCopies`);
* the **request plan** the radix cache asks for once per match: which context, where its
  rows come from, the bookkeeping and what is left to do (:class:`~.request_plan.RequestPlanner`).

The data model (settings, a context, a fetched copy) is in :mod:`.context`.

The device tier is SGLang's radix tree itself; the backend asks the manager where a
matched context is stored and loads it into device slots (see :mod:`.radix`).

Threading: every method takes ``self.lock``. Moves (which touch the host pool) run on
the scheduler thread only; other threads (the control server) enqueue work with
:meth:`submit`, which the scheduler thread drains in :meth:`run_pending`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from . import codec
from .codec import FullKV
from .config import DROPPED, FULL, CompressionConfig, Placement, Tier, TierSpec
from .context import Context, KVDims, Settings
from .context_registry import ContextRegistry
from .placement import Move
from .profile_state import ProfileState
from .policy import LRUPolicy, Policy, UtilityPolicy
from .profiler import ProfileMetric, QualityTracker, QueryLog
from .request_plan import RequestPlanner
from .storage_copies import StorageCopies
from .utility import ContextInfo, UtilityModel

logger = logging.getLogger(__name__)

__all__ = ["EvicPressManager"]


class EvicPressManager:
    """The contexts, their placement across tiers and the moves that realise it; its parts
    (``registry``, ``storage_copies``, ``profiling``, ``requests``) are composed, each
    given the manager."""
    def __init__(
        self,
        settings: Settings,
        dims: KVDims,
        host_store,
        disk_store,
        *,
        device_store=None,
        copies_store=None,
        full_pages=None,
        counters: Optional[Callable[..., None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.dims = dims
        self.host = host_store
        self.disk = disk_store
        # where storage copies are written: the storage tier's backend outside the disk
        # tier's budget (the shared store keeps every context, as HiCache's writes do);
        # the disk tier reads them as any other server's entries
        self.copies = copies_store if copies_store is not None else disk_store
        # full contexts on the storage tier are HiCache's pages (:mod:`.hicache_pages`),
        # not a copy of their own; None: EvicPress blobs (no HiCache host pool, tests)
        self.full_pages = full_pages
        self.device = device_store if settings.device_capacity > 0 else None
        self.clock = clock
        self.lock = threading.RLock()
        self.contexts: dict[str, Context] = {}
        self.tracker = QualityTracker(settings.reprofile_threshold)
        self.querylog = QueryLog(maxlen=50)
        self._tasks: "queue.Queue[tuple[Callable, concurrent.futures.Future]]" = queue.Queue()
        self.rebalance_pending = False
        # the entry find_shared read to check it, kept for the fetch that follows: one read
        # of a shared context over the link, not two (ctx_id -> (config, blob, seconds))
        self._found: dict[str, tuple[CompressionConfig, bytes, float]] = {}
        self._local = collections.Counter()
        self._counters = counters
        host_cap = settings.host_capacity
        if host_cap is None:
            host_cap = host_store.capacity_bytes
        self.tier_specs = {
            Tier.HOST: TierSpec(int(min(host_cap, host_store.capacity_bytes)), settings.host_bandwidth),
            Tier.DISK: TierSpec(int(settings.disk_capacity), settings.disk_bandwidth),
        }
        if self.device is not None:
            # Resident copies cost no load time. The device holds full and token-dropped
            # copies only, so it is relieved by demotion (compressing on the way down as
            # the knapsack likes), never by re-encoding in place: that would confine a
            # context to token dropping for good.
            self.tier_specs[Tier.DEVICE] = TierSpec(int(settings.device_capacity), math.inf,
                                                    compresses_in_place=False)
        self.policy = self._make_policy()
        # its parts, each a class of its own working on the state above
        self.registry = ContextRegistry(self)
        self.storage_copies = StorageCopies(self)
        self.profiling = ProfileState(self)
        self.requests = RequestPlanner(self)

    def _make_policy(self) -> Policy:
        s = self.settings
        if s.policy == "evicpress":
            return UtilityPolicy(self.utility_model)
        if s.policy == "lru":
            return LRUPolicy(self.tier_specs, FULL)
        if s.policy == "fixed":
            if s.fixed_config.drops_tokens and not s.serves_dropped:
                raise ValueError(f"fixed config {s.fixed_config} drops tokens: serving it needs the "
                                 "vc_torch attention backend (--attention-backend vc_torch)")
            return LRUPolicy(self.tier_specs, s.fixed_config)
        raise ValueError(f"unknown EvicPress policy {s.policy!r}")

    def reconfigure(self, policy: Optional[str] = None, alpha: Optional[float] = None,
                    fixed_config: Optional[str] = None, observe_rate: Optional[float] = None,
                    reprofile_threshold: Optional[float] = None, profile_metric: Optional[str] = None) -> dict:
        """Empty the host and disk tiers, forget access statistics (profiles are kept)
        and switch policy / alpha / the drift check's sampling and threshold -- runs
        several systems in one runtime (benchmarks). Scheduler thread."""
        with self.lock:
            s = self.settings
            old = (s.policy, s.alpha, s.fixed_config)
            if observe_rate is not None and not 0 <= observe_rate <= 1:
                raise ValueError("observe_rate must be in [0, 1]")
            if reprofile_threshold is not None and not reprofile_threshold >= 0:
                raise ValueError("reprofile_threshold must be >= 0")
            metric = ProfileMetric(profile_metric) if profile_metric is not None else s.profile_metric
            try:
                if policy is not None:
                    s.policy = policy
                if alpha is not None:
                    if not alpha >= 0:
                        raise ValueError("alpha must be >= 0")
                    s.alpha = float(alpha)
                if fixed_config is not None:
                    s.fixed_config = CompressionConfig.parse(fixed_config)
                self.policy = self._make_policy()
            except ValueError:
                s.policy, s.alpha, s.fixed_config = old
                raise
            for ctx in self.contexts.values():
                self._delete_blob(ctx, ctx.placement)
                self._set_placement(ctx, DROPPED)
                ctx.frequency = 0.0
                ctx.hits.clear()
                ctx.device_config = None
                ctx.sizes.clear()
                ctx.profile_in_flight = False
            if observe_rate is not None:
                s.observe_rate = float(observe_rate)
            if reprofile_threshold is not None:
                s.reprofile_threshold = float(reprofile_threshold)
            s.profile_metric = metric
            self.tracker = QualityTracker(s.reprofile_threshold)
            self.profiling.observations.clear()
            self._publish_usage()
            return {"policy": self.policy.name, "alpha": s.alpha, "observe_rate": s.observe_rate,
                    "reprofile_threshold": s.reprofile_threshold, "profile_metric": s.profile_metric.value}

    # ------------------------------------------------------------------ counters
    def count(self, **incs: float) -> None:
        with self.lock:  # also called from the full-copy reader thread (read_storage_copy)
            for k, v in incs.items():
                self._local[k] += v
        if self._counters is not None:
            self._counters(**incs)

    @property
    def counters(self) -> dict:
        return dict(self._local)

    # ------------------------------------------------------------------ model
    def info(self, ctx: Context) -> ContextInfo:
        n = ctx.stored_len or ctx.num_tokens
        full = self.dims.bytes_per_token * n
        sizes = {}
        quality = {}
        for cfg, q in ctx.quality.items():
            if cfg.is_full:
                continue
            quality[cfg] = q
        cfgs = {FULL, *quality, self.settings.fixed_config}
        if ctx.stored:
            cfgs.add(ctx.placement.config)
        for cfg in cfgs:
            exact = ctx.sizes.get(cfg) if ctx.stored_len == n else None
            sizes[cfg] = exact if exact is not None else codec.estimate_bytes(full, n, cfg, self.dims.itemsize)
        sizes = {c: self._footprint(c, s) for c, s in sizes.items()}
        # the device tier holds no quantized copy (it would be dequantized there): it
        # would take as much room as the full one, so it is never chosen for the device
        resident = {c: sizes[FULL] for c in cfgs if c.is_quantized}
        return ContextInfo(
            ctx_id=ctx.ctx_id,
            num_tokens=n,
            full_bytes=full,
            frequency=max(ctx.frequency, 1.0),
            quality=quality,
            query_tokens=int(ctx.suffix_tokens),
            sizes=sizes,
            resident_bytes=resident,
        )

    def _footprint(self, cfg, nbytes: int) -> int:
        # bytes a blob occupies: host slots round up; disk adds a header
        return max(self.host.footprint(nbytes), self.disk.entry_bytes("ctx/x" * 4, nbytes))

    def utility_model(self) -> UtilityModel:
        s = self.settings
        return UtilityModel(
            alpha=s.alpha,
            tiers=self.tier_specs,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            decompress_bytes_per_s=dict(s.decompress_bytes_per_s),
        )

    def _stored(self) -> list[Context]:
        return [c for c in self.contexts.values() if c.stored]

    # ------------------------------------------------------------------ stores
    def _store(self, tier: Tier):
        return {Tier.DEVICE: self.device, Tier.HOST: self.host, Tier.DISK: self.disk}[tier]

    def context_of_key(self, key: str) -> Optional[Context]:
        """The context whose blob is stored under ``key`` (see :meth:`blob_key`)."""
        return self.contexts.get(key[len("ctx/"):]) if key.startswith("ctx/") else None

    def blob_key(self, ctx: Context, tier: Optional[Tier] = None,
                 config: Optional[CompressionConfig] = None) -> str:
        """A context's key in a store: ``ctx/<id>`` on this server's own tiers; on the
        shared storage tier a key of its content (model, namespace, tokens) and of the
        copy's config (default: its placement's), the same on every server of the model,
        so several copies of one context live side by side."""
        if tier == Tier.DISK:
            from .storage_tier import content_key

            cfg = ctx.placement.config if config is None else config
            return content_key(self.settings.model_id, ctx.namespace, ctx.token_ids) + "@" + cfg.label
        return f"ctx/{ctx.ctx_id}"

    def host_backed(self, ctx: Context) -> bool:
        """Whether ``ctx``'s host copy is SGLang's HiCache backup of its tree nodes."""
        is_backed = getattr(self.host, "is_backed", None)
        return bool(is_backed and is_backed(self.blob_key(ctx, Tier.HOST)))

    def stored_blob(self, ctx: Context) -> Optional[bytes]:
        """The stored bytes of ``ctx`` as they are now (None when not stored); no
        accounting, no side effect (diagnostics)."""
        with self.lock:
            if ctx.placement.dropped:
                return None
            if self.on_pages(ctx.placement.tier, ctx.placement.config):
                return self.full_pages.get_blob(ctx.token_ids, ctx.namespace)
            return self._store(ctx.placement.tier).get(self.blob_key(ctx, ctx.placement.tier))

    def on_pages(self, tier: Optional[Tier], config: CompressionConfig) -> bool:
        """Whether ``config`` on ``tier`` is HiCache's pages of the context."""
        return self.full_pages is not None and tier == Tier.DISK and config.is_full

    def _read_blob(self, ctx: Context, placement: Placement) -> Optional[bytes]:
        """The stored bytes; None (and the context marked dropped) when absent or
        corrupted -- a corrupted disk entry is never served."""
        store = self._store(placement.tier)
        found = self._found.pop(ctx.ctx_id, None)
        if found is not None and placement.tier == Tier.DISK and found[0] == placement.config:
            return found[1]  # read (and checked) by find_shared just now
        if self.on_pages(placement.tier, placement.config):
            blob = self.full_pages.load(ctx, self.count)
        elif placement.tier == Tier.DISK:
            before = self.disk.stats.corrupted
            blob = self.disk.get(self.blob_key(ctx, Tier.DISK, placement.config))
            if self.disk.stats.corrupted > before:
                self.count(disk_corrupted=1)
                logger.warning("EvicPress: disk entry of context %s is corrupted; it will be recomputed", ctx.ctx_id)
        else:
            blob = store.get(self.blob_key(ctx, placement.tier))
        if blob is None and placement.tier == Tier.DISK:
            ctx.shared.discard(placement.config)
        if blob is None:
            self._set_placement(ctx, DROPPED)
            self.count(lost=1)
        return blob

    def _delete_blob(self, ctx: Context, placement: Placement) -> None:
        if self.on_pages(placement.tier, placement.config):
            # HiCache's pages: left as its cache (plain prefixes hit them too), evictable again
            self.full_pages.keep(ctx.token_ids, ctx.namespace, keep=False)
            return
        if placement.tier == Tier.DISK and placement.config in ctx.shared:
            return  # a storage copy outlives the placement: other servers read it
        if placement.tier is not None:
            self._store(placement.tier).delete(self.blob_key(ctx, placement.tier, placement.config))

    def _put_blob(self, ctx: Context, tier: Tier, blob: bytes, config: CompressionConfig) -> bool:
        if tier == Tier.DISK and config in ctx.shared and not self.on_pages(tier, config):
            return True  # the storage copy of that config is the placement's entry
        store = self._store(tier)
        before = store.write_errors
        try:
            if self.on_pages(tier, config):
                ok = self.full_pages.place(ctx, blob, self.count)
            else:
                ok = store.put(self.blob_key(ctx, tier, config), blob)
        except Exception:  # a store refusing the form is a policy bug: say so, place lower
            logger.exception("EvicPress: the %s tier refused context %s", tier.name.lower(), ctx.ctx_id)
            self.count(put_errors=1)
            return False
        if not ok:
            if tier == Tier.DISK:
                if store.write_errors > before:
                    self.count(disk_write_errors=1)
                else:
                    self.count(disk_full=1)
            else:
                self.count(host_full=1)
            return False
        if not self.on_pages(tier, config):  # (pages: what was written, by _write_pages)
            self.count(**{f"bytes_written_{tier.name.lower()}": len(blob)})
        return True

    def _set_placement(self, ctx: Context, placement: Placement) -> None:
        old = ctx.placement
        ctx.placement = placement
        if placement.dropped:
            ctx.stored_len = 0
            self.tracker.forget(ctx.ctx_id)
        elif placement.config != old.config or old.dropped:
            q = ctx.quality.get(placement.config)
            if q is not None and not placement.config.is_full:
                self.tracker.set_profile(ctx.ctx_id, placement.config, q)
            else:
                self.tracker.forget(ctx.ctx_id)

    # ------------------------------------------------------------------ moves
    def apply(self, moves: Sequence[Move], sources: Optional[dict] = None,
              blobs: Optional[dict] = None) -> int:
        """Apply ``moves`` to the stored blobs; returns how many took effect.

        ``sources`` maps a context id to the data an insert starts from: a
        :class:`FullKV` (with its config) or a blob. ``blobs`` gives stored bytes
        already read (a context just fetched), so they are not read again. Every source is read and removed
        before any destination is written, so a plan whose end state fits never needs
        more than that end state's bytes on any tier.
        """
        sources = dict(sources or {})
        staged = []  # (ctx, move, blob or None, kv or None, kv_config)
        for m in moves:
            ctx = self.contexts.get(m.ctx_id)
            if ctx is None:
                continue
            if m.src.dropped:
                src = sources.get(m.ctx_id)
                if src is None:
                    continue
                if isinstance(src, tuple):  # (FullKV, config)
                    staged.append((ctx, m, None, src[0], src[1]))
                else:
                    staged.append((ctx, m, src, None, None))
                continue
            if ctx.placement != m.src:
                logger.warning("EvicPress: stale move %s (context is %s)", m, ctx.placement)
                continue
            blob = (blobs or {}).get(m.ctx_id) or self._read_blob(ctx, m.src)
            if blob is None:
                continue
            self._delete_blob(ctx, m.src)
            staged.append((ctx, m, blob, None, None))
        done = 0
        for ctx, m, blob, kv, kv_cfg in staged:
            dst = m.dst
            if dst.dropped:
                self._set_placement(ctx, DROPPED)
                self.count(drops=1)
                done += 1
                continue
            try:
                if blob is not None:
                    cfg = codec.blob_config(blob)
                    if cfg != dst.config:
                        blob = codec.transcode(blob, dst.config)
                        self.count(compressions=1)
                else:
                    if kv_cfg != dst.config:
                        self.count(compressions=1)
                    blob = codec.encode(kv, dst.config)
            except Exception:
                logger.exception("EvicPress: could not encode context %s as %s", ctx.ctx_id, dst.config)
                self._set_placement(ctx, DROPPED)
                self.count(drops=1)
                continue
            if not self._put_blob(ctx, dst.tier, blob, dst.config):
                # The tier is full after all (slot rounding, a full file system):
                # try the next tier down, else drop (recomputed on demand).
                placed = False
                for lower in (t for t in sorted(self.tier_specs) if t > dst.tier):
                    if self._put_blob(ctx, lower, blob, dst.config):
                        dst = Placement(dst.config, lower)
                        placed = True
                        break
                if not placed:
                    self._set_placement(ctx, DROPPED)
                    self.count(drops=1)
                    continue
            ctx.sizes[dst.config] = len(blob)
            if m.src.dropped:
                ctx.stored_len = kv.num_tokens if kv is not None else ctx.stored_len
            if m.src.tier is not None and dst.tier is not None:
                if dst.tier > m.src.tier:
                    self.count(demotions=1)
                elif dst.tier < m.src.tier:
                    self.count(promotions=1)
            elif m.src.dropped:
                self.count(**{f"stores_{dst.tier.name.lower()}": 1})
            self._set_placement(ctx, dst)
            done += 1
        self._publish_usage()
        return done

    def _publish_usage(self) -> None:
        if self.device is not None:
            self._local["device_used_bytes"] = self.device.used_bytes
        self._local["host_used_bytes"] = self.host.used_bytes
        self._local["disk_used_bytes"] = self.disk.used_bytes
        self._local["compressed_contexts"] = sum(1 for c in self._stored() if not c.placement.config.is_full)
        self._local["stored_contexts"] = len(self._stored())

    def _state(self, exclude: Optional[Context] = None):
        ctxs = [c for c in self._stored() if c is not exclude]
        infos = [self.info(c) for c in ctxs]
        placements = {c.ctx_id: c.placement for c in ctxs}
        last = {c.ctx_id: c.last_access for c in self.contexts.values()}
        return infos, placements, last

    def store_computed(self, ctx: Context, kv: FullKV, source_config: CompressionConfig = FULL) -> list[Move]:
        """A context's KV was just computed (or reached the device): store it (paper
        section 5: ``store`` then ``manage``)."""
        with self.lock:
            if ctx.ctx_id not in self.contexts or ctx.stored:
                return []
            ctx.stored_len = kv.num_tokens
            ctx.sizes.clear()
            if not source_config.is_full and source_config not in ctx.quality:
                ctx.quality[source_config] = ctx.quality.get(source_config, 1.0)
            if source_config.is_full:
                self.storage_copies.write_storage_copies(ctx, kv)
            infos, placements, last = self._state(exclude=ctx)
            new = self.info(ctx)
            cfg = None if source_config.is_full else source_config
            if cfg is None and isinstance(self.policy, LRUPolicy):
                cfg = self.policy.config
            moves = self.policy.plan_insert(new, infos, placements, last, config=cfg)
            self.apply(moves, {ctx.ctx_id: (kv, source_config)})
            return moves

    def after_hit(self, ctx: Context, tier: Tier, blob: Optional[bytes] = None) -> list[Move]:
        """A context was served from ``tier`` (its copy was loaded onto the device for
        the request): promote it to the fastest tier its form can live on (the device
        for a full or token-dropped copy when the device tier is on, else the host),
        as the policy decides."""
        with self.lock:
            if tier != ctx.placement.tier:
                return []
            top = self.policy.insert_tier(ctx.placement.config)
            if tier <= top:
                return []
            infos, placements, last = self._state(exclude=ctx)
            placements[ctx.ctx_id] = ctx.placement
            new = self.info(ctx)
            moves = self.policy.plan_insert(new, infos, placements, last, config=ctx.placement.config)
            self.apply(moves, blobs={ctx.ctx_id: blob} if blob is not None else None)
            return moves

    def set_placement(self, ctx: Context, placement: Placement) -> bool:
        """Manual move (admin API). Only to a config reachable from the stored one."""
        with self.lock:
            if ctx.placement == placement:
                return True
            if ctx.placement.dropped:
                raise ValueError(f"context {ctx.ctx_id} is not stored")
            if not placement.dropped:
                if not placement.config.reachable_from(ctx.placement.config):
                    raise ValueError(
                        f"cannot go from {ctx.placement.config} to {placement.config}: "
                        "compression is one-way and dropped tokens are gone (drop and "
                        "recompute instead)")
                if placement.config.drops_tokens and not self.settings.serves_dropped:
                    raise ValueError(f"{placement.config} drops tokens: serving it needs the "
                                     "vc_torch attention backend")
                if placement.config not in ctx.quality:
                    ctx.quality[placement.config] = ctx.quality.get(placement.config, 0.0)
            return self.apply([Move(ctx.ctx_id, ctx.placement, placement)]) == 1

    def rebalance(self) -> list[Move]:
        with self.lock:
            self.rebalance_pending = False
            infos, placements, last = self._state()
            moves = self.policy.rebalance(infos, placements, last)
            if moves:
                self.apply(moves)
            return moves

    def on_host_cleared(self) -> None:
        """SGLang reset its cache (flush_cache): the host pool is empty again."""
        with self.lock:
            self.host.clear(pool_was_cleared=True)
            if self.device is not None:
                self.device.clear(tree_was_reset=True)
            for ctx in self.contexts.values():
                if ctx.placement.tier in (Tier.HOST, Tier.DEVICE):
                    self._set_placement(ctx, DROPPED)
                ctx.device_config = None
            self._publish_usage()

    # ------------------------------------------------------------------ scheduler tasks
    def submit(self, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
        """Run ``fn`` on the scheduler thread (see :meth:`run_pending`) and wait."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((fn, fut))
        return fut.result(timeout)

    def run_pending(self) -> None:
        """Scheduler thread: run queued tasks and a pending rebalance."""
        while True:
            try:
                fn, fut = self._tasks.get_nowait()
            except queue.Empty:
                break
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
        if self.rebalance_pending:
            try:
                self.rebalance()
            except Exception:
                logger.exception("EvicPress: rebalance failed")

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        with self.lock:
            self._publish_usage()
            s = self.settings
            return {
                "policy": self.policy.name,
                "alpha": s.alpha,
                "candidates": [c.label for c in s.candidates],
                "tiers": {
                    t.name.lower(): {
                        "capacity_bytes": spec.capacity_bytes,
                        "used_bytes": self._store(t).used_bytes,
                        # None: resident, no load (JSON has no infinity)
                        "load_bandwidth": None if math.isinf(spec.load_bandwidth) else spec.load_bandwidth,
                        "contexts": sum(1 for c in self.contexts.values() if c.placement.tier == t),
                    }
                    for t, spec in self.tier_specs.items()
                },
                # full host copies kept as SGLang's own HiCache node backups
                "host_backups": len(getattr(self.host, "backed", ())),
                "host_pool_used_bytes": getattr(self.host, "pool_used_bytes", None),
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "decompress_bytes_per_s": dict(s.decompress_bytes_per_s),
                "contexts": len(self.contexts),
                "idle_seconds": self.profiling.idle_for(),
                "active_requests": len(self.profiling.active_requests),
                "pending_profiles": sum(1 for c in self.contexts.values() if c.profile_reason),
                "pending_observations": len(self.profiling.observations),
                "counters": self.counters,
            }
