"""EvicPress: joint KV-cache compression and eviction across tiers ("EvicPress: Joint KV-Cache Compression and Eviction for Efficient LLM Serving", Feng, Liu et al.).

SGLang-independent core:

* :mod:`.config`    -- compression configs, tiers, placements, candidate set (section 4.2)
* :mod:`.utility`   -- ``Util = (alpha * quality - TTFT) * frequency`` (section 4.2)
* :mod:`.placement` -- greedy multi-choice knapsack when a tier is full (section 4.4, A)
* :mod:`.profiler`  -- quality profiling and the re-profiling trigger (section 4.3)
* :mod:`.quality`   -- MiniLM-L6-v2 / task-metric answer scorers (section 6.1; lazy)
* :mod:`.disk_tier` -- checksummed, atomic on-disk KV store with a byte budget

Runtime (``--radix-cache-backend evicpress`` with SGLang's hierarchical-cache flags):

* :mod:`.codec`     -- a context's KV as one blob per config (full, KIVI 2/4-bit, 1-bit,
  token dropping: the kept rows of each layer and head)
* :mod:`.host_tier` -- host tier: blobs in the slots of SGLang's HiCache host pool
* :mod:`.policy`    -- the utility knapsack and the LRU / fixed-compression baselines
* :mod:`.context`   -- the data model: settings, a context, a fetched copy, namespaces
* :mod:`.manager`   -- contexts, placements, the real moves, counters; with
  :mod:`.storage_copies` (copies on the shared storage tier) and :mod:`.profile_state`
  (what needs profiling, observations, drift)
* :mod:`.radix`     -- the SGLang radix cache: loads stored contexts into device slots
  on a match, stores computed ones, routes the profiler's namespaces; a token-dropped
  context is served from its kept rows as a compressed prefix by the ``vc_torch``
  attention backend (:mod:`sglang_vc.kvruntime`), which EvicPress then selects
* :mod:`.control`   -- the scheduler's control channel (JSON over localhost HTTP)
* :mod:`.service`   -- ``/evicpress/*`` routes, flag checks and the idle-time profiler
* :mod:`.flags`     -- ``--evicpress-*`` flags

Quick start::

    python -m sglang_vc.launch_server --dtype float32 \
        --enable-hierarchical-cache --hicache-ratio 2 --hicache-io-backend direct \
        --hicache-mem-layout layer_first --radix-cache-backend evicpress \
        --evicpress-disk-dir /tmp/evicpress --evicpress-disk-size-gb 4
    curl -H 'Content-Type: application/json' localhost:30000/evicpress/contexts \
        -d '{"id": "doc1", "text": "...", "queries": ["What is it about?"]}'
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
from .profiler import QualityTracker, QueryLog, monotone_profile, profile_quality, reprofile
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
    "monotone_profile",
    "profile_quality",
    "reprofile",
]
