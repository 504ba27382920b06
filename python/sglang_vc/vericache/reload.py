"""The host copy of the full KV and its layer-wise reload for a verify forward.

:class:`HostKVStore` keeps, per request, the full KV of the prompt positions ``[p, n)``
whose device rows compression replaced (pinned memory on an accelerator, written by
asynchronous copies on the copy stream; a token-dropping drafter's dropped rows only,
selected on the device). It has a byte capacity: a request that does not
fit is not compressed at all (it decodes from its full device KV, the slower path) rather
than losing KV that a verify would need.

:class:`LayerwiseReload` copies that KV back for one verify forward, layer by layer, on a
copy thread, straight into the pool slots the verify reads it from (:mod:`.staging`: the
request's row points at them during the forward). The slots are taken from SGLang's
allocator when the reload starts (the staggered schedule starts it iterations ahead of
the verify) or from the verify headroom, and go back after the verify: nothing is set
aside for reloads at start-up, and a request of any length reloads into as many slots
as its span, the same slots its verify needs anyway. Each layer passes through a device
tensor of one layer's span on the copy stream (pinned host rows can only be scattered
into pool slots from the device), so ``depth`` bounds that transient, not the reload.
Layer ``l + 1`` lands while the verify computes layer ``l``, and layer 0 while the
batch drafts; the verify's stream waits for each layer's copy event before reading it.
A failed copy is retried synchronously on the scheduler thread (counted as a reload
failure). A copy that fails every retry hands its requests to ``on_failure``
(:class:`~.restore.FullKVRestore` writes their full KV into device slots, and they verify
and decode from it: the slower correct path); the requests it finds no room for are the
reload's :attr:`LayerwiseReload.lost`, a result the iteration reads after the forward. Without ``on_failure`` it raises
:class:`ReloadFailed`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream, kernels

from .host_copy import HOST_COPY_BYTES, ArenaCopyOut
from .host_slabs import HostSlabs
from .staging_arena import ALIGN, StagingArena

logger = logging.getLogger(__name__)

SYNC_RETRIES = 2
# Testing hooks, so that tests can force the fallback paths of a real server:
# fail the first N staged copies (the async copy and its retries alike) ...
FAIL_RELOADS_ENV = "SGLANG_VC_FAIL_RELOADS"
# ... or every copy of the first N reloads (a permanent failure); and, for the faults that
# end one request: the first N full-KV restores find no pool room, the first N verifies find
# their host entry gone.
FAIL_WHOLE_RELOADS_ENV = "SGLANG_VC_FAIL_WHOLE_RELOADS"
NO_RESTORE_ROOM_ENV = "SGLANG_VC_NO_RESTORE_ROOM"
LOSE_HOST_ENTRIES_ENV = "SGLANG_VC_LOSE_HOST_ENTRIES"


@dataclasses.dataclass
class Span:
    """The KV a verify needs of one layer of one request: row positions ``[p, n)``.

    Either the full rows (``k``/``v`` ``[n - p, H, D]``), or -- for a token-dropping
    drafter -- only the rows compression dropped (``k``/``v`` ``[n_drop, H, D]`` at
    ``dropped [H, n_drop]``, positions relative to ``p``), the kept ones being on the
    device already: row ``p + j`` of the request holds, for head ``h``, position
    ``p + kept[h, j]``."""

    p: int
    n: int
    k: torch.Tensor
    v: torch.Tensor
    kept: Optional[torch.Tensor] = None  # [H, n_keep] relative positions, or None: full rows
    dropped: Optional[torch.Tensor] = None  # [H, n_drop]

    def to(self, device) -> "Span":
        # (a tensor already there is used as it is: on the CPU the host rows are written
        # into the pool directly)
        move = lambda t: t if t is None or t.device == torch.device(device) else \
            t.to(device, non_blocking=True)  # noqa: E731
        return Span(self.p, self.n, move(self.k), move(self.v), move(self.kept), move(self.dropped))

    def tensors(self) -> tuple:
        return self.k, self.v, self.kept, self.dropped

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def full(self, k_buf: torch.Tensor, v_buf: torch.Tensor, span_slots: torch.Tensor):
        """The full rows ``[n - p, H, D]`` of the span: as staged, or assembled from the
        kept rows in the pool (``span_slots``: the request's own slots of ``[p, n)``, the
        kept rows first) and the dropped rows staged from the host."""
        if self.kept is None:
            return self.k, self.v
        kept_slots = span_slots[: self.kept.shape[1]]
        return (_assemble(self.n - self.p, k_buf[kept_slots], self.kept, self.k.to(k_buf.dtype), self.dropped),
                _assemble(self.n - self.p, v_buf[kept_slots], self.kept, self.v.to(v_buf.dtype), self.dropped))


def _assemble(num: int, kept_rows, kept_pos, dropped_rows, dropped_pos) -> torch.Tensor:
    """``out[kept_pos[h, j], h] = kept_rows[j, h]`` and likewise for the dropped rows
    (``sgl_kernel_ext.scatter_head_rows``: a Triton kernel on CUDA)."""
    from sgl_kernel_ext import scatter_head_rows

    h, d = kept_rows.shape[1], kept_rows.shape[2]
    out = kept_rows.new_empty((num, h, d))
    for rows, pos in ((kept_rows, kept_pos), (dropped_rows, dropped_pos)):
        scatter_head_rows(out, pos, rows)
    return out


@dataclasses.dataclass
class HostEntry:
    """The KV of prompt positions ``[p, n)`` of one request that compression replaced
    on the device, per layer, in host memory: the full rows, or only the dropped ones
    once the compressor's kept positions are known (:meth:`HostKVStore.kept`)."""

    rid: str
    req_pool_idx: int
    p: int
    n: int
    reserved: int = 0  # bytes reserved in the store when admitted
    k: dict = dataclasses.field(default_factory=dict)  # layer_id -> [n - p or n_drop, H, D] (cpu)
    v: dict = dataclasses.field(default_factory=dict)
    kept: dict = dataclasses.field(default_factory=dict)  # layer_id -> [H, n_keep] (relative)
    dropped: dict = dataclasses.field(default_factory=dict)  # layer_id -> [H, n_drop]
    # layer_id -> (k, v) [n - p, H, D] on the device, until moved to the host
    pending: dict = dataclasses.field(default_factory=dict)
    event: object = None  # the last copy to the host (None: done when issued)
    # [L, 2] int64 addresses of each layer's K and V copies, for the batched SpeCache fetch
    # (built on first use once every layer landed; reset when a layer's copy changes)
    addresses: Optional[torch.Tensor] = None

    def wait(self) -> None:
        """Block until every copy of this entry to the host has landed (a reader on the
        host; a reload on the copy stream is ordered after them anyway)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    @property
    def num_tokens(self) -> int:
        return self.n - self.p

    def span(self, layer_id: int) -> Span:
        return Span(self.p, self.n, self.k[layer_id], self.v[layer_id],
                    self.kept.get(layer_id), self.dropped.get(layer_id))

    def nbytes(self) -> int:
        """Bytes a reload of this request copies."""
        return sum(self.span(layer_id).nbytes() for layer_id in self.k)


class HostKVStore:
    """Full KV of the prompt positions whose device rows were replaced by compressed ones.

    ``admit`` reserves room before a request's prefill compresses it; ``sink`` (called by
    the lossy runtime right before it compresses each layer) hands over the layer's rows
    on the device; ``kept`` (a token-dropping compressor's choice) keeps only the dropped
    ones, selected on the device; :meth:`flush` (after the prefill forward) moves what is
    left whole. The move to the host is an asynchronous copy into pinned memory on the
    copy stream (on an accelerator), after an event of the forward that computed the
    rows: the prefill does not wait for it, and a reload, queued on the same stream, runs
    after it. A reader on the host (:meth:`HostEntry.wait`) waits for its event."""

    def __init__(self, capacity_bytes: Optional[int] = None, copy_stream: Optional[CopyStream] = None,
                 pin: Optional[bool] = None):
        self.capacity_bytes = capacity_bytes
        self.entries: dict[str, HostEntry] = {}
        self.reserved_bytes = 0
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream("cpu")
        # pinned host memory where there is a device to copy to (asynchronous copies)
        self.pin = self.copy_stream.stream is not None if pin is None else pin
        # the prefill's copies through the staging arena, once the worker has one
        # (:meth:`use_arena`); None: each copy reads the device rows it was given
        self.copy_out: Optional[ArenaCopyOut] = None
        # where the host rows live: views of a few large slabs, pinned when first needed
        self.slabs = HostSlabs(self.pin, capacity_bytes, fences=self.copy_stream.fences)

    def use_arena(self, arena: StagingArena) -> None:
        """Copy the prefill's rows to the host through blocks of ``arena`` (:mod:`.host_copy`),
        on an accelerator."""
        if self.copy_stream.stream is not None and arena.capacity >= ALIGN:
            self.copy_out = ArenaCopyOut(arena, self.copy_stream, self.pin)

    def ensure_copy_buffer(self, device) -> None:
        """The prefill's host copies' buffer (:data:`~.host_copy.HOST_COPY_BYTES`), allocated
        when the first request is compressed (never at start-up), on an accelerator only."""
        if self.copy_out is None and self.copy_stream.stream is not None:
            self.use_arena(StagingArena(HOST_COPY_BYTES, device, self.copy_stream.fences))

    def admit(self, rid: str, req_pool_idx: int, p: int, n: int, nbytes: int) -> bool:
        old = self.entries.pop(rid, None)
        if old is not None:
            self.reserved_bytes -= old.reserved
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False
        self.entries[rid] = HostEntry(rid, req_pool_idx, p, n, reserved=nbytes)
        self.reserved_bytes += nbytes
        return True

    def sink(self, rid: str, req_pool_idx: int, layer_id: int, p: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
        """Rows ``[0, n)`` of one layer (``k``/``v`` on the device, the store's own copies:
        the runtime gathered them); ``[p, n)`` go to the host."""
        entry = self.entries.get(rid)
        n = k.shape[0]
        if entry is None or entry.req_pool_idx != req_pool_idx or entry.n != n or entry.p != p:
            # Not admitted through ``admit`` (the runtime always admits first): keep the
            # KV anyway, a verify must never lack it.
            self.admit(rid, req_pool_idx, p, n, 0)
            entry = self.entries[rid]
        entry.pending[layer_id] = (k[p:], v[p:])

    def kept(self, rid: str, req_pool_idx: int, layer_id: int, kept_positions: Optional[torch.Tensor]) -> None:
        """A token-dropping compressor kept ``kept_positions`` (``[H, n_keep]`` of
        ``[0, n)``, on the device) of this layer: the host keeps only the other rows of
        ``[p, n)``, those a verify cannot find on the device, selected on the device. Left
        as full rows when a kept position lies before ``p`` (then the heads keep different
        numbers of rows of the span; only a prefix-cache hit has ``p > 0``).
        ``kept_positions=None`` (a quantizer: no row stays full on the device): the whole
        layer goes to the host now, while the prefill computes the next layers, so the
        device does not hold every layer's full copy until the prefill's end."""
        entry = self.entries.get(rid)
        if entry is None or entry.req_pool_idx != req_pool_idx or layer_id not in entry.pending:
            return
        if kept_positions is None:
            k, v = entry.pending.pop(layer_id)
            self._to_host(entry, layer_id, k, v, None, None)
            return
        k, v = entry.pending[layer_id]
        rel = kept_positions.to(k.device, torch.int64) - entry.p
        if entry.p > 0 and bool((rel < 0).any()):
            return
        h, n_keep = rel.shape
        mask = torch.ones(h, entry.num_tokens, dtype=torch.int8, device=k.device).scatter_(1, rel, 0)
        # the dropped positions of each head, ascending: a stable sort puts the 1s first
        dropped = torch.sort(mask, dim=1, descending=True, stable=True).indices[:, : entry.num_tokens - n_keep]
        idx = dropped.t().unsqueeze(-1).expand(-1, -1, k.shape[2])
        del entry.pending[layer_id]
        self._to_host(entry, layer_id, k.gather(0, idx), v.gather(0, idx), rel, dropped)

    def flush(self) -> None:
        """Move every layer still on the device whole (no compressor chose its rows)."""
        for entry in self.entries.values():
            for layer_id, (k, v) in list(entry.pending.items()):
                del entry.pending[layer_id]
                self._to_host(entry, layer_id, k, v, None, None)

    def _to_host(self, entry: "HostEntry", layer_id: int, *tensors) -> None:
        def empty(shape, dtype) -> torch.Tensor:  # a slab's block, back when the entry dies
            return self.slabs.empty(shape, dtype, owner=entry)

        if self.copy_out is not None:  # through the staging arena (an accelerator)
            (k, v, kept, dropped), event = self.copy_out.to_host(tensors, empty)
            self._landed(entry, layer_id, k, v, kept, dropped, event)
            return

        def copy() -> list:
            out = []
            for t in tensors:
                if t is None:
                    out.append(None)
                    continue
                host = empty(t.shape, t.dtype)
                host.copy_(t, non_blocking=self.pin)
                if self.copy_stream.stream is not None:
                    self.copy_stream.keep_alive(t, self.copy_stream.stream)  # read by the copy stream
                out.append(host)
            return out

        (k, v, kept, dropped), event = self.copy_stream.copy(copy, after=self.copy_stream.mark())
        self._landed(entry, layer_id, k, v, kept, dropped, event)

    @staticmethod
    def _landed(entry: "HostEntry", layer_id: int, k, v, kept, dropped, event) -> None:
        entry.k[layer_id], entry.v[layer_id] = k, v
        entry.addresses = None
        if kept is not None:
            entry.kept[layer_id], entry.dropped[layer_id] = kept, dropped
        entry.event = event if event is not None else entry.event

    def get(self, rid: str, req_pool_idx: int) -> Optional[HostEntry]:
        entry = self.entries.get(rid)
        if entry is None or entry.req_pool_idx != req_pool_idx or not entry.k:
            return None
        return entry

    def drop(self, rid: str) -> None:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.reserved_bytes -= entry.reserved

    def retain(self, live_rids: set[str]) -> None:
        for rid in [r for r in self.entries if r not in live_rids]:
            self.reserved_bytes -= self.entries.pop(rid).reserved


def measure_bandwidth(device, nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """Host-to-device copy bandwidth (bytes/s), the best of ``repeats`` copies of
    ``nbytes``: the BW ring's link speed, measured at start-up on the link reloads use,
    from the memory kind they copy (pinned on an accelerator, as :class:`HostKVStore`)."""
    import time

    src = torch.empty(nbytes, dtype=torch.uint8)
    if torch.device(device).type == "cuda":
        src = src.pin_memory()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst = src.to(device, copy=True)
        if dst.device.type == "cuda":
            torch.cuda.synchronize(dst.device)
        best = min(best, time.perf_counter() - t)
    return nbytes / max(best, 1e-9)


class _FaultInjector:
    def __init__(self):
        self.remaining = int(os.environ.get(FAIL_RELOADS_ENV, "0") or 0)
        self.whole = int(os.environ.get(FAIL_WHOLE_RELOADS_ENV, "0") or 0)
        self.no_room = int(os.environ.get(NO_RESTORE_ROOM_ENV, "0") or 0)
        self.lose = int(os.environ.get(LOSE_HOST_ENTRIES_ENV, "0") or 0)
        self.lock = threading.Lock()

    def take(self, name: str) -> bool:
        """One of the ``name`` faults (``no_room``, ``lose``) left to inject: take it."""
        with self.lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
            return left > 0

    def check(self) -> None:
        with self.lock:
            if self.remaining > 0:
                self.remaining -= 1
                raise RuntimeError(f"injected reload failure ({FAIL_RELOADS_ENV})")

    def doom_next_reload(self) -> bool:
        with self.lock:
            if self.whole > 0:
                self.whole -= 1
                return True
            return False


faults = _FaultInjector()


class ReloadFailed(RuntimeError):
    """A layer's staged copy failed the first time and every synchronous retry."""


def _give_back(orphan: Optional[Callable[[torch.Tensor], None]], slots: list) -> None:
    # (a finalizer, on any thread: a reload dropped without closing only queues its slots,
    # :meth:`.staging.AheadSlots.orphan`)
    if orphan is not None:
        for s in slots:
            orphan(s)


class LayerwiseReload:
    """Copy the full KV of ``entries`` (batch index -> :class:`HostEntry`) into the pool
    slots ``dest`` (batch index -> ``[n - p]`` slots on ``pool``'s device) one layer at a
    time, ``depth`` layers ahead of the consumer. ``release`` (an
    :class:`~.staging.AheadSlots`, if given) takes the slots back when the reload closes
    without having handed them over to its verify (:meth:`hand_over`)."""

    def __init__(self, executor: ThreadPoolExecutor, entries: dict[int, HostEntry], dest: dict[int, torch.Tensor],
                 pool, req_to_token: torch.Tensor, layer_ids: list[int], device, depth: int = 2,
                 on_failure: Optional[Callable[[dict[int, HostEntry], object], dict[str, str]]] = None,
                 copy_stream: Optional[CopyStream] = None, release=None, staging=None):
        self.entries = entries
        self.dest = dest
        self.pool = pool
        self.device = device
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream(device)
        self.layer_ids = layer_ids
        # a token-dropping drafter's kept rows are read from the request's own slots of
        # [p, n) (a copy: the verify points the row elsewhere)
        self._own = {i: req_to_token[e.req_pool_idx, e.p : e.n].to(torch.int64, copy=True)
                     for i, e in entries.items() if e.kept}
        # the copies start after what the compute stream queued so far: the slots' previous
        # users and the kept rows
        self._after = self.copy_stream.mark()
        self._release = release
        self._finalizer = weakref.finalize(self, _give_back, release.orphan if release is not None else None,
                                           list(dest.values()))
        self._finalizer.atexit = False
        self._last_copy = None  # the event after this reload's last copy issued
        self.failures = 0
        self.on_failure = on_failure
        self.gave_up = False  # every retry failed: on_failure took the requests over
        self.lost: dict[str, str] = {}  # rid -> why: on_failure could not restore its full KV
        self.staging = staging  # the verify forward's PoolStaging, once it holds the slots
        self.staged_bytes = 0
        self._lock = threading.Lock()
        self._doomed = faults.doom_next_reload()
        self._slots = threading.Semaphore(depth)
        self._depth, self._acquired = depth, 0
        # per slot given back: an event on the consumer's stream at the hand-over, after
        # which the GPU has used every layer handed over before (None on the CPU)
        self._consumed: collections.deque = collections.deque()
        self._futures: dict[int, Future] = {}
        self._cancelled = False
        for layer_id in layer_ids:
            self._futures[layer_id] = executor.submit(self._stage_async, layer_id)

    @property
    def requests(self) -> set[int]:
        """The requests (batch indices) whose KV this reload stages."""
        return set(self.entries)

    def hand_over(self, staging=None) -> dict[int, torch.Tensor]:
        """The destination slots, now the verify's (``staging`` frees them after the
        forward): this reload no longer gives them back."""
        self.staging = staging
        if self._release is not None:
            self._release.handed_over(sum(s.numel() for s in self.dest.values()))
        self._release = None
        self._finalizer.detach()
        return self.dest

    def _copy_layer(self, layer_id: int) -> None:
        """Each request's full rows of the layer into its slots: the host rows as they
        are, or (a token-dropping drafter) the dropped rows merged with the kept ones."""
        k_buf, v_buf = self.pool.get_key_buffer(layer_id), self.pool.get_value_buffer(layer_id)
        for i, e in self.entries.items():
            span = e.span(layer_id).to(k_buf.device)
            k, v = span.full(k_buf, v_buf, self._own.get(i))
            slots = self.dest[i]
            kernels.write_rows(k_buf, slots, k)
            kernels.write_rows(v_buf, slots, v)

    def _stage(self, layer_id: int):
        """``(spans, event)``: the layer's rows copied to the device (see :class:`CopyStream`)."""
        if self._doomed:
            raise RuntimeError(f"injected reload failure ({FAIL_WHOLE_RELOADS_ENV})")
        faults.check()
        _, event = self.copy_stream.copy(lambda: self._copy_layer(layer_id), after=self._after)
        with self._lock:
            self.staged_bytes += sum(e.span(layer_id).nbytes() for e in self.entries.values())
            self._last_copy = event if event is not None else self._last_copy
        return event

    def _stage_async(self, layer_id: int):
        # at most ``depth`` staged layers wait for the consumer on the device (plus the one
        # it is using): a slot given back waits, on this copy thread, until the GPU has
        # used the layers handed over before it -- not only the host's hand-over
        self._slots.acquire()
        self._acquired += 1
        if self._acquired > self._depth and self._consumed:
            event = self._consumed.popleft()
            if event is not None:
                event.synchronize()
        if self._cancelled:
            return None
        return self._stage(layer_id)

    def layer(self, layer_id: int) -> None:
        """Make the consumer's stream wait until ``layer_id`` has landed in the slots (the
        copy thread may then stage one more layer). Nothing to wait for once
        ``on_failure`` has taken the requests over (their KV is on the device)."""
        fut = self._futures.pop(layer_id)
        if self.gave_up:
            self._next()
            return
        try:
            staged = fut.result()
        except Exception as exc:  # the slower path: copy again, here
            try:
                staged = self._retry(layer_id, exc)
            except ReloadFailed:
                if self.on_failure is None:
                    raise
                if not self.gave_up:
                    self.gave_up = True
                    self._cancelled = True  # the copy thread stops staging later layers
                    self.lost.update(self.on_failure(self.entries, self.staging) or {})
                staged = None
        self._next()
        if not self.gave_up and staged is not None:
            self.copy_stream.wait(staged, ())  # the slots are the pool's: nothing to keep alive

    def _next(self) -> None:
        self._consumed.append(self.copy_stream.mark())
        self._slots.release()

    def _retry(self, layer_id: int, exc: Exception):
        self.failures += 1
        logger.warning("VERICACHE reload of layer %d failed (%s); retrying synchronously", layer_id, exc)
        for attempt in range(SYNC_RETRIES):
            try:
                return self._stage(layer_id)
            except Exception as again:  # noqa: PERF203 - a rare path
                self.failures += 1
                exc = again
        raise ReloadFailed(f"VERICACHE: reload of layer {layer_id} failed {SYNC_RETRIES + 1} times: {exc}")

    def close(self) -> None:
        """Drop what was not consumed (e.g. the forward raised, or the verify was put off),
        and give the slots back unless they were handed over. Call it before the slots are
        freed elsewhere: a layer not consumed may still be landing, and the consumer's
        stream then waits for this reload's last copy (no host wait)."""
        unconsumed = bool(self._futures)
        self._cancelled = True
        for _ in self._futures:
            self._next()
        for fut in self._futures.values():
            try:
                fut.result()
            except Exception:
                pass
        self._futures.clear()
        if unconsumed and self._last_copy is not None:
            self.copy_stream.wait(self._last_copy, ())
        if self._finalizer.detach() is not None and self._release is not None:
            for slots in self.dest.values():
                self._release.give(slots)
        self._release = None

    def nbytes(self) -> int:
        """Bytes staged so far (each layer once, retries included)."""
        return self.staged_bytes
