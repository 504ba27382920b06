"""The delay model's inputs measured at start-up, where flags do not give them: host
copy bandwidth, storage read bandwidth, and decompression rate per quantization."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch

from . import codec
from .codec import FullKV
from .config import CompressionConfig
from .context import KVDims
from .disk_tier import measure_bandwidth

logger = logging.getLogger(__name__)


def storage_dir(backend) -> Optional[Path]:
    """The local directory of a file-system storage backend (ours, SGLang's ``file``)."""
    for attr in ("root", "file_path"):
        path = getattr(backend, attr, None)
        if path:
            return Path(path)
    return None


def measure_delay_inputs(ep: dict, dims: KVDims, disk_dir: Optional[Path]) -> dict:
    """Tier load bandwidths and decompression rates for the delay model, unless flags
    give them: a 64 MiB host copy, a 32 MiB write+read (page cache dropped) in the
    storage backend's directory when it has one, and decoding a 256-token context of
    this model under each quantization candidate. A remote store is not measured:
    give ``--evicpress-disk-bandwidth`` (1 GB/s is assumed)."""
    out: dict = {}
    if not ep.get("host_bandwidth"):
        src = torch.empty(64 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        out["host_bandwidth"] = 3 * src.numel() / max(time.perf_counter() - t, 1e-9)
    if not ep.get("disk_bandwidth"):
        try:
            if disk_dir is None:
                raise OSError("the storage backend has no local directory")
            out["disk_bandwidth"] = measure_bandwidth(disk_dir, 32 << 20).read_bytes_per_s
        except OSError as exc:
            logger.warning("EvicPress: storage bandwidth not measured (%s); assuming 1 GB/s "
                           "(--evicpress-disk-bandwidth sets it)", exc)
    if ep.get("decompress_bandwidth"):
        return out
    rates = {}
    n = 256
    k = torch.randn(dims.layers, n, dims.heads, dims.head_dim)
    v = torch.randn(dims.layers, n, dims.v_heads, dims.v_head_dim)
    kv = FullKV(k, v)
    for label in ep.get("candidates", ()):
        cfg = CompressionConfig.parse(label)
        if not cfg.is_quantized or cfg.method in rates:
            continue
        blob = codec.encode(kv, cfg)
        t = time.perf_counter()
        codec.decode(blob)
        rates[cfg.method] = kv.nbytes / max(time.perf_counter() - t, 1e-9)
    out["decompress_bytes_per_s"] = rates
    return out
