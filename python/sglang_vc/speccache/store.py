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

Counters (``speccache`` in ``/server_info``): ``chunk_hits_device`` / ``chunk_misses``
(partly found chunks count as hits; their missing tail is recomputed), ``tokens_reused``,
``tokens_recomputed`` (the tokens the target computed in SpecCache prefills) and
``load_s`` (the fill).
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from sglang_vc import stats

from . import rope
from .names import GROUP, PLAN_KEY

logger = logging.getLogger(__name__)


@dataclass
class ChunkHit:
    start: int  # the chunk's first position in the prompt
    length: int  # its tokens
    matched: int  # tokens the tree had (a prefix of the chunk)
    node: Any = None  # the locked tree node (None once released, or when nothing matched)
    indices: Optional[Tensor] = None  # [matched] device slots of its KV


@dataclass
class PrefillCounts:
    """What one SpecCache prefill did (its response's meta_info and the counters)."""

    chunks: int = 0
    chunk_hits_device: int = 0
    chunk_misses: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    load_s: float = 0.0


@dataclass
class ServerPlan:
    rid: str
    num_tokens: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    selected: Tensor  # [num_tokens] bool: chunk tokens chosen for recompute
    selector: str
    ratio: float
    times: dict
    hits: Optional[list[ChunkHit]] = None  # None until looked up
    filled_to: int = 0  # prompt rows prepared so far
    incomplete: list[int] = field(default_factory=list)  # chunks not (wholly) in the tree: re-register
    counts: PrefillCounts = field(default_factory=PrefillCounts)

    def report(self) -> dict:
        return {"selector": self.selector, "ratio": self.ratio, "chunks": len(self.starts),
                "incomplete_chunks": list(self.incomplete),
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self.counts).items()},
                "front_end": self.times}


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
                      dict(raw.get("times") or {}))


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
                self.plans[req.rid] = plan
        return plan

    def look_up(self, plan: ServerPlan, ids, match: Callable, lock: Callable, path_indices: Callable) -> None:
        """Find and lock each chunk's KV in the tree (``match(token_ids) -> (n, node)``)."""
        plan.hits = []
        for s, e in zip(plan.starts, plan.ends):
            n, node = match(array.array("q", [int(t) for t in ids[s:e]]))
            hit = ChunkHit(s, e - s, n)
            if n > 0:
                lock(node)
                hit.node, hit.indices = node, path_indices(node)[:n].to(torch.int64)
            plan.hits.append(hit)
        found = sum(1 for h in plan.hits if h.matched)
        plan.incomplete = [i for i, h in enumerate(plan.hits) if h.matched < h.length]
        c = plan.counts
        c.chunks, c.chunk_hits_device, c.chunk_misses = len(plan.hits), found, len(plan.hits) - found

    def unlock(self, plan: ServerPlan, unlock: Callable) -> None:
        for hit in plan.hits or ():
            if hit.node is not None:
                unlock(hit.node)
                hit.node = None

    def forget(self, rid: str, unlock: Callable) -> Optional[ServerPlan]:
        plan = self.plans.pop(rid, None)
        if plan is not None:
            self.unlock(plan, unlock)
        return plan

    # ------------------------------------------------------------------ forward side

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
            reuse = self._fill(plan, a, a + n, req_to_token[pool_idx[i]], k_buffer, v_buffer, num_layers, rotary)
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
    def _fill(plan: ServerPlan, a: int, b: int, row: Tensor, k_buffer, v_buffer, num_layers: int,
              rotary) -> Tensor:
        """Write the reused rows of ``[a, b)`` into the request's slots; returns the
        ``[b - a]`` mask of the rows reused."""
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
            for layer in range(num_layers):
                kb, vb = k_buffer(layer), v_buffer(layer)
                kb[dst] = rope.shift(kb[src], hit.start, *rotary).to(kb.dtype)
                vb[dst] = vb[src]
            reuse[lo - a: hi - a] = keep
        return reuse
