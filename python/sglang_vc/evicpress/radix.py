"""Radix-cache backend ``evicpress`` (``--radix-cache-backend evicpress``).

:class:`EvicPressRadixCache` is SGLang's default cache (``UnifiedRadixCache``, built by
``create_unified_radix_cache`` with SGLang's hierarchical-cache flags) plus EvicPress:

* **device tier** -- contexts the utility policy keeps on the device are radix-tree nodes
  EvicPress pins (:mod:`.device_tier`): the context's own node for a full copy, the
  private node of its kept rows for a token-dropped one (``n_keep`` slots); other device
  copies are SGLang's LRU cache of what requests loaded;
* **host tier** -- the HiCache host pool SGLang allocates for ``--enable-hierarchical-cache``.
  Plain prefixes are written through to it, and from it to the storage backend, by
  SGLang's rules, as with plain HiCache, and so are a context's full rows (other servers
  match HiCache's pages); EvicPress's private namespaces are skipped there
  (:meth:`TreeRows.owned_by_evicpress`, see :mod:`.tree_rows`): EvicPress decides where
  they go (:mod:`.host_tier`). A full
  copy on the host is the tree's own backup of the context's nodes, written by the
  HiCache controller when the policy places it there; a request that finds it evicted
  from the device is SGLang's host hit, loaded back by the scheduler. A compressed copy
  is a blob in pool slots, so it takes fewer host slots;
* **storage tier** -- :class:`~.storage_tier.StorageTier` on the HiCache storage backend
  SGLang builds from ``--hicache-storage-backend`` (``file``, ``seaweedfs``...; with
  ``--evicpress-disk-dir`` our checksummed ``evicpress_file``), shared by every server of
  the model: a context one server stored is a storage hit for another, and so is a plain
  prefix (HiCache's own pages and prefetch, on the same backend). A full context there is
  HiCache's pages of it (:mod:`.hicache_pages`), not a blob: one copy of the full KV.

A request whose prompt starts with a known context (registered through the API, or a
long prompt seen before) is looked up in ``match_prefix``: if the device tree has the
context, it is a device hit; otherwise the context's blob is read from its tier (a
corrupted disk entry is detected by its checksum and dropped, never served) and decoded.
A full copy is written into freshly allocated device slots inserted into the tree under
the request's own key -- SGLang's own match then finds them. A miss is computed by
prefill as usual, and its KV is captured from the device right after
(``checkpoint_into_tree``) and stored by the placement policy (:mod:`.manager`,
:mod:`.policy`).

**The rows in a request's namespace are always exact.** A lossy copy (quantized or
token-dropped) is never inserted there: every request sharing a few first tokens with
the context (an instruction header, a system prompt) would match its rows and decode
over lossy KV without having asked for it. A lossy copy lives in a private namespace of
its own (``evicpress:lossy:<ctx>:<config>``; ``evicpress:drop:<ctx>:<config>:<n>`` for a
token-dropped one, whose kept rows depend on ``n``) that no ordinary request matches.
The request served from it:

1. has its match redirected to the private node, which SGLang reports as its cached
   prefix (all ``n`` context tokens);
2. never puts its own KV in the tree (``skip_radix_cache_insert``): it was computed over
   lossy rows;
3. for a quantized copy, gets the node's slots as its prefix row. A token-dropped copy's
   node holds only the ``n_keep`` kept rows of each (layer, head) (served by the
   ``vc_torch`` attention backend, which the launcher then selects): the request's row
   gets the kept slots followed by ``NULL_SLOT`` for the dropped tokens
   (``prefix_device_indices``), and once SGLang has allocated it
   (``maybe_hand_to_session``), a :class:`~sglang_vc.kvruntime.CompressedKVIndex`
   (``attend_from = n``) makes the backend attend, for every query, over the kept rows
   (their keys already carry RoPE) plus the ordinary causal rows from position ``n`` on
   (the question, the generated tokens), skipping the null positions; the entry is
   released with the request.

The private node stays in the tree as the context's device copy (``device_config``)
until the tree evicts it. :meth:`EvicPressRadixCache.install_full` (VeriCache's remote
prefix caching) overwrites it with the exact KV in place, for the requests holding it,
and puts the exact copy in the context's own namespace for the later ones.

A request's match asks the manager once for the request's plan (:mod:`.request_plan`:
which context, where its rows come from, what to store or promote after), the tree
answering through :class:`~.match_rows.MatchRows`. The tiers reach the tree's rows
(matching, gathering, writing, pinning, the HiCache backups) through
:class:`~.tree_rows.TreeRows`, a mixin of this class; the delay model's start-up
measurements are in :mod:`.measure`.

The profiler's requests carry an ``extra_key`` namespace (``evicpress:ref`` for full-KV
reference answers, ``evicpress:cfg:<config>/<ctx>`` to answer on a compressed version of
the context), so they never share tree nodes with user requests.

The profiler answers on a token-dropped candidate the same way (its own private
namespace), so the quality it measures is the quality this path serves.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from . import codec, flags, hicache_pages
from .codec import FullKV
from .config import FULL, CompressionConfig, Tier
from .device_tier import DeviceTierStore
from .host_tier import HostSlotStore, HostTierStore
from .storage_tier import StorageTier
from .context import (CFG_NAMESPACE, PROFILE_NAMESPACE, REF_NAMESPACE, Context, KVDims, profiled_context_id,
                      ref_namespace, variant_label)
from .manager import EvicPressManager
from .measure import measure_delay_inputs, storage_dir
from .match_rows import MatchRows
from .request_plan import ContextPlan, Origin
from . import tenant
from .tree_rows import TreeRows, private_namespace

logger = logging.getLogger(__name__)

BACKEND_NAME = "evicpress"
_ACTIVE: Optional["EvicPressRadixCache"] = None  # this scheduler's cache (one TP rank)


def served_config(rid: str) -> Optional[CompressionConfig]:
    """The form of the stored context request ``rid``'s prefix was served from on this
    server (``FULL``, or the lossy copy it loaded: what a drafter must have verified);
    None when its prefix matched no context or EvicPress is not the radix cache."""
    return None if _ACTIVE is None else _ACTIVE.served_config(rid)


def served_context(rid: str) -> Optional[Context]:
    """The stored context request ``rid``'s prefix matched on this server, or None."""
    return None if _ACTIVE is None else _ACTIVE.served_context(rid)


def active_cache() -> Optional["EvicPressRadixCache"]:
    """This scheduler's EvicPress radix cache (None when it is not the radix cache)."""
    return _ACTIVE


@dataclass
class _PrivatePrefix:
    """A request served from a lossy copy: its first ``n`` row positions are the private
    node in ``namespace``, of which the first ``n_keep`` hold rows (``n_keep == n`` for
    a quantized copy; the kept rows of a token-dropped one)."""

    namespace: str
    n: int
    n_keep: int
    config: CompressionConfig
    ctx_id: str


def evicpress_factory(ctx):
    """``register_radix_cache_backend("evicpress", evicpress_factory)``."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from sglang_vc.config import get_vc_config

    ep = flags.settings_of(get_vc_config(ctx.server_args))
    if not ep.get("enabled"):
        raise ValueError("--radix-cache-backend evicpress needs --evicpress-disk-dir")
    if not ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend evicpress needs SGLang's hierarchical cache for its host "
            "tier: --enable-hierarchical-cache (with --hicache-size or --hicache-ratio)"
        )
    if getattr(ctx.server_args, "hicache_write_policy", None) == "write_back":
        # write-back backs nodes up inside SGLang's eviction walk, where EvicPress cannot
        # leave its contexts' rows to its own placement
        raise ValueError("--radix-cache-backend evicpress needs --hicache-write-policy "
                         "write_through or write_through_selective, not write_back")
    if getattr(ctx.server_args, "hicache_host_memory_mode", "cache") == "buffer_only":
        # a buffer-only host pool keeps nothing: EvicPress's host tier is that pool
        raise ValueError("--radix-cache-backend evicpress needs --hicache-host-memory-mode cache, "
                         "not buffer_only")
    if ctx.tp_size > 1 or ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.disable_radix_cache:
        raise NotImplementedError(
            "--radix-cache-backend evicpress supports one TP rank, full-attention models "
            "and an enabled radix cache"
        )
    return create_unified_radix_cache(ctx, cache_class=EvicPressRadixCache)


class EvicPressRadixCache(UnifiedRadixCache):
    evicpress: Optional[EvicPressManager] = None
    _inserting_key: Optional[RadixKey] = None

    @functools.cached_property
    def tree_rows(self) -> TreeRows:
        """The tree's rows as the tiers use them (:mod:`.tree_rows`)."""
        return TreeRows(self)

    # ------------------------------------------------------------------ set-up
    def init_hicache(self, server_args, params) -> None:
        super().init_hicache(server_args, params)
        from sglang_vc import stats
        from sglang_vc.config import get_vc_config

        from .control import ControlServer

        if self.cache_controller is None:
            raise ValueError("evicpress: the HiCache controller was not created")

        ep = dict(flags.settings_of(get_vc_config(server_args)))
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        self._kv_pool = pool
        itemsize = torch.empty((), dtype=pool.dtype).element_size()
        dims = KVDims(
            layers=pool.layer_num, heads=pool.head_num, head_dim=pool.head_dim,
            v_heads=pool.head_num, v_head_dim=pool.v_head_dim, itemsize=itemsize,
        )
        from sglang.srt.mem_cache.hicache_storage import PoolName

        host_pool = self.cache_controller.mem_pool_host
        if hasattr(host_pool, "get_pool"):  # a HostPoolGroup: its KV pool is the anchor
            host_pool = host_pool.get_pool(PoolName.KV)
        host_cap = None if ep["host_size_gb"] is None else int(ep["host_size_gb"] * flags.GB)
        self._host_pool = host_pool
        host = HostTierStore(HostSlotStore(host_pool, host_cap), self.tree_rows,
                             lambda key: self.evicpress.context_of_key(key))
        # The storage tier: the HiCache storage backend SGLang built from
        # --hicache-storage-backend (ours for --evicpress-disk-dir). EvicPress decides
        # what of its contexts goes there; HiCache's page backups and prefetches of
        # plain prefixes use the same backend.
        backend = self.cache_controller.storage_backend
        if backend is None:
            raise ValueError("evicpress: no HiCache storage backend (--hicache-storage-backend "
                             "or --evicpress-disk-dir)")
        self._released = []  # host backups EvicPress released (tree_rows.trim_host_pool)
        # whose KV it is: the weights themselves (not the served name) and the KV layout
        model_id = f"{tenant.weights_digest(server_args.model_path)}|{pool.dtype}|" \
                   f"{dims.layers}x{dims.heads}x{dims.head_dim}"
        disk = StorageTier(backend, int(ep["disk_size_gb"] * flags.GB), namespace=model_id)
        # storage copies of every computed context (--evicpress-storage-copies): on the
        # same backend, bounded by the backend's own retention, not the disk tier's budget
        copies = StorageTier(backend, 1 << 62, namespace=model_id)
        # a full context on storage is HiCache's own pages of it, read by SGLang's keys
        # (in the format SGLang's controller writes them: zero-copy calls or generic ones)
        zero_copy = getattr(self.cache_controller.page_set_func, "__name__", "") == "_page_set_zero_copy"
        full_pages = hicache_pages.for_pool(backend, host_pool, self.page_size, dims, zero_copy)
        measured = measure_delay_inputs(ep, dims, storage_dir(backend))
        pool_bytes = dims.bytes_per_token * self.token_to_kv_pool_allocator.size
        settings = flags.settings_from_dict(ep, device_pool_bytes=pool_bytes, **measured)
        from sglang_vc import kvruntime

        # the vc_torch attention backend made the compressed-KV runtime with the model runner
        settings.serves_dropped = kvruntime.current_runtime() is not None
        if settings.serves_dropped and self.page_size != 1:
            raise ValueError("evicpress: token-dropped contexts need --page-size 1")
        self._private: dict[str, _PrivatePrefix] = {}  # rid -> its lossy prefix
        # the private namespaces of each context's quantized device copies (install_full
        # makes them all exact), and those it made exact
        self._lossy_spaces: dict[str, set[str]] = {}
        self._exact_spaces: set[str] = set()
        settings.model_id = model_id
        self.evicpress = EvicPressManager(
            settings, dims, host, disk,
            device_store=DeviceTierStore(self.tree_rows, settings.device_capacity,
                                         lambda key: self.evicpress.context_of_key(key)),
            copies_store=copies,
            full_pages=full_pages,
            counters=lambda **kw: stats.add("evicpress", **kw),
        )
        if full_pages is None:  # the capability off: said in the log (for_pool) and counted
            self.evicpress.count(full_pages_off=1)
        self._reqs: dict[str, ContextPlan] = {}  # rid -> its plan (request_plan)
        # requests SGLang has given a row (maybe_hand_to_session): released by on_release
        self._holding_rows: set[str] = set()
        # full KV of contexts the profiler just computed (reference answers), the source
        # of the compressed versions it answers on next; a few entries, LRU
        self._profile_kv: "collections.OrderedDict[str, FullKV]" = collections.OrderedDict()
        # stores and promotions wait for the next scheduler step, off the TTFT path
        self._deferred: collections.deque = collections.deque()
        self._control = ControlServer(self, int(ep["control_port"]))
        self._control.start()
        global _ACTIVE
        _ACTIVE = self
        logger.info(
            "EvicPress: policy=%s device=%.1f MB host=%.1f MB (%d B/token slot) storage=%.1f MB on %s; "
            "bandwidth host=%.2f GB/s disk=%.2f GB/s; candidates=%s",
            settings.policy, settings.device_capacity / 2**20,
            self.evicpress.tier_specs[Tier.HOST].capacity_bytes / 2**20,
            host.slot_bytes, settings.disk_capacity / 2**20, type(backend).__name__,
            settings.host_bandwidth / 1e9, settings.disk_bandwidth / 1e9,
            [c.label for c in settings.candidates],
        )

    def reset(self) -> None:
        super().reset()
        if self.evicpress is not None:
            self._released = []
            self.evicpress.on_host_cleared()
            self._reqs.clear()
            self._private.clear()
            self._holding_rows.clear()
            self._lossy_spaces.clear()
            self._exact_spaces.clear()

    def check_hicache_events(self) -> None:
        super().check_hicache_events()
        if self.evicpress is not None:
            while self._deferred:
                fn = self._deferred.popleft()
                try:
                    fn()
                except Exception:
                    logger.exception("EvicPress: deferred store/promotion failed")
                    self.evicpress.count(deferred_failures=1)  # benchmarks report it
            self.evicpress.run_pending()
            self.tree_rows.trim_host_pool()

    def served_config(self, rid: str) -> Optional[CompressionConfig]:
        st = self._reqs.get(rid)
        return None if st is None or st.ctx is None else st.served

    def served_context(self, rid: str) -> Optional[Context]:
        st = self._reqs.get(rid)
        return None if st is None else st.ctx

    def context_rows(self, rid: str) -> int:
        """The rows of request ``rid``'s prefix that are its context's copy (0 when it
        matched none): what follows them the request computed itself."""
        st = self._reqs.get(rid)
        return 0 if st is None or st.ctx is None else st.usable

    def mark_exact(self, rid: str, prefix_len: int) -> bool:
        """Request ``rid`` matched a lossy copy that :meth:`install_full` has since made
        exact, and its prefill forward starts at ``prefix_len``, within the context's
        rows: nothing of it was computed over the lossy copy, so it is served FULL."""
        st = self._reqs.get(rid)
        if st is None or st.ctx is None or not (st.ctx.device_config is None or st.ctx.device_config.is_full):
            return False
        if prefix_len > st.usable:  # an earlier chunk ran over the lossy rows
            return False
        private = self._private.get(rid)
        if private is not None and private.namespace not in self._exact_spaces:
            return False  # its own rows are a copy install_full did not rewrite
        st.served = FULL
        return True

    def install_full(self, ctx: Context, kv: FullKV) -> int:
        """Make the device copy of ``ctx`` exact with its full KV ``kv``: the rows of its
        quantized copies (every config and salt loaded) are overwritten in place (the
        requests holding them keep them, now exact), and the exact copy is put in the
        context's own namespace, where later requests match it (``device_config`` FULL).
        Only the context's own rows change; a request's rows after the context are its own
        to recompute. Returns the rows made exact: 0 when there is no room for them, or
        when a request holds the context's token-dropped rows (they cannot be made exact;
        such a request fails over as when the copy cannot be read)."""
        if any(p.ctx_id == ctx.ctx_id and p.config.drops_tokens for p in self._private.values()):
            return 0  # a request holds kept rows, which cannot be made exact in place
        n = self.tree_rows.floor(min(kv.num_tokens, ctx.stored_len or ctx.num_tokens))
        ids = ctx.token_ids[:n].tolist()
        in_place = 0
        for space in self._lossy_spaces.pop(ctx.ctx_id, ()):  # every quantized copy: any config, any salt
            have, _, idx = self.tree_rows.device_match(self.tree_rows.key(ids, None, space))
            if have:
                self.tree_rows.write(idx[:have], kv.prefix(have))
            self._exact_spaces.add(space)
            in_place = max(in_place, have)
        rows = max(in_place, self.tree_rows.inject(ids, None, ctx.namespace, n, kv))
        if rows == 0:
            return 0
        ctx.device_config = FULL
        self.evicpress.count(full_copies_installed=1)
        return rows

    # ------------------------------------------------------------------ SGLang hooks
    def insert(self, params: InsertParams):
        # the key whose path SGLang writes through meanwhile (owned_by_evicpress)
        self._inserting_key = params.key
        try:
            return super().insert(params)
        finally:
            self._inserting_key = None

    def _apply_cache_action(self, action) -> None:
        if self.evicpress is not None and isinstance(action, BackupKV):
            # the tree's write-through of a node chain (root first) stops before the
            # first node EvicPress stores itself: HiCache keeps a chain contiguous
            keep = list(itertools.takewhile(lambda n: not self.tree_rows.owned_by_evicpress(n), action.node_ids))
            if len(keep) < len(action.node_ids):
                self.evicpress.count(write_through_left_to_evicpress=len(action.node_ids) - len(keep))
                if not keep:
                    return
                action = BackupKV(node_ids=keep)
        super()._apply_cache_action(action)

    def write_backup_storage(self, node_id) -> None:
        # lossy and profiler rows are EvicPress's alone (a context's compressed storage
        # copies are its storage_copies); full rows reach storage as HiCache's pages
        if self.evicpress is not None and self.tree_rows.stored_by_evicpress(node_id):
            return
        super().write_backup_storage(node_id)

    def match_prefix(self, params: MatchPrefixParams):
        if self.evicpress is not None and params.req is not None and not self.disable:
            try:
                self._before_match(params)
            except Exception:  # never fail a request because of EvicPress
                logger.exception("EvicPress: lookup failed; serving without it")
                self.evicpress.count(lookup_failures=1)  # the benchmarks report it
            private = self._private.get(params.req.rid)
            if private is not None:
                key = params.key
                limit = key.limit if key.limit is not None else len(key)
                pkey = self.tree_rows.key(key.raw_token_ids()[: private.n_keep], None, private.namespace)
                result = super().match_prefix(dataclasses.replace(params, key=pkey))
                if result.device_prefix_len == private.n_keep and limit >= private.n:
                    # SGLang counts all n context tokens as cached; a token-dropped
                    # copy's row gets the kept slots then NULL_SLOT for the dropped ones
                    # (prefix_device_indices). The request's own KV, computed over
                    # lossy rows, stays out of the tree.
                    params.req.skip_radix_cache_insert = True
                    n = private.n
                    return result._replace(device_prefix_len=n, full_kv_hit_length=n,
                                           full_device_match_len=n, cache_protected_len=n)
                # evicted meanwhile or capped shorter: the request recomputes the context
                del self._private[params.req.rid]
        return super().match_prefix(params)

    def prefix_device_indices(self, req) -> torch.Tensor:
        private = self._private.get(req.rid) if self.evicpress is not None else None
        if private is None:
            return super().prefix_device_indices(req)
        rows = self.tree_core.collect_full_device_indices(req.last_node, self.root_node_handle(private.namespace))
        assert len(rows) == private.n_keep, (req.rid, len(rows), private.n_keep)
        if private.n == private.n_keep:
            return rows[: req.prefix_len]
        from sglang_vc.kvruntime import NULL_SLOT

        null = torch.full((private.n - private.n_keep,), NULL_SLOT, dtype=rows.dtype, device=rows.device)
        return torch.cat([rows, null])[: req.prefix_len]

    # ------------------------------------------------------------------ lossy copies
    def _lossy_runtime(self):
        from sglang_vc.kvruntime import get_runtime

        return get_runtime()  # created by the vc_torch backend with the model runner

    def _private_on_device(self, req, ctx: Context, ids, namespace: str, n: int, cfg: CompressionConfig) -> bool:
        """Whether the private node ``namespace`` holds the copy ``cfg`` of ``ids[:n]``
        (its kept rows for a token-dropped one); then ``req`` is served from it."""
        from sglang_vc.compress import num_kept

        n_keep = num_kept(n, cfg.ratio) if cfg.drops_tokens else n
        if n_keep <= 0 or self.tree_rows.device_match(self.tree_rows.key(ids[:n_keep], None, namespace))[0] < n_keep:
            return False
        self._private[req.rid] = _PrivatePrefix(namespace, n, n_keep, cfg, ctx.ctx_id)
        return True

    def _load_private(self, req, ctx: Context, ids, namespace: str, n: int, cfg: CompressionConfig, kv: FullKV) -> bool:
        """Put the copy ``cfg`` of the context ``ids[:n]`` on the device as the private
        node ``namespace`` (see the module docstring) and serve ``req`` from it. ``kv``
        is the copy decoded: ``[L, >= n, H, D]`` for a quantized one, the kept rows
        ``[L, n_keep, H, D]`` for a token-dropped one."""
        if self._private_on_device(req, ctx, ids, namespace, n, cfg):
            return True
        if not cfg.drops_tokens:  # rows a shorter request left there are this copy's too
            self._lossy_spaces.setdefault(ctx.ctx_id, set()).add(namespace)
            self._exact_spaces.discard(namespace)  # lossy rows again (a partial node topped up)
            self.tree_rows.inject(ids, None, namespace, n, kv)
            return self._private_on_device(req, ctx, ids, namespace, n, cfg)
        n_keep = kv.num_tokens
        key = self.tree_rows.key(ids[:n_keep], None, namespace)
        if self.tree_rows.device_match(key)[0]:  # a partly evicted node: not a usable prefix
            return False
        new = self.tree_rows.alloc(n_keep)
        if new is None:
            logger.info("EvicPress: no device room to load %d kept rows", n_keep)
            return False
        new = new.to(torch.int64)
        self.tree_rows.write(new, kv)
        self.insert(InsertParams(key=key, value=new, prev_prefix_len=0, inserted_len=0))
        return self._private_on_device(req, ctx, ids, namespace, n, cfg)

    def maybe_hand_to_session(self, req) -> None:
        super().maybe_hand_to_session(req)
        if self.evicpress is not None:
            self._holding_rows.add(req.rid)
        drop = self._private.get(req.rid) if self.evicpress is not None else None
        if drop is None or not drop.config.drops_tokens or req.kv.req_pool_idx is None:
            return
        from sglang_vc.kvruntime import CompressedKVIndex, make_spec

        runtime = self._lossy_runtime()
        idx = int(req.kv.req_pool_idx)
        entry = runtime.entry_for_row(idx)
        if entry is not None and entry.rid == req.rid:
            return  # a later prefill chunk
        runtime.register_index(CompressedKVIndex(
            req.rid, idx, make_spec(drop.config.method, drop.config.ratio), drop.n, drop.n,
            row_start=0, attend_from=drop.n, tokens_kept=drop.n_keep,
        ))
        self.evicpress.count(dropped_prefix_requests=1)

    def _before_match(self, params: MatchPrefixParams) -> None:
        req, key = params.req, params.key
        ns = tenant.namespace(key.extra_key, key.cache_salt, req.lora_id)
        mgr = self.evicpress
        if ns and ns.startswith(PROFILE_NAMESPACE):
            if ns.startswith(CFG_NAMESPACE):
                self._inject_variant(req, key, ns)
            elif ns.startswith(REF_NAMESPACE + "/") and req.rid not in self._reqs:
                m = mgr.registry.match_id(profiled_context_id(ns), key.raw_token_ids())
                if m is not None and m[0].ctx_id not in self._profile_kv:
                    n = self.tree_rows.floor(min(m[1], len(key)))
                    self._reqs[req.rid] = ContextPlan(Origin.REF, m[0], m[1], n, capture_len=n,
                                                      t0=time.perf_counter())
            return
        # kept before the manager fills it: a later match of a request whose first one
        # failed half-way is not its first
        plan = self._reqs.setdefault(req.rid, ContextPlan())
        rows = MatchRows(self, req, key)
        mgr.requests.plan_match(req.rid, rows.ids, ns, req.origin_input_ids, rows, plan)
        if plan.store_device_rows:  # another request computed it: store those rows
            ctx, kv = plan.ctx, self.tree_rows.gather(rows.exact_idx)
            self._deferred.append(lambda: mgr.store_computed(ctx, kv, FULL))
        if plan.promote is not None:
            self._deferred.append(plan.promote)
        plan.store_device_rows, plan.promote = False, None

    def _inject_variant(self, req, key: RadixKey, ns: str) -> None:
        """Profiler request: answer on config ``variant_label(ns)`` of the context.
        Its own KV never enters the tree (a failed load must not leave full KV in this
        namespace); the profiler checks ``cached_tokens`` to know the load happened."""
        req.skip_radix_cache_insert = True
        mgr = self.evicpress
        cfg = CompressionConfig.parse(variant_label(ns))
        ids = key.raw_token_ids()
        m = mgr.registry.match_id(profiled_context_id(ns), ids)
        if m is None:
            return
        ctx, lcp = m
        n = self.tree_rows.floor(min(lcp, len(key)))
        drop_ns = private_namespace(ctx, cfg, n, profile=True) if cfg.drops_tokens else None
        if drop_ns is not None and self._private_on_device(req, ctx, ids, drop_ns, n, cfg):
            return
        if drop_ns is None and self.tree_rows.device_match(self.tree_rows.key(ids[:n], key))[0] >= n:
            return
        # The full KV to compress: the profiler's reference copy, the user copy (always
        # exact), or a full stored blob.
        spaces = [ref_namespace(ctx.ctx_id), ctx.namespace]
        src = None
        kept = self._profile_kv.get(ctx.ctx_id)
        if kept is not None and kept.num_tokens >= n:
            src = kept.prefix(n)
            spaces = []
        for space in spaces:
            have, _, idx = self.tree_rows.device_match(self.tree_rows.key(ids[:n], None, space))
            if have >= n:
                src = self.tree_rows.gather(idx[:n])
                break
        if src is None and ctx.stored and ctx.placement.config.is_full:
            fetched = mgr.requests.fetch(ctx)
            if fetched is not None and fetched.kv.num_tokens >= n:
                src = fetched.kv.prefix(n)
        if src is None:
            return
        if not cfg.is_full:
            _, src, _ = codec.decode(codec.encode(src, cfg))
        if drop_ns is not None:
            if not self._load_private(req, ctx, ids, drop_ns, n, cfg, src):
                return
        else:
            self.tree_rows.inject(ids, key, ns, n, src)
        mgr.count(profile_loads=1)

    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        if self.evicpress is None:
            return
        st = self._reqs.get(req.rid)
        if st is None or st.ctx is None or not st.capture_len or up_to < st.capture_len:
            return
        n, st.capture_len = st.capture_len, 0
        if st.origin is Origin.REF:  # the profiler's full-KV copy: keep it for the variants
            have, _, idx = self.tree_rows.device_match(RadixKey(
                array.array("q", [int(t) for t in req.origin_input_ids[:n]]), ref_namespace(st.ctx.ctx_id),
                is_bigram=self.tree_core.is_eagle))
            if have >= n:
                self._profile_kv[st.ctx.ctx_id] = self.tree_rows.gather(idx)
                while len(self._profile_kv) > 8:
                    self._profile_kv.popitem(last=False)
            return
        try:
            ctx = st.ctx
            if ctx.stored or ctx.ctx_id not in self.evicpress.contexts:
                return
            ids = req.origin_input_ids[:n]
            key = RadixKey(array.array("q", [int(t) for t in ids]), req.extra_key,
                           is_bigram=self.tree_core.is_eagle, cache_salt=req.cache_salt)
            have, _, idx = self.tree_rows.device_match(key)
            if have < n:
                return
            elapsed = time.perf_counter() - st.t0
            self.evicpress.profiling.note_prefill(n - st.prefix_have, elapsed)
            ctx.device_config = FULL  # computed in the request's namespace: exact
            kv, mgr = self.tree_rows.gather(idx), self.evicpress
            self._deferred.append(lambda: mgr.store_computed(ctx, kv, FULL))
            self.evicpress.count(captures=1)
        except Exception:
            logger.exception("EvicPress: could not store context %s", st.ctx.ctx_id)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if self.evicpress is None:
            return
        self._holding_rows.discard(req.rid)
        private = self._private.pop(req.rid, None)
        if private is not None and private.config.drops_tokens:
            # before SGLang frees the row: its index entry must not outlive it
            self._lossy_runtime().release(req.rid, req.kv.req_pool_idx)
        st = self._reqs.pop(req.rid, None)
        if st is None or not st.active:
            return
        self.evicpress.profiling.note_activity(req.rid, False)
        if st.backed_hit:  # SGLang loaded the backup back: the rows are on the device now
            ctx, mgr = st.ctx, self.evicpress
            self._deferred.append(lambda: mgr.after_hit(ctx, Tier.HOST))
        if st.ctx is None or st.served is None or st.served.is_full:
            return
        try:
            sp = req.sampling_params
            greedy = getattr(sp, "temperature", 1.0) == 0 or getattr(sp, "top_k", 0) == 1
            if greedy and req.finished() and len(req.output_ids):
                self.evicpress.profiling.observe_served(
                    st.ctx, st.served, req.origin_input_ids, req.output_ids,
                    getattr(sp, "max_new_tokens", len(req.output_ids)) or len(req.output_ids))
        except Exception:
            logger.exception("EvicPress: could not record an observation")

    def release_aborted_request(self, request) -> None:
        # SGLang calls this (through finish(ABORT)) for a request aborted while waiting,
        # which is never released: its plan and lossy-prefix entry would stay forever.
        # An aborted chunked prefill also comes here, but holds a row: on_release, which
        # SGLang calls next, frees its index entry and the rest.
        super().release_aborted_request(request)
        if self.evicpress is None or request.rid in self._holding_rows:
            return
        self._private.pop(request.rid, None)
        st = self._reqs.pop(request.rid, None)
        if st is not None and st.active:
            self.evicpress.profiling.note_activity(request.rid, False)
