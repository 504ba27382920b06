"""An emulated link to the HiCache storage tier: ``--vc-storage-read-gbps G`` paces this
server's storage reads to ``G`` GB/s (off by default), so one machine can run a "local"
server (fast link) and a "remote" one (slow link) on one shared store, as VeriCache's
remote prefix caching (paper sec. 4.2.2) assumes. It is an EMULATION: the bytes still
come as fast as the store serves them; the reader then waits until a link of that speed
would have delivered them. One token bucket per server process carries every read, in
slices of ``SLICE_BYTES``, so concurrent reads share the link as flows on one link do (a
small load is not queued behind a whole large one); reads a thread makes inside
:func:`background_reads` yield to the others. Writes are not paced.

The flag becomes a key of SGLang's ``--hicache-storage-backend-extra-config``
(``vc_read_gbps``; the backends ignore keys they do not know), and the storage backend
SGLang's factory creates is wrapped in :class:`PacedReads` (``hooks.py``). Counters:
``storage_link`` in ``/server_info`` (bytes read, seconds waited).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import threading
import time
from typing import Optional

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

from sglang_vc import stats
from sglang_vc.config import ConfigError, FlagGroup, register_flag_group

GROUP = "storage_link"
EXTRA_KEY = "vc_read_gbps"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Emulated storage link")
    g.add_argument("--vc-storage-read-gbps", type=float, default=None, metavar="G",
                   help="EMULATION: pace this server's reads from the HiCache storage tier to G GB/s "
                        "(a slow link to a shared store; default: no pacing). Needs a storage tier "
                        "(--hicache-storage-backend, or EvicPress's).")


def from_cli_args(args: argparse.Namespace) -> Optional[dict]:
    g = args.vc_storage_read_gbps
    if g is None:
        return None
    if not math.isfinite(g) or g <= 0:
        raise ConfigError(f"--vc-storage-read-gbps must be a finite number > 0, got {g}")
    return {"read_gbps": g}


def describe(settings: dict) -> dict:
    return {"read_gbps": settings["read_gbps"], "emulated": True}


def storage_argv(settings: Optional[dict], argv: list[str]) -> list[str]:
    """``argv`` with the read limit in the storage backend's extra config."""
    from sglang_vc.kvruntime.select import flag_value, without_flag

    if not settings:
        return argv
    if flag_value(argv, "--hicache-storage-backend")[1] is None:
        raise ConfigError("--vc-storage-read-gbps paces reads from a storage tier: give --hicache-storage-backend "
                          "(with --enable-hierarchical-cache) or EvicPress's --evicpress-disk-dir")
    extra = flag_value(argv, "--hicache-storage-backend-extra-config")[1]
    try:
        given = json.loads(extra) if extra else {}
    except ValueError:
        raise ConfigError(f"--hicache-storage-backend-extra-config is not JSON: {extra!r}") from None
    given[EXTRA_KEY] = settings["read_gbps"]
    return without_flag(argv, "--hicache-storage-backend-extra-config") + [
        "--hicache-storage-backend-extra-config", json.dumps(given)]


SLICE_BYTES = 1 << 20
_reads = threading.local()


@contextlib.contextmanager
def background_reads():
    """Reads of this thread inside the block are background traffic: each of their slices
    waits while a foreground read is on the link (VERICACHE_REMOTE's full-copy streams
    yield to the compressed copies requests wait for)."""
    before = getattr(_reads, "background", False)
    _reads.background = True
    try:
        yield
    finally:
        _reads.background = before


class Link:
    """A token bucket of one link: each slice of a read waits until ``bytes / rate``
    after the later of now and the end of the previous slice (of any read); a
    background read's slices also wait until no foreground read is carrying."""

    def __init__(self, bytes_per_s: float, clock=time.monotonic, sleep=time.sleep):
        self.bytes_per_s = bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.foreground = 0  # foreground reads on the link now

    def carry(self, nbytes: int) -> float:
        """Wait as the link would for ``nbytes`` that already arrived; the seconds waited."""
        background = getattr(_reads, "background", False)
        if not background:
            with self._lock:
                self.foreground += 1
        waited = 0.0
        try:
            while nbytes > 0:
                part = min(nbytes, SLICE_BYTES)
                nbytes -= part
                with self._lock:
                    busy = background and self.foreground > 0
                    if not busy:
                        now = self._clock()
                        self._free_at = max(now, self._free_at) + part / self.bytes_per_s
                        wait = self._free_at - now
                if busy:  # yield a slice's time to the foreground reads, then try again
                    nbytes += part
                    wait = part / self.bytes_per_s
                self._sleep(wait)
                waited += wait
        finally:
            if not background:
                with self._lock:
                    self.foreground -= 1
        return waited


class PacedReads(HiCacheStorageFailureInjector):
    """Any HiCache storage backend, its reads paced by a :class:`Link`. Built on SGLang's
    own proxy of a backend (every call forwarded); delay and failure injection off."""

    def __init__(self, backend, read_gbps: float):
        super().__init__(backend, 0.0, 0.0)
        self.link = Link(read_gbps * 1e9)
        self._pools: dict = {}

    def __getattr__(self, name):  # backend-specific attributes (EvicPress reads its own)
        if name == "_backend":
            raise AttributeError(name)
        return getattr(self._backend, name)

    def register_mem_pool_host(self, mem_pool_host):
        self._pools[None] = mem_pool_host
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        self._pools[host_pool_name] = host_pool
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _pace(self, nbytes: float) -> None:
        waited = self.link.carry(int(nbytes))
        stats.add(GROUP, read_bytes=float(nbytes), waited_s=waited)

    def _token_bytes(self, name=None) -> int:
        pool = self._pools.get(name) or self._pools.get(None) or next(iter(self._pools.values()), None)
        return int(getattr(pool, "size_per_token", 0) or 0)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        ok = self._backend.batch_get_v1(keys, host_indices, extra_info)
        if keys:
            self._pace(host_indices.numel() * self._token_bytes() * sum(map(bool, ok)) / len(keys))
        return ok

    def batch_get_v2(self, transfers, extra_info=None):
        results = self._backend.batch_get_v2(transfers, extra_info)
        nbytes = 0.0
        for t in transfers:
            ok = results.get(t.name, [])
            if t.keys and t.host_indices is not None:
                nbytes += t.host_indices.numel() * self._token_bytes(t.name) * sum(map(bool, ok)) / len(t.keys)
        self._pace(nbytes)
        return results

    def get(self, key, target_location=None, target_sizes=None):
        out = self._backend.get(key, target_location, target_sizes)
        self._pace(_tensor_bytes([out]))
        return out

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        out = self._backend.batch_get(keys, target_locations, target_sizes)
        self._pace(_tensor_bytes(out) if isinstance(out, list) else 0)
        return out


def _tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if hasattr(v, "element_size"))


def pace_created_backend(backend, storage_config):
    """The backend SGLang's factory created, paced when its extra config asks for it."""
    gbps = (getattr(storage_config, "extra_config", None) or {}).get(EXTRA_KEY)
    return PacedReads(backend, float(gbps)) if gbps else backend


register_flag_group(FlagGroup(GROUP, add_cli_args, from_cli_args, describe))
