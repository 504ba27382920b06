"""sgl-kernel-ext: the GPU kernels of sglang-vc's compressed-KV paths, in Triton, each
module one kernel with its torch reference beside it. Each public function picks Triton
on CUDA tensors and the torch reference elsewhere (:mod:`.dispatch`).

* :func:`build_kv_indices` -- paged index lists of live rows, built on the device;
* :func:`paged_attention` -- decode/extend attention over paged rows, causal by position;
* :func:`kivi_attention` -- KIVI 2/1-bit dequantization fused with attention;
* :func:`payload_scores`, :func:`select_topk` -- SpeCache's top-k over the low-bit keys;
* :func:`merge_state` -- two partial attentions into one (torch);
* :func:`copy_rows`, :func:`scatter_head_rows` -- SpecCache's gather/scatter and
  VeriCache's reload scatter; :func:`gather_head_rows` -- SpeCache's top-k rows read
  from pinned host memory by the GPU;
* :func:`position_mask` -- the selective prefill's mask.
"""

from .copy_rows import copy_rows, gather_head_rows, scatter_head_rows
from .dispatch import Backend, backend_for, launches
from .kivi_attention import Payload, kivi_attention
from .kv_indices import KVIndices, build_kv_indices
from .merge_state import merge_state
from .paged_attention import paged_attention
from .position_mask import position_mask
from .specache_topk import payload_scores, select_topk

__all__ = [
    "Backend", "KVIndices", "Payload", "backend_for", "build_kv_indices", "copy_rows", "gather_head_rows",
    "kivi_attention",
    "launches", "merge_state", "paged_attention", "payload_scores", "position_mask", "scatter_head_rows",
    "select_topk",
]
