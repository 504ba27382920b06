"""Eviction-compression configuration selection (paper section 4.4, Algorithm 1 in A).

When a storage tier S is over capacity, every context on S may be updated "either by
more aggressive compression to fit in S, or by evicting it to a lower-tier storage";
options that stay on S without saving space are filtered out. Choosing one option per
context to maximise the total utility on S is a multi-choice knapsack (NP-hard), which
the paper solves greedily:

    while S_T > C:                                          (Algorithm 1, lines 5-14)
        j, r, o <- KV cache in T with the least utility drop operation
        apply o (compress: S_T -= T_j * (r_j - r); evict: S_T -= T_j * r_j)

"Then, the same update process is applied recursively if the lower-tier storage is
also full." We follow that exactly:

* the greedy key is the **absolute** utility drop ``U(current) - U(option)`` -- the paper
  does not normalise by bytes freed. ``rank="drop_per_byte"`` is offered as a
  non-paper variant and is never the default;
* tiers are relieved fast -> slow; demoted contexts join the lower tier before it is
  examined, so the cascade needs a single pass (every move goes down or stays);
* an option is (config, tier) with the tier S itself (strictly fewer bytes), any
  lower tier (the paper's "# lower-tier storage devices"), or DROPPED -- our slowest
  tier is bounded, so eviction from it means "recompute on demand";
* compression is one-way: by default a context can only move to a config whose stored
  size is not larger than its current one (dropped tokens / bits cannot be restored
  without recomputing). ``can_transform`` overrides this (e.g. when the controller
  keeps the full copy on the host);
* ties break deterministically: larger bytes freed, then context id, then destination
  (faster tier first, then config order). The result does not depend on input order.

Contexts are independent in the utility, so each context's best option is kept in a
heap and recomputed only for the context that just changed: O((n + steps) k log n)
for n contexts with k options each.

Not in the paper's algorithm and therefore not done here: promoting contexts from a
lower tier into free space (the introduction mentions it as a possibility only).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Hashable, Iterable, Mapping, NamedTuple, Optional, Sequence

from .config import DROPPED, FULL, CompressionConfig, Placement, Tier, TierSpec, ordered_tiers
from .utility import ContextInfo

__all__ = [
    "Move",
    "size_monotone",
    "admit",
    "greedy_steps",
    "net_moves",
    "execution_order",
    "rebalance",
    "plan_insert",
    "apply_moves",
    "tier_usage",
    "total_utility",
]

UtilityFn = Callable[[ContextInfo, Placement], float]
TransformFn = Callable[[CompressionConfig, CompressionConfig], bool]


class Move(NamedTuple):
    """Move context ``ctx_id`` from placement ``src`` to ``dst``."""

    ctx_id: Hashable
    src: Placement
    dst: Placement

    @property
    def kind(self) -> str:
        """``insert``, ``drop``, ``compress``, ``demote`` or ``compress+demote``."""
        if self.src.dropped:
            return "insert"
        if self.dst.dropped:
            return "drop"
        recompress = self.src.config != self.dst.config
        if self.src.tier == self.dst.tier:
            return "compress"
        return "compress+demote" if recompress else "demote"

    def __str__(self) -> str:
        return f"{self.ctx_id}: {self.src} -> {self.dst}"


def size_monotone(src: CompressionConfig, dst: CompressionConfig) -> bool:
    """Default ``can_transform``: lossy compression never grows the stored form, and a
    token-dropped form only shrinks within its own method (``reachable_from``)."""
    return dst.reachable_from(src)


def admit(
    ctx: ContextInfo,
    tiers: Iterable[Tier],
    tier: Optional[Tier] = None,
    config: Optional[CompressionConfig] = None,
) -> Placement:
    """Algorithm 1 line 1: a new context enters ``tier`` (default: the fastest) with
    ``r_i = argmax Q_i(r)``; among equal qualities the smallest stored form wins.
    ``config`` forces the config instead (a context re-entering a tier in the form it
    is already stored in)."""
    order = ordered_tiers(tiers)
    target = order[0] if tier is None else tier
    if target not in order:
        raise ValueError(f"tier {target!r} is not configured")
    if config is not None:
        return Placement(config, target)
    # a compressed form that takes no less room on the target tier is not admitted there
    full = ctx.bytes_at(Placement(FULL, target))
    options = [c for c in ctx.candidates()
               if c.is_full or ctx.bytes_at(Placement(c, target)) < full]
    best = min(options, key=lambda c: (-ctx.quality_of(c), c.size_fraction, c.sort_key()))
    return Placement(best, target)


def _id_key(ctx_id: Hashable) -> tuple:
    return (type(ctx_id).__name__, ctx_id)


def _options(
    ctx: ContextInfo, cur: Placement, lower: Sequence[Tier], can_transform: TransformFn,
    in_place: bool = True,
) -> list[Placement]:
    """Placements reachable from ``cur`` that free space on ``cur.tier`` (section 4.4);
    ``in_place`` False: none that stays on ``cur.tier``."""
    cur_bytes = ctx.bytes_at(cur)
    out = []
    for cfg in ctx.candidates():
        if not can_transform(cur.config, cfg):
            continue
        stay = Placement(cfg, cur.tier)
        if in_place and ctx.bytes_at(stay) < cur_bytes:
            out.append(stay)
        out.extend(Placement(cfg, t) for t in lower)
    out.append(DROPPED)
    return out


def _best_option(ctx, cur, lower, utility, rank, can_transform, in_place=True) -> tuple:
    """Heap entry for ``ctx``'s least-drop option: (score, -freed, id, dst key, dst).

    The id key is unique per context and each context has one entry, so comparisons
    never reach the (unordered) Placement at the end.
    """
    u_cur = utility(ctx, cur)
    cur_bytes = ctx.bytes_at(cur)
    best = None
    for dst in _options(ctx, cur, lower, can_transform, in_place):
        drop = u_cur - utility(ctx, dst)
        freed = cur_bytes - (ctx.bytes_at(dst) if dst.tier == cur.tier else 0)
        if rank == "drop":
            score = drop
        elif freed > 0:
            score = drop / freed
        else:  # a zero-byte context: only a utility gain makes moving it worthwhile
            score = 0.0 if drop == 0 else math.copysign(math.inf, drop)
        key = (score, -freed, _id_key(ctx.ctx_id), dst.sort_key(), dst)
        if best is None or key[:4] < best[:4]:
            best = key
    return best


def _index(contexts: Iterable[ContextInfo], placements: Mapping[Hashable, Placement], tiers):
    ctxs: dict[Hashable, ContextInfo] = {}
    for c in contexts:
        if c.ctx_id in ctxs:
            raise ValueError(f"duplicate context id {c.ctx_id!r}")
        ctxs[c.ctx_id] = c
    unknown = set(placements) - set(ctxs)
    if unknown:
        raise ValueError(f"placements for unknown contexts: {sorted(map(repr, unknown))}")
    state = {cid: placements.get(cid, DROPPED) for cid in ctxs}
    for cid, p in state.items():
        if p.tier is not None and p.tier not in tiers:
            raise ValueError(f"context {cid!r} is on unconfigured tier {p.tier!r}")
        if ctxs[cid].quality_of(p.config) is None:
            raise ValueError(f"context {cid!r} is stored as unprofiled config {p.config}")
    return ctxs, state


def greedy_steps(
    contexts: Iterable[ContextInfo],
    placements: Mapping[Hashable, Placement],
    tiers: Mapping[Tier, TierSpec],
    utility: UtilityFn,
    *,
    rank: str = "drop",
    can_transform: TransformFn = size_monotone,
) -> list[Move]:
    """Every operation the greedy applies, in order (Algorithm 1's list ``L``).

    A context may appear several times (compressed, then demoted, then demoted again
    from the lower tier). Contexts missing from ``placements`` are dropped (not stored).
    """
    if rank not in ("drop", "drop_per_byte"):
        raise ValueError(f"rank must be 'drop' (paper) or 'drop_per_byte', got {rank!r}")
    ctxs, state = _index(contexts, placements, tiers)
    order = ordered_tiers(tiers)
    steps: list[Move] = []
    for i, tier in enumerate(order):
        cap = tiers[tier].capacity_bytes
        if cap is None:
            continue
        lower = order[i + 1 :]
        on_tier = sorted((cid for cid, p in state.items() if p.tier == tier), key=_id_key)
        used = sum(ctxs[cid].bytes_at(state[cid]) for cid in on_tier)
        in_place = tiers[tier].compresses_in_place
        heap = [_best_option(ctxs[c], state[c], lower, utility, rank, can_transform, in_place)
                for c in on_tier]
        heapq.heapify(heap)
        while used > cap:
            # One entry per context on the tier; DROPPED is always an option, so the
            # heap cannot run dry while bytes remain on the tier.
            _, _, (_, cid), _, dst = heapq.heappop(heap)
            src = state[cid]
            state[cid] = dst
            steps.append(Move(cid, src, dst))
            ctx = ctxs[cid]
            used -= ctx.bytes_at(src)
            if dst.tier == tier:  # compressed in place: may be compressed or demoted again
                used += ctx.bytes_at(dst)
                heapq.heappush(heap, _best_option(ctx, dst, lower, utility, rank, can_transform, in_place))
    return steps


def net_moves(steps: Iterable[Move]) -> list[Move]:
    """Collapse a step list to one move per context (first source -> last destination),
    in order of first appearance; contexts that end where they started are omitted."""
    first: dict[Hashable, Placement] = {}
    last: dict[Hashable, Placement] = {}
    for m in steps:
        first.setdefault(m.ctx_id, m.src)
        last[m.ctx_id] = m.dst
    return [Move(cid, src, last[cid]) for cid, src in first.items() if src != last[cid]]


def rebalance(
    contexts: Iterable[ContextInfo],
    placements: Mapping[Hashable, Placement],
    tiers: Mapping[Tier, TierSpec],
    utility: UtilityFn,
    *,
    rank: str = "drop",
    can_transform: TransformFn = size_monotone,
) -> list[Move]:
    """Relieve every over-capacity tier (section 4.4); returns the net moves.

    Pure: ``placements`` is not modified. Each move is a single compress and/or demote
    (or drop) of one context; see :func:`execution_order` for the order.
    """
    steps = greedy_steps(contexts, placements, tiers, utility, rank=rank, can_transform=can_transform)
    return execution_order(net_moves(steps))


def execution_order(moves: Iterable[Move]) -> list[Move]:
    """Order net moves so that applying them one at a time never pushes a tier above
    ``max(capacity, what it held before)``: moves out of slower tiers first (they make
    room below before anything is pushed down), inserts (source: not stored) last;
    otherwise greedy order (stable sort).

    Why it is safe: when the moves out of tier S run, every move out of a slower tier
    has run, so each slower tier holds at most its final contents, which fit.
    """
    def src_rank(m: Move) -> int:
        return -1 if m.src.tier is None else int(m.src.tier)

    return sorted(moves, key=lambda m: -src_rank(m))


def plan_insert(
    new: ContextInfo,
    contexts: Iterable[ContextInfo],
    placements: Mapping[Hashable, Placement],
    tiers: Mapping[Tier, TierSpec],
    utility: UtilityFn,
    *,
    tier: Optional[Tier] = None,
    config: Optional[CompressionConfig] = None,
    rank: str = "drop",
    can_transform: TransformFn = size_monotone,
) -> list[Move]:
    """Algorithm 1 end to end: admit ``new`` at ``tier`` (default fastest) with its
    highest-quality config (or ``config``), then relieve the tiers. ``new``'s own move (an insert
    straight to its final placement; absent if it ends up not stored) comes last in
    :func:`execution_order`."""
    others = [c for c in contexts if c.ctx_id != new.ctx_id]
    start = dict(placements)
    start.pop(new.ctx_id, None)
    start[new.ctx_id] = admit(new, tiers, tier, config)
    steps = [Move(new.ctx_id, placements.get(new.ctx_id, DROPPED), start[new.ctx_id])]
    steps += greedy_steps([new, *others], start, tiers, utility, rank=rank, can_transform=can_transform)
    return execution_order(net_moves(steps))


def apply_moves(
    placements: Mapping[Hashable, Placement], moves: Iterable[Move]
) -> dict[Hashable, Placement]:
    """A new placement map with ``moves`` applied (dropped contexts are removed)."""
    out = dict(placements)
    for m in moves:
        if m.dst.dropped:
            out.pop(m.ctx_id, None)
        else:
            out[m.ctx_id] = m.dst
    return out


def tier_usage(
    contexts: Iterable[ContextInfo], placements: Mapping[Hashable, Placement]
) -> dict[Tier, int]:
    """Bytes used per tier."""
    ctxs = {c.ctx_id: c for c in contexts}
    used: dict[Tier, int] = {}
    for cid, p in placements.items():
        if p.tier is not None:
            used[p.tier] = used.get(p.tier, 0) + ctxs[cid].bytes_at(p)
    return used


def total_utility(
    contexts: Iterable[ContextInfo], placements: Mapping[Hashable, Placement], utility: UtilityFn
) -> float:
    """Sum of utilities; contexts without a placement count as dropped."""
    return sum(utility(c, placements.get(c.ctx_id, DROPPED)) for c in contexts)
