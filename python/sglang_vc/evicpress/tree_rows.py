"""The radix tree's device and host rows as EvicPress's tiers use them.

:class:`TreeRows` is the part of :class:`~.radix.EvicPressRadixCache` the tiers call
(the ``DeviceTree`` protocol of :mod:`.device_tier`, the ``HostTree`` protocol of
:mod:`.host_tier`): keys in a namespace, matching, gathering and writing KV rows,
injecting a copy into the tree, pinning it, and the HiCache backups of the host tier.
The request path (``match_prefix`` and the hooks around a request) stays in
:mod:`.radix`; both work on the same tree: this object is given the cache
(``cache.tree_rows``).

**Who stores which rows.** HiCache writes the tree through to the host pool and the
storage backend by SGLang's rules (EvicPress always has a storage backend), a context's
full rows in its tenant namespace included: they reach storage as HiCache's own pages,
under SGLang's hash chain for the prompt, so the next server's ordinary prefix match finds
them (a plain HiCache server's too), whatever EvicPress decides for its compressed copies
and placement. What HiCache never writes is what only EvicPress reads
(:meth:`TreeRows.owned_by_evicpress`): its private and profiler namespaces. A context's
full host copy is the tree's own backup of its nodes, written by HiCache's write-through
or when EvicPress places it there.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from . import codec, tenant
from .codec import FullKV
from .config import CompressionConfig, Tier
from .context import PROFILE_NAMESPACE, Context

logger = logging.getLogger(__name__)

DROP_NAMESPACE = PROFILE_NAMESPACE + "drop:"  # device copies of token-dropped contexts
LOSSY_NAMESPACE = PROFILE_NAMESPACE + "lossy:"  # device copies of quantized contexts
SAME_NAMESPACE = object()  # "the namespace of the key given"


def private_namespace(ctx: Context, cfg: CompressionConfig, n: int, profile: bool = False,
                       salt: Optional[str] = None) -> str:
    """The namespace of a lossy device copy of ``ctx``'s first ``n`` tokens (module
    docstring). A quantized copy's rows are the same whatever prefix of it is used;
    a token-dropped copy's kept rows depend on ``n``. A request's ``cache_salt`` keeps
    its own copy, as SGLang keeps salted requests' rows apart."""
    if cfg.drops_tokens:
        ns = f"{DROP_NAMESPACE}{'profile:' if profile else ''}{ctx.ctx_id}:{cfg.label}:{n}"
    else:
        ns = f"{LOSSY_NAMESPACE}{ctx.ctx_id}:{cfg.label}"
    return ns if not salt else f"{ns}@{salt}"


@dataclass
class _Pin:
    """A copy EvicPress holds in the tree: its key and EvicPress's lock on it (a device
    lock for a device-tier copy; for a host backup, the host-lock receipt of ``node``)."""

    key: RadixKey
    lock: Any
    node: Any = None
    slots: int = 0  # host slots of a backup


class TreeRows:
    """Rows of the tree for the tiers, composed into the radix cache (``cache.tree_rows``):
    it uses the tree's match, insert, lock and evict methods and ``_kv_pool`` /
    ``_host_pool``, the device and host KV pools, of ``self.cache``."""

    def __init__(self, cache):
        self.cache = cache

    def key(self, ids, like: Optional[RadixKey], namespace=SAME_NAMESPACE) -> RadixKey:
        """A key for ``ids`` in ``like``'s namespace (or in ``namespace``, a context's
        tenant namespace: :mod:`.tenant`)."""
        extra_key, cache_salt = ((like.extra_key, like.cache_salt) if namespace is SAME_NAMESPACE
                                 else tenant.tree_key(namespace))
        return RadixKey(array.array("q", [int(t) for t in ids]), extra_key, is_bigram=self.cache.tree_core.is_eagle,
                        cache_salt=cache_salt)

    def floor(self, n: int) -> int:
        return n // self.cache.page_size * self.cache.page_size

    def owned_by_evicpress(self, node_id) -> bool:
        """Whether tree node ``node_id``, which SGLang writes through to the host while
        it inserts a key (kept by :meth:`~.radix.EvicPressRadixCache.insert`; the node
        lies on that key's path), holds rows only EvicPress reads (lossy and profiler rows,
        module docstring): a context's full rows are HiCache's to write, as a plain prefix's."""
        key = self.cache._inserting_key
        return self.stored_by_evicpress(node_id) if key is None else _private(key.extra_key)

    def stored_by_evicpress(self, node_id) -> bool:
        """Whether the host backup of ``node_id`` holds lossy or profiler rows: HiCache
        does not write it to storage."""
        return _private(self.cache.tree_core.prefetch_anchor_info(node_id)[0])

    def device_match(self, key: RadixKey):
        """(device tokens, last device node, their device indices) for ``key``."""
        r = self.cache._match_tree(MatchPrefixParams(key=key))
        have = int(r.device_prefix_len)
        if have == 0:
            return 0, r.last_device_node, torch.empty(0, dtype=torch.int64)
        idx = self.cache.tree_core.collect_full_device_indices(
            r.last_device_node, self.cache.root_node_handle(key.extra_key)
        )
        return have, r.last_device_node, idx[:have]

    def cached_len(self, key: RadixKey) -> int:
        """Tokens of ``key`` the tree holds on the device or, backed up, on the host."""
        r = self.cache._match_tree(MatchPrefixParams(key=key))
        return int(r.device_prefix_len) + int(r.host_hit_length)

    def gather(self, indices: torch.Tensor) -> FullKV:
        pool = self.cache._kv_pool
        idx = indices.to(torch.int64).to(pool.k_buffer[0].device)
        k = torch.stack([pool.k_buffer[l][idx] for l in range(pool.layer_num)]).cpu()
        v = torch.stack([pool.v_buffer[l][idx] for l in range(pool.layer_num)]).cpu()
        return FullKV(k, v)

    def write(self, indices: torch.Tensor, kv: FullKV) -> None:
        pool = self.cache._kv_pool
        dev = pool.k_buffer[0].device
        idx = indices.to(torch.int64).to(dev)
        for l in range(pool.layer_num):
            pool.k_buffer[l][idx] = kv.k[l].to(device=dev, dtype=pool.k_buffer[l].dtype)
            pool.v_buffer[l][idx] = kv.v[l].to(device=dev, dtype=pool.v_buffer[l].dtype)

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        alloc = self.cache.token_to_kv_pool_allocator
        idx = alloc.alloc(n)
        if idx is None:
            self.cache.evict(EvictParams(num_tokens=n))
            idx = alloc.alloc(n)
        return idx

    def inject(self, ids, like: RadixKey, namespace, n: int, kv: FullKV) -> int:
        """Put tokens ``[have, n)`` of ``kv`` on the device under ``ids[:n]`` and insert
        them into the tree. Returns the device-resident length afterwards."""
        key = self.key(ids[:n], like, namespace)
        have, node, prefix_idx = self.device_match(key)
        if have >= n:
            return have
        lock = self.cache.lock(node) if have > 0 else None
        try:
            new = self.alloc(n - have)
            if new is None:
                logger.info("EvicPress: no device room to load %d tokens", n - have)
                return have
            self.write(new, FullKV(kv.k[:, have:n], kv.v[:, have:n]))
            value = torch.cat([prefix_idx.to(torch.int64), new.to(torch.int64)])
            self.cache.insert(InsertParams(key=key, value=value, prev_prefix_len=have, inserted_len=have))
        finally:
            self.cache.unlock(lock)
        return self.device_match(key)[0]

    # ------------------------------------------------------------------ device tier
    # The DeviceTree protocol of :mod:`.device_tier`: copies the policy keeps on the
    # device are tree nodes EvicPress holds a lock on.
    @property
    def bytes_per_token(self) -> int:
        return self.cache.evicpress.dims.bytes_per_token if self.cache.evicpress is not None else 0

    def pin(self, key: RadixKey) -> Optional[_Pin]:
        have, node, _ = self.device_match(key)
        if have < len(key):
            return None
        return _Pin(key, self.cache.lock(node))

    def place_full(self, ctx: Context, kv: Optional[FullKV]) -> Optional[_Pin]:
        n = kv.num_tokens if kv is not None else (ctx.stored_len or ctx.num_tokens)
        ids = ctx.token_ids[:n].tolist()
        if kv is not None and self.inject(ids, None, ctx.namespace, n, kv) < n:
            return None
        return self.pin(self.key(ids, None, ctx.namespace))

    def place_dropped(self, ctx: Context, config: CompressionConfig, rows: FullKV) -> Optional[_Pin]:
        n = ctx.stored_len or ctx.num_tokens
        n_keep = rows.num_tokens
        key = self.key(ctx.token_ids[:n_keep].tolist(), None, private_namespace(ctx, config, n))
        have = self.device_match(key)[0]
        if have == 0:
            new = self.alloc(n_keep)
            if new is None:
                return None
            self.write(new.to(torch.int64), rows)
            self.cache.insert(InsertParams(key=key, value=new.to(torch.int64), prev_prefix_len=0, inserted_len=0))
        elif have < n_keep:  # a partly evicted copy: not usable
            return None
        return self.pin(key)

    def read_pinned(self, pin: _Pin) -> FullKV:
        have, _, idx = self.device_match(pin.key)
        if have < len(pin.key):
            raise RuntimeError("a pinned device copy is missing from the tree")
        return self.gather(idx)

    def unpin(self, pin: _Pin) -> None:
        self.cache.unlock(pin.lock)

    # ------------------------------------------------------------------ host tier
    # The HostTree protocol of :mod:`.host_tier`: a full host copy is SGLang's own
    # HiCache backup of the context's nodes (controller write), host-locked; SGLang loads
    # it back layer-wise when a request finds the device copy evicted.
    def back_up_full(self, ctx: Context) -> Optional[_Pin]:
        n = ctx.stored_len or ctx.num_tokens
        key = self.key(ctx.token_ids[:n].tolist(), None, ctx.namespace)
        have, node, _ = self.device_match(key)
        if have < n:
            return None  # not on the device: the caller stores a blob instead
        for node_id in self.cache.tree_core.build_backup_kv_action(node).node_ids:
            if self.cache.tree_core.is_backuped(node_id):
                continue
            if not self.cache.backup_node_for_write_back(node_id):  # HiCache then writes it to storage too
                logger.info("EvicPress: HiCache backup of context %s failed (host pool full)", ctx.ctx_id)
                return None
        self.cache._released = [p for p in self.cache._released if p.node != node]  # held again
        return _Pin(key, self.cache.inc_host_lock_ref(node).to_dec_params(), node, n)

    def read_backed(self, pin: _Pin) -> Optional[FullKV]:
        r = self.cache._match_tree(MatchPrefixParams(key=pin.key))
        have = int(r.device_prefix_len)
        if have + int(r.host_hit_length) < len(pin.key):
            return None
        kv = None
        if have:
            idx = self.cache.tree_core.collect_full_device_indices(
                r.last_device_node, self.cache.root_node_handle(pin.key.extra_key))[:have]
            kv = self.gather(idx)
        if have < len(pin.key):
            xfer, _ = self.cache.tree_core.build_load_back_spec(r.best_match_node)
            host_idx = xfer.host_indices[: len(pin.key) - have].to(torch.int64)
            if len(host_idx) < len(pin.key) - have:
                return None
            rows = FullKV(_host_rows(self.cache._host_pool, self.cache._host_pool.k_buffer, host_idx),
                          _host_rows(self.cache._host_pool, self.cache._host_pool.v_buffer, host_idx))
            kv = rows if kv is None else FullKV(torch.cat([kv.k, rows.k], 1), torch.cat([kv.v, rows.v], 1))
        return kv

    def release_backed(self, pin: _Pin) -> None:
        self.cache.dec_host_lock_ref(pin.node, pin.lock)
        self.cache._released.append(pin)  # evicted by _trim_host_pool

    def free_host(self, num_slots: int) -> int:
        return self.cache.evict_host(num_slots)

    def trim_host_pool(self) -> None:
        """Evict the HiCache backups of contexts EvicPress released (demoted or dropped):
        such a context must not keep answering from the host pool beyond its placement.
        SGLang's host LRU evicts only rows no longer on the device and has no eviction
        of one node, so it is asked once for as many rows as a released backup holds
        on the host alone (its least recently used rows go first: usually the released
        ones; if other rows went, the backup is left to the LRU like a plain prefix's).
        A released backup still on the device waits until SGLang evicts its device rows."""
        excess, keep = 0, []
        for pin in self.cache._released:
            try:
                if not self.cache.tree_core.is_backuped(pin.node):
                    continue  # gone from the host
                if self.cache.tree_core.is_full_device_evicted(pin.node):
                    excess += pin.slots
                else:
                    keep.append(pin)
            except (KeyError, ValueError, IndexError):  # the node left the tree (the interface's
                continue  # missing handles raise KeyError; tolerant of a core that says otherwise)
        self.cache._released = keep
        if excess:
            self.cache.evict_host(excess)

    # ------------------------------------------------------------------ tests and admin
    def device_digest(self, ctx: Context) -> dict:
        """xxh3 of the device copy of ``ctx`` (the stored length) and of its stored KV
        decoded, for tests of moves between tiers."""
        import xxhash

        from sglang_vc.compress import num_kept

        n = ctx.stored_len or ctx.num_tokens
        dev_cfg = ctx.device_config
        lossy = dev_cfg is not None and not dev_cfg.is_full
        dropped = lossy and dev_cfg.drops_tokens
        # a lossy device copy is in its private namespace (a token-dropped one: its kept rows)
        ns = private_namespace(ctx, dev_cfg, n) if lossy else ctx.namespace
        length = num_kept(n, dev_cfg.ratio) if dropped else n
        key = RadixKey(array.array("q", ctx.token_ids[:length].tolist()), ns,
                       is_bigram=self.cache.tree_core.is_eagle)
        have, _, idx = self.device_match(key)
        out = {"device_tokens": have, "device": None, "stored": None, "stored_config": None}
        if dropped and have >= length:
            out["device_slots"] = have  # the kept rows only: n_keep of the n tokens
            out["device_tokens"] = n
            out["device"] = _digest(self.gather(idx[:length]))
            out["device_config"] = dev_cfg.label
        elif have and not dropped:
            kv = self.gather(idx)
            out["device"] = _digest(kv)
            if lossy:
                out["device_config"] = dev_cfg.label
        if ctx.placement.tier == Tier.DISK:
            out["storage_files"] = self.cache.evicpress.storage_copies.storage_files(ctx)
        if ctx.stored:
            blob = self.cache.evicpress.stored_blob(ctx)
            if blob is not None:
                cfg, kv, _ = codec.decode(blob)
                out["stored"] = _digest(kv)
                out["stored_config"] = cfg.label
                out["blob"] = xxhash.xxh3_64_hexdigest(blob)
        return out

    def evict_device_all(self) -> int:
        """Evict every evictable node from the device tree (admin / tests)."""
        n = self.cache.evictable_size()
        if n:
            self.cache.evict(EvictParams(num_tokens=n))
        self.trim_host_pool()  # evicted backed-up nodes went to the host: drop released ones
        return n


def _private(namespace: Optional[str]) -> bool:
    return namespace is not None and namespace.startswith(PROFILE_NAMESPACE)


def _digest(kv: FullKV) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for t in (kv.k, kv.v):  # the raw bytes, whatever the dtype (numpy has no bfloat16)
        h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _host_rows(pool, buffer: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Token rows ``idx`` of a host pool K or V buffer as ``[L, n, H, D]``."""
    if pool.layout == "layer_first":  # [L, size, H, D]
        return buffer[:, idx.to(buffer.device)].cpu()
    if pool.layout == "page_first":  # [size, L, H, D]
        return buffer[idx.to(buffer.device)].transpose(0, 1).cpu()
    raise ValueError(f"EvicPress reads host pools with layout layer_first or page_first, not {pool.layout!r}")
