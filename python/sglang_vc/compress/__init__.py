"""KV-cache compressor library: the uniform interface of VeriCache section 6.

Per layer and per request, on ``[num_tokens, num_kv_heads, head_dim]`` K/V (SGLang's MHA
pool layout)::

    comp = get_compressor("snapkv")
    ckv = comp.compress(layer_idx, k, v, 0.25, queries=last_w_queries)
    k_kept, v_kept, positions = comp.decompress(ckv)

See ``base.py`` for the contracts.
"""

from .base import (
    CompressedKV,
    Compressor,
    DroppedKV,
    QuantizedKV,
    check_bits,
    check_ratio,
    num_kept,
)
from .bitpack import pack_bits, packed_size, unpack_bits, unpack_float
from .h2o import H2O
from .keydiff import KeyDiff
from .kivi import KIVI, kivi_split
from .kivi1 import KIVI1
from .knorm import KNorm
from .kvzip import KVzip
from .registry import get_compressor, list_compressors, register_compressor, standalone_compressors
from .scorer import ScorerCompressor, grouped_attention
from .snapkv import SnapKV
from .specache_copy import SpeCacheCopy
from .streamingllm import StreamingLLM

__all__ = [
    "CompressedKV", "Compressor", "DroppedKV", "QuantizedKV", "ScorerCompressor",
    "StreamingLLM", "KNorm", "SnapKV", "KeyDiff", "H2O", "KVzip", "KIVI", "KIVI1",
    "SpeCacheCopy",
    "get_compressor", "list_compressors", "register_compressor", "standalone_compressors",
    "num_kept", "check_ratio", "check_bits", "kivi_split", "grouped_attention",
    "pack_bits", "unpack_bits", "unpack_float", "packed_size",
]
