"""EvicPress utility function (paper section 4.2).

    Util(method, ratio, device) = (alpha * quality - TTFT) * frequency

* ``quality`` -- mean agreement of answers under the config with full-KV answers over
  the context's profiling queries (section 4.3; see :mod:`.profiler`). Full KV and a
  recomputed (dropped) context have quality 1.0.
* ``TTFT`` -- a delay *model*, in seconds, of the time to first token when the
  context is reused from placement (config, tier):

      load        = stored_bytes(config) / load_bandwidth(tier)     (0 on the device)
      decompress  = decompressed_bytes / decompress_rate[method]    (0 if no rate given)
      suffix      = query_tokens / prefill_tokens_per_s             (the new question)
      recompute   = num_tokens / prefill_tokens_per_s               (only when dropped)

  The paper's "delay item is computed with estimated latency to fetch a (compressed)
  KV cache from the corresponding storage device" (section 4.2) and TTFT "includes the
  delay to retrieve KV cache ... and the time to prefill the new queries" (section 6.1);
  decompression and recompute are the two terms our setting adds (KIVI needs
  dequantization; our slowest tier is bounded, so a context can be dropped).
  Prefill is modelled as linear in tokens at a measured throughput -- the superlinear
  attention term is ignored; measure the throughput at a typical context length.
* ``frequency`` -- how often the context is accessed (any consistent unit; the
  runtime may use a decayed count).

``alpha`` trades quality against seconds: with alpha = 1 a 0.1 quality drop is worth
0.1 s of TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, NamedTuple, Optional

from .config import FULL, CompressionConfig, Placement, Tier, TierSpec, stored_bytes

__all__ = ["ContextInfo", "TTFT", "UtilityModel"]


@dataclass(frozen=True, eq=False)
class ContextInfo:
    """What the policy knows about one cached context (a radix-tree prefix).

    ``quality`` is the context's profile: config -> quality in [0, 1]. Configs absent
    from it are not candidates for this context (except :data:`FULL`, always 1.0).
    ``query_tokens`` is the typical suffix (question) length in tokens.
    ``sizes`` optionally gives the real stored bytes of some configs (e.g. measured
    blob sizes, which depend on the KV dtype); other configs use
    ``stored_bytes(full_bytes, config)``.
    """

    ctx_id: Hashable
    num_tokens: int
    full_bytes: int
    frequency: float = 1.0
    quality: Mapping[CompressionConfig, float] = field(default_factory=dict)
    query_tokens: int = 0
    sizes: Mapping[CompressionConfig, int] = field(default_factory=dict)
    # Bytes a config's copy takes on the device tier where that differs from its stored
    # bytes (a runtime that attends over quantized KV dequantized holds it at full size).
    resident_bytes: Mapping[CompressionConfig, int] = field(default_factory=dict)

    def stored_bytes(self, config: CompressionConfig) -> int:
        """Bytes of this context's KV stored under ``config``."""
        size = self.sizes.get(config)
        return stored_bytes(self.full_bytes, config) if size is None else int(size)

    def quality_of(self, config: CompressionConfig) -> Optional[float]:
        """Profiled quality of ``config``; 1.0 for full; None when not profiled."""
        if config.is_full:
            return 1.0
        return self.quality.get(config)

    def candidates(self) -> tuple[CompressionConfig, ...]:
        """FULL plus every profiled config, in deterministic order."""
        return tuple(sorted({FULL, *self.quality}, key=CompressionConfig.sort_key))

    def bytes_at(self, placement: Placement) -> int:
        """Bytes this context occupies on ``placement.tier`` (0 when dropped): the
        stored bytes, or on the device tier ``resident_bytes`` where given."""
        if placement.dropped:
            return 0
        if placement.tier == Tier.DEVICE and placement.config in self.resident_bytes:
            return int(self.resident_bytes[placement.config])
        return self.stored_bytes(placement.config)


class TTFT(NamedTuple):
    """The delay model's terms, in seconds; ``total`` is what the utility uses."""

    load: float
    decompress: float
    suffix_prefill: float
    recompute: float

    @property
    def total(self) -> float:
        return self.load + self.decompress + self.suffix_prefill + self.recompute


@dataclass(frozen=True, eq=False)
class UtilityModel:
    """Scores placements with ``(alpha * quality - TTFT) * frequency`` (section 4.2).

    ``tiers`` gives each tier's load bandwidth (and capacity, used by placement);
    ``prefill_tokens_per_s`` is a measured prefill throughput; ``decompress_bytes_per_s``
    maps a method name to the rate at which its compressed form is expanded back
    (methods not listed cost nothing to decompress, e.g. token dropping).
    Calling the model is :meth:`utility`.
    """

    alpha: float
    tiers: Mapping[Tier, TierSpec]
    prefill_tokens_per_s: float
    decompress_bytes_per_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError("prefill_tokens_per_s must be > 0")

    def quality(self, ctx: ContextInfo, placement: Placement) -> float:
        if placement.dropped:
            return 1.0  # recomputing the prefix is exact
        q = ctx.quality_of(placement.config)
        if q is None:
            raise KeyError(f"context {ctx.ctx_id!r} has no profiled quality for {placement.config}")
        return q

    def ttft_terms(self, ctx: ContextInfo, placement: Placement) -> TTFT:
        suffix = ctx.query_tokens / self.prefill_tokens_per_s
        if placement.dropped:
            return TTFT(0.0, 0.0, suffix, ctx.num_tokens / self.prefill_tokens_per_s)
        cfg = placement.config
        load = self.tiers[placement.tier].load_seconds(ctx.stored_bytes(cfg))
        # a device copy is already expanded (dequantized) where attention reads it
        on_device = placement.tier == Tier.DEVICE
        rate = self.decompress_bytes_per_s.get(cfg.method) if cfg.method and not on_device else None
        # Decompression writes the expanded KV: all tokens for quantization, the kept
        # ones for token dropping.
        decompress = ctx.full_bytes * cfg.token_fraction / rate if rate else 0.0
        return TTFT(load, decompress, suffix, 0.0)

    def ttft(self, ctx: ContextInfo, placement: Placement) -> float:
        return self.ttft_terms(ctx, placement).total

    def utility(self, ctx: ContextInfo, placement: Placement) -> float:
        return (self.alpha * self.quality(ctx, placement) - self.ttft(ctx, placement)) * ctx.frequency

    __call__ = utility

    def best_placement(self, ctx: ContextInfo) -> Placement:
        """The unconstrained optimum over candidates x tiers x {dropped} (section 4.4's
        initial choice "with the highest utility function score"); ties go to the faster
        tier, then the config order."""
        options = [Placement(c, t) for t in sorted(self.tiers) for c in ctx.candidates()]
        options.append(Placement(FULL, None))
        return min(options, key=lambda p: (-self.utility(ctx, p), p.sort_key()))
