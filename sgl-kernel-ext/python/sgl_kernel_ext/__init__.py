"""sgl-kernel-ext: the GPU kernels of sglang-vc's compressed-KV paths, in Triton, each
module one kernel with its torch reference beside it. Each public function picks Triton
on CUDA tensors and the torch reference elsewhere (:mod:`.dispatch`).

* :func:`build_kv_indices` -- paged index lists of live rows, built on the device;
* :func:`paged_attention` -- decode/extend attention over paged rows, causal by position;
* :func:`kivi_attention` -- KIVI 2/1-bit dequantization fused with attention;
* :func:`payload_scores`, :func:`select_topk` -- SpeCache's top-k over the low-bit keys;
* :func:`kivi_attention_batch`, :func:`payload_scores_batch` -- the same over many
  requests' payloads in one launch (a table of their addresses, :class:`PayloadBatch`);
* :func:`fetch_rows`, :func:`rows_attention` -- SpeCache's top-k rows of a batch, read
  from the pool or pinned host memory, and attended;
* :func:`merge_state` -- two partial attentions into one;
* :func:`copy_rows`, :func:`scatter_head_rows` -- SpecCache's gather/scatter and
  VeriCache's reload scatter; :func:`gather_head_rows` -- SpeCache's top-k rows read
  from pinned host memory by the GPU;
* :func:`position_mask` -- the selective prefill's mask;
* :func:`bucket` -- launch shapes rounded up to four buckets per doubling, so that one
  CUDA graph serves every batch of a bucket.
"""

from .copy_rows import copy_rows, gather_head_rows, scatter_head_rows
from .dispatch import Backend, backend_for, bucket, launches
from .kivi_attention import Payload, kivi_attention
from .kv_indices import KVIndices, build_kv_indices
from .merge_state import merge_state
from .payload_batch import PayloadBatch, kivi_attention_batch, payload_batch, payload_scores_batch
from .paged_attention import paged_attention
from .position_mask import position_mask
from .specache_rows import Fetched, fetch_rows, rows_attention
from .specache_topk import payload_scores, select_topk

__all__ = [
    "Backend", "Fetched", "KVIndices", "Payload", "PayloadBatch", "backend_for", "bucket", "build_kv_indices",
    "copy_rows", "fetch_rows", "gather_head_rows", "kivi_attention", "kivi_attention_batch", "launches",
    "merge_state", "paged_attention", "payload_batch", "payload_scores", "payload_scores_batch", "position_mask",
    "rows_attention", "scatter_head_rows", "select_topk",
]
