"""``evicpress_file``: the checksummed, atomic disk store as a SGLang HiCache storage backend.

:class:`EvicPressFileStorage` is a :class:`HiCacheStorage` over
:class:`~.disk_tier.DiskTierStore`: every object is one file with an xxh3-128 digest over
its header, key and bytes, written to a temporary file and renamed into place. A damaged
file is detected on read, deleted and reported as a miss -- never served, unlike SGLang's
``file`` backend, which copies whatever bytes a file holds. It serves two callers:

* HiCache itself (plain, non-hybrid models): pages as tensors through ``set``/``get``/
  ``exists`` and the ``batch_*`` calls of the generic page interface (flat pages; the
  zero-copy ``*_v1`` and hybrid-model ``*_v2`` calls are not implemented);
* EvicPress's :class:`~.storage_tier.StorageTier`, which also uses :meth:`delete`.

Configuration (``--hicache-storage-backend-extra-config``)::

    {"path": "/var/cache/sglang-kv", "capacity_gb": 100, "fsync": true}

``path`` (required) is shared by every server and model that should see each other's
entries; each model and rank scope (SGLang's own rule, :func:`key_scope`, as the
``seaweedfs`` backend and the ``file`` backend's key suffix use) gets a sub-directory and
a key prefix. ``capacity_gb`` (required) bounds what this backend object writes. The
objects of EvicPress's storage tier (``set``) are never evicted: the tier decides what to
delete, and a ``set`` that does not fit returns False. HiCache's pages of plain prefixes
(``batch_set``) are a cache inside the same budget, marked evictable in their file
header: the oldest pages of this scope (written by this object, or found in the
directory at start-up) are deleted to make room for a tier object or a newer page, except
pages a full EvicPress context stands on (:meth:`EvicPressFileStorage.keep`, until released)
(pages written before the flag existed count as tier objects: clear them by hand). ``fsync`` (default true)
syncs each file and the directory before a write returns. Other keys are ignored (the
extra config also carries SGLang's own keys, e.g. ``prefetch_threshold``).

Selecting it: ``python -m sglang_vc.launch_server --hicache-storage-backend evicpress_file
--hicache-storage-backend-extra-config '{"path": DIR, "capacity_gb": G}'`` (or just
``--evicpress-disk-dir DIR``). SGLang 0.5.23's parser accepts only its own backend names,
so the launcher passes it through SGLang's ``dynamic`` backend, which builds an outside
class from ``backend_name``/``module_path``/``class_name`` in the extra config
(:func:`dynamic_extra_config` adds them); with plain ``sglang.launch_server`` give those
keys yourself with ``--hicache-storage-backend dynamic``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .disk_tier import FLAG_EVICTABLE, SUFFIX, DiskTierStats, DiskTierStore

__all__ = [
    "BACKEND_NAME",
    "EvicPressFileConfig",
    "EvicPressFileStorage",
    "dynamic_extra_config",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "evicpress_file"
_CLASS_NAME = "EvicPressFileStorage"
GB = 1 << 30
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclasses.dataclass(frozen=True)
class EvicPressFileConfig:
    """The backend's part of ``storage_config.extra_config``."""

    path: Path
    capacity_bytes: int
    fsync: bool = True

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "EvicPressFileConfig":
        extra = extra or {}
        example = '{"path": "/var/cache/sglang-kv", "capacity_gb": 100}'
        path = extra.get("path")
        if not isinstance(path, str) or not path.strip():
            raise ValueError(
                f"{BACKEND_NAME}: the storage extra config needs \"path\", a directory "
                f"(got {path!r}); e.g. --hicache-storage-backend-extra-config '{example}'"
            )
        cap = extra.get("capacity_gb")
        if (
            isinstance(cap, bool)
            or not isinstance(cap, (int, float))
            or not math.isfinite(cap)
            or cap <= 0
        ):
            raise ValueError(
                f"{BACKEND_NAME}: the storage extra config needs \"capacity_gb\", a "
                f"number > 0 (got {cap!r}); e.g. '{example}'"
            )
        fsync = extra.get("fsync", True)
        if not isinstance(fsync, bool):
            raise ValueError(f"{BACKEND_NAME}: \"fsync\" must be true or false (got {fsync!r})")
        root = Path(path).expanduser()
        if root.exists() and not root.is_dir():
            raise ValueError(f"{BACKEND_NAME}: \"path\" {path!r} exists and is not a directory")
        return cls(root, int(cap * GB), fsync)


def key_scope(storage_config: HiCacheStorageConfig) -> List[str]:
    """Model and rank parts that keep models and TP shards apart: SGLang's rule
    (``seaweedfs_store.key_scope``, which mirrors the ``file`` backend's suffixes)."""
    from sglang.srt.mem_cache.storage.seaweedfs.seaweedfs_store import key_scope as scope

    return scope(storage_config)


class EvicPressFileStorage(HiCacheStorage):
    """HiCache objects as checksummed files under ``path/<scope>/``.

    Contract (beyond :class:`HiCacheStorage`'s):

    * ``set`` writes atomically and replaces an existing object; False when it does not
      fit ``capacity_gb`` or the write fails (nothing is left behind).
    * ``get`` returns the exact bytes written or None: absent, damaged (deleted on the
      spot; counted in ``stats.corrupted``), or not the size of ``target_location``.
    * ``exists`` asks the file system, so objects that another process wrote to the
      same directory are visible; ``delete`` removes an object (False when absent).

    The byte budget counts what this object wrote plus what was in its directory when it
    started; several servers on one directory each keep their own count.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host: Any = None) -> None:
        # ``mem_pool_host``: the factory's positional argument (the host pool, or the
        # ``dynamic`` path's kwargs dict); pages come in as tensors, so it is not needed.
        self.config = EvicPressFileConfig.from_extra_config(storage_config.extra_config)
        scope = key_scope(storage_config)
        self.key_prefix = "/".join(scope)
        dir_name = "_".join(_UNSAFE.sub("_", p) for p in scope).lstrip(".") or "default"
        self.root = self.config.path / dir_name
        self.store = DiskTierStore(self.root, self.config.capacity_bytes, fsync=self.config.fsync)
        # HiCache's pages of this scope (key -> bytes on disk), oldest first: evicted to
        # make room. Pages an earlier run left count in the budget, so they are adopted.
        self._pages: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._page_bytes = 0
        # pages a tier object stands on (EvicPress's full contexts, :meth:`keep`): not
        # evicted for newer pages, also when HiCache writes them again
        self._kept: set[str] = set()
        self._lock = threading.Lock()
        self._adopt_pages()
        logger.info(
            "%s HiCache backend at %s (%.2f GB, %d existing objects, %d of them evictable pages)",
            BACKEND_NAME, self.root, self.config.capacity_bytes / GB, len(self.store), len(self._pages),
        )

    def _adopt_pages(self) -> None:
        prefix = f"{self.key_prefix}/" if self.key_prefix else ""
        found = []
        for raw, flags, size, mtime in self.store.entries():
            key = raw.decode("utf-8", errors="replace")
            if flags & FLAG_EVICTABLE and key.startswith(prefix):
                found.append((mtime, key[len(prefix):], size))
        for _, key, size in sorted(found):
            self._pages[key] = size
            self._page_bytes += size

    @property
    def stats(self) -> DiskTierStats:
        return self.store.stats

    def _key(self, key: str) -> str:
        return f"{self.key_prefix}/{key}" if self.key_prefix else key

    def entry_path(self, key: str) -> Path:
        """The file that holds ``key``'s object (whether or not it exists)."""
        return self.root / DiskTierStore.file_name(self._key(key))

    # -- single objects -----------------------------------------------------------------
    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        page = value if value is not None else target_location
        if not isinstance(page, torch.Tensor):
            raise TypeError(
                f"{BACKEND_NAME} stores tensors (the generic page interface), got "
                f"{type(page).__name__}"
            )
        return self._put(key, page, is_page=False)

    def _put(self, key: str, page: torch.Tensor, is_page: bool) -> bool:
        flat = page.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        name = self._key(key)
        with self._lock:
            size = DiskTierStore.entry_bytes(name, flat.numel())
            over = self.store.used_bytes - (self.store.size_of(name) or 0) + size - self.store.capacity_bytes
            # evict only when the pages (the other ones) can make room: never in vain. A
            # page another server already deleted still frees its bytes of this object's
            # count (the budget counts what this object wrote or found)
            if 0 < over <= self._page_bytes - self._pages.get(key, 0):
                for oldest in list(self._pages):
                    if over <= 0:
                        break
                    if oldest != key:
                        over -= self._forget_page(oldest)
                        self.store.delete(self._key(oldest))
                        self.stats.pages_evicted += 1
            ok = self.store.put(name, memoryview(flat.numpy()), flags=FLAG_EVICTABLE if is_page else 0)
            if ok:
                self._forget_page(key)  # a tier object under a page's key is the tier's now
                if is_page and key not in self._kept:
                    self._pages[key] = size
                    self._page_bytes += size
            return ok

    def keep(self, keys: List[str]) -> None:
        """Pages that hold a tier object (a full context EvicPress places on storage,
        :mod:`.hicache_pages`), written or still to be written: no newer page evicts
        them until :meth:`release`."""
        with self._lock:
            for key in keys:
                self._kept.add(key)
                self._forget_page(key)

    def release(self, keys: List[str]) -> None:
        """Kept pages become HiCache's cache again, the first to be evicted."""
        with self._lock:
            for key in keys:
                self._kept.discard(key)
                size = self.store.size_of(self._key(key))
                if size and key not in self._pages:
                    self._pages[key] = size
                    self._pages.move_to_end(key, last=False)
                    self._page_bytes += size

    def _forget_page(self, key: str) -> int:
        size = self._pages.pop(key, 0)
        self._page_bytes -= size
        return size

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> torch.Tensor | None:
        data = self.store.get(self._key(key))
        if data is None:
            with self._lock:  # absent or damaged (the store deleted it), unless rewritten meanwhile
                if self.store.size_of(self._key(key)) is None:
                    self._forget_page(key)
            return None
        if target_location is None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        nbytes = target_location.numel() * target_location.element_size()
        if len(data) != nbytes:  # a page of another layout: copying it would be wrong
            logger.warning("%s: object %s is %d bytes, target is %d", BACKEND_NAME, key, len(data), nbytes)
            return None
        if not target_location.is_contiguous():
            raise ValueError(f"{BACKEND_NAME}: target_location must be contiguous")
        flat = target_location.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            memoryview(flat.numpy())[:] = data
        else:
            flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return target_location

    def exists(self, key: str) -> bool:
        return self.entry_path(key).is_file()

    def delete(self, key: str) -> bool:
        """Remove ``key``'s object; False when there was none."""
        with self._lock:
            self._forget_page(key)
            self._kept.discard(key)
            return self.store.delete(self._key(key))

    # -- batches (the generic page interface) -------------------------------------------
    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        pages = values if values is not None else target_locations
        return all(self._put(k, v, is_page=True) for k, v in zip(keys, pages))

    def clear(self) -> None:
        """Remove every object of this scope (other models' directories are left alone).
        Not concurrent with other calls (SGLang clears storage with I/O stopped)."""
        for path in self.root.glob("*" + SUFFIX):
            path.unlink(missing_ok=True)
        self._pages.clear()
        self._kept.clear()
        self._page_bytes = 0
        stats = self.store.stats
        self.store = DiskTierStore(self.root, self.config.capacity_bytes, fsync=self.config.fsync)
        self.store.stats = stats


# -- how SGLang builds it --------------------------------------------------------------------
def dynamic_extra_config(extra: Optional[dict] = None) -> dict:
    """``extra`` plus the keys SGLang's ``dynamic`` storage backend needs to build
    :class:`EvicPressFileStorage` (``backend_name``, ``module_path``, ``class_name``).

    SGLang's storage factory builds outside classes only through ``--hicache-storage-backend
    dynamic`` (its parser accepts only its own names); the launcher rewrites
    ``--hicache-storage-backend evicpress_file`` into that."""
    return {
        **(extra or {}),
        "backend_name": BACKEND_NAME,
        "module_path": __name__,
        "class_name": _CLASS_NAME,
    }
