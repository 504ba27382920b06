"""Placement policies of the runtime: EvicPress's utility knapsack and the baselines.

A policy sees the stored contexts (their :class:`~.utility.ContextInfo`, placement and
last access time) and returns :class:`~.placement.Move` lists; the manager applies them
to the real KV. Three policies share the same tiers and the same runtime:

* :class:`UtilityPolicy` -- EvicPress (paper section 4.4 / Algorithm 1): a context
  enters the host tier with its best config; when a tier is over capacity the greedy
  multi-choice knapsack compresses or demotes the contexts with the least utility drop,
  cascading to disk and to "dropped" (recompute on demand).
* :class:`LRUPolicy` -- the baselines: every context is stored under one config (``full``
  for the paper's "eviction only" baseline, e.g. ``kivi@4b`` for "fixed compression +
  LRU"); an over-full tier demotes its least recently used context to the next tier.

Both promote a context hit on a lower tier back to the host tier (as a new insert of the
form it is stored in): without it a context demoted while it was cold would stay on disk
however popular it becomes. (LRU promotes by definition; for EvicPress this is the
paper's "store" of KV that was just retrieved, section 5.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Hashable, Mapping, Optional, Sequence

from .config import DROPPED, FULL, CompressionConfig, Placement, Tier, TierSpec
from .placement import Move, net_moves, plan_insert, rebalance
from .utility import ContextInfo, UtilityModel

__all__ = ["Policy", "UtilityPolicy", "LRUPolicy", "order_moves"]


def order_moves(moves: Sequence[Move]) -> list[Move]:
    """Moves out of slower tiers first; moves that go up a tier (promotions) and
    inserts last. (The manager reads and removes every source before writing any
    destination, so this order only matters for readability and logs.)"""

    def rank(m: Move) -> tuple:
        src = len(Tier) if m.src.tier is None else int(m.src.tier)
        up = m.src.tier is None or (m.dst.tier is not None and m.dst.tier < m.src.tier)
        return (up, -src)

    return sorted(moves, key=rank)


class Policy(ABC):
    """Decides placements; pure (no KV is touched here)."""

    name: str

    @abstractmethod
    def plan_insert(
        self,
        new: ContextInfo,
        contexts: Sequence[ContextInfo],
        placements: Mapping[Hashable, Placement],
        last_access: Mapping[Hashable, float],
        config: Optional[CompressionConfig] = None,
    ) -> list[Move]:
        """``new`` (not stored, or stored on a lower tier) enters the host tier;
        ``config`` is the form it must enter in (None: the policy's choice)."""

    def rebalance(
        self,
        contexts: Sequence[ContextInfo],
        placements: Mapping[Hashable, Placement],
        last_access: Mapping[Hashable, float],
    ) -> list[Move]:
        """Moves after profiles changed (default: none)."""
        return []

    @abstractmethod
    def insert_config(self, ctx: ContextInfo) -> CompressionConfig:
        """The config a freshly computed context is stored in."""

    @property
    @abstractmethod
    def tiers(self) -> Mapping[Tier, TierSpec]:
        """The tiers the policy places contexts on."""

    def insert_tier(self, config: Optional[CompressionConfig] = None) -> Tier:
        """Where a context enters: the fastest tier, except that the device tier keeps no
        quantized copy (it would be held dequantized, saving nothing)."""
        order = sorted(self.tiers)
        if order[0] == Tier.DEVICE and config is not None and config.is_quantized:
            return order[1]
        return order[0]


class UtilityPolicy(Policy):
    """EvicPress: ``(alpha * quality - TTFT) * frequency`` and the greedy knapsack."""

    name = "evicpress"

    def __init__(self, model: Callable[[], UtilityModel]) -> None:
        self._model = model

    @property
    def model(self) -> UtilityModel:
        return self._model()

    @property
    def tiers(self) -> Mapping[Tier, TierSpec]:
        return self.model.tiers

    def insert_config(self, ctx: ContextInfo) -> CompressionConfig:
        from .placement import admit

        return admit(ctx, self.model.tiers).config

    def plan_insert(self, new, contexts, placements, last_access, config=None):
        model = self.model
        moves = plan_insert(
            new, contexts, placements, model.tiers, model.utility,
            tier=self.insert_tier(config), config=config,
        )
        return order_moves(moves)

    def rebalance(self, contexts, placements, last_access):
        """Relieve over-full tiers with the new profiles; and drop a lossy stored copy
        whose (re-profiled) utility is below recomputing it (it is then recomputed in
        full and stored again with a better config) -- the paper's "re-arrange KV
        caches ... after re-profiling" (section 1), restricted to what can be done
        without a full copy."""
        model = self.model
        moves = rebalance(contexts, placements, model.tiers, model.utility)
        moved = {m.ctx_id for m in moves}
        for ctx in contexts:
            p = placements.get(ctx.ctx_id, DROPPED)
            if ctx.ctx_id in moved or p.dropped or p.config.is_full:
                continue
            if model.utility(ctx, DROPPED) > model.utility(ctx, p):
                moves.append(Move(ctx.ctx_id, p, DROPPED))
        return order_moves(moves)


class LRUPolicy(Policy):
    """Multi-tier LRU with one fixed config (``full``: eviction only)."""

    def __init__(self, tiers: Mapping[Tier, TierSpec], config: CompressionConfig = FULL) -> None:
        self._tiers = dict(tiers)
        self.config = config
        self.name = "lru" if config.is_full else f"fixed:{config.label}"

    @property
    def tiers(self) -> Mapping[Tier, TierSpec]:
        return self._tiers

    def insert_config(self, ctx: ContextInfo) -> CompressionConfig:
        return self.config

    def plan_insert(self, new, contexts, placements, last_access, config=None):
        ctxs = {c.ctx_id: c for c in contexts}
        ctxs[new.ctx_id] = new
        state = dict(placements)
        start = state.get(new.ctx_id, DROPPED)
        cfg = config or self.config
        top = self.insert_tier(cfg)
        steps = [Move(new.ctx_id, start, Placement(cfg, top))]
        state[new.ctx_id] = steps[0].dst
        order = [t for t in sorted(self.tiers) if t >= top]
        for i, tier in enumerate(order):
            cap = self.tiers[tier].capacity_bytes
            if cap is None:
                continue
            on = [cid for cid, p in state.items() if p.tier == tier]
            used = sum(ctxs[cid].bytes_at(state[cid]) for cid in on)
            # least recently used first; the new context counts as just used
            on.sort(key=lambda cid: (cid == new.ctx_id, last_access.get(cid, 0.0), str(cid)))
            lower = order[i + 1] if i + 1 < len(order) else None
            for cid in on:
                if used <= cap:
                    break
                src = state[cid]
                dst = DROPPED if lower is None else Placement(src.config, lower)
                steps.append(Move(cid, src, dst))
                state[cid] = dst
                used -= ctxs[cid].bytes_at(src)
        return order_moves(net_moves(steps))
