"""EvicPress: joint KV-cache compression and eviction across tiers (papers/evicpress.md).

SGLang-independent core:

* :mod:`.config`    -- compression configs, tiers, placements, candidate set (section 4.2)
* :mod:`.utility`   -- ``Util = (alpha * quality - TTFT) * frequency`` (section 4.2)
* :mod:`.placement` -- greedy multi-choice knapsack when a tier is full (section 4.4, A)
* :mod:`.profiler`  -- quality profiling and the re-profiling trigger (section 4.3)
* :mod:`.quality`   -- MiniLM-L6-v2 / task-metric answer scorers (section 6.1; lazy)
* :mod:`.disk_tier` -- checksummed, atomic on-disk KV store with a byte budget

The radix-cache backend and the tier controller build on these.
"""

from .config import (
    DROPPED,
    FULL,
    CompressionConfig,
    Placement,
    Tier,
    TierSpec,
    candidate_configs,
    stored_bytes,
)
from .placement import (
    Move,
    admit,
    apply_moves,
    execution_order,
    greedy_steps,
    plan_insert,
    rebalance,
    total_utility,
)
from .profiler import QualityTracker, QueryLog, profile_quality, reprofile
from .utility import TTFT, ContextInfo, UtilityModel

__all__ = [
    "DROPPED",
    "FULL",
    "CompressionConfig",
    "Placement",
    "Tier",
    "TierSpec",
    "candidate_configs",
    "stored_bytes",
    "ContextInfo",
    "TTFT",
    "UtilityModel",
    "Move",
    "admit",
    "apply_moves",
    "execution_order",
    "greedy_steps",
    "plan_insert",
    "rebalance",
    "total_utility",
    "QualityTracker",
    "QueryLog",
    "profile_quality",
    "reprofile",
]
