"""EvicPress's storage tier: context blobs on a SGLang HiCache storage backend.

:class:`StorageTier` keeps EvicPress's blobs (one ``bytes`` per context, :mod:`.codec`)
on any :class:`~sglang.srt.mem_cache.hicache_storage.HiCacheStorage` that
``--hicache-storage-backend`` builds -- SGLang's ``file`` and ``seaweedfs``, or our
``evicpress_file`` (:mod:`.storage_backend`) -- so that servers of the same model on
several machines share them. It has the interface of the other tiers' stores
(:class:`~.disk_tier.DiskTierStore`, :class:`~.host_tier.HostSlotStore`).

Objects. HiCache backends store tensors under string keys, and ``get(key,
target_location)`` reads exactly ``target_location``'s bytes, so an entry is two objects::

    <base>.<gen>.h          64-byte header: <4s B B H Q Q> magic "EVPS", version, flags,
                            reserved, generation, payload length; 24 zero bytes; and an
                            xxh3-128 digest over the header's first 48 bytes, the entry's
                            identity (namespace and key) and the payload
    <base>.<gen>.<digest>.p the payload (absent when it is empty)
    base = "evp_" + xxh3_64(namespace) + "_" + xxh3_128(key)     (hex)

``get`` reads the header, then exactly the payload length it declares, and checks the
digest: a flipped bit, a truncated object, or an object of another key, generation or
namespace is counted in ``stats.corrupted``, removed where the backend can delete, and
returned as None (the caller recomputes) -- never served.

Generations. Backends skip a ``set`` of an existing key (SGLang's ``file``, ``mooncake``)
or overwrite it (``seaweedfs``), so an entry is never rewritten in place: each ``put`` of
a key writes generation ``latest + 1`` (the payload first, then the header, which is the
commit: an entry is visible whole or not at all). Headers are kept as the key's
generation log -- generations ``0..latest`` always exist -- so any server finds the newest
one with a few ``exists`` calls (a galloping search from what it saw last). The digest in
the payload's name keeps two servers writing the same generation consistent: a header
always names its own payload. A backend's own eviction (the ``file`` backend's optional
LRU cap) can break that log: a payload gone under its header reads as damaged, and a
missing header hides the generations above it from servers that have not seen them --
they miss, or read an older generation of the same key. Naming entries by content
(:func:`content_key`) keeps every generation of a key a valid blob of the same tokens.

Deletion. ``HiCacheStorage`` has no delete. Where the backend has ``delete(key)``
(``evicpress_file``), :meth:`StorageTier.delete` removes every object of the key -- for
every server -- and a ``put`` removes the payload it supersedes. Elsewhere (``file``,
``seaweedfs``) ``delete`` forgets the entry in this tier (its accounting, and ``get``
returns None until the key is written again) and leaves the bytes to the backend's own
eviction or retention; other servers still read them.

Budget. ``capacity_bytes`` bounds what this tier has put (``entry_bytes`` per entry: the
header plus the payload); a ``put`` that does not fit returns False and writes nothing.
``used_bytes``, ``len`` and ``in`` count this process's puts only; ``get`` and
:meth:`StorageTier.probe` also see entries other servers wrote.

Keys. Callers name a context's entry with :func:`content_key` (model, SGLang's
``extra_key`` namespace and the token ids), so every server of the same model computes
the same key for the same tokens; ``namespace`` (e.g. a hash of the model path) keeps
models apart even on one backend. Blobs are self-describing (:func:`.codec.blob_config`),
so a reader needs nothing but the key.

Backends must take tensors in ``set(key, value)`` / ``get(key, target_location)``
(``file``, ``seaweedfs``, ``evicpress_file``); ``mooncake``'s single-key calls take
pointers into registered memory and are not supported.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import threading
from typing import Optional, Sequence, Union

import numpy as np
import torch
import xxhash

from .tier_store import TierStore

__all__ = ["StorageTier", "StorageTierStats", "content_key", "HEADER_BYTES"]

logger = logging.getLogger(__name__)

HEADER_BYTES = 64
MAGIC = b"EVPS"
VERSION = 1
_FIELDS = struct.Struct("<4sBBHQQ")  # magic, version, flags, reserved, generation, length
_DIGEST_AT = HEADER_BYTES - 16  # the digest covers every header byte before it
_MAX_TRIES = 3  # reads of a key whose newest generation moved while we read it

Blob = Union[bytes, bytearray, memoryview]


def content_key(model: str, namespace: Optional[str], token_ids: Sequence[int]) -> str:
    """The storage key of a context: xxh3-128 (hex) of the model name, the request's
    ``extra_key`` namespace (None and "" differ) and the token ids. Every server of the
    same model computes the same key for the same tokens."""
    h = xxhash.xxh3_128()
    h.update(b"evicpress-context-v1\0")
    for part in (model, namespace):
        if part is None:
            h.update(b"\0")
        else:
            raw = part.encode("utf-8")
            h.update(b"\1" + struct.pack("<Q", len(raw)) + raw)
    ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
    h.update(struct.pack("<Q", ids.size))
    h.update(ids.tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class StorageTierStats:
    puts: int = 0
    put_rejected: int = 0  # did not fit the budget
    write_errors: int = 0  # the backend refused or failed a write; nothing became visible
    gets: int = 0
    hits: int = 0
    remote_hits: int = 0  # hits on a generation this tier did not write (another server's)
    misses: int = 0
    corrupted: int = 0  # detected on read, removed (or forgotten), returned as a miss
    deletes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclasses.dataclass
class _Entry:
    """One of this tier's own puts."""

    generation: int
    payload_bytes: int


class _Damaged(Exception):
    pass


class StorageTier(TierStore):
    """Blobs on ``backend`` (a ``HiCacheStorage``), at most ``capacity_bytes`` put by this
    tier, under ``namespace``. Thread-safe (one lock; backend calls run under it)."""

    def __init__(self, backend, capacity_bytes: int, namespace: str) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace must be a non-empty string (e.g. a hash of the model path)")
        self.backend = backend
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = namespace
        self.can_delete = callable(getattr(backend, "delete", None))
        self.stats = StorageTierStats()
        self._ns_tag = xxhash.xxh3_64_hexdigest(namespace.encode("utf-8"))
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._used = 0
        self._seen: dict[str, int] = {}  # key -> newest generation seen (search hint)
        self._forgotten: dict[str, int] = {}  # key -> generations <= this read as absent

    # -- naming and sizes ---------------------------------------------------------------
    def header_key(self, key: str, generation: int) -> str:
        """The backend key of ``key``'s header of ``generation``."""
        return f"{self._base(key)}.{generation}.h"

    def _payload_key(self, key: str, generation: int, digest: bytes) -> str:
        return f"{self._base(key)}.{generation}.{digest.hex()}.p"

    def _base(self, key: str) -> str:
        return f"evp_{self._ns_tag}_{xxhash.xxh3_128_hexdigest(key.encode('utf-8'))}"

    def _identity(self, key: str) -> bytes:
        ns, k = self.namespace.encode("utf-8"), key.encode("utf-8")
        return struct.pack("<QQ", len(ns), len(k)) + ns + k

    @staticmethod
    def entry_bytes(key: str, nbytes: int) -> int:
        """Bytes an entry with an ``nbytes`` payload takes on the backend."""
        return HEADER_BYTES + int(nbytes)

    def footprint(self, nbytes: int) -> int:
        return self.entry_bytes("", nbytes)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def size_of(self, key: str) -> Optional[int]:
        """Entry bytes of this tier's own entry of ``key``, or None."""
        e = self._entries.get(key)
        return None if e is None else self.entry_bytes(key, e.payload_bytes)

    def object_keys(self, key: str) -> Optional[tuple[str, Optional[str]]]:
        """(header, payload) backend keys of ``key``'s newest generation, or None; the
        payload key is None when the payload is empty or the header is unreadable."""
        with self._lock:
            gen = self._latest(key)
            if gen is None:
                return None
            header = self._read(self.header_key(key, gen), HEADER_BYTES)
            parsed = None if header is None else self._parse(header, gen)
            payload = None if not parsed or not parsed[0] else self._payload_key(key, gen, parsed[1])
            return self.header_key(key, gen), payload

    # -- operations ---------------------------------------------------------------------
    def put(self, key: str, blob: Blob) -> bool:
        """Store ``blob`` as ``key``'s newest generation. False, with nothing made
        visible, when it does not fit the budget or the backend fails the write; the
        previous entry of ``key`` is then left as it was."""
        payload = blob if isinstance(blob, bytearray) else bytearray(blob)
        total = self.entry_bytes(key, len(payload))
        with self._lock:
            old = self._entries.get(key)
            old_total = 0 if old is None else self.entry_bytes(key, old.payload_bytes)
            if self._used - old_total + total > self.capacity_bytes:
                self.stats.put_rejected += 1
                return False
            # Two servers putting one key at once may pick the same generation: one
            # header wins (kept or overwritten, per backend) and names its own payload.
            latest = self._latest(key)
            gen = 0 if latest is None else latest + 1
            header = self._header(key, gen, payload)
            digest = bytes(header[_DIGEST_AT:])
            payload_key = self._payload_key(key, gen, digest)
            if not (
                (not payload or self._write(payload_key, payload))
                and self._write(self.header_key(key, gen), header)
            ):
                self.stats.write_errors += 1
                if payload and self.can_delete:
                    self._delete_object(payload_key)
                return False
            if latest is not None and self.can_delete:
                self._delete_payload(key, latest)  # superseded; its header stays (the log)
            self._seen[key] = gen
            self._forgotten.pop(key, None)
            self._entries[key] = _Entry(gen, len(payload))
            self._used += total - old_total
            self.stats.puts += 1
            self.stats.bytes_written += total
            return True

    def get(self, key: str) -> Optional[bytes]:
        """The newest generation's bytes (whoever wrote it), or None when absent,
        forgotten here, or damaged. The read itself runs outside the tier's lock (a
        generation's objects never change once written): a long read, such as a full
        copy streamed over a slow link, does not stall the tier's other callers."""
        with self._lock:
            self.stats.gets += 1
        for _ in range(_MAX_TRIES):
            with self._lock:
                gen = self._latest(key)
                if gen is None or gen <= self._forgotten.get(key, -1):
                    self.stats.misses += 1
                    return None
            try:
                blob = self._read_entry(key, gen)
            except _Damaged:
                with self._lock:  # again, with writers and deleters held off
                    newer = self._latest(key)
                    if newer is not None and newer > gen:  # superseded while we read
                        continue
                    try:
                        blob = self._read_entry(key, gen)  # rewritten under the same generation
                    except _Damaged as exc:
                        self._drop_damaged(key, gen, str(exc))
                        return None
            with self._lock:
                own = self._entries.get(key)
                if own is None or own.generation != gen:
                    self.stats.remote_hits += 1
                self.stats.hits += 1
                self.stats.bytes_read += self.entry_bytes(key, len(blob))
            return blob
        with self._lock:
            self.stats.misses += 1  # other servers kept rewriting it: a miss, not damage
        return None

    def probe(self, key: str) -> bool:
        """Whether the backend holds a generation of ``key`` that this tier would read
        (written by any server; its contents are checked only by :meth:`get`)."""
        with self._lock:
            gen = self._latest(key)
            return gen is not None and gen > self._forgotten.get(key, -1)

    def delete(self, key: str) -> bool:
        """Remove ``key``: every object where the backend can delete, otherwise forget it
        here (see the module docstring). False when there was nothing to remove."""
        with self._lock:
            had = self._forget(key)
            gen = self._latest(key)
            if gen is not None and gen > self._forgotten.get(key, -1):
                had = True
                if self.can_delete:
                    self._purge(key, gen)
                else:
                    self._forgotten[key] = gen
            if had:
                self.stats.deletes += 1
            return had

    def clear(self) -> None:
        """Delete every entry this tier put (as :meth:`delete` does)."""
        for key in list(self._entries):
            self.delete(key)
        with self._lock:
            self._seen.clear()

    # -- entries ------------------------------------------------------------------------
    def _header(self, key: str, gen: int, payload: bytearray) -> bytearray:
        header = bytearray(HEADER_BYTES)
        _FIELDS.pack_into(header, 0, MAGIC, VERSION, 0, 0, gen, len(payload))
        h = xxhash.xxh3_128()
        h.update(header[:_DIGEST_AT])
        h.update(self._identity(key))
        h.update(payload)
        header[_DIGEST_AT:] = h.digest()
        return header

    @staticmethod
    def _parse(header: bytes, gen: int) -> Optional[tuple[int, bytes]]:
        """(payload length, digest) of a well-formed header of generation ``gen``."""
        magic, version, _, _, stored_gen, length = _FIELDS.unpack_from(header)
        if magic != MAGIC or version != VERSION or stored_gen != gen:
            return None
        return length, bytes(header[_DIGEST_AT:])

    def _read_entry(self, key: str, gen: int) -> bytes:
        header = self._read(self.header_key(key, gen), HEADER_BYTES)
        if header is None:
            raise _Damaged("header unreadable")
        parsed = self._parse(header, gen)
        if parsed is None:
            raise _Damaged("bad header")
        length, digest = parsed
        payload = b"" if length == 0 else self._read(self._payload_key(key, gen, digest), length)
        if payload is None:
            raise _Damaged("payload missing or short")
        h = xxhash.xxh3_128()
        h.update(header[:_DIGEST_AT])
        h.update(self._identity(key))
        h.update(payload)
        if h.digest() != digest:
            raise _Damaged("digest mismatch")
        return payload

    def _drop_damaged(self, key: str, gen: Optional[int], why: str) -> None:
        logger.warning("storage tier: entry %s generation %s is damaged (%s); dropped", key, gen, why)
        self.stats.corrupted += 1
        self.stats.misses += 1
        self._forget(key)
        if gen is None:
            return
        if self.can_delete:
            self._purge(key, gen)
        else:
            self._forgotten[key] = gen

    def _forget(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= self.entry_bytes(key, entry.payload_bytes)
        return True

    def _latest(self, key: str) -> Optional[int]:
        """Newest generation whose header exists: a galloping search up from the last one
        seen (headers ``0..latest`` all exist), or None."""
        hint = self._seen.get(key)
        if hint is not None and self._exists(self.header_key(key, hint)):
            lo = hint
        elif self._exists(self.header_key(key, 0)):
            lo = 0
        else:
            self._seen.pop(key, None)
            return None
        step = 1
        while self._exists(self.header_key(key, lo + step)):
            lo += step
            step *= 2
        hi = lo + step  # lo exists, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._exists(self.header_key(key, mid)):
                lo = mid
            else:
                hi = mid
        self._seen[key] = lo
        return lo

    def _delete_payload(self, key: str, gen: int) -> None:
        header = self._read(self.header_key(key, gen), HEADER_BYTES)
        parsed = None if header is None else self._parse(header, gen)
        if parsed is not None and parsed[0]:
            self._delete_object(self._payload_key(key, gen, parsed[1]))

    def _purge(self, key: str, latest: int) -> None:
        """Delete generations ``latest..0`` (newest first, so the log stays contiguous)."""
        for gen in range(latest, -1, -1):
            self._delete_payload(key, gen)
            self._delete_object(self.header_key(key, gen))
        self._seen.pop(key, None)
        self._forgotten.pop(key, None)

    # -- backend calls (a backend error is a failed call, never an exception here) -------
    def _exists(self, name: str) -> bool:
        try:
            return bool(self.backend.exists(name))
        except Exception as exc:  # noqa: BLE001 - any backend error reads as absent
            logger.debug("storage tier: exists(%s) failed: %s", name, exc)
            return False

    def _read(self, name: str, nbytes: int) -> Optional[bytes]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        try:
            out = self.backend.get(name, buf)
        except Exception as exc:  # noqa: BLE001 - e.g. the file backend's short read
            logger.debug("storage tier: get(%s) failed: %s", name, exc)
            return None
        if not isinstance(out, torch.Tensor) or out.numel() * out.element_size() != nbytes:
            return None
        return out.contiguous().view(torch.uint8).numpy().tobytes()

    def _write(self, name: str, data: bytearray) -> bool:
        try:
            return bool(self.backend.set(name, torch.frombuffer(data, dtype=torch.uint8)))
        except Exception as exc:  # noqa: BLE001
            logger.warning("storage tier: set(%s) failed: %s", name, exc)
            return False

    def _delete_object(self, name: str) -> bool:
        try:
            return bool(self.backend.delete(name))
        except Exception as exc:  # noqa: BLE001
            logger.debug("storage tier: delete(%s) failed: %s", name, exc)
            return False
