"""EvicPress configuration space: compression configs, storage tiers, placements.

An *eviction-compression configuration* in the paper (EvicPress section 4.2) is the
triple (compression method, compression ratio, storage device). Here it is split in two:

* :class:`CompressionConfig` -- (method, ratio) for token dropping, (method, bits) for
  quantization, or ``FULL`` (no compression);
* :class:`Tier` -- where the bytes live (device, host, disk), ordered fast -> slow;

and the pair is a :class:`Placement`. A context whose KV is stored nowhere is
``DROPPED``: the next request recomputes it by prefill (the paper's remote disk is
unlimited, section 4.1; ours is not, so the slowest tier evicts to "recompute").

Conventions (see "doubtful" notes in the module docstrings of utility/placement):

* ``ratio`` is the *fraction of the KV kept*, as in the paper's footnote 2 ("ratio
  between compressed KV cache size and original KV cache size") and in the project's
  ``--vc-compression-ratio``. (The paper's section 4.2 examples and kvpress use the
  opposite convention, fraction pruned.)
* Stored size of a quantized config is ``full * (bits + 2*16/G) / 16``: KIVI stores one
  fp16 scale and one fp16 zero-point per group of ``G`` elements (``G = 32`` here, KIVI's
  default). KIVI's full-precision residual window is ignored: it is a constant of a few
  dozen tokens per context, negligible at the context lengths EvicPress targets.

No SGLang (or torch) import: the policy works on abstract contexts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = [
    "CompressionConfig",
    "FULL",
    "Tier",
    "TierSpec",
    "Placement",
    "DROPPED",
    "QUANT_METHODS",
    "QUANT_GROUP_SIZE",
    "DEFAULT_METHODS",
    "DEFAULT_RATIOS",
    "DEFAULT_QUANT_METHODS",
    "DEFAULT_BITS",
    "candidate_configs",
    "stored_bytes",
    "ordered_tiers",
]

#: Methods whose knob is a bit width (everything else is token dropping with a ratio).
#: Names are those of the compressor registry (``sglang_vc.compress``): KIVI 2/4-bit and
#: SpeCache's 1-bit KIVI.
QUANT_METHODS = frozenset({"kivi", "kivi1"})
#: Elements per quantization group; each group carries a scale and zero-point in the KV
#: dtype (the compressor library's KIVI default, ``group_size=32``).
QUANT_GROUP_SIZE = 32
#: Bits of the uncompressed KV element (fp16 / bf16).
FULL_BITS = 16

# Paper defaults: the three token-dropping methods of the evaluation (section 6.1) at
# three kept fractions, plus KIVI 2/4-bit (section 8 "extending to quantization").
DEFAULT_METHODS: tuple[str, ...] = ("knorm", "snapkv", "keydiff")
DEFAULT_RATIOS: tuple[float, ...] = (0.3, 0.6, 0.9)
DEFAULT_QUANT_METHODS: tuple[str, ...] = ("kivi",)
DEFAULT_BITS: tuple[int, ...] = (2, 4)


@dataclass(frozen=True)
class CompressionConfig:
    """One compression setting of a context's KV cache.

    ``method=None`` is the uncompressed cache (use :data:`FULL`). A token-dropping
    method takes ``ratio`` in (0, 1], the fraction of tokens kept; a method in
    :data:`QUANT_METHODS` takes ``bits`` in [1, 8]. Hashable, so it keys quality
    profiles.
    """

    method: Optional[str] = None
    ratio: Optional[float] = None
    bits: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method is None:
            if self.ratio is not None or self.bits is not None:
                raise ValueError("the full config takes neither ratio nor bits")
            return
        if self.method in QUANT_METHODS:
            if self.bits is None or self.ratio is not None:
                raise ValueError(f"{self.method} takes bits, not ratio")
            if not 1 <= int(self.bits) <= 8 or int(self.bits) != self.bits:
                raise ValueError(f"bits must be an integer in [1, 8], got {self.bits}")
        else:
            if self.ratio is None or self.bits is not None:
                raise ValueError(f"{self.method} takes ratio (fraction kept), not bits")
            if not 0.0 < self.ratio <= 1.0:
                raise ValueError(f"ratio is the fraction kept, in (0, 1]; got {self.ratio}")

    @property
    def is_full(self) -> bool:
        return self.method is None

    @property
    def is_quantized(self) -> bool:
        return self.bits is not None

    @property
    def drops_tokens(self) -> bool:
        """Token dropping: only the kept rows of each (layer, head) are stored."""
        return self.ratio is not None

    def reachable_from(self, src: "CompressionConfig") -> bool:
        """Whether a context stored as ``src`` can be re-encoded as ``self`` without
        recomputing it: never to a larger form; and a token-dropped copy has lost the
        other rows, so it only becomes the same method at a ratio not above its own
        (re-selecting among the kept rows, see ``codec.transcode``)."""
        if self.size_fraction > src.size_fraction:
            return False
        if src.drops_tokens:
            return self.method == src.method and self.ratio <= src.ratio
        return True

    @property
    def size_fraction(self) -> float:
        """Stored bytes / uncompressed bytes (see the module docstring)."""
        if self.method is None:
            return 1.0
        if self.bits is not None:
            return (self.bits + 2 * FULL_BITS / QUANT_GROUP_SIZE) / FULL_BITS
        return float(self.ratio)

    @property
    def token_fraction(self) -> float:
        """Fraction of the context's tokens that remain (1 for full and quantized)."""
        return float(self.ratio) if self.ratio is not None else 1.0

    @property
    def label(self) -> str:
        """``full``, ``snapkv@0.3`` or ``kivi@2b``; :meth:`parse` reads it back."""
        if self.method is None:
            return "full"
        if self.bits is not None:
            return f"{self.method}@{self.bits}b"
        return f"{self.method}@{self.ratio:g}"

    @classmethod
    def parse(cls, text: str) -> "CompressionConfig":
        """Inverse of :attr:`label` (for command-line flags)."""
        text = text.strip()
        if text in ("full", "none", ""):
            return FULL
        method, sep, knob = text.partition("@")
        if not sep:
            raise ValueError(f"expected METHOD@RATIO or METHOD@BITSb, got {text!r}")
        if knob.endswith("b"):
            return cls(method, bits=int(knob[:-1]))
        return cls(method, ratio=float(knob))

    def sort_key(self) -> tuple:
        """Total order for deterministic tie-breaking: full first, then by name/knob."""
        return (self.method or "", self.ratio or 0.0, self.bits or 0)

    def __str__(self) -> str:
        return self.label


#: The uncompressed configuration; its quality is 1.0 by definition.
FULL = CompressionConfig()


def stored_bytes(full_bytes: int, config: CompressionConfig) -> int:
    """Bytes a context of ``full_bytes`` uncompressed KV occupies under ``config``."""
    if config.method is None:
        return int(full_bytes)
    return int(round(full_bytes * config.size_fraction))


def candidate_configs(
    methods: Iterable[str] = DEFAULT_METHODS,
    ratios: Iterable[float] = DEFAULT_RATIOS,
    quant_methods: Iterable[str] = DEFAULT_QUANT_METHODS,
    bits: Iterable[int] = DEFAULT_BITS,
    include_full: bool = True,
) -> tuple[CompressionConfig, ...]:
    """The profiler's candidate set: ``methods x ratios`` + ``quant_methods x bits``.

    With the defaults: full, {knorm, snapkv, keydiff} x {0.3, 0.6, 0.9} kept, and KIVI
    at 2 and 4 bits -- 12 configurations. The order is deterministic (sorted).
    """
    out = {FULL} if include_full else set()
    ratios, bits = tuple(ratios), tuple(bits)
    for m in methods:
        if m in QUANT_METHODS:
            out.update(CompressionConfig(m, bits=b) for b in bits)
        else:
            out.update(CompressionConfig(m, ratio=float(r)) for r in ratios)
    for m in quant_methods:
        out.update(CompressionConfig(m, bits=b) for b in bits)
    return tuple(sorted(out, key=CompressionConfig.sort_key))


class Tier(enum.IntEnum):
    """Storage tiers, ordered fast -> slow (a smaller value is faster)."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @classmethod
    def parse(cls, text: str) -> "Tier":
        aliases = {"gpu": cls.DEVICE, "cpu": cls.HOST, "ssd": cls.DISK}
        t = text.strip().lower()
        return aliases[t] if t in aliases else cls[t.upper()]


@dataclass(frozen=True)
class TierSpec:
    """Capacity and load bandwidth of one tier.

    ``capacity_bytes=None`` is unlimited (the paper's remote disk, section 4.1).
    ``load_bandwidth`` is bytes/s into the device; use ``math.inf`` for the device tier
    itself (KV already resident costs no load time).
    ``compresses_in_place``: whether the knapsack may re-encode a copy while it stays on
    this tier (the paper's "more aggressive compression to fit in S"). A runtime that can
    hold only some forms on a tier turns it off there, so that relieving that tier never
    locks a context into the one family it can hold (compression is one-way).
    """

    capacity_bytes: Optional[int]
    load_bandwidth: float
    compresses_in_place: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0 or None")
        if not self.load_bandwidth > 0:
            raise ValueError("load_bandwidth must be > 0 bytes/s")

    def load_seconds(self, nbytes: int) -> float:
        return 0.0 if math.isinf(self.load_bandwidth) else nbytes / self.load_bandwidth


@dataclass(frozen=True)
class Placement:
    """Where and how a context's KV is stored: (config, tier); ``tier=None`` = dropped."""

    config: CompressionConfig
    tier: Optional[Tier]

    def __post_init__(self) -> None:
        # A dropped context has no stored bytes; normalise so DROPPED compares equal.
        if self.tier is None and self.config != FULL:
            object.__setattr__(self, "config", FULL)

    @property
    def dropped(self) -> bool:
        return self.tier is None

    def bytes(self, full_bytes: int) -> int:
        return 0 if self.tier is None else stored_bytes(full_bytes, self.config)

    def sort_key(self) -> tuple:
        """Fast tiers first, dropped last; then config order."""
        return (len(Tier) if self.tier is None else int(self.tier), self.config.sort_key())

    def __str__(self) -> str:
        return "dropped" if self.tier is None else f"{self.config.label}/{self.tier.name.lower()}"


#: Not stored anywhere: the next request recomputes the context by prefill.
DROPPED = Placement(FULL, None)


def ordered_tiers(tiers: Iterable[Tier]) -> Sequence[Tier]:
    """Tiers sorted fast -> slow."""
    return tuple(sorted(tiers))
