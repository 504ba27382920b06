"""What a request's KV becomes after its prefill: the server's compressor settings, or the
request's own choice in ``sampling_params.custom_params``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang_vc.compress import check_bits, check_ratio, get_compressor, num_kept
from sglang_vc.compress.kivi import kivi_split

NO_COMPRESSION = ("none", "full", "")


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """A compressor name and its amount: keep ratio (token dropping) or bits (quantization)."""

    compressor: str
    scenario: str  # "token_dropping" | "quantization"
    mode: str  # "offline" | "online"
    ratio: Optional[float] = None
    bits: Optional[int] = None

    @property
    def amount(self) -> float | int:
        return self.ratio if self.scenario == "token_dropping" else self.bits

    def rows_kept(self, num_tokens: int) -> int:
        """Pool rows a token-dropping compressor keeps of ``num_tokens`` (every layer)."""
        return num_kept(num_tokens, self.ratio)

    def describe(self) -> dict[str, Any]:
        out = {"compressor": self.compressor}
        out["compression_ratio" if self.scenario == "token_dropping" else "kv_bits"] = self.amount
        return out


@dataclasses.dataclass
class RequestPlan:
    """Per request: the spec (None = full KV) and the length its prefill ends at."""

    rid: str
    spec: Optional[CompressionSpec]
    prefill_len: int
    error: Optional[str] = None  # a rejected per-request override (the server default ran)
    tree_prefix_len: Optional[int] = None  # row [0, here) borrowed from the radix tree

    def min_own_rows(self) -> int:
        """Rows of its prefill the request must own itself (not borrowed from the tree):
        the compressed rows of a token-dropping spec go into the request's own slots."""
        if self.spec is None or self.spec.scenario != "token_dropping":
            return 0
        return self.spec.rows_kept(self.prefill_len)


def make_spec(name: str, ratio: Any = None, bits: Any = None) -> CompressionSpec:
    """Validate ``name`` with its amount (``ValueError`` with a message on a bad value)."""
    compressor = get_compressor(name)
    if compressor.scenario == "quantization":
        if bits is None:
            raise ValueError(f"{name} quantizes: it needs vc_kv_bits")
        bits = check_bits(bits, compressor.supported_bits, name)
        return CompressionSpec(compressor.name, compressor.scenario, compressor.mode, bits=bits)
    if ratio is None:
        raise ValueError(f"{name} drops tokens: it needs vc_compression_ratio")
    check_ratio(ratio, name)
    return CompressionSpec(compressor.name, compressor.scenario, compressor.mode, ratio=float(ratio))


def resolve_spec(default: Optional[CompressionSpec], custom_params: Any) -> tuple[Optional[CompressionSpec], Optional[str]]:
    """The spec for one request: ``default`` unless ``custom_params`` overrides it.

    Keys: ``vc_compressor`` (a name, or "none" for full KV), ``vc_compression_ratio``,
    ``vc_kv_bits``. A missing amount is taken from the server's setting when that is of
    the same kind. Returns ``(spec, error)``: on an invalid override the default is kept
    and ``error`` says why (the scheduler cannot reject a request at this point)."""
    if not isinstance(custom_params, dict):
        return default, None
    keys = ("vc_compressor", "vc_compression_ratio", "vc_kv_bits")
    if not any(k in custom_params for k in keys):
        return default, None
    name = custom_params.get("vc_compressor", default.compressor if default else None)
    if name is None or str(name).lower() in NO_COMPRESSION:
        return None, None
    try:
        scenario = get_compressor(str(name)).scenario
        same_kind = default is not None and default.scenario == scenario
        ratio = custom_params.get("vc_compression_ratio", default.ratio if same_kind else None)
        bits = custom_params.get("vc_kv_bits", default.bits if same_kind else None)
        return make_spec(str(name), ratio, bits), None
    except (ValueError, TypeError) as exc:
        return default, f"invalid per-request compression {dict((k, custom_params.get(k)) for k in keys)}: {exc}"


def quantized_len(spec: CompressionSpec, num_tokens: int) -> int:
    """Tokens KIVI quantizes of a ``num_tokens`` prefill (the rest stays full precision)."""
    if spec.bits >= 16:
        return 0
    comp = get_compressor(spec.compressor)
    return kivi_split(num_tokens, comp.group_size, comp.residual_length)[0]
