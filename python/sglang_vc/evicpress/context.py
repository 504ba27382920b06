"""EvicPress's data model: its settings, a *context* (a token prefix with its queries,
access statistics, quality profile and placement), the shape of one token's KV, a copy
read back for loading, and the namespaces of EvicPress's own requests."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .codec import FullKV
from .config import DROPPED, FULL, CompressionConfig, Placement, Tier
from .probes import ProbeSource
from .profiler import ProfileMetric

__all__ = ["Settings", "KVDims", "Context", "Fetched", "common_prefix_len", "as_token_array",
           "PROFILE_NAMESPACE", "REF_NAMESPACE", "CFG_NAMESPACE", "MIN_CONTEXT_TOKENS",
           "variant_namespace", "variant_label", "ref_namespace", "profiled_context_id"]

PROFILE_NAMESPACE = "evicpress:"  # extra_key prefix of the profiler's own requests
REF_NAMESPACE = "evicpress:ref"
CFG_NAMESPACE = "evicpress:cfg:"
MIN_CONTEXT_TOKENS = 16


def variant_namespace(label: str, ctx_id: Any) -> str:
    """The profiler's namespace for answering on config ``label`` of context ``ctx_id``:
    one per context, because contexts share first tokens (an instruction header) and a
    variant's rows are compressed over the whole context -- in a shared namespace one
    context's variant would start from another's rows."""
    return f"{CFG_NAMESPACE}{label}/{ctx_id}"


def ref_namespace(ctx_id: Any) -> str:
    """The profiler's namespace for context ``ctx_id``'s full-KV reference answers: one per
    context, so that the server finds the context by its id whatever tenant it belongs to
    (the profiler's requests carry no ``cache_salt``)."""
    return f"{REF_NAMESPACE}/{ctx_id}"


def profiled_context_id(namespace: str) -> str:
    """The context id of a profiler namespace (:func:`ref_namespace`, :func:`variant_namespace`)."""
    return namespace.split("/", 1)[1] if "/" in namespace else ""


def variant_label(namespace: str) -> str:
    """The config label of a profiler namespace (``evicpress:cfg:<label>[/<context>]``)."""
    return namespace[len(CFG_NAMESPACE):].split("/", 1)[0]


@dataclass
class Settings:
    alpha: float = 1.0
    policy: str = "evicpress"  # evicpress | lru | fixed
    fixed_config: CompressionConfig = FULL
    candidates: tuple[CompressionConfig, ...] = ()  # lossy configs the profiler tries
    model_id: str = ""  # names the model's entries on the shared storage tier
    device_capacity: int = 0  # bytes of pinned context copies on the device (0: no device tier)
    host_capacity: Optional[int] = None  # bytes (None: the whole store)
    disk_capacity: int = 10 << 30
    host_bandwidth: float = 10e9  # bytes/s into the device
    disk_bandwidth: float = 1e9
    prefill_tokens_per_s: float = 1000.0
    prefill_measured: bool = True  # update prefill_tokens_per_s from observed misses
    decompress_bytes_per_s: dict = field(default_factory=dict)
    reprofile_threshold: float = 0.3  # paper section 6.3
    profile_queries: int = 4
    generate_queries: int = 4
    profile_source: ProbeSource = ProbeSource.CONTEXT
    profile_metric: ProfileMetric = ProfileMetric.ANSWER
    likelihood_scale: float = 1.0
    profile_max_new_tokens: int = 24
    observe_rate: float = 0.25
    idle_seconds: float = 1.0
    auto_context_tokens: int = 256  # 0: only registered contexts
    max_contexts: int = 4096
    throttle: bool = False  # sleep to the modelled tier bandwidth on loads
    # The attention backend serves token-dropped KV (vc_torch): without it, token-dropping
    # configs are refused (a stored one would have to be recomputed on every hit).
    serves_dropped: bool = False
    # Copies of every newly computed context written to the shared storage tier whatever
    # the policy places (the paper's remote store keeps every context): FULL for the next
    # server's exact hit, a compressed one (KIVI 4-bit by default) for servers behind a
    # slow link to draft from (VeriCache section 5.3). () writes none.
    storage_copies: tuple[CompressionConfig, ...] = ()
    # the copy a shared-storage hit loads first (None: the full KV first). A server
    # behind a slow link loads the compressed copy and drafts from it (VeriCache 5.3)
    load_copy: Optional[CompressionConfig] = None


@dataclass(frozen=True)
class KVDims:
    """Shape of one token's KV in the device pool."""

    layers: int
    heads: int
    head_dim: int
    v_heads: int
    v_head_dim: int
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * (self.heads * self.head_dim + self.v_heads * self.v_head_dim) * self.itemsize


@dataclass
class Context:
    ctx_id: str
    token_ids: np.ndarray  # int64
    namespace: Optional[str] = None
    source: str = "api"  # api | auto
    queries: list = field(default_factory=list)  # registered query suffixes (token id lists)
    query_texts: list = field(default_factory=list)
    frequency: float = 0.0
    last_access: float = 0.0
    quality: dict = field(default_factory=lambda: {FULL: 1.0})
    profiled: bool = False
    profile_reason: Optional[str] = None  # why a (re-)profile is pending
    profile_in_flight: bool = False
    profile_failures: int = 0
    placement: Placement = DROPPED
    stored_len: int = 0  # tokens covered by the stored blob
    sizes: dict = field(default_factory=dict)  # config -> exact blob bytes
    device_config: Optional[CompressionConfig] = None  # form of the copy we put on the device
    hits: dict = field(default_factory=lambda: collections.Counter())
    suffix_tokens: float = 32.0  # running mean of the question length
    # configs of this context's copies on the shared storage tier (written by
    # :meth:`EvicPressManager.write_storage_copies` or found there): never deleted by a move
    shared: set = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return int(len(self.token_ids))

    @property
    def stored(self) -> bool:
        return not self.placement.dropped

    def describe(self, with_tokens: bool = False) -> dict:
        out = {
            "id": self.ctx_id,
            "num_tokens": self.num_tokens,
            "namespace": self.namespace,
            "source": self.source,
            "num_queries": len(self.queries),
            "frequency": self.frequency,
            "placement": {
                "tier": None if self.placement.dropped else self.placement.tier.name.lower(),
                "config": None if self.placement.dropped else self.placement.config.label,
                "stored_tokens": self.stored_len,
                "stored_bytes": self.sizes.get(self.placement.config) if self.stored else 0,
            },
            "device_config": None if self.device_config is None else self.device_config.label,
            "storage_copies": sorted(c.label for c in self.shared),
            "quality": {c.label: q for c, q in sorted(self.quality.items(), key=lambda x: x[0].sort_key())},
            "profiled": self.profiled,
            "profile_pending": self.profile_reason,
            "hits": dict(self.hits),
        }
        if with_tokens:
            out["token_ids"] = self.token_ids.tolist()
        return out


class Fetched:
    """A context's stored KV, read and decoded for loading onto the device (``blob``
    is the stored bytes, reused when the context is then promoted). A token-dropped
    config gives only the kept rows: ``kv`` is ``[L, n_keep, H, D]``, ``positions``
    their original positions and ``num_tokens`` the context tokens they stand for."""

    def __init__(self, kv: FullKV, config: CompressionConfig, tier: Tier, nbytes: int, seconds: float,
                 blob: Optional[bytes] = None, positions=None, num_tokens: Optional[int] = None):
        self.kv, self.config, self.tier, self.nbytes, self.seconds = kv, config, tier, nbytes, seconds
        self.blob = blob
        self.positions = positions
        self.num_tokens = kv.num_tokens if num_tokens is None else int(num_tokens)

    @property
    def dropped(self) -> bool:
        return self.positions is not None


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    return n if bool(eq.all()) else int(np.argmin(eq))


def as_token_array(ids) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    try:
        import array

        if isinstance(ids, array.array) and ids.itemsize == 8:
            return np.frombuffer(ids, dtype=np.int64)
    except Exception:  # pragma: no cover
        pass
    return np.asarray(list(ids), dtype=np.int64)
