"""Disk tier for KV blobs (EvicPress's slowest bounded tier; paper sections 4.1, 5, 6.1).

One file per entry under a directory, with a byte budget. Each file is

    header  <4s B B H I Q 16s>  magic "EVPK", version, kind, reserved,
                                 key length, payload length, xxh3-128 digest
    key     (utf-8 / raw bytes)
    payload (raw bytes, or a safetensors blob of a dict of tensors)

The digest covers the header's fixed fields, the key and the payload, so a flipped
bit anywhere, a truncated file or a file of another key is detected. Writes are
atomic: a temporary file in the same directory, fsync, rename over the final name,
fsync of the directory -- a reader sees the old entry or the new one, never a part.

Space is the caller's policy: :meth:`DiskTierStore.put` never evicts; it returns False
when the entry does not fit in the budget (after whatever eviction the caller did), and
then nothing is written. Corrupted or truncated entries are deleted when read and
reported as misses (counted in ``stats.corrupted``).

One lock serialises operations; the HiCache-style controller calls from its own I/O
thread. Torch/safetensors are imported only when tensors are stored.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

import xxhash

from .tier_store import TierStore

__all__ = ["DiskTierStore", "DiskTierStats", "Bandwidth", "measure_bandwidth"]

MAGIC = b"EVPK"
VERSION = 1
KIND_BYTES = 0
KIND_TENSORS = 1
_HEAD = struct.Struct("<4sBBHIQ16s")  # 36 bytes: magic, version, kind, flags, key and payload lengths, digest
FLAG_EVICTABLE = 1  # a cache entry its writer may delete to make room (evicpress_file's HiCache pages)
_FIXED = _HEAD.size - 16  # the fields the digest covers (all but the digest)
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"

Key = Union[str, bytes]
Data = Union[bytes, bytearray, memoryview, Mapping[str, Any]]


@dataclasses.dataclass
class DiskTierStats:
    puts: int = 0
    put_rejected: int = 0  # did not fit the budget
    write_errors: int = 0  # OS error while writing (e.g. ENOSPC); nothing left behind
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupted: int = 0  # detected on read, deleted, returned as a miss
    deletes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    pages_evicted: int = 0  # evicpress_file: HiCache pages deleted to make room


def _key_bytes(key: Key) -> bytes:
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def _encode(data: Data) -> tuple[int, bytes]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return KIND_BYTES, bytes(data)
    if isinstance(data, Mapping):
        from safetensors.torch import save

        tensors = {str(k): v.detach().cpu().contiguous() for k, v in data.items()}
        return KIND_TENSORS, save(tensors)
    raise TypeError(f"expected bytes or a dict of tensors, got {type(data).__name__}")


def _decode(kind: int, payload: bytes):
    if kind == KIND_BYTES:
        return payload
    from safetensors.torch import load

    return load(payload)


def _digest(fixed: bytes, key: bytes, payload: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(fixed)
    h.update(key)
    h.update(payload)
    return h.digest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class DiskTierStore(TierStore):
    """KV blobs on disk under ``root``, at most ``capacity_bytes`` in total.

    ``used_bytes`` counts whole files (header + key + payload). Existing entries are
    indexed at start-up (from file sizes; contents are verified when read) and stale
    temporary files of an interrupted writer are removed.
    """

    def __init__(self, root: Union[str, os.PathLike], capacity_bytes: int, *, fsync: bool = True,
                 drop_cache: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        # Ask the kernel to drop an entry's pages after writing and reading it, so that
        # reads come from the device rather than from the page cache (which would
        # otherwise be an unbudgeted RAM tier in front of the disk). Best effort.
        self.drop_cache = drop_cache and hasattr(os, "posix_fadvise")
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # file name -> bytes
        self._used = 0
        for p in self.root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                p.unlink(missing_ok=True)
            elif p.name.endswith(SUFFIX) and p.is_file():
                size = p.stat().st_size
                self._sizes[p.name] = size
                self._used += size

    # -- naming and sizes ---------------------------------------------------------------
    @staticmethod
    def file_name(key: Key) -> str:
        return xxhash.xxh3_128_hexdigest(_key_bytes(key)) + SUFFIX

    @staticmethod
    def entry_bytes(key: Key, payload_bytes: int) -> int:
        """On-disk size of an entry with a payload of ``payload_bytes``."""
        return _HEAD.size + len(_key_bytes(key)) + payload_bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: Key) -> bool:
        return self.file_name(key) in self._sizes

    def size_of(self, key: Key) -> Optional[int]:
        """On-disk bytes of ``key``'s entry, or None."""
        return self._sizes.get(self.file_name(key))

    # -- operations ---------------------------------------------------------------------
    def put(self, key: Key, data: Data, flags: int = 0) -> bool:
        """Store ``data`` (bytes, or a dict name -> tensor) under ``key``, replacing any
        previous entry. False, with nothing written, when it does not fit or the write
        fails; the previous entry of ``key`` is then left as it was. ``flags`` (e.g.
        :data:`FLAG_EVICTABLE`) are kept in the header, under the digest."""
        kb = _key_bytes(key)
        kind, payload = _encode(data)
        fixed = _HEAD.pack(MAGIC, VERSION, kind, flags, len(kb), len(payload), b"\0" * 16)[:_FIXED]
        header = fixed + _digest(fixed, kb, payload)
        total = len(header) + len(kb) + len(payload)
        name = self.file_name(key)
        with self._lock:
            old = self._sizes.get(name, 0)
            if self._used - old + total > self.capacity_bytes:
                self.stats.put_rejected += 1
                return False
            tmp = None
            try:
                fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=self.root)
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(kb)
                    f.write(payload)
                    f.flush()
                    if self.fsync or self.drop_cache:
                        os.fsync(f.fileno())
                    if self.drop_cache:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                os.replace(tmp, self.root / name)
                tmp = None
                if self.fsync:
                    _fsync_dir(self.root)
            except OSError:
                self.stats.write_errors += 1
                return False
            finally:
                if tmp is not None:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
            self._sizes[name] = total
            self._used += total - old
            self.stats.puts += 1
            self.stats.bytes_written += total
            return True

    def get(self, key: Key):
        """The stored bytes / dict of tensors, or None when absent or corrupted."""
        kb = _key_bytes(key)
        name = self.file_name(key)
        with self._lock:
            self.stats.gets += 1
            try:
                blob = self._read(self.root / name)
            except FileNotFoundError:
                self._forget(name)
                self.stats.misses += 1
                return None
            parsed = self._parse(blob)
            if parsed is None:
                self._remove(name)
                self.stats.corrupted += 1
                self.stats.misses += 1
                return None
            kind, stored_key, payload = parsed
            if stored_key != kb:  # a 128-bit name collision: not ours, leave it
                self.stats.misses += 1
                return None
            try:
                data = _decode(kind, payload)
            except Exception:  # digest matched but the payload does not parse
                self._remove(name)
                self.stats.corrupted += 1
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.bytes_read += len(blob)
            return data

    def delete(self, key: Key) -> bool:
        """Remove ``key``'s entry; False when there was none."""
        name = self.file_name(key)
        with self._lock:
            existed = name in self._sizes or (self.root / name).exists()
            self._remove(name)
            if existed:
                self.stats.deletes += 1
            return existed

    def entries(self) -> list[tuple[bytes, int, int, float]]:
        """(key, flags, bytes, mtime) of every indexed entry, from each file's header
        (not verified: a damaged entry is found when read). Files that vanished or do not
        parse are left out."""
        out = []
        with self._lock:
            names = list(self._sizes.items())
        for name, size in names:
            path = self.root / name
            try:
                with open(path, "rb") as f:
                    head = f.read(_HEAD.size)
                    if len(head) < _HEAD.size:
                        continue
                    magic, version, _, flags, klen, _, _ = _HEAD.unpack(head)
                    if magic != MAGIC or version != VERSION:
                        continue
                    key = f.read(klen)
                mtime = path.stat().st_mtime
            except OSError:
                continue
            out.append((key, flags, size, mtime))
        return out

    # -- internals ----------------------------------------------------------------------
    def _read(self, path: Path) -> bytes:
        if not self.drop_cache:
            return path.read_bytes()
        with open(path, "rb") as f:
            blob = f.read()
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return blob

    @staticmethod
    def _parse(blob: bytes) -> Optional[tuple[int, bytes, bytes]]:
        """(kind, key, payload) of a well-formed entry, else None."""
        if len(blob) < _HEAD.size:
            return None
        magic, version, kind, _flags, klen, plen, digest = _HEAD.unpack_from(blob)
        if magic != MAGIC or version != VERSION or kind not in (KIND_BYTES, KIND_TENSORS):
            return None
        if len(blob) != _HEAD.size + klen + plen:  # truncated or trailing garbage
            return None
        key = blob[_HEAD.size : _HEAD.size + klen]
        payload = blob[_HEAD.size + klen :]
        if _digest(blob[:_FIXED], key, payload) != digest:
            return None
        return kind, key, payload

    def _forget(self, name: str) -> None:
        self._used -= self._sizes.pop(name, 0)

    def _remove(self, name: str) -> None:
        self._forget(name)
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            pass


class Bandwidth(NamedTuple):
    write_bytes_per_s: float
    read_bytes_per_s: float


def measure_bandwidth(
    path: Union[str, os.PathLike], nbytes: int = 64 << 20, block: int = 4 << 20
) -> Bandwidth:
    """Sequential write and read bandwidth of the file system holding ``path`` (a
    directory), for the disk tier's ``TierSpec.load_bandwidth`` at start-up.

    Writes ``nbytes`` in ``block``-sized chunks with a final fsync, asks the kernel to
    drop the file's cached pages (``posix_fadvise DONTNEED``, best effort) and reads it
    back; the probe file is removed. Where the page cache cannot be dropped the read
    figure is optimistic -- use ``nbytes`` well above free RAM for a cold number.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(min(block, nbytes)) if nbytes else b""
    fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX + "bw-", dir=root)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            n = min(len(chunk), nbytes - written)
            written += os.write(fd, chunk[:n])
        os.fsync(fd)
        t_write = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        read = 0
        while True:
            got = os.read(fd, block)
            if not got:
                break
            read += len(got)
        t_read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(probe)
    eps = 1e-9
    return Bandwidth(written / max(t_write, eps), read / max(t_read, eps))
