"""A verify forward's full KV in SGLang's KV pool.

A verifying request's prompt rows ``[p, n)`` hold its compressed KV: a token-dropping
drafter's kept rows (per head, a different position in each) followed by null slots, or
nothing but null slots where the KV is quantized outside the pool. For its verify,
:class:`PoolStaging` gives the span ``n - p`` fresh pool slots (or takes over those its
reload already holds: :class:`AheadSlots`), points the request's ``req_to_token`` row at
them, and the reload copies each layer's full rows there from the host copy
(:class:`~.reload.LayerwiseReload`); the layer's attention waits for its copy. The
request's row then describes full KV
like any uncompressed request's, so the verify runs the attention backend SGLang chose
(FlashInfer, FA3 or Triton on CUDA; ``torch_native`` on the CPU) as an ordinary extend:
prefix = the committed tokens, extend = the verified window, causal.

After the forward the compressed mapping comes back and the slots go back to the
allocator. A pool slot holds a token's KV for every layer, so a verifying request holds
``n - p`` slots for the whole forward. A request whose reload failed every retry keeps the staged
slots for good: its full KV (all layers, from the host copy) is written there and its
compressed index is dropped, so it verifies and decodes from full KV (the slower, correct
path) while the forward's metadata stays valid.

The verify always runs in pool slots. Where the allocator has no free slots for a span,
the span comes from :class:`VerifyHeadroom`: slots the worker holds back in the pool, as
many as the longest compressed span of the batch (the paper's eq. 5 counts a verifier's
full KV in the device budget), so at least one verifier per forward always finds room. A
verifier that finds none waits an iteration (``verify_deferrals``): it commits nothing
and drafts again. The headroom leaves SGLang the slots its next decode tops the running
requests up with, unless :data:`STARVED_AFTER` verifies waited with no token committed in
between: then it takes them too (SGLang retracts a request if it must), so no verify
waits forever.

No host synchronisation: the slots, the row indices and the saved mapping are device
tensors built from host-known sizes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang_vc import stats
from sglang_vc.kvruntime import NULL_SLOT, kernels

if TYPE_CHECKING:
    from .reload import HostEntry, Span

logger = logging.getLogger(__name__)

HEADROOM_ONLY_ENV = "SGLANG_VC_STAGE_IN_HEADROOM_ONLY"

# After this many verifies waited for pool room with no request committing a token in
# between, the headroom grows into the running batch's decode room too: every request
# holding a slot may be waiting to verify, so none would ever be freed. SGLang retracts a
# request instead if it must (it prefills again: the correct, slower path), and no verify
# waits forever. (While some request commits, slots come free as requests finish.)
STARVED_AFTER = 4


@dataclasses.dataclass
class StagedRequest:
    """One verifying request's span ``[p, n)`` of row ``row``: ``slots`` hold its full KV
    during the forward, ``saved`` is its compressed mapping (restored after)."""

    host: "HostEntry"
    slots: torch.Tensor  # [n - p] fresh pool slots
    saved: Optional[torch.Tensor] = None  # [n - p] the row's own slots of [p, n), while pointed
    adopted: bool = False  # its reload failed: the staged slots are its full KV for good
    from_headroom: bool = False  # the slots are the headroom's (given back to it, not freed)

    @property
    def row(self) -> int:
        return self.host.req_pool_idx


class PoolStaging:
    """The staged full KV of one verify forward's verifying requests (forward index ->
    :class:`StagedRequest`). ``layer_ready(layer_id)`` makes the forward's stream wait
    until the reloads have copied that layer into the staged slots."""

    def __init__(self, runtime, layer_ready: Callable[[int], None] = lambda layer_id: None,
                 headroom: Optional["VerifyHeadroom"] = None):
        self.runtime = runtime
        self.req_to_token = runtime.req_to_token
        self.allocator = runtime.allocator
        self.layer_ready = layer_ready
        self.headroom = headroom
        self.requests: dict[int, StagedRequest] = {}
        self._pointed = False

    def reserve(self, k: int, host: "HostEntry") -> bool:
        """Take ``n - p`` pool slots for the request at forward index ``k``: free slots of
        the allocator, else the headroom's. False (nothing taken) when neither has room:
        the request verifies in a later iteration."""
        span = host.n - host.p
        slots = None if _headroom_only() else self.allocator.alloc(span)
        from_headroom = slots is None and self.headroom is not None
        if from_headroom:
            slots = self.headroom.take(span)
        if slots is None:
            stats.add("vericache", verify_deferrals=1)
            logger.debug("VERICACHE: no pool room to stage %d rows of %s; its verify waits", span, host.rid)
            return False
        if from_headroom:
            stats.add("vericache", staged_in_headroom=1)
        self.requests[k] = StagedRequest(host, slots.to(torch.int64), from_headroom=from_headroom)
        return True

    def hold(self, k: int, host: "HostEntry", slots: torch.Tensor) -> None:
        """The request at forward index ``k`` verifies in ``slots``, which its reload took
        from the allocator when it started (:meth:`~.reload.LayerwiseReload.hand_over`):
        freed with the others after the forward."""
        self.requests[k] = StagedRequest(host, slots)

    def rekey(self, index: dict[int, int]) -> None:
        """Key the staged requests by their index in the forward (``index``: old -> new)."""
        self.requests = {index[k]: r for k, r in self.requests.items()}

    def __contains__(self, k: int) -> bool:
        return k in self.requests

    def point(self) -> None:
        """Point each staged request's row at its staged slots (before the forward's
        metadata is built: the backends read ``req_to_token`` then)."""
        if not self.requests or self._pointed:
            return
        rows, cols = PoolStaging._index_of(list(self.requests.values()), self.req_to_token.device)
        saved = self.req_to_token[rows, cols].to(torch.int64)
        offset = 0
        for r in self.requests.values():
            num = r.host.n - r.host.p
            r.saved = saved[offset : offset + num]
            offset += num
        staged = torch.cat([r.slots for r in self.requests.values()])  # the allocator's: on the device
        self.req_to_token[rows, cols] = staged.to(self.req_to_token.dtype)
        self._pointed = True

    def layer_landed(self, layer_id: int) -> None:
        """Before this layer's attention: its full rows are in the staged slots (the
        forward's stream waits for the reloads' copies of it)."""
        self.layer_ready(layer_id)

    def adopt(self, host: "HostEntry", full_rows: Callable[["HostEntry", torch.Tensor], tuple]) -> bool:
        """The request's reload failed every retry: its full KV of every layer
        (``full_rows(host, span_slots)``: layer id -> rows, from the host copy) goes into
        its staged slots, which stay its rows after the forward. False if it is not staged."""
        r = next((r for r in self.requests.values() if r.host is host), None)
        if r is None or r.saved is None:
            return False
        k, v = full_rows(host, r.saved)
        pool = self.runtime.kv_pool
        for layer_id in k:
            at = r.slots.to(pool.get_key_buffer(layer_id).device)
            kernels.write_rows(pool.get_key_buffer(layer_id), at, k[layer_id])
            kernels.write_rows(pool.get_value_buffer(layer_id), at, v[layer_id])
        r.adopted = True
        if r.from_headroom:
            self.headroom.keep(r.slots)  # its rows now: the headroom grows back at the next fit
        return True

    def restore(self) -> None:
        """After the forward: the compressed mappings back, the staged slots freed; an
        adopted request keeps its staged slots and gives its compressed ones back."""
        if not self._pointed:
            self._free([r for r in self.requests.values() if not r.from_headroom])
            self.requests.clear()
            return
        back = [r for r in self.requests.values() if not r.adopted]
        if back:
            rows, cols = PoolStaging._index_of(back, self.req_to_token.device)
            self.req_to_token[rows, cols] = torch.cat([r.saved for r in back]).to(self.req_to_token.dtype)
            self._free([r for r in back if not r.from_headroom])
        for r in self.requests.values():
            if r.adopted:
                own = r.saved[r.saved != NULL_SLOT]  # its kept rows: a rare path, may sync
                self.allocator.free(own.clone())
                self.runtime.drop_compressed_index(r.row)
        self.requests.clear()
        self._pointed = False

    def _free(self, reqs: list[StagedRequest]) -> None:
        """The allocator's slots back to it; the headroom's are all free again."""
        if reqs:
            self.allocator.free(torch.cat([r.slots for r in reqs]))
        if self.headroom is not None:
            self.headroom.give_back()

    @staticmethod
    def _index_of(reqs: list[StagedRequest], dev):
        rows = torch.cat([torch.full((r.host.n - r.host.p,), r.row, dtype=torch.int64) for r in reqs])
        cols = torch.cat([torch.arange(r.host.p, r.host.n, dtype=torch.int64) for r in reqs])
        return rows.to(dev, non_blocking=True), cols.to(dev, non_blocking=True)

    def staged_slots(self) -> int:
        return sum(r.host.n - r.host.p for r in self.requests.values())


def _headroom_only() -> bool:
    """Testing hook: ``SGLANG_VC_STAGE_IN_HEADROOM_ONLY=1`` stages verifies in the headroom
    only (never the allocator's free slots), so that tests run the path a full pool takes."""
    return os.environ.get(HEADROOM_ONLY_ENV, "") not in ("", "0")


class VerifyHeadroom:
    """Pool slots held back for verify staging: as many as the longest span a verifier of
    the batch stages (``fit``), taken from the allocator (SGLang's admission counts them
    as used, so new requests cannot take the room a verify needs) and given back when no
    compressed request is left. One forward's verifiers take them in turn (``take``) and
    give them all back after it (``give_back``)."""

    def __init__(self, allocator, evict: Optional[Callable[[int], object]] = None):
        self.allocator = allocator
        self.evict = evict  # frees n slots from SGLang's prefix cache (its unlocked entries)
        self.slots: Optional[torch.Tensor] = None  # the held slots (the allocator's device)
        self.used = 0  # taken in the forward now running
        self.need = 0  # what the last fit asked for
        self._starved = False  # a verify waits too long (warned once per episode)

    @property
    def size(self) -> int:
        return 0 if self.slots is None else self.slots.numel()  # host metadata: no sync

    def fit(self, need: int, keep_free: int = 0, stalled: int = 0) -> None:
        """Hold ``need`` slots: grow from the allocator's free slots (evicting SGLang's
        cached prefixes where they fall short), leaving it ``keep_free`` (the running
        batch's next decode steps: taking those would make SGLang retract a request, which
        prefills and compresses again) unless ``stalled`` (verifies that waited, nothing
        committed since) reached :data:`STARVED_AFTER`; shrink back to ``need``. Not while
        a forward holds some."""
        if self.used:
            return
        self.need = need
        starved = stalled >= STARVED_AFTER
        if need > self.size and starved:
            if not self._starved:
                logger.warning("VERICACHE: %d verifies waited for pool room with no token committed; the "
                               "verify headroom takes the running batch's decode room (SGLang may retract a "
                               "request, which prefills again)", stalled)
            stats.add("vericache", headroom_starved=1)
            keep_free = 0
        self._starved = starved
        if need > self.size:
            short = need - self.size - (self.allocator.available_size() - keep_free)
            if short > 0 and self.evict is not None:
                self.evict(short)  # cached prefixes make room, as they do for SGLang's own allocations
            n = min(need - self.size, self.allocator.available_size() - keep_free)
            more = self.allocator.alloc(n) if n > 0 else None
            if more is not None and more.numel():
                more = more.to(torch.int64)
                self.slots = more if self.slots is None else torch.cat([self.slots, more])
            if self.size < need:
                stats.add("vericache", headroom_short=1)
        elif need < self.size:
            self._shrink_to(need)

    @property
    def starved_shortfall(self) -> int:
        """Slots the headroom lacks while verifies starve: SGLang's next decode is asked
        for them too (``hooks.py``), so that it retracts a request to free them where the
        pool has none (staggered drafts take one slot an iteration, as decoding does, so
        without this nothing else makes room and the verifies would wait forever)."""
        return max(0, self.need - self.size) if self._starved else 0

    def yield_to_decode(self, n: int) -> None:
        """Give ``n`` held slots back to the allocator: SGLang's next decode lacks them (it
        would retract a request). Not while verifies starve (they take that room on
        purpose), nor while a forward holds some."""
        n = min(n, self.size)
        if self._starved or self.used or n <= 0:
            return
        stats.add("vericache", headroom_yielded=n)
        self._shrink_to(self.size - n)

    def _shrink_to(self, size: int) -> None:
        """Hold the first ``size`` slots; the rest go back to the allocator."""
        self.allocator.free(self.slots[size:].clone())
        self.slots = self.slots[:size] if size else None

    def take(self, n: int) -> Optional[torch.Tensor]:
        if self.size - self.used < n:
            return None
        out = self.slots[self.used : self.used + n]
        self.used += n
        return out

    def give_back(self) -> None:
        self.used = 0

    def keep(self, taken: torch.Tensor) -> None:
        """``taken`` (slots this headroom gave) stay with a request: no longer held here
        (the rare path of a reload that failed; may synchronise)."""
        held = ~torch.isin(self.slots, taken)
        self.slots = self.slots[held]
        self.used = min(self.used, self.size)


def staged_layers(reloads) -> Callable[[int], None]:
    """The reloads of one verify forward (each started when its request's own window
    came, or at the verify) as one ``layer_ready``: wait for each one's copy of the layer."""
    reloads = list(reloads)

    def ready(layer_id: int) -> None:
        for reload in reloads:
            reload.layer(layer_id)

    return ready


class AheadSlots:
    """Pool slots the reloads started ahead of their verify hold (the staggered schedule
    starts a reload iterations before its verify, so that the link hides it): taken from
    SGLang's allocator when a reload starts (SGLang's admission counts them as used), given
    back when it closes unconsumed, or handed to the verify's :class:`PoolStaging`. The
    HBM ring caps them at ``cap_bytes`` (``--vc-staging-fraction`` of the pool's bytes),
    or the longest compressed span where that is more (so that a reload of any length can
    be placed); nothing is set aside at start-up. No host synchronisation: counts are host-known."""

    def __init__(self, allocator, bytes_per_slot: int, cap_bytes: int, join: Callable[[], None] = lambda: None):
        self.allocator = allocator
        self.bytes_per_slot = bytes_per_slot
        self.cap_bytes = cap_bytes
        self.join = join  # the compute stream waits for every copy queued so far
        self.held = 0  # slots held now
        self.peak = 0
        self._orphans: collections.deque = collections.deque()  # of reloads dropped unclosed

    def take(self, n: int) -> Optional[torch.Tensor]:
        """``n`` free slots, or None (nothing taken) where the allocator has fewer."""
        self.reclaim()
        slots = self.allocator.alloc(n) if n > 0 and not _headroom_only() else None
        if slots is None:
            stats.add("vericache", reloads_without_room_ahead=1)
            return None
        self.held += n
        self.peak = max(self.peak, self.held)
        stats.add("vericache", reloads_ahead=1)
        return slots.to(torch.int64)

    def give(self, slots: torch.Tensor) -> None:
        """A reload closed without its verify: its slots back to the allocator."""
        self.allocator.free(slots)
        self.held -= slots.numel()  # (host metadata: no sync)

    def orphan(self, slots: torch.Tensor) -> None:
        """A reload was dropped without closing, on whatever thread (a finalizer): its
        slots go back at the next :meth:`reclaim`, on the scheduler thread."""
        self._orphans.append(slots)

    def reclaim(self) -> None:
        if self._orphans:
            self.join()  # their copies may still be landing
            while self._orphans:
                self.give(self._orphans.popleft())

    def handed_over(self, n: int) -> None:
        """``n`` slots now belong to a verify forward (freed by its staging)."""
        self.held -= n

    def stats(self) -> dict:
        return {"reload_ahead_cap_bytes": self.cap_bytes, "reload_ahead_bytes": self.held * self.bytes_per_slot,
                "reload_ahead_peak_bytes": self.peak * self.bytes_per_slot}
