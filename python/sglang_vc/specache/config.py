"""One SpeCache configuration: the device copy's bits, the rows prefetched per step, the
full-precision residual, and whether the prefetch is speculative."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sglang_vc.compress.kivi import KIVI, kivi_split
from sglang_vc.compress.kivi1 import KIVI1

SUPPORTED_BITS = (1, 2)
DEFAULT_TOPK = 64
# rows prefetched per layer and KV head at most (the server's and a request's): past a few
# thousand the fetch costs more than the full KV it stands for, and the batched kernels
# index the rows with 32-bit offsets
MAX_TOPK = 4096
DEFAULT_RESIDUAL = 64  # the paper's fair comparison with KIVI at residual 128
DEFAULT_GROUP = 32


@dataclass(frozen=True)
class SpeCacheConfig:
    """``bits``: the device copy, 2-bit KIVI or 1-bit KIVI with eq. 3's zero-point and
    scale (``kivi1``). ``topk``: full-precision rows prefetched per layer and KV head
    (0: plain KIVI, nothing prefetched). ``residual``: the most recent tokens kept in
    full precision on the device. ``speculative=False`` is the paper's table-4
    comparison: the output token's own top-k, fetched after its attention, which is then
    recomputed."""

    bits: int = 1
    topk: int = DEFAULT_TOPK
    residual: int = DEFAULT_RESIDUAL
    group_size: int = DEFAULT_GROUP
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"specache: kv bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        if not isinstance(self.topk, int) or not 0 <= self.topk <= MAX_TOPK:
            raise ValueError(f"specache: topk must be an integer in [0, {MAX_TOPK}], got {self.topk!r}")
        if not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"specache: residual must be an integer >= 0, got {self.residual!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"specache: group size must be an integer >= 1, got {self.group_size!r}")

    @property
    def compressor_name(self) -> str:
        return "kivi1" if self.bits == 1 else "kivi"

    def quantizer(self, residual: Optional[int] = None) -> KIVI:
        """The device copy's KIVI quantizer (``residual`` overrides this config's)."""
        cls = KIVI1 if self.bits == 1 else KIVI
        return cls(group_size=self.group_size, residual_length=self.residual if residual is None else residual)

    def quantized_len(self, num_tokens: int) -> int:
        """Tokens quantized of a ``num_tokens`` prefill (KIVI's split)."""
        return kivi_split(num_tokens, self.group_size, self.residual)[0]

    def stream_due(self, num_quantized: int, kv_len: int) -> bool:
        """Whether the oldest ``group_size`` tail tokens are quantized now: the tail
        (``kv_len - num_quantized`` full-precision tokens) has reached residual + group."""
        return kv_len - num_quantized >= self.residual + self.group_size

    @property
    def label(self) -> str:
        if self.topk == 0:
            return f"{self.compressor_name}@{self.bits}b/r{self.residual}"
        out = f"specache@{self.bits}b"
        if self.topk != DEFAULT_TOPK:
            out += f"/k{self.topk}"
        if self.residual != DEFAULT_RESIDUAL:
            out += f"/r{self.residual}"
        if not self.speculative:
            out += "/nonspec"
        return out

    def describe(self) -> dict[str, Any]:
        return {"kv_bits": self.bits, "topk": self.topk, "residual": self.residual,
                "group_size": self.group_size, "speculative": self.speculative}

    def device_bytes(self, kv_len: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        """Device KV bytes of one request of ``kv_len`` tokens, per layer: packed codes,
        scales and zero-points of the quantized part, full-precision tail, and the
        prefetched rows (K and V)."""
        n_q = self.quantized_len(kv_len)
        hd = num_kv_heads * head_dim
        codes = 2 * n_q * hd * self.bits // 8
        gv = min(self.group_size, head_dim)
        meta = 2 * elem_bytes * (n_q // self.group_size * hd + n_q * num_kv_heads * (head_dim // gv))
        full = 2 * elem_bytes * hd * ((kv_len - n_q) + min(self.topk, n_q))
        return codes + meta + full


def parse_variant(text: str) -> SpeCacheConfig:
    """``{bits}b[/k{K}][/r{R}][/g{G}][/nonspec]``, e.g. ``1b``, ``2b/k16``, ``1b/nonspec``,
    ``1b/k0/r128`` (plain 1-bit KIVI at residual 128)."""
    parts = [p for p in text.strip().lower().split("/") if p]
    if not parts or not parts[0].endswith("b") or not parts[0][:-1].isdigit():
        raise ValueError(f"specache variant {text!r}: expected BITSb[/kK][/rR][/gG][/nonspec], e.g. 1b/k64")
    fields: dict[str, Any] = {"bits": int(parts[0][:-1])}
    names = {"k": "topk", "r": "residual", "g": "group_size"}
    for p in parts[1:]:
        if p == "nonspec":
            fields["speculative"] = False
        elif p[:1] in names and p[1:].isdigit():
            fields[names[p[0]]] = int(p[1:])
        else:
            raise ValueError(f"specache variant {text!r}: unknown part {p!r}")
    return SpeCacheConfig(**fields)
