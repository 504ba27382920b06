"""A context's copies on the shared storage tier, beside whatever the policy places: written
for every computed context (``--evicpress-storage-copies``: the full KV for the next
server's exact hit, a compressed one for servers behind a slow link to draft from), found
there by a server that did not compute it, read back whole (VeriCache's remote prefix
caching, path P2 and the fallback)."""

from __future__ import annotations

import logging
import time
from typing import Optional

from . import codec
from .codec import FullKV
from .config import FULL, CompressionConfig, Placement, Tier
from .context import Context

logger = logging.getLogger(__name__)


class StorageCopies:
    """:class:`~.manager.EvicPressManager`'s storage copies (``manager.storage_copies``:
    they use the manager's lock, stores, settings and counters, ``self.m``)."""

    def __init__(self, manager):
        self.m = manager

    def storage_files(self, ctx: Context) -> list[str]:
        """Local files of ``ctx``'s entry on the storage tier (header, payload), where the
        backend keeps them in files (diagnostics and tests); [] otherwise."""
        with self.m.lock:
            if self.m.on_pages(Tier.DISK, ctx.placement.config):
                return self.m.full_pages.files(ctx.token_ids, ctx.namespace)
            objects = (self.m.disk.object_keys(self.m.blob_key(ctx, Tier.DISK, ctx.placement.config))
                       if hasattr(self.m.disk, "object_keys") else None)
            path_of = getattr(getattr(self.m.disk, "backend", None), "entry_path", None)
            if not objects or path_of is None:
                return []
            return [str(path_of(name)) for name in objects if name is not None]

    def find_shared(self, ctx: Context) -> bool:
        """Whether another server (or an earlier run) left a copy of ``ctx`` on the shared
        storage tier; if so ``ctx`` is now placed there, on the best copy found: the full
        KV first, then the configured storage copies, then the profiler's candidates."""
        with self.m.lock:
            if ctx.stored or not hasattr(self.m.disk, "probe"):
                return False
            first = [self.m.settings.load_copy] if self.m.settings.load_copy is not None else []
            order = [*first, FULL, *self.m.settings.storage_copies, *self.m.settings.candidates]
            for cfg in dict.fromkeys(order):
                if cfg.drops_tokens and not self.m.settings.serves_dropped:
                    continue
                t0 = time.perf_counter()
                if self.m.on_pages(Tier.DISK, cfg):  # the full KV: HiCache's pages
                    blob = self.m.full_pages.get_blob(ctx.token_ids, ctx.namespace)
                else:
                    key = self.m.blob_key(ctx, Tier.DISK, cfg)
                    blob = self.m.disk.get(key) if self.m.disk.probe(key) else None
                if blob is None:
                    continue
                try:
                    if codec.blob_config(blob) != cfg:
                        raise ValueError("config differs from its key")
                    ctx.stored_len = codec.blob_tokens(blob)
                except Exception:
                    logger.warning("EvicPress: shared entry %s of %s does not decode; ignored", cfg.label, ctx.ctx_id)
                    continue
                ctx.shared.add(cfg)
                ctx.sizes[cfg] = len(blob)
                ctx.quality.setdefault(cfg, 1.0 if cfg.is_full else 0.0)
                self.m._set_placement(ctx, Placement(cfg, Tier.DISK))
                self.m._found[ctx.ctx_id] = (cfg, blob, time.perf_counter() - t0)
                self.m.count(shared_found=1)
                return True
            return False

    def read_storage_copy(self, ctx: Context, config: CompressionConfig = FULL) -> Optional[FullKV]:
        """``ctx``'s storage copy of ``config`` decoded, read from the shared store over
        this server's link, or None (absent, corrupted). Changes no placement. Safe off
        the scheduler thread: the manager lock is not held during the read (the store
        has its own), so a long read does not stall the scheduler's lookups."""
        t0 = time.perf_counter()
        if self.m.on_pages(Tier.DISK, config):  # HiCache's pages, decoded already
            kv = self.m.full_pages.read(ctx.token_ids, ctx.namespace)
            if kv is None:
                self.m.count(storage_copy_misses=1)
                return None
            self.m.count(storage_copies_read=1, bytes_read_storage_copies=kv.nbytes,
                         storage_copy_read_seconds=time.perf_counter() - t0)
            return kv
        with self.m.lock:
            key = self.m.blob_key(ctx, Tier.DISK, config)
        blob = self.m.disk.get(key)
        if blob is None:
            self.m.count(storage_copy_misses=1)
            return None
        try:
            cfg, kv, positions = codec.decode(blob)
            if cfg != config or positions is not None:
                raise ValueError(f"entry holds {cfg.label}")
        except Exception:
            logger.warning("EvicPress: storage copy %s of %s does not decode; not used", config.label, ctx.ctx_id)
            self.m.count(storage_copy_misses=1)
            return None
        self.m.count(storage_copies_read=1, bytes_read_storage_copies=len(blob),
                   storage_copy_read_seconds=time.perf_counter() - t0)
        return kv

    def write_storage_copies(self, ctx: Context, kv: FullKV) -> int:
        """Write ``ctx``'s configured storage copies (``Settings.storage_copies``) that the
        shared store does not hold yet, from its just computed full KV; returns how many
        were written. On the scheduler thread, in the deferred step after the prefill
        (off the TTFT path, not off the scheduler: a store write thread is not built).
        A full or failing store skips the copy (counted); the context stays served."""
        written = 0
        for cfg in self.m.settings.storage_copies:
            if cfg in ctx.shared or (cfg.drops_tokens and not self.m.settings.serves_dropped):
                continue
            if self.m.on_pages(Tier.DISK, cfg):  # the full KV: HiCache's pages, written if missing
                ok, nbytes = self.m.full_pages.write(ctx.token_ids, ctx.namespace, kv,
                                                         keep=self.m.on_pages(ctx.placement.tier, ctx.placement.config))
                if ok:
                    ctx.shared.add(cfg)
                    written += bool(nbytes)
                    self.m.count(**({"storage_copies_written": 1, "bytes_written_storage_copies": nbytes}
                                    if nbytes else {"full_pages_found": 1}))
                else:
                    self.m.count(storage_copy_skipped=1)
                continue
            key = self.m.blob_key(ctx, Tier.DISK, cfg)
            if hasattr(self.m.copies, "probe") and self.m.copies.probe(key):
                ctx.shared.add(cfg)  # another server wrote it already
                continue
            t0 = time.perf_counter()
            try:
                blob = codec.encode(kv, cfg)
            except Exception:
                logger.exception("EvicPress: could not encode the %s storage copy of %s", cfg.label, ctx.ctx_id)
                self.m.count(storage_copy_errors=1)
                continue
            if not self.m.copies.put(key, blob):
                self.m.count(storage_copy_skipped=1)
                continue
            ctx.shared.add(cfg)
            ctx.sizes[cfg] = len(blob)
            written += 1
            self.m.count(storage_copies_written=1, bytes_written_storage_copies=len(blob),
                       storage_copy_seconds=time.perf_counter() - t0)
        return written
