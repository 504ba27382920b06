"""VeriCache core, independent of SGLang ("VeriCache: Turning Lossy KV Cache into Lossless LLM Inference", Yao et al.).

* ``rings``, ``admit``, ``scheduler``: the runtime of §5 (BW/HBM rings, Algorithm 1
  ADMIT, the per-iteration execution loop) as :class:`ReloadScheduler`;
* ``sampling``: verification rules (greedy, rejection sampling), §4.1;
* ``perf_model``: the throughput model of appendix B.1;
* ``metrics``: live counters.
"""

from sglang_vc.vericache.admit import Mode, Placement, admit
from sglang_vc.vericache.metrics import VeriCacheMetrics
from sglang_vc.vericache.rings import BwRing, HbmRing, Ring
from sglang_vc.vericache.scheduler import Admission, ReloadScheduler

__all__ = [
    "Admission",
    "BwRing",
    "HbmRing",
    "Mode",
    "Placement",
    "ReloadScheduler",
    "Ring",
    "VeriCacheMetrics",
    "admit",
]
