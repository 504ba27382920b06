"""A request's full KV back in device slots: the slower correct path of a reload that
failed every retry, and of a request ADMIT gave up on.

:class:`FullKVRestore` is what a :class:`~.reload.LayerwiseReload` hands its requests to
when its copy fails every retry, from inside the verify forward before the failed layer
is attended: each request's full KV (from the host copy, merged with the kept rows a
token-dropping drafter left in the pool) goes into its staged slots for good, else into
new pool slots, and its compressed index is dropped; it verifies, from that layer on,
and decodes from its full device KV. The requests it finds no room for are returned:
the reload keeps them (:attr:`~.reload.LayerwiseReload.lost`) and the iteration fails
them after the forward. Nothing calls back into the worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from sglang_vc import stats

from sglang_vc.kvruntime.held_rows import HeldRows
from sglang_vc.kvruntime.names import NULL_SLOT

from .reload import faults as reload_faults

if TYPE_CHECKING:
    from .reload import HostEntry, HostKVStore
    from .staging import PoolStaging

logger = logging.getLogger(__name__)


class FullKVRestore:
    """``restore(entries, staging)``, the reloads' failure path; ``full_rows(entry)``;
    ``held_rows(entry, start, end, span_k, span_v)``, a finished request's full KV on the host."""

    def __init__(self, host: "HostKVStore", runtime, req_to_token: torch.Tensor):
        self.host = host
        self.runtime = runtime
        self.req_to_token = req_to_token

    def __call__(self, entries: "dict[int, HostEntry]", staging: "Optional[PoolStaging]") -> dict[str, str]:
        """Restore each request's full KV on the device (its staged slots, else new pool
        slots); returns the requests it found no room for, rid -> why."""
        lost = {}
        for entry in entries.values():
            # (the testing hook: neither has room)
            restored = not reload_faults.take("no_room") and (
                (staging is not None and staging.adopt(entry, self.full_rows))
                or self.runtime.restore_full_kv(entry.req_pool_idx, entry.p, *self.full_rows(entry)))
            if not restored:
                # nothing correct is left to serve it: the forward goes on for the others, and
                # the request ends after it
                lost[entry.rid] = ("its reload failed every retry and the KV pool has no free slots to "
                                   "restore its full KV")
                continue
            self.host.drop(entry.rid)
            logger.warning("VERICACHE: reload of request %s failed every retry; it decodes from its "
                           "full KV, restored on the device", entry.rid)
            stats.add("vericache", reload_fallbacks=1, fallbacks=1)
        return lost

    def full_rows(self, entry: "HostEntry", span_slots: Optional[torch.Tensor] = None) -> tuple[dict, dict]:
        """The full KV of the entry's span per layer: the host rows, merged with the kept
        rows still in the pool where the host holds only the dropped ones (``span_slots``:
        the request's own slots of ``[p, n)``; by default its row's)."""
        pool = self.runtime.kv_pool
        entry.wait()  # its copies to the host have landed
        if span_slots is None:
            span_slots = self.req_to_token[entry.req_pool_idx, entry.p : entry.n]
        span_slots = span_slots.to(torch.int64)
        k, v = {}, {}
        for layer_id in entry.k:
            k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            span = entry.span(layer_id).to(k_buf.device)
            k[layer_id], v[layer_id] = span.full(k_buf, v_buf, span_slots.to(k_buf.device))
        return k, v

    def held_rows(self, entry: "HostEntry", start: int, end: int, span_k: dict,
                  span_v: dict) -> Optional[HeldRows]:
        """The full KV of row positions ``[start, end)`` of the entry's request on the host:
        the span's full rows (``span_k``/``span_v``, from :meth:`full_rows`) between the
        pool's rows around it. A finished request's KV for the tree where the pool has no
        room for it (:mod:`sglang_vc.kvruntime.held_rows`); None where a position outside
        the span has no slot. Device-to-host copies at the request's end, on this path only."""
        if not start <= entry.p <= entry.n <= end:
            return None
        pool = self.runtime.kv_pool
        row = self.req_to_token[entry.req_pool_idx, start:end].to(torch.int64)  # (on the pool's device)
        before, after = row[: entry.p - start], row[entry.n - start:]
        if bool(((before == NULL_SLOT).any() | (after == NULL_SLOT).any())):  # (a host sync, once per held request)
            return None
        k, v = {}, {}
        for layer_id in span_k:
            k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            k[layer_id] = torch.cat([k_buf[before], span_k[layer_id].to(k_buf.dtype), k_buf[after]]).cpu()
            v[layer_id] = torch.cat([v_buf[before], span_v[layer_id].to(v_buf.dtype), v_buf[after]]).cpu()
        return HeldRows(start, k, v)
