"""The prefill's copies of the full KV to the host store, through one small device buffer.

Right before a prompt's layer is compressed, its full rows (those compression replaces)
go to pinned host memory on the copy stream (:class:`~.reload.HostKVStore`). A copy
that read the gathered rows themselves would keep them alive until it lands
(``record_stream``), and the host runs ahead of the GPU: a 32-layer prefill queues every
layer's copy long before the first lands, so a 32k-token prompt on 8B shapes (128 MiB
per layer) would hold gigabytes of device memory outside SGLang's budget.

Here each layer's rows are written, piece by piece, into blocks of one small device
buffer (:data:`HOST_COPY_BYTES`, allocated when the first request is compressed, never at
start-up: :meth:`~.reload.HostKVStore.ensure_copy_buffer`) on the compute stream and
copied from there to the host on the copy stream; the gathered rows are free as soon as
the layer is done with them. Past the buffer's bytes in flight the scheduler waits for the
oldest piece's copy to land (the link is behind the prefill; the GPU keeps the layers
queued after it). Where the buffer has no room a piece is copied from a tensor of its own,
as before, and counted (``host_copies_outside_arena``).
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream

from .staging_arena import ALIGN, StagingArena, aligned

# The prefill's copies in flight at most: 256 MiB is ~10 ms of a 25 GB/s link, enough to
# keep it busy, and beside SGLang's activations (outside the KV pool) it is small
HOST_COPY_BYTES = 256 << 20


class ArenaCopyOut:
    """Device rows to pinned host tensors through ``arena`` blocks on ``copy_stream``."""

    def __init__(self, arena: StagingArena, copy_stream: CopyStream, pin: bool = True):
        self.arena = arena
        self.copy_stream = copy_stream
        self.pin = pin
        self.cap = arena.capacity // ALIGN * ALIGN
        self.piece = max(ALIGN, self.cap // 2)  # two pieces in flight: one copies while one fills
        self._in_flight: collections.deque = collections.deque()  # (bytes, copy event), oldest first
        self.in_flight_bytes = 0
        self.peak_in_flight = 0
        self.outside = 0  # pieces copied from tensors of their own (no room in the arena)

    def to_host(self, tensors: Sequence[Optional[torch.Tensor]],
                empty: Optional[Callable[..., torch.Tensor]] = None) -> tuple[list, object]:
        """Host copies of ``tensors`` (None stays None) into ``empty(shape, dtype)``
        (a slab's view, :mod:`.host_slabs`; by default a pinned tensor of its own), and the
        event of the last copy."""
        out, last = [], None
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            host = (empty(t.shape, t.dtype) if empty is not None
                    else torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin))
            row = max(1, t[0].numel() * t.element_size()) if t.shape[0] else 1
            rows = max(1, self.piece // row)
            for a in range(0, t.shape[0], rows):
                last = self._piece(t[a : a + rows], host[a : a + rows])
            out.append(host)
        return out, last

    def _piece(self, src: torch.Tensor, dst: torch.Tensor):
        nbytes = src.numel() * src.element_size()
        block = self._block(nbytes)
        if block is None:
            self.outside += 1
            stats.add("vericache", host_copies_outside_arena=1)

            def direct():
                dst.copy_(src, non_blocking=self.pin)
                self.copy_stream.keep_alive(src, self.copy_stream.stream)  # read by the copy stream
            return self.copy_stream.copy(direct, after=self.copy_stream.mark())[1]
        staged = self.arena.view(block, 0, src.shape, src.dtype)
        staged.copy_(src)  # on the compute stream: ``src`` is free once this has run
        _, event = self.copy_stream.copy(lambda: dst.copy_(staged, non_blocking=self.pin),
                                         after=self.copy_stream.mark())
        self.arena.release(block, (event,))
        self._in_flight.append((block.size, event))
        self.in_flight_bytes += block.size
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight_bytes)
        return event

    def _block(self, nbytes: int):
        """A block for one piece once the prefill's pieces in flight leave room for it
        under :attr:`cap` (waiting for the oldest copies where they do not), or None."""
        size = aligned(nbytes)
        if size > self.cap:
            return None
        while self._in_flight and (self._in_flight[0][1].query() or self.in_flight_bytes + size > self.cap):
            done, event = self._in_flight.popleft()
            event.synchronize()  # a no-op once it passed; else the link is behind the prefill
            self.in_flight_bytes -= done
        return self.arena.alloc(size)
