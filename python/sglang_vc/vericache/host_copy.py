"""The prefill's copies of the full KV to the host store, through leased pool slots.

Right before a prompt's layer is compressed, its full rows (those compression replaces)
go to pinned host memory on the copy stream (:class:`~.reload.HostKVStore`). A copy
that read the gathered rows themselves would keep them alive until it lands
(``record_stream``), and the host runs ahead of the GPU: a 32-layer prefill queues every
layer's copy long before the first lands, so a 32k-token prompt on 8B shapes (128 MiB
per layer) would hold gigabytes of device memory outside SGLang's budget.

Here each request leases pool slots for its copies at its first layer
(:class:`~.staging_leases.StagingLeases`: a contiguous run, as many slots as its span has
rows), each layer's rows are written into the lease's rows of that layer's K and V
buffers on the compute stream and copied from there to the host on the copy stream; the
gathered rows are free as soon as the layer is done with them. The lease goes back once
the request's last copy has landed (:meth:`LeasedCopyOut.close`, after the prefill
forward). Where the pool has no run for it (or a layer does not fit it) the rows are
copied from a tensor of their own, as before, and counted (``host_copies_outside_pool``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import CopyStream
from sglang_vc.kvruntime.pool_lease import PoolLease, aligned

from .staging_leases import StagingLeases

K_SIDE = (0, 2, 3)  # (k, v, kept, dropped): what goes in the lease's K rows; v in its V rows


def side_bytes(tensors: Sequence[Optional[torch.Tensor]]) -> tuple[int, int]:
    """Bytes ``(k, v, kept, dropped)`` take in a lease's K and V rows (each aligned)."""
    sizes = [0 if t is None else aligned(t.numel() * t.element_size()) for t in tensors]
    return sum(sizes[i] for i in K_SIDE), sizes[1]


def _row_bytes(t: torch.Tensor) -> int:
    return max(1, t[0].numel() * t.element_size()) if t.shape[0] else 1


def rows_for(groups: Sequence[Sequence[Optional[torch.Tensor]]]) -> int:
    """Slots a lease needs for each group's ``(k, v, kept, dropped)`` of one layer, one
    group after another (``k``/``v`` are pool rows ``[n, H, D]``: a slot's share of a
    layer's K buffer is one of their rows)."""
    sides = [side_bytes(g) for g in groups]
    k_bytes, v_bytes = sum(k for k, _ in sides), sum(v for _, v in sides)
    return max(-(-k_bytes // _row_bytes(groups[0][0])), -(-v_bytes // _row_bytes(groups[0][1])), 1)


def stage(tensors: Sequence[Optional[torch.Tensor]], lease: PoolLease, region: int, copy,
          offsets: Optional[list] = None) -> Optional[list]:
    """Views of ``tensors`` in ``lease``'s rows of layer ``region`` (``k``, ``kept``,
    ``dropped`` in its K buffer's, ``v`` in its V buffer's) from ``offsets`` (bytes, K side
    and V side: advanced past them), each filled by ``copy(view, tensor)``; None where they
    do not fit."""
    offsets = [0, 0] if offsets is None else offsets
    k_bytes, v_bytes = side_bytes(tensors)
    if offsets[0] + k_bytes > lease.region_bytes("k") or offsets[1] + v_bytes > lease.region_bytes("v"):
        return None
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            out.append(None)
            continue
        side = 1 if i == 1 else 0
        nbytes = t.numel() * t.element_size()
        start = offsets[side]
        view = lease.region(region, "kv"[side])[start : start + nbytes].view(t.dtype).view(t.shape)
        copy(view, t)
        offsets[side] += aligned(nbytes)
        out.append(view)
    return out


class LeasedCopyOut:
    """Device rows to pinned host tensors through pool slots leased per request."""

    def __init__(self, staging: StagingLeases, copy_stream: CopyStream, pin: bool = True):
        self.staging = staging
        self.copy_stream = copy_stream
        self.pin = pin
        self._open: dict[str, list] = {}  # key -> [lease or None, last copy event]
        self.outside = 0  # copies from tensors of their own (no lease, or it did not fit)

    def to_host(self, key: str, layer_id: int, tensors: Sequence[Optional[torch.Tensor]]) -> tuple[list, object]:
        """Host copies of ``tensors`` (None stays None) of request ``key``'s layer
        ``layer_id``, and the event of the last copy."""
        hosts = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
                 for t in tensors]
        slot = self._open.get(key)
        if slot is None:
            slot = self._open[key] = [self.staging.take(rows_for([tensors])), None]
        staged = None if slot[0] is None else stage(tensors, slot[0], layer_id, lambda dst, src: dst.copy_(src))
        if staged is None:  # on the compute stream the rows were written to, then read by the copy stream
            self.outside += 1
            stats.add("vericache", host_copies_outside_pool=1)
            staged = list(tensors)
            for t in staged:
                if t is not None:
                    self.copy_stream.keep_alive(t, self.copy_stream.stream)

        def copy() -> None:
            for h, s in zip(hosts, staged):
                if h is not None:
                    h.copy_(s, non_blocking=self.pin)
        _, event = self.copy_stream.copy(copy, after=self.copy_stream.mark())
        slot[1] = event
        return hosts, event

    def close(self) -> None:
        """Every request's copies are issued (the prefill forward ended): each lease goes
        back once its last copy has landed."""
        for lease, event in self._open.values():
            if lease is not None:
                self.staging.release(lease, (event,))
        self._open.clear()
