"""Per-process state of lossy serving, shared by the attention backend (which compresses
and attends) and the radix cache (which plans requests and frees their slots).

Life of a request ``r`` whose spec compresses (see :mod:`.index` for the KV layout):

1. ``plan`` (radix cache, at prefix match): resolve its spec, remember the prefill length.
2. ``begin_forward`` (backend, once per forward): the forward whose extend ends at the
   prefill length is ``r``'s last prefill chunk, so ``r`` is *pending*.
3. ``compress_layer`` (backend, each layer, after the layer's attention): read the
   layer's K/V of the ``n`` prefill tokens from the pool, compress with that layer's
   queries, write the kept rows into the request's own slots ``row[p : p + n_keep]``
   (token dropping) or keep the packed payload (quantization).
4. ``end_forward`` (backend, after the last layer): point the row positions whose slots
   are no longer needed at ``NULL_SLOT`` and free those slots, put a
   :class:`CompressedKVIndex` in ``index``; online methods commit their evictions.
5. ``free_request_slots`` / ``release`` (radix cache, when SGLang releases the row).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from sglang_vc import stats
from sglang_vc.compress import DroppedKV, QuantizedKV, get_compressor
from sglang_vc.compress.base import Compressor
from sglang_vc.compress.kivi import KIVI

from . import kernels
from .index import CompressedKVIndex, QuantPayload
from .payload_store import PayloadHome, PayloadStore
from .names import NULL_SLOT
from .warmup import warm_up_kernels
from .plan import CompressionSpec, RequestPlan, make_spec, resolve_spec
from .scheduler_side import SchedulerSide
from . import writes

logger = logging.getLogger(__name__)

SNAPKV_WINDOW = 32  # observation window (SnapKV's reference code)
MAX_SCORING_QUERIES = 512  # last prompt queries H2O/KVzip score with (memory bound)
# Extra tokens a payload's home holds past its prompt's, as a fraction of them, for the
# decode tail that KIVI quantizes group by group (VERICACHE keeps its rows full: none)
PAYLOAD_TAIL_HEADROOM = 0.25

_runtime: Optional["KVRuntime"] = None
def host_rows(forward_batch) -> list[int]:
    """The forward's ``req_to_token`` rows, read from a host copy: SGLang makes one for an
    extend (``req_pool_indices_cpu``), the project's workers for each forward they run
    (``spec_worker.forward_sub``). Without one (a forward SGLang builds for a decode), a
    read of the device tensor: a synchronisation on a GPU."""
    rows = getattr(forward_batch, "req_pool_indices_cpu", None)  # a stand-in batch may lack the field
    return (rows if rows is not None else forward_batch.req_pool_indices).tolist()


def get_runtime(model_runner=None) -> "KVRuntime":
    """The process's runtime, created from the first model runner that asks."""
    global _runtime
    if _runtime is None:
        if model_runner is None:
            raise RuntimeError("compressed-KV runtime not initialised: no model runner yet")
        writes.watch(KVRuntime)  # (SGLANG_VC_WATCH_WRITES: nobody parks state on it)
        _runtime = KVRuntime(model_runner)
    return _runtime


def current_runtime() -> Optional["KVRuntime"]:
    """The process's runtime if an attention backend of this package created it."""
    return _runtime


@dataclasses.dataclass
class _Pending:
    """A request whose prefill ends in this forward and is compressed in it."""

    plan: RequestPlan
    req_pool_idx: int
    n: int  # prefill tokens (= seq_len)
    p: int  # of which borrowed from the tree (row positions [0, p))
    q_lo: int  # rows of this request in the forward's q
    q_hi: int
    n_keep: int = 0  # token dropping: rows kept
    n_quant: int = 0  # quantization: tokens quantized
    layers: dict = dataclasses.field(default_factory=dict)  # layer -> QuantizedKV
    home: Optional[PayloadHome] = None  # the payload's leased slots (taken at its first layer)
    no_home: bool = False  # no run of free slots for it: the runtime's fallback at the end


@dataclasses.dataclass
class _Online:
    """An online (H2O) request in a decode forward: rows it attends to and evictions."""

    entry: CompressedKVIndex
    slots: torch.Tensor  # its live rows' slots, in row order
    positions: torch.Tensor  # their row positions
    seq_len: int
    kept: Optional[int] = None  # rows kept after this step's eviction (same for all layers)


@dataclasses.dataclass
class BatchView:
    """The lossy state of one forward's requests, built in ``begin_forward``."""

    entries: list  # per request: CompressedKVIndex or None
    pending: list  # _Pending
    online: dict  # batch index -> _Online (decode only)
    streaming: list = dataclasses.field(default_factory=list)  # (entry, seq_len): KIVI in decode

    @property
    def any_compressed(self) -> bool:
        return any(e is not None for e in self.entries)


class KVRuntime:
    def __init__(self, model_runner):
        from sglang_vc.config import get_vc_config

        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.kv_pool = model_runner.token_to_kv_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.page_size = getattr(self.allocator, "page_size", 1)
        if self.page_size != 1:
            raise ValueError("lossy serving needs --page-size 1 (compressed rows are token slots)")
        vc = get_vc_config(model_runner.server_args)
        self.default_spec: Optional[CompressionSpec] = (
            make_spec(vc.vc_compressor, vc.vc_compression_ratio, vc.vc_kv_bits)
            if vc.vc_compressor else None
        )
        self.start_layer = self.kv_pool.start_layer
        self.last_layer = self.kv_pool.start_layer + self.kv_pool.layer_num - 1
        k0 = self.kv_pool.get_key_buffer(self.start_layer)
        v0 = self.kv_pool.get_value_buffer(self.start_layer)
        self.bytes_per_slot = self.kv_pool.layer_num * (
            k0[0].numel() * k0.element_size() + v0[0].numel() * v0.element_size()
        )
        # quantized payloads live in slots leased from the pool while their request does
        self.payloads = PayloadStore(self.allocator, self.kv_pool, self._evict)
        self.payload_tail_headroom = PAYLOAD_TAIL_HEADROOM
        self.reload_ahead = None  # VERICACHE's pool slots of reloads started ahead of their verify (stats())
        self.host_store = None  # VERICACHE's host store of the full KV compression replaced
        self.plans: dict[str, RequestPlan] = {}
        self.index: dict[int, CompressedKVIndex] = {}
        self.meta: dict[str, dict] = {}  # rid -> summary dict shown in meta_info
        self._compressors: dict[str, Compressor] = {}
        self.batch: Optional[BatchView] = None
        # VeriCache keeps the full KV of what compression replaces: when set, called as
        # sink(rid, req_pool_idx, layer_id, p, k, v) with the layer's full prefill K/V
        # (row positions [0, n)) right before they are compressed.
        self.full_kv_sink = None
        # ... and decides, before a request is compressed, whether it has room for that
        # KV: ``admit(rid, req_pool_idx, p, n) -> bool``; a refused request keeps its
        # full KV on the device (decodes uncompressed).
        self.full_kv_admit = None
        # ... and may decide that a request need not be compressed at all, and answers
        # SGLang's scheduler (its decode reserve, pool room held back): the worker's one
        # seam with the scheduler (:mod:`.scheduler_side`), registered once
        self.side = SchedulerSide()
        self.tree_cache = None  # the radix cache (set by it): its evictable rows count as room
        # ... and, for a token-dropping method, learns which rows stayed on the device:
        # ``kept(rid, req_pool_idx, layer_id, kept_positions [H, n_keep])`` after each
        # layer's selection (the kept rows need no reload).
        self.full_kv_kept = None
        # ... and, when decode quantizes a tail group, gets that group's full KV before
        # its slots are freed: ``streamed(rid, req_pool_idx, layer_id, start, k, v)``
        # (SpeCache's host copy grows with the quantized part).
        self.full_kv_streamed = None
        # When the pool has no run of free slots for a payload, a quantized request's
        # dequantized values are written over its own rows (lossy, nothing saved). A user that must know which
        # rows are quantized (SpeCache) sets False: such a request then keeps its full KV.
        self.in_place_fallback = True
        # slots given back to the allocator by compression, not yet reported to the
        # scheduler's admission (take_returned_slots)
        self._returned_slots = 0
        # called with a request's rid when SGLang releases it (finished, aborted, retracted):
        # what a user holds for it (VERICACHE's host entry, reload, staging) goes at once
        self.release_listeners: list = []
        # the Triton kernels compile now (SGLang's warm-up forward), not at the first
        # compressed request; None on the CPU
        mc = model_runner.model_config
        self.kernel_warmup_s = warm_up_kernels(k0, mc.num_attention_heads // max(model_runner.server_args.tp_size, 1))
        logger.info("compressed-KV runtime: default %s; quantized payloads in pool slots leased per request",
                    self.default_spec.describe() if self.default_spec else "full KV")

    def _evict(self, n: int) -> None:
        """Make room for a lease: evict ``n`` slots' worth of the radix tree's unreferenced
        prefixes (SGLang's own eviction)."""
        if self.tree_cache is not None:
            from sglang.srt.mem_cache.common import evict_from_tree_cache

            evict_from_tree_cache(self.tree_cache, n)

    @property
    def payload_bytes(self) -> int:
        """Device bytes the quantized payloads hold: their leased slots."""
        return self.payloads.leased_slots * self.bytes_per_slot

    # ------------------------------------------------------------------ planning

    def free_room(self) -> int:
        """Pool slots a new request could take now: free plus evictable from the tree
        (what SGLang's admission counts)."""
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return self.allocator.available_size() + evictable

    def compressor(self, name: str) -> Compressor:
        if name not in self._compressors:
            self._compressors[name] = get_compressor(name)
        return self._compressors[name]

    def use_compressor(self, compressor: Compressor) -> None:
        """Serve every request whose spec names ``compressor.name`` with this instance
        (e.g. KIVI at another residual length or group size than its defaults)."""
        self._compressors[compressor.name] = compressor

    def plan(self, rid: str, custom_params: Any, prefill_len: int) -> RequestPlan:
        """Plan (or re-plan, e.g. after a retraction) request ``rid``."""
        spec, error = resolve_spec(self.default_spec, custom_params)
        plan = self.plans.get(rid)
        if plan is None or plan.spec != spec or plan.prefill_len != prefill_len:
            if error and (plan is None or plan.error != error):
                logger.warning("request %s: %s; using %s", rid, error,
                               spec.describe() if spec else "full KV")
            plan = self.plans[rid] = RequestPlan(rid, spec, prefill_len, error)
        return plan

    def is_lossy(self, req) -> bool:
        """Whether ``req``'s KV is (or is to be) compressed: it must not enter the tree."""
        plan = self.plans.get(req.rid)
        if plan is not None and plan.full_again:
            return False
        if plan is not None and plan.spec is not None:
            return True
        entry = self.index.get(req.kv.req_pool_idx)
        return entry is not None and entry.rid == req.rid

    def _own_rows_hold_it(self, spec, n: int, p: int) -> Optional[str]:
        """Under a lossless worker a request borrows the tree's whole match (``side.lossless``);
        where its own rows cannot hold a token-dropping spec's kept rows, it keeps its full KV
        (the reason): its prompt is mostly the tree's, which compressing would not free."""
        if not self.side.lossless or spec.scenario != "token_dropping" or n - p >= spec.rows_kept(n):
            return None
        stats.add("compression", full_kv_mostly_cached=1)
        return (f"{p} of its {n} prompt tokens are the radix tree's: compressing it would free nothing "
                f"(its {spec.rows_kept(n)} kept rows need slots of its own)")

    def full_again(self, req, up_to: int):
        """A finished compressed request's full KV for the tree (``side.full_kv_for_tree``):
        True where the worker put it back in its row (from now on it is a full request,
        which the tree takes); a :class:`~.held_rows.HeldRows` host copy of its rows below
        ``up_to`` where the pool had no room (the tree takes it after a release); False
        where nobody can (lossy serving)."""
        plan = self.plans.get(req.rid)
        restore = self.side.full_kv_for_tree
        kept = restore(req, up_to) if plan is not None and restore is not None else False
        if kept is True:
            plan.full_again = True
        return kept

    def register_index(self, entry: CompressedKVIndex) -> None:
        """Serve the request in row ``entry.req_pool_idx`` from a compressed prefix that
        someone else put on the device (e.g. an EvicPress context's kept rows)."""
        self.index[entry.req_pool_idx] = entry

    def entry_for_row(self, req_pool_idx: int) -> Optional[CompressedKVIndex]:
        """The compressed-KV index of the request in row ``req_pool_idx``, if any."""
        return self.index.get(req_pool_idx)

    def compressed_rids(self) -> set[str]:
        """Requests that have a compressed-KV index now."""
        return {entry.rid for entry in self.index.values()}

    def has_entry(self, rid: str) -> bool:
        return any(entry.rid == rid for entry in self.index.values())

    # ------------------------------------------------------------------ forward

    def begin_forward(self, forward_batch) -> BatchView:
        if self.batch is not None:  # the last forward raised before its end: its payloads' slots go back
            for pend in self.batch.pending:
                self.payloads.release(pend.home)
        mode = forward_batch.forward_mode
        rids = forward_batch.rids or []
        pool_idx = host_rows(forward_batch)
        seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                    else forward_batch.seq_lens).tolist()
        entries = [self.index.get(i) for i in pool_idx]
        pending, online, streaming = [], {}, []
        if mode.is_extend() and not mode.is_target_verify() and rids:
            prefix = forward_batch.extend_prefix_lens_cpu
            ext = forward_batch.extend_seq_lens_cpu
            q_lo = 0
            for i, rid in enumerate(rids):
                plan = self.plans.get(rid)
                if plan is not None and plan.tree_prefix_len is None:
                    # A plan's first extend starts at the tree-matched prefix: the row's
                    # [0, p) belongs to the tree, [p, n) to the request (lossy requests
                    # never insert, so later prefill chunks do not move that boundary).
                    plan.tree_prefix_len = prefix[i]
                if (plan is not None and plan.spec is not None and entries[i] is None
                        and seq_lens[i] == plan.prefill_len):
                    pend = self._pending(plan, pool_idx[i], seq_lens[i], q_lo, q_lo + ext[i])
                    if pend is not None:
                        pending.append(pend)
                q_lo += ext[i]
        elif mode.is_decode():
            for i, entry in enumerate(entries):
                if entry is None or entry.keep_full_rows:
                    continue
                if entry.spec.mode == "online":
                    slots, positions = kernels.live_rows(
                        self.req_to_token[entry.req_pool_idx], entry.row_start, seq_lens[i])
                    online[i] = _Online(entry, slots, positions, seq_lens[i])
                elif entry.spec.scenario == "quantization":
                    streaming.append((entry, seq_lens[i]))
        self.batch = BatchView(entries, pending, online, streaming)
        return self.batch

    def _pending(self, plan: RequestPlan, req_pool_idx: int, n: int, q_lo: int,
                 q_hi: int) -> Optional[_Pending]:
        p = plan.tree_prefix_len
        pend = _Pending(plan, req_pool_idx, n, p, q_lo, q_hi)
        spec = plan.spec
        if n - p < 1:  # an empty prompt: nothing to compress (SGLang serves it)
            plan.spec = None
            return None
        gate = self.side.compress_gate
        reason = self._own_rows_hold_it(spec, n, p)
        if reason is None and gate is not None:
            reason = gate(plan.rid, n - p, spec)
        if reason is not None:
            plan.spec = None
            self.meta[plan.rid] = {"compressor": "none", "full_kv_reason": reason}
            return None
        if self.full_kv_admit is not None and not self.full_kv_admit(plan.rid, req_pool_idx, p, n):
            plan.spec, plan.error = None, "no room for its full KV in the host store; served with full KV"
            return None
        if spec.scenario == "token_dropping":
            pend.n_keep = spec.rows_kept(n)
            if n - p < pend.n_keep:  # the match cap should prevent this
                logger.warning("request %s owns %d of %d prefill rows but keeps %d; not compressed",
                               plan.rid, n - p, n, pend.n_keep)
                plan.spec, plan.error = None, "not enough own slots for the compressed rows"
                return None
        return pend

    def _queries(self, spec: CompressionSpec, q: torch.Tensor, pend: _Pending) -> Optional[torch.Tensor]:
        """The queries ``spec`` scores with, from this layer's prefill queries (post-RoPE).

        SnapKV: the last ``SNAPKV_WINDOW`` prompt queries (its observation window).
        H2O: the last ``MAX_SCORING_QUERIES`` prompt queries (accumulated attention).
        KVzip: the same prompt queries stand in for its context-reconstruction pass (no
        second forward is run here; see the package notes)."""
        need = self.compressor(spec.compressor).needs_queries
        if need is None:
            return None
        qs = q[pend.q_lo : pend.q_hi]
        if need == "observation_window":
            w = min(SNAPKV_WINDOW, qs.shape[0], pend.n - 1)
            return qs[-w:] if w > 0 else None
        return qs[-MAX_SCORING_QUERIES:]

    def compress_layer(self, layer_id: int, q: torch.Tensor) -> None:
        """Compress this layer of every pending request (``q [T, Hq, D]`` post-RoPE)."""
        k_buf = self.kv_pool.get_key_buffer(layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer_id)
        for pend in self.batch.pending:
            spec = pend.plan.spec
            comp = self.compressor(spec.compressor)
            row = self.req_to_token[pend.req_pool_idx]
            slots = row[: pend.n].to(torch.int64)
            k, v = k_buf[slots], v_buf[slots]
            if self.full_kv_sink is not None:
                self.full_kv_sink(pend.plan.rid, pend.req_pool_idx, layer_id, pend.p, k, v)
            queries = self._queries(spec, q, pend)
            ckv = comp.compress(layer_id, k, v, spec.amount, queries=queries, req_id=pend.plan.rid)
            if isinstance(ckv, DroppedKV):
                assert ckv.n_keep == pend.n_keep, (ckv.n_keep, pend.n_keep)
                if self.full_kv_kept is not None:
                    self.full_kv_kept(pend.plan.rid, pend.req_pool_idx, layer_id, ckv.kept_positions)
                dest = row[pend.p : pend.p + pend.n_keep].to(torch.int64)
                kernels.write_rows(k_buf, dest, ckv.k)
                kernels.write_rows(v_buf, dest, ckv.v)
            elif isinstance(ckv, QuantizedKV):
                if self.full_kv_kept is not None:  # every row quantized: the full layer can go now
                    self.full_kv_kept(pend.plan.rid, pend.req_pool_idx, layer_id, None)
                pend.n_quant = ckv.num_quantized
                if ckv.num_quantized:
                    pend.layers[layer_id] = self._into_home(pend, _without_residual(ckv))
            else:  # pragma: no cover - the library has only these two kinds
                raise TypeError(type(ckv).__name__)

    def _into_home(self, pend: _Pending, q: QuantizedKV) -> QuantizedKV:
        """``q`` copied into the payload's leased slots, taken at its first layer; ``q``
        itself where the pool had no run of free slots for it (the fallback at the end)."""
        if pend.home is None and not pend.no_home:
            cap = _capacity(q.num_quantized, q.group_size, self.payload_tail_headroom)
            pend.home = self.payloads.home(q, cap)
            pend.no_home = pend.home is None
            if pend.home is not None:  # room compression gives back is net of the lease
                self._returned_slots -= pend.home.lease.size
        return pend.home.put(q) if pend.home is not None else q

    def no_forward(self) -> None:
        """A forward the full-KV backend runs alone (a CUDA graph's capture or replay): no
        view of the batch."""
        self.batch = None

    def end_forward(self) -> None:
        """After the last layer: register compressed requests, free their spare slots,
        and commit online evictions."""
        batch = self.batch
        for pend in batch.pending:
            entry = self._finish_pending(pend)
            self.index[pend.req_pool_idx] = entry
            meta = self.meta.setdefault(entry.rid, {})
            meta.clear()
            meta.update(entry.summary())
            if pend.plan.error:
                meta["error"] = pend.plan.error
        for i, onl in batch.online.items():
            self._commit_online(onl)
        for entry, seq_len in batch.streaming:
            self._quantize_tail(entry, seq_len)
        self.batch = None

    def _finish_pending(self, pend: _Pending) -> CompressedKVIndex:
        spec = pend.plan.spec
        row = self.req_to_token[pend.req_pool_idx]
        if spec.scenario == "token_dropping":
            # rows [0, p) are the tree's full KV, replaced for this request by its own
            # kept rows: reading starts at p
            entry = CompressedKVIndex(pend.plan.rid, pend.req_pool_idx, spec, pend.n, pend.p,
                                      row_start=pend.p, attend_from=pend.n, tokens_kept=pend.n_keep)
            freed = self._drop_positions(pend.req_pool_idx, pend.p + pend.n_keep, pend.n)
            tokens_after, payload_bytes = pend.n_keep, 0
        else:
            entry = self._finish_quantized(pend)
            freed = 0
            if entry.payload is not None:
                freed = self._drop_positions(pend.req_pool_idx, pend.p, pend.n_quant)
            tokens_after = pend.n
            payload_bytes = entry.payload.nbytes if entry.payload is not None else 0
        entry.slots_freed = freed
        saved = freed * self.bytes_per_slot - payload_bytes
        stats.add(
            "compression",
            requests=1,
            **{f"requests_{spec.compressor}": 1},
            tokens_before=pend.n,
            tokens_after=tokens_after,
            slots_freed=freed,
            bytes_saved=saved,
        )
        logger.debug("compressed %s: %s", entry.rid, entry.summary())
        return entry

    def _drop_positions(self, req_pool_idx: int, start: int, end: int) -> int:
        """Free the live slots of row positions ``[start, end)`` and point them at
        ``NULL_SLOT``; returns the number of slots freed."""
        if end <= start:
            return 0
        row = self.req_to_token[req_pool_idx]
        slots = row[start:end].to(torch.int64)
        live = slots[slots != NULL_SLOT]
        if live.numel():
            self.allocator.free(live.clone())
            self._returned_slots += int(live.numel())
        row[start:end] = NULL_SLOT
        return int(live.numel())

    def memory_split(self) -> dict[str, int]:
        """Device memory of compressed-KV serving beside SGLang's pool (``/server_info``)."""
        return {  # pool slots leased for quantized payloads now, and the most they held at once
                "payload_store_bytes": self.payload_bytes,
                "payload_store_peak_bytes": self.payloads.peak_slots * self.bytes_per_slot,
                # pool slots reloads started ahead of their verify hold: their cap (not set
                # aside), now and at most (VERICACHE)
                **(self.reload_ahead.stats() if self.reload_ahead is not None else
                   {"reload_ahead_cap_bytes": 0, "reload_ahead_bytes": 0, "reload_ahead_peak_bytes": 0}),
                # the prefill's host copies' device buffer, allocated when a request is first compressed
                "host_copy_buffer_bytes": self._host_copy_bytes(),
                # host memory holding the full KV that compression replaced (VERICACHE)
                "host_store_bytes": self.host_store.reserved_bytes if self.host_store is not None else 0,
                # the pinned slabs its rows are views of, pinned when first needed (VERICACHE)
                **(self.host_store.slabs.stats() if self.host_store is not None else
                   {"host_slabs": 0, "host_slab_bytes": 0, "host_slab_in_use_bytes": 0, "host_rows_outside_slabs": 0}),
                "verify_headroom_tokens": self.side.held_back.size if self.side.held_back is not None else 0}

    def _host_copy_bytes(self) -> int:
        copy_out = getattr(self.host_store, "copy_out", None)
        return copy_out.arena.capacity if copy_out is not None else 0

    def take_returned_slots(self) -> int:
        """Slots compression gave back to the allocator since the last call: room that
        appeared without any request leaving the batch."""
        n, self._returned_slots = self._returned_slots, 0
        return max(0, n)

    def _finish_quantized(self, pend: _Pending) -> CompressedKVIndex:
        spec = pend.plan.spec
        entry = CompressedKVIndex(pend.plan.rid, pend.req_pool_idx, spec, pend.n, pend.p,
                                  row_start=0, attend_from=0)
        if not pend.n_quant:  # 16 bits, or too short to quantize: nothing changes
            return entry
        nbytes = sum(c.nbytes() for c in pend.layers.values())
        if pend.home is not None:
            entry.quantized_tokens = pend.n_quant
            entry.payload = QuantPayload(pend.layers, pend.n_quant, nbytes, home=pend.home)
            entry.row_start = entry.attend_from = pend.n_quant
            return entry
        stats.add("compression", payload_no_room=1)
        if not self.in_place_fallback:
            return entry  # the request keeps its full KV on the device
        # The store is full: write the dequantized values over the request's own rows
        # (same output as with the payload, no memory saved). Rows [0, p) belong to the
        # radix tree and keep their full-precision values.
        row = self.req_to_token[pend.req_pool_idx]
        own = row[pend.p : pend.n_quant].to(torch.int64)
        for layer_id, ckv in pend.layers.items():
            k, v = KIVI.dequantize(ckv)
            kernels.write_rows(self.kv_pool.get_key_buffer(layer_id), own, k[pend.p :])
            kernels.write_rows(self.kv_pool.get_value_buffer(layer_id), own, v[pend.p :])
        entry.in_place = True
        entry.quantized_tokens = max(0, pend.n_quant - pend.p)
        return entry

    # ------------------------------------------------------------------ attention

    def request_kv(self, entry: CompressedKVIndex, layer_id: int, seq_len: int,
                   online: Optional[_Online] = None, live: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """What a compressed request attends to in ``layer_id``: K, V ``[N, H, D]``, the
        number of payload rows first (visible to every query) and the row positions of
        the pool rows after them. ``live``: its live pool rows ``(slots, positions)`` up
        to ``seq_len`` where the caller built them for the whole forward."""
        k_buf = self.kv_pool.get_key_buffer(layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer_id)
        if online is not None:
            slots, positions = online.slots, online.positions
        elif live is not None:
            slots, positions = live
        else:
            slots, positions = kernels.live_rows(self.req_to_token[entry.req_pool_idx],
                                                 entry.row_start, seq_len)
        pk = pv = None
        if entry.payload is not None:
            pk, pv = KIVI.dequantize(entry.payload.layers[layer_id])
        k, v = kernels.gather_kv(k_buf, v_buf, slots, pk, pv)
        return k, v, entry.num_payload_rows, positions

    def payload_kv(self, entry: CompressedKVIndex, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized payload of ``layer_id`` (row positions ``[0, num_payload_rows)``),
        ``[n, H, D]`` K and V; empty when the request has no payload."""
        if entry.payload is None:
            k0 = self.kv_pool.get_key_buffer(layer_id)
            v0 = self.kv_pool.get_value_buffer(layer_id)
            return k0[:0], v0[:0]
        return KIVI.dequantize(entry.payload.layers[layer_id])

    def packed_payload(self, entry: CompressedKVIndex, layer_id: int):
        """The payload of ``layer_id`` as ``sgl_kernel_ext.Payload`` (packed codes, for the
        attention kernel that dequantizes as it reads), or None without a payload."""
        if entry.payload is None:
            return None
        from sgl_kernel_ext import Payload

        qkv = entry.payload.layers[layer_id]
        return Payload(qkv.bits, qkv.group_size, qkv.value_group_size, qkv.k_payload, qkv.k_scales, qkv.k_zeros,
                       qkv.v_payload, qkv.v_scales, qkv.v_zeros, qkv.k_residual.shape[2], qkv.v_residual.shape[2])

    # ------------------------------------------------------------------ online

    def online_update(self, layer_id: int, onl: _Online, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """H2O step for one request and layer: score, evict, compact the layer's rows.

        ``k``/``v`` are the rows the request attended to (``onl.slots`` in order)."""
        entry = onl.entry
        comp = self.compressor(entry.spec.compressor)
        kept_before = comp.kept(layer_id, entry.rid)  # [H, c] positions of the compressed rows
        h = kept_before.shape[0]
        fresh = torch.arange(entry.attend_from, onl.seq_len, device=k.device)
        pos = torch.cat([kept_before, fresh.expand(h, -1)], 1)
        drops = comp.update(layer_id, q, [k], req_ids=[entry.rid], positions=[pos])[0]
        m = k.shape[0]
        if drops.numel() == 0:
            kept = m
        else:
            dropped = (pos.unsqueeze(-1) == drops.unsqueeze(1)).any(-1)  # [H, m]
            keep_idx = torch.nonzero(~dropped)[:, 1].view(h, -1)
            kept = keep_idx.shape[1]
            dest = onl.slots[:kept]
            kernels.write_rows(self.kv_pool.get_key_buffer(layer_id), dest, kernels.keep_rows(k, keep_idx))
            kernels.write_rows(self.kv_pool.get_value_buffer(layer_id), dest, kernels.keep_rows(v, keep_idx))
        if onl.kept is None:
            onl.kept = kept
        elif onl.kept != kept:
            raise RuntimeError(f"h2o evicted different row counts across layers ({onl.kept} vs {kept})")

    def _commit_online(self, onl: _Online) -> None:
        """The step's kept rows now sit in the first ``kept`` live slots (compacted per
        head); the row positions of the other live slots become null."""
        entry = onl.entry
        kept = onl.slots.numel() if onl.kept is None else onl.kept
        spare, spare_pos = onl.slots[kept:], onl.positions[kept:]
        if spare.numel():
            self.allocator.free(spare.clone())
            self._returned_slots += int(spare.numel())
            self.req_to_token[entry.req_pool_idx, spare_pos] = NULL_SLOT
            entry.slots_freed += int(spare.numel())
            entry.online_evicted += int(spare.numel())
            stats.add("compression", online_evicted=int(spare.numel()), slots_freed=int(spare.numel()),
                      bytes_saved=int(spare.numel()) * self.bytes_per_slot)
        entry.tokens_kept = kept
        entry.attend_from = onl.seq_len
        meta = self.meta.get(entry.rid)
        if meta is not None:
            meta.update(entry.summary())

    # ------------------------------------------------------------------ KIVI streaming

    def stream_tail(self, req_pool_idx: int, seq_len: int) -> None:
        """KIVI's decode-time quantization for the request in row ``req_pool_idx`` whose
        KV is final up to ``seq_len`` (a worker that forwards decode tokens outside plain
        ``DECODE`` forwards calls this after committing them)."""
        entry = self.index.get(req_pool_idx)
        if entry is not None and entry.spec.scenario == "quantization":
            self._quantize_tail(entry, seq_len)

    def _quantize_tail(self, entry: CompressedKVIndex, seq_len: int) -> None:
        """KIVI during decode: once the full-precision tail reaches ``residual_length +
        group_size`` tokens, quantize its oldest ``group_size`` tokens (one more key group),
        append them to the payload and free their slots."""
        spec = entry.spec
        comp = self.compressor(spec.compressor)
        g, r = comp.group_size, comp.residual_length
        if spec.bits >= 16 or entry.in_place or seq_len - entry.attend_from < r + g:
            return
        start = entry.attend_from
        rows = self.req_to_token[entry.req_pool_idx, start : start + g].to(torch.int64)
        whole = self.compressor_with(spec.compressor, residual_length=0)
        tails = {lid: _without_residual(whole.compress(lid, self.kv_pool.get_key_buffer(lid)[rows],
                                                       self.kv_pool.get_value_buffer(lid)[rows], spec.bits))
                 for lid in range(self.start_layer, self.last_layer + 1)}
        placed = self._tail_home(entry, tails)
        if placed is None:
            stats.add("compression", payload_no_room=1)
            return  # no room for a larger payload: the tail stays in full precision
        home, base = placed
        layers = {lid: home.append(base[lid], t) if lid in base else home.put(t) for lid, t in tails.items()}
        nbytes = sum(q.nbytes() for q in layers.values())
        added = nbytes - (entry.payload.nbytes if entry.payload is not None else 0)
        if self.full_kv_streamed is not None:
            for layer_id in range(self.start_layer, self.last_layer + 1):
                self.full_kv_streamed(entry.rid, entry.req_pool_idx, layer_id, start,
                                      self.kv_pool.get_key_buffer(layer_id)[rows],
                                      self.kv_pool.get_value_buffer(layer_id)[rows])
        if entry.payload is not None and entry.payload.home is not home:
            self.payloads.release(entry.payload.home)
        entry.payload = QuantPayload(layers, start + g, nbytes, home=home)
        entry.row_start = entry.attend_from = start + g
        entry.quantized_tokens += g
        # rows below prefix_len are the tree's: they stay, unread (reading starts past them)
        freed = self._drop_positions(entry.req_pool_idx, max(start, entry.prefix_len), start + g)
        entry.slots_freed += freed
        stats.add("compression", streamed_tokens=g, slots_freed=freed,
                  bytes_saved=freed * self.bytes_per_slot - added)
        meta = self.meta.get(entry.rid)
        if meta is not None:
            meta.update(entry.summary())

    def _tail_home(self, entry: CompressedKVIndex, tails: dict) -> Optional[tuple[PayloadHome, dict]]:
        """Where the payload grown by ``tails`` goes, and its current layers there: its home
        while it holds them, else a larger one with the current layers copied in (the old
        is given back by the caller), or None where the pool has no run for that."""
        old = entry.payload
        base = old.layers if old is not None else {}
        g = next(iter(tails.values())).num_quantized
        n = (next(iter(base.values())).num_quantized if base else 0) + g
        if old is not None and old.home is not None and old.home.holds(n):
            return old.home, base
        like = next(iter(tails.values()))
        home = self.payloads.home(like, _capacity(n, g, self.payload_tail_headroom))
        if home is None:
            return None
        return home, {lid: home.put(q) for lid, q in base.items()}

    def compressor_with(self, name: str, **config) -> Compressor:
        """The instance serving ``name`` with some of its settings changed."""
        base = self.compressor(name)
        key = (name, id(base), tuple(sorted(config.items())))
        if key not in self._compressors:
            self._compressors[key] = dataclasses.replace(base, **config)
        return self._compressors[key]

    # ------------------------------------------------------------------ release

    def owned_slots(self, entry: CompressedKVIndex, start: int, end: int) -> torch.Tensor:
        """Slots a compressed request owns in the row range SGLang asks to free: the live
        ones from ``max(start, prefix_len)`` on (below it the row is the tree's)."""
        row = self.req_to_token[entry.req_pool_idx, max(start, entry.prefix_len) : end].to(torch.int64)
        return row[row != NULL_SLOT]

    def restore_full_kv(self, req_pool_idx: int, start: int, k: dict[int, torch.Tensor],
                        v: dict[int, torch.Tensor]) -> bool:
        """Undo the compression of the request in row ``req_pool_idx``: its full KV of
        row positions ``[start, start + N)`` (``k``/``v``: layer id -> ``[N, H, D]``, e.g.
        a host copy) goes back into device slots -- the live ones it still owns, and new
        ones where compression freed them -- and its compressed index is dropped, so it
        attends to full KV from now on (it still never enters the tree). False, with
        nothing changed, when the pool has no free slots for it."""
        entry = self.index.get(req_pool_idx)
        if entry is None or not k:
            return False
        n = next(iter(k.values())).shape[0]
        row = self.req_to_token[req_pool_idx]
        slots = row[start : start + n].to(torch.int64)
        missing = (slots == NULL_SLOT).nonzero().view(-1)
        if missing.numel():
            new = self.allocator.alloc(int(missing.numel()))
            if new is None:
                return False
            slots[missing] = new.to(slots.device, torch.int64)
            row[start : start + n] = slots.to(row.dtype)
        dev = self.kv_pool.get_key_buffer(next(iter(k))).device
        at = slots.to(dev)
        for layer_id in k:
            kernels.write_rows(self.kv_pool.get_key_buffer(layer_id), at, k[layer_id].to(dev))
            kernels.write_rows(self.kv_pool.get_value_buffer(layer_id), at, v[layer_id].to(dev))
        self.drop_compressed_index(req_pool_idx)
        stats.add("compression", slots_restored=int(missing.numel()))
        return True

    def drop_compressed_index(self, req_pool_idx: int) -> None:
        """The request in row ``req_pool_idx`` has its full KV in its row's slots again (put
        there by the caller): forget its compressed index, so it attends to full KV from
        now on (it still never enters the tree)."""
        entry = self.index.pop(req_pool_idx, None)
        if entry is None:
            return
        if entry.payload is not None:
            self._returned_slots += self.payloads.release(entry.payload.home)
        stats.add("compression", restored=1)

    def release(self, rid: str, req_pool_idx: Optional[int]) -> None:
        """Forget a request (finished, aborted or retracted)."""
        entry = self.index.get(req_pool_idx) if req_pool_idx is not None else None
        if entry is not None and entry.rid == rid:
            del self.index[req_pool_idx]
            if entry.payload is not None:
                self.payloads.release(entry.payload.home)
        # an idle pool holds nothing back (also when the request's index went earlier: a
        # finished request whose full KV was put back for the tree, KVRuntime.full_again)
        if not self.index and self.side.held_back is not None:
            self.side.held_back.fit(0)
        plan = self.plans.pop(rid, None)
        if plan is not None and plan.spec is not None:
            self.compressor(plan.spec.compressor).release(rid)
        self.meta.pop(rid, None)
        for listener in self.release_listeners:
            listener(rid)


def _without_residual(q: QuantizedKV) -> QuantizedKV:
    """The quantized part of ``q`` (a payload keeps no full-precision rows: the pool does)."""
    return dataclasses.replace(q, k_residual=q.k_residual[:0].clone(), v_residual=q.v_residual[:0].clone())


def _capacity(n: int, group: int, headroom: float) -> int:
    """Tokens a payload's home holds: ``n`` and ``headroom`` of it more, in whole groups."""
    want = n + int(n * headroom)
    return -(-want // group) * group
