"""SpecCache in the scheduler process: each request's plan, its chunks' KV found in the
radix tree, and the selective-recompute prefill's two steps before the forward.

* **Lookup** (:meth:`ChunkStore.look_up`, from the radix cache's ``match_prefix``): each
  chunk's token ids are matched from the tree's root; the matched node is locked so the
  chunk's KV stays until the request's prefill has read it. A chunk's KV there was
  computed alone at positions ``0 ..`` (registered by the front end).
* **Fill and shrink** (:meth:`ChunkStore.prepare_extend`, from the attention backend
  before an extend forward): for each extend range ``[a, b)`` of a SpecCache request,
  the rows of found, unselected chunk tokens are written into the request's own slots,
  for every layer: values as they are, keys re-rotated from the chunk's local positions
  to its absolute ones (:mod:`.rope`). The forward batch then keeps only the other tokens
  (selected chunk tokens, tokens outside chunks, chunk tokens the tree did not have, and
  the range's last token, whose logits the scheduler reads), at their true positions;
  the attention backend lets each attend over the request's whole row causally by
  position. Their K/V overwrite the reused rows layer by layer, as the forward writes
  them.
* **In-prefill selection** (:meth:`ChunkStore.probe_ranges`, :meth:`fill_probe_layer`,
  :meth:`select_from_probe`): a selector that needs the target's own first layer
  (``cacheblend``) picks the recomputed tokens from a first pass the attention backend
  runs over the batch, before the fill and shrink.

Counters (``speccache`` in ``/server_info``): ``chunks_lost`` (chunks not wholly on the
device when the prefill looked them up, although the front end had just fetched them:
evicted in between; their missing rows are recomputed), ``tokens_reused``,
``tokens_recomputed`` (the tokens the target computed in SpecCache prefills) and
``load_s`` (the fill). Where each chunk came from (device, host, storage, computed) is
counted by the front end's fetch and travels in the plan.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from sgl_kernel_ext import copy_rows
from torch import Tensor

from sglang_vc import stats

from . import rope
from .fetch import ChunkSource
from .names import GROUP, META_INFO_KEY, PLAN_KEY
from .selectors import Chunks, Need, SelectionInput, get_selector

# The layer whose K/V an in-prefill selector (cacheblend) compares: layer-0 K/V depend on
# the token and its position alone, so layer 1's are the first that can deviate.
PROBE_LAYER = 1

logger = logging.getLogger(__name__)


@dataclass
class ChunkHit:
    start: int  # the chunk's first position in the prompt
    length: int  # its tokens
    matched: int  # tokens the tree had (a prefix of the chunk)
    lock: Any = None  # the tree lock on its node (None once released, or when nothing matched)
    indices: Optional[Tensor] = None  # [matched] device slots of its KV


@dataclass
class PrefillCounts:
    """What one SpecCache prefill did (its response's meta_info and the counters)."""

    chunks: int = 0
    chunk_hits_device: int = 0  # fetched from the device, or known and found whole there
    chunks_lost: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    load_s: float = 0.0
    probe_s: float = 0.0  # an in-prefill selector's first pass (cacheblend)


@dataclass
class ServerPlan:
    rid: str
    num_tokens: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    selected: Tensor  # [num_tokens] bool: chunk tokens chosen for recompute
    selector: str
    ratio: float
    times: dict  # the front end's, by part
    sources: list[ChunkSource]  # per chunk, where the front end's fetch found it
    req: Any = None  # SGLang's Req, whose meta_info gets the report
    hits: Optional[list[ChunkHit]] = None  # None until looked up
    filled_to: int = 0  # prompt rows prepared so far
    lost: list[int] = field(default_factory=list)  # chunks not (wholly) on the device at lookup
    counts: PrefillCounts = field(default_factory=PrefillCounts)
    return_selection: bool = False  # the request asked for the selected positions

    def report(self) -> dict:
        out = {"selector": self.selector, "ratio": self.ratio,
               **{f"chunk_hits_{t.value}": self.sources.count(t) for t in (ChunkSource.HOST, ChunkSource.STORAGE)},
               "chunk_misses": self.sources.count(ChunkSource.COMPUTED), "lost_chunks": list(self.lost),
               **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self.counts).items()},
               "front_end": self.times}
        if self.return_selection:  # asked for: one copy at the end of the request's prefill
            out["selected_positions"] = self.selected.nonzero().flatten().tolist()
        return out

    @property
    def selects_in_prefill(self) -> bool:
        """Whether the target's own first layer picks the recomputed tokens (cacheblend)."""
        return get_selector(self.selector).needs is Need.FIRST_LAYER_DEVIATION

    def publish(self) -> None:
        """Put the report in the request's ``meta_info`` (SGLang's ``customized_info``)."""
        if self.req is not None:
            if self.req.customized_info is None:
                self.req.customized_info = {}
            self.req.customized_info[META_INFO_KEY] = [self.report()]


def parse_plan(rid: str, custom_params: Any, num_tokens: int) -> Optional[ServerPlan]:
    """The plan the front end attached (``custom_params[PLAN_KEY]``), or None."""
    raw = custom_params.get(PLAN_KEY) if isinstance(custom_params, dict) else None
    if raw is None:
        return None
    starts, ends = tuple(int(s) for s in raw["starts"]), tuple(int(e) for e in raw["ends"])
    selected = torch.zeros(num_tokens, dtype=torch.bool)
    recompute = torch.tensor([int(p) for p in raw["recompute"]], dtype=torch.int64)
    if (len(starts) != len(ends) or (ends and ends[-1] > num_tokens)
            or (recompute.numel() and int(recompute.max()) >= num_tokens)):
        raise ValueError(f"SpecCache plan of {rid} does not fit its {num_tokens} prompt tokens")
    selected[recompute] = True
    return ServerPlan(rid, num_tokens, starts, ends, selected, str(raw.get("selector")), float(raw.get("ratio", 0.0)),
                      dict(raw.get("times") or {}), [ChunkSource(x) for x in raw.get("sources") or ()],
                      return_selection=bool(raw.get("return_selection", False)))


@dataclass
class ProbeRange:
    """An extend range ``[a, b)`` of a request whose tokens an in-prefill selector picks."""

    index: int  # the request's index in the batch
    plan: ServerPlan
    a: int
    b: int
    offset: int  # the range's first token in the batch's tokens


@dataclass
class ExtendPlan:
    """What :meth:`ChunkStore.prepare_extend` changed in one forward batch."""

    q_positions: dict[int, Tensor]  # batch index -> positions of its computed tokens


class ChunkStore:
    """Per scheduler process; the radix cache sets ``tree`` (match, lock, unlock)."""

    def __init__(self):
        self.plans: dict[str, ServerPlan] = {}
        self.tree = None

    # ------------------------------------------------------------------ tree side

    def plan_for(self, req) -> Optional[ServerPlan]:
        plan = self.plans.get(req.rid)
        if plan is None:
            custom = getattr(req.sampling_params, "custom_params", None)
            try:
                plan = parse_plan(req.rid, custom, len(req.origin_input_ids))
            except (KeyError, TypeError, ValueError) as exc:  # the front end builds it: a bug, not input
                logger.error("request %s: %s; served by full prefill", req.rid, exc)
                plan = None
            if plan is not None:
                plan.req = req
                self.plans[req.rid] = plan
        return plan

    def look_up(self, plan: ServerPlan, ids, match: Callable, lock: Callable) -> None:
        """Find and lock each chunk's KV on the device (``match(token_ids) -> (n, node,
        slots)``, ``lock(node) -> lock``)."""
        plan.hits = []
        for s, e in zip(plan.starts, plan.ends):
            n, node, slots = match(array.array("q", [int(t) for t in ids[s:e]]))
            hit = ChunkHit(s, e - s, n)
            if n > 0:
                hit.lock, hit.indices = lock(node), slots.to(torch.int64)
            plan.hits.append(hit)
        plan.lost = [i for i, h in enumerate(plan.hits) if h.matched < h.length]
        plan.counts.chunks, plan.counts.chunks_lost = len(plan.hits), len(plan.lost)
        # a chunk not fetched (KNOWN) is a device hit unless the lookup lost it
        plan.counts.chunk_hits_device = sum(
            1 for i, src in enumerate(plan.sources)
            if src is ChunkSource.DEVICE or src is ChunkSource.KNOWN and i not in plan.lost)

    def unlock(self, plan: ServerPlan, unlock: Callable) -> None:
        for hit in plan.hits or ():
            if hit.lock is not None:
                unlock(hit.lock)
                hit.lock = None

    def forget(self, rid: str, unlock: Callable) -> Optional[ServerPlan]:
        plan = self.plans.pop(rid, None)
        if plan is not None:
            self.unlock(plan, unlock)
        return plan

    # ------------------------------------------------------------------ forward side

    def probe_ranges(self, fb) -> list[ProbeRange]:
        """This extend's ranges whose recomputed tokens are chosen in the prefill."""
        out, lo = [], 0
        for i, (rid, a, n) in enumerate(zip(fb.rids or [], fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            plan = self.plans.get(rid)
            if plan is not None and plan.hits is not None and a < plan.num_tokens and plan.selects_in_prefill:
                out.append(ProbeRange(i, plan, a, a + n, lo))
            lo += n
        return out

    def fill_probe_layer(self, fb, ranges: list[ProbeRange], k_buffer, v_buffer, req_to_token: Tensor,
                         rotary) -> None:
        """Put every found chunk row of the ranges in place at :data:`PROBE_LAYER` (the
        reused K/V the first pass compares against)."""
        pool_idx = fb.req_pool_indices.tolist()
        for r in ranges:
            self._fill(r.plan, r.a, r.b, req_to_token[pool_idx[r.index]], k_buffer, v_buffer, [PROBE_LAYER], rotary)

    def select_from_probe(self, fb, ranges: list[ProbeRange], k_new: Tensor, v_new: Tensor, k_reused: Tensor,
                          v_reused: Tensor, req_to_token: Tensor, seconds: float) -> None:
        """CacheBlend's choice from the first pass: each token's deviation is the L2
        distance between the K/V the recomputed first layer feeds :data:`PROBE_LAYER`
        (``k_new``/``v_new``, the batch's tokens) and the reused K/V there; the selector
        takes the chunk tokens of the range that deviate most (its budget, ``ceil(ratio x
        chunk tokens)``, counted per extend range when chunked prefill splits a prompt)."""
        pool_idx = fb.req_pool_indices.tolist()
        for r in ranges:
            n, plan = r.b - r.a, r.plan
            slots = req_to_token[pool_idx[r.index], r.a:r.b].to(torch.int64)
            dk = (k_new[r.offset:r.offset + n].reshape(n, -1).float() - k_reused[slots].reshape(n, -1).float())
            dv = (v_new[r.offset:r.offset + n].reshape(n, -1).float() - v_reused[slots].reshape(n, -1).float())
            deviation = torch.full((plan.num_tokens,), float("-inf"))
            deviation[r.a:r.b] = (dk.pow(2).sum(1) + dv.pow(2).sum(1)).sqrt().cpu()
            found = torch.zeros(plan.num_tokens, dtype=torch.bool)
            for hit in plan.hits:
                found[hit.start:hit.start + hit.matched] = True
            deviation[~found] = float("-inf")  # a lost chunk's tokens are recomputed anyway
            spans = [(max(s, r.a), min(e, r.b)) for s, e in zip(plan.starts, plan.ends) if max(s, r.a) < min(e, r.b)]
            chunks = Chunks(tuple(s for s, _ in spans), tuple(e for _, e in spans), plan.num_tokens)
            mask = get_selector(plan.selector).select(SelectionInput(chunks, first_layer_deviation=deviation),
                                                     plan.ratio)
            plan.selected[r.a:r.b] = mask[r.a:r.b]
            plan.counts.probe_s += seconds / len(ranges)

    def prepare_extend(self, fb, k_buffer: Callable[[int], Tensor], v_buffer: Callable[[int], Tensor],
                       num_layers: int, req_to_token: Tensor, rotary: tuple, unlock: Callable) -> Optional[ExtendPlan]:
        """Fill the reused rows of this extend's SpecCache requests and drop them from
        ``fb`` (see the module docstring); None when the batch has none."""
        rids = fb.rids or []
        if not any(rid in self.plans for rid in rids):
            return None
        prefix, ext = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        pool_idx = fb.req_pool_indices.tolist()
        keep: list[Tensor] = []
        q_positions: dict[int, Tensor] = {}
        new_ext: list[int] = []
        lo = 0
        for i, rid in enumerate(rids):
            a, n = prefix[i], ext[i]
            plan = self.plans.get(rid)
            if plan is None or plan.hits is None or a >= plan.num_tokens:
                keep.append(torch.arange(lo, lo + n))
                new_ext.append(n)
                lo += n
                continue
            t = time.perf_counter()
            reuse = self._fill(plan, a, a + n, req_to_token[pool_idx[i]], k_buffer, v_buffer, range(num_layers),
                               rotary)
            reuse[-1] = False  # the range's last token is computed: its logits are read
            comp = (~reuse).nonzero().flatten()
            keep.append(comp + lo)
            q_positions[i] = comp + a
            new_ext.append(int(comp.numel()))
            lo += n
            plan.counts.tokens_reused += int(reuse.sum())
            plan.counts.tokens_recomputed += int(comp.numel())
            plan.counts.load_s += time.perf_counter() - t
            plan.filled_to = a + n
            if plan.filled_to >= plan.num_tokens:  # every chunk row is in the request's own slots now
                self.unlock(plan, unlock)
                plan.publish()
                stats.add(GROUP, prefills=1, **asdict(plan.counts))
        idx = torch.cat(keep).to(fb.input_ids.device)
        fb.input_ids = fb.input_ids[idx]
        fb.positions = fb.positions[idx]
        fb.out_cache_loc = fb.out_cache_loc[idx]
        fb.extend_seq_lens_cpu = new_ext
        fb.extend_seq_lens = torch.tensor(new_ext, dtype=fb.extend_seq_lens.dtype, device=fb.extend_seq_lens.device)
        starts = [0]
        for m in new_ext[:-1]:
            starts.append(starts[-1] + m)
        fb.extend_start_loc = torch.tensor(starts, dtype=fb.extend_start_loc.dtype, device=fb.extend_start_loc.device)
        fb.extend_num_tokens = sum(new_ext)
        if getattr(fb, "num_token_non_padded", None) is not None:
            fb.num_token_non_padded = torch.tensor(sum(new_ext), dtype=fb.num_token_non_padded.dtype,
                                                   device=fb.num_token_non_padded.device)
        if getattr(fb, "num_token_non_padded_cpu", None) is not None:
            fb.num_token_non_padded_cpu = sum(new_ext)
        return ExtendPlan(q_positions)

    @staticmethod
    def _fill(plan: ServerPlan, a: int, b: int, row: Tensor, k_buffer, v_buffer, layers: Sequence[int],
              rotary) -> Tensor:
        """Write the reused rows of ``[a, b)`` (found, unselected chunk tokens) into the
        request's slots, for ``layers``; returns the ``[b - a]`` mask of the rows reused."""
        reuse = torch.zeros(b - a, dtype=torch.bool)
        for hit in plan.hits:
            lo, hi = max(a, hit.start), min(b, hit.start + hit.matched)
            if lo >= hi:
                continue
            local = torch.arange(lo - hit.start, hi - hit.start)
            keep = ~plan.selected[lo:hi]
            if not bool(keep.any()):
                continue
            local = local[keep]
            dst = row[lo:hi][keep.to(row.device)].to(torch.int64)
            src = hit.indices[local.to(hit.indices.device)]
            every = torch.arange(dst.numel(), device=dst.device)
            for layer in layers:
                kb, vb = k_buffer(layer), v_buffer(layer)
                copy_rows(kb, dst, rope.shift(kb[src], hit.start, *rotary).contiguous(), every)
                copy_rows(vb, dst, vb, src)
            reuse[lo - a: hi - a] = keep
        return reuse
