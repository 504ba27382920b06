"""What a request's KV becomes after its prefill: the server's compressor settings, or the
request's own choice in ``sampling_params.custom_params``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang_vc.compress import check_bits, check_ratio, get_compressor, num_kept
from sglang_vc.compress.kivi import kivi_split

from .names import REQUEST_KEYS

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
    # its full KV was put back in its row when it finished (VERICACHE's host copy): the
    # tree takes it as any full request's
    full_again: bool = False

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


def request_spec(default: Optional[CompressionSpec], custom_params: Any) -> Optional[CompressionSpec]:
    """The spec ``custom_params`` chooses for a request (None = full KV; ``default``
    when it chooses nothing). ``ValueError`` with a message when the choice is invalid.

    Keys: ``vc_compressor`` (a name, or "none" for full KV), ``vc_compression_ratio``,
    ``vc_kv_bits``. A missing amount is taken from the server's setting when that is of
    the same kind."""
    if not isinstance(custom_params, dict) or not any(k in custom_params for k in REQUEST_KEYS):
        return default
    name = custom_params.get("vc_compressor", default.compressor if default else None)
    if name is None:
        raise ValueError(f"{_keys_given(custom_params)} without vc_compressor: this server "
                         "has no default compressor to apply it to")
    if str(name).lower() in NO_COMPRESSION:
        return None
    try:
        scenario = get_compressor(str(name)).scenario
        same_kind = default is not None and default.scenario == scenario
        ratio = custom_params.get("vc_compression_ratio", default.ratio if same_kind else None)
        bits = custom_params.get("vc_kv_bits", default.bits if same_kind else None)
        return make_spec(str(name), ratio, bits)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid per-request compression {_keys_given(custom_params)}: {exc}") from exc


def resolve_spec(default: Optional[CompressionSpec], custom_params: Any) -> tuple[Optional[CompressionSpec], Optional[str]]:
    """The spec for one request: ``default`` unless ``custom_params`` overrides it.
    Returns ``(spec, error)``: on an invalid override the default is kept and ``error``
    says why. The HTTP layer refuses such requests first (:func:`check_request`); this is
    the scheduler's side, which cannot reject a request."""
    try:
        return request_spec(default, custom_params), None
    except ValueError as exc:
        return default, str(exc)


def check_request(custom_params: Any, default: Optional[CompressionSpec], serves_overrides: bool) -> None:
    """Refuse (``ValueError``, the client's HTTP 400) a per-request compression this
    server cannot honour exactly: an invalid one, or any on a server whose cache does not
    apply per-request compression (the ``vc`` radix cache of lossy serving and VERICACHE does)."""
    if not isinstance(custom_params, dict) or not any(k in custom_params for k in REQUEST_KEYS):
        return
    if not serves_overrides:
        raise ValueError(f"{_keys_given(custom_params)}: per-request compression is applied only by "
                         "a server with --vc-compressor (lossy serving, VERICACHE); this one would ignore it")
    request_spec(default, custom_params)


def _keys_given(custom_params: dict) -> dict:
    return {k: custom_params[k] for k in REQUEST_KEYS if k in custom_params}


def quantized_len(spec: CompressionSpec, num_tokens: int) -> int:
    """Tokens KIVI quantizes of a ``num_tokens`` prefill (the rest stays full precision)."""
    if spec.bits >= 16:
        return 0
    comp = get_compressor(spec.compressor)
    return kivi_split(num_tokens, comp.group_size, comp.residual_length)[0]
