"""The full-precision KV of SpeCache's quantized rows, in host memory, and the copy
thread that prefetches the rows each step picked.

A request's host copy holds, per layer, the full-precision K/V of every row position its
device copy has quantized (``[0, n_q)``; the prompt's part arrives at the prefill, each
tail group as decode quantizes it). On CUDA the tensors are pinned so that the copy is
asynchronous; the copy thread issues it on a stream of its own (the paper's copy stream,
:class:`~sglang_vc.kvruntime.CopyStream`), after the step that picked the rows, and the
step that reads them waits on the copy's event.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream

from .core import Rows
from .names import STATS

logger = logging.getLogger(__name__)


@dataclass
class HostEntry:
    rid: str
    k: dict = field(default_factory=dict)  # layer_id -> [n, H, D] (CPU)
    v: dict = field(default_factory=dict)
    nbytes: int = 0  # stored
    reserved: int = 0  # reserved at admission

    def num_rows(self, layer_id: int) -> int:
        return self.k[layer_id].shape[0] if layer_id in self.k else 0


class HostKVStore:
    """Per request, per layer: full-precision rows of positions ``[0, n)``, appended in
    order. ``capacity`` bytes in all (None: unbounded) bounds what prompts reserve at
    admission; a request that does not fit is refused and keeps its full KV on the device."""

    def __init__(self, capacity: Optional[int], pin: bool):
        self.capacity = capacity
        self.pin = pin
        self.entries: dict[str, HostEntry] = {}
        self.used = 0
        self._lock = threading.Lock()

    def admit(self, rid: str, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``rid``'s prompt rows; False when they do not fit. Rows
        the decode tail adds later are not refused (at most ``max_new_tokens`` of them)."""
        with self._lock:
            if self.capacity is not None and self.used + nbytes > self.capacity:
                return False
            entry = self.entries.setdefault(rid, HostEntry(rid))
            entry.reserved += nbytes
            self.used += nbytes
            return True

    def append(self, rid: str, layer_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Rows ``[start, start + len(k))`` of one layer; False (nothing stored) when the
        request was not admitted or the rows do not continue its copy."""
        nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        k_h, v_h = k.to("cpu", copy=True), v.to("cpu", copy=True)
        if self.pin:
            k_h, v_h = k_h.pin_memory(), v_h.pin_memory()
        with self._lock:
            entry = self.entries.get(rid)
            if entry is None or entry.num_rows(layer_id) != start:
                return False
            self.used += max(0, entry.nbytes + nbytes - max(entry.reserved, entry.nbytes))
            entry.nbytes += nbytes
            if layer_id in entry.k:
                entry.k[layer_id] = torch.cat([entry.k[layer_id], k_h])
                entry.v[layer_id] = torch.cat([entry.v[layer_id], v_h])
            else:
                entry.k[layer_id], entry.v[layer_id] = k_h, v_h
        return True

    def get(self, rid: str) -> Optional[HostEntry]:
        return self.entries.get(rid)

    def gather(self, rid: str, layer_id: int, positions: torch.Tensor, device) -> Rows:
        """The rows ``positions [H, k]`` of one layer, copied to ``device``."""
        entry = self.entries[rid]
        k_h, v_h = entry.k[layer_id], entry.v[layer_id]
        idx = positions.t().to("cpu")  # [k, H]
        k = k_h.gather(0, idx.unsqueeze(-1).expand(-1, -1, k_h.shape[2]))
        v = v_h.gather(0, idx.unsqueeze(-1).expand(-1, -1, v_h.shape[2]))
        if self.pin:
            k, v = k.pin_memory(), v.pin_memory()
        nb = device is not None and torch.device(device).type != "cpu"
        return Rows(positions, k.to(device, non_blocking=nb), v.to(device, non_blocking=nb))

    def drop(self, rid: str) -> None:
        with self._lock:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                self.used -= max(entry.nbytes, entry.reserved)

    def retain(self, rids: set[str]) -> None:
        """Forget every request not in ``rids`` (finished, aborted, retracted)."""
        for rid in [r for r in self.entries if r not in rids]:
            self.drop(rid)


class Prefetcher:
    """Starts each layer's prefetch on a copy thread as soon as the step picked its rows,
    and hands them to the next step's attention of that layer.

    A prefetch not finished when its layer needs it is waited for (a *stall*, counted). A
    prefetch that failed is redone synchronously (``sync_fetches``); if that fails too the
    layer attends over the low-bit copy alone (``fetch_failures``): still SpeCache's
    output, without that layer's correction, and the request goes on."""

    def __init__(self, host: HostKVStore, device, fetch: Optional[Callable] = None,
                 copy_stream: Optional[CopyStream] = None):
        self.host = host
        self.device = device
        self.fetch = fetch or host.gather  # tests inject failures here
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream(device)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specache-prefetch",
                                         initializer=self.copy_stream.bind_thread)
        self.pending: dict[tuple[str, int], tuple[Future, torch.Tensor]] = {}

    def start(self, rid: str, layer_id: int, positions: torch.Tensor) -> None:
        # the copy reads ``positions``, computed by the work queued so far on this stream
        ready = self.copy_stream.mark()
        fut = self.thread.submit(self.copy_stream.copy,
                                 lambda: self.fetch(rid, layer_id, positions, self.device), ready)
        self.pending[(rid, layer_id)] = (fut, positions)

    def take(self, rid: str, layer_id: int) -> Optional[Rows]:
        """The rows prefetched for this layer, or None when none were started."""
        item = self.pending.pop((rid, layer_id), None)
        if item is None:
            return None
        fut, positions = item
        if not fut.done():
            stats.add(STATS, prefetch_stalls=1)
        try:
            rows, event = fut.result()
        except Exception as exc:  # a failed copy: the slower correct path (on this stream)
            logger.warning("SPECACHE: prefetch of request %s layer %d failed (%s); fetching synchronously",
                           rid, layer_id, exc)
            stats.add(STATS, sync_fetches=1)
            try:
                return self.host.gather(rid, layer_id, positions, self.device)
            except Exception as exc2:
                logger.warning("SPECACHE: synchronous fetch failed too (%s); layer %d attends over the "
                               "low-bit copy alone this step", exc2, layer_id)
                stats.add(STATS, fetch_failures=1)
                return None
        self.copy_stream.wait(event, (rows.k, rows.v))  # landed before this step reads them
        return rows

    def forget(self, rid: str) -> None:
        for key in [k for k in self.pending if k[0] == rid]:
            self.pending.pop(key)
