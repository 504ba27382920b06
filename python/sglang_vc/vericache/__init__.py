"""VeriCache core, independent of SGLang ("VeriCache: Turning Lossy KV Cache into Lossless LLM Inference", Yao et al.).

* ``rings``, ``admit``, ``scheduler``: the runtime of §5 (BW/HBM rings, Algorithm 1
  ADMIT, the per-iteration execution loop) as :class:`ReloadPlanner`;
* ``sampling``: verification rules (greedy, rejection sampling), §4.1;
* ``perf_model``: the throughput model of appendix B.1;
* ``metrics``: live counters.
"""

from sglang_vc.vericache.admit import AdmitState, Placement, admit
from sglang_vc.vericache.metrics import VeriCacheMetrics
from sglang_vc.vericache.rings import BwRing, HbmRing, Ring
from sglang_vc.vericache.reload_planner import Admission, ReloadPlanner

__all__ = [
    "Admission",
    "BwRing",
    "HbmRing",
    "AdmitState",
    "Placement",
    "ReloadPlanner",
    "Ring",
    "VeriCacheMetrics",
    "admit",
]
