"""What one SpeCache decode step asks of the attention backend, per request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from .config import SpeCacheConfig
from .core import coverage_of_scores
from .host import HostKVStore, Prefetcher


class Phase(enum.Enum):
    PREDECODE = "predecode"  # algorithm 2: first step after the prefill, commits nothing
    DECODE = "decode"  # algorithm 3: output token + speculative token
    FULL = "full"  # not compressed (short prompt, host store full, opted out): plain attention


@dataclass
class ReqStep:
    rid: str
    phase: Phase
    topk: int = 0  # rows prefetched per layer and KV head (the request's, or the server's)

    @property
    def select_row(self) -> Optional[int]:
        """The query row whose attention picks the next step's rows: the speculative
        token's (row 1), or at pre-decode the first output token's (row 0)."""
        return {Phase.PREDECODE: 0, Phase.DECODE: 1}.get(self.phase)


@dataclass
class StepCounters:
    rows_prefetched: int = 0  # rows (per KV head) substituted in full precision
    bytes_prefetched: int = 0
    covered: float = 0.0  # attention mass of the output token's top-k on prefetched rows
    top_mass: float = 0.0  # attention mass of the output token's top-k

    def add(self, rows, out_scores, topk: int) -> None:
        """One layer's prefetched ``rows`` (a :class:`.core.Rows`) and the output token's
        attention over the payload per KV head ``[H, n_q]``."""
        self.rows_prefetched += rows.num_rows * out_scores.shape[0]
        self.bytes_prefetched += rows.nbytes()
        covered, total = coverage_of_scores(out_scores, rows.positions, topk)
        self.covered += covered
        self.top_mass += total

    @property
    def hit_rate(self) -> Optional[float]:
        return self.covered / self.top_mass if self.top_mass > 0 else None

    def as_stats(self) -> dict:
        return {"rows_prefetched": self.rows_prefetched, "bytes_prefetched": self.bytes_prefetched,
                "prefetch_hit_mass": self.covered, "prefetch_topk_mass": self.top_mass}


@dataclass
class StepPlan:
    """Set on the attention backend by the worker for one forward."""

    config: SpeCacheConfig
    host: HostKVStore
    prefetcher: Prefetcher
    requests: list  # per batch index: ReqStep
    counters: StepCounters = field(default_factory=StepCounters)
