"""Uniform KV-compressor interface (VeriCache section 6, Listing 1).

Everything here is pure torch and works on *one request, one layer* at a time, in
SGLang's MHA pool layout: a layer's K (or V) for a request is the tensor
``k_buffer[layer][token_indices]`` of shape ``[num_tokens, num_kv_heads, head_dim]``.

Two kinds of result, both frozen dataclasses deriving from :class:`CompressedKV`:

* :class:`DroppedKV` (scenario ``"token_dropping"``): each KV head keeps its own set of
  positions, but every head of a layer keeps the *same number* ``n_keep`` (VeriCache
  scope (i)), so the kept rows fit a dense ``[n_keep, num_kv_heads, head_dim]`` tensor:
  the pool layout again, ready to be written into ``n_keep`` pool slots. Row ``j`` of
  head ``h`` holds the token at position ``kept_positions[h, j]``.
* :class:`QuantizedKV` (scenario ``"quantization"``): KIVI-style packed codes with
  per-group scales/zero-points plus a full-precision residual of the most recent tokens.

Budget rule (exact, used by every token-dropping method and by the runtime to size
allocations): ``n_keep = max(1, floor(ratio * n))`` per layer and per head, where
``ratio`` is read as the decimal the caller wrote (``0.29`` is 29/100, not the binary
float below it). Floor, like kvpress, so the kept KV never exceeds the requested
fraction except for the one token every head must keep.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal, Sequence

import torch
from torch import Tensor

Scenario = Literal["token_dropping", "quantization"]
Mode = Literal["offline", "online"]


# ----------------------------------------------------------------------------- budgets


def check_ratio(ratio: Any, method: str = "token-dropping method") -> Fraction:
    """Validate a keep ratio and return it as an exact fraction.

    Raises ``ValueError`` for non-numbers, NaN/inf, values outside (0, 1], and integers
    >= 2 (almost certainly a bit width passed to a token-dropping method).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise ValueError(f"{method}: keep ratio must be a number in (0, 1], got {ratio!r}")
    if isinstance(ratio, numbers.Integral) and ratio >= 2:
        raise ValueError(
            f"{method} is a token-dropping method and takes a keep ratio in (0, 1], got {ratio} "
            "which looks like a bit width; use a quantization method ('kivi', 'kivi1') for bits"
        )
    if isinstance(ratio, (numbers.Integral, Fraction)):
        exact = Fraction(ratio)
    else:
        if not math.isfinite(float(ratio)):
            raise ValueError(f"{method}: keep ratio must be finite, got {ratio!r}")
        exact = Fraction(repr(float(ratio)))  # shortest decimal: 0.29 -> 29/100
    if not 0 < exact <= 1:
        raise ValueError(f"{method}: keep ratio must be in (0, 1] (fraction of KV kept), got {ratio!r}")
    return exact


def num_kept(num_tokens: int, ratio: Any) -> int:
    """Tokens kept per layer and per head: ``max(1, floor(ratio * num_tokens))``.

    ``num_kept(n, 1.0) == n``; ``num_tokens == 0`` keeps 0.
    """
    exact = check_ratio(ratio)
    if num_tokens <= 0:
        return 0
    return max(1, math.floor(exact * num_tokens))


def check_bits(bits: Any, supported: Sequence[int], method: str) -> int:
    """Validate a bit width against ``supported``; integral floats (4.0) are accepted."""
    allowed = ", ".join(str(b) for b in supported)
    if isinstance(bits, bool) or not isinstance(bits, numbers.Real):
        raise ValueError(f"{method}: bits must be one of {{{allowed}}}, got {bits!r}")
    if not float(bits).is_integer():
        hint = " (looks like a keep ratio; use a token-dropping method)" if 0 < bits < 1 else ""
        raise ValueError(
            f"{method} is a quantization method and takes bits in {{{allowed}}}, got {bits!r}{hint}"
        )
    if int(bits) not in supported:
        raise ValueError(f"{method}: unsupported bit width {int(bits)}; supported: {{{allowed}}}")
    return int(bits)


def check_kv(k: Tensor, v: Tensor, method: str) -> None:
    """K/V must be ``[num_tokens, num_kv_heads, head_dim]`` with matching first two dims."""
    if not isinstance(k, Tensor) or not isinstance(v, Tensor):
        raise ValueError(f"{method}: k and v must be tensors")
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"{method}: k and v must be [num_tokens, num_kv_heads, head_dim], "
            f"got k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{method}: k{tuple(k.shape)} and v{tuple(v.shape)} differ in tokens or heads")
    if k.shape[0] == 0:
        raise ValueError(f"{method}: cannot compress an empty KV (0 tokens)")


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, eq=False)
class CompressedKV:
    """One layer of one request after compression.

    ``num_tokens`` is the original (uncompressed) length; ``bit_scheme`` the bits per
    stored K/V element (the dtype width for token dropping, the code width for
    quantization), as in VeriCache Listing 1.
    """

    layer_idx: int
    num_tokens: int
    bit_scheme: int

    scenario: ClassVar[Scenario]

    def nbytes(self) -> int:
        """Bytes this object stores (everything needed to rebuild the dense K/V)."""
        raise NotImplementedError

    def bits_per_element(self) -> float:
        """Stored bits per element of the *original* K and V (``8 * nbytes / numel``)."""
        raise NotImplementedError


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True, eq=False)
class DroppedKV(CompressedKV):
    """Token-dropping result for one layer.

    ``kept_positions``: int64 ``[num_kv_heads, n_keep]``, ascending per head, positions in
    ``[0, num_tokens)``; the same ``n_keep`` for all heads.
    ``k``: ``[n_keep, num_kv_heads, head_dim]`` with ``k[j, h] = k_full[kept_positions[h, j], h]``
    (pool layout, heads may hold different tokens in the same row; the runtime can write
    it to ``n_keep`` pool slots as ``k_buffer[layer][slots] = k``); ``v`` likewise.
    At ratio 1.0, ``k``/``v`` are the input tensors themselves (no copy).
    """

    kept_positions: Tensor
    k: Tensor
    v: Tensor

    scenario: ClassVar[Scenario] = "token_dropping"

    def __post_init__(self) -> None:
        h, n_keep = self.kept_positions.shape
        if self.k.shape[:2] != (n_keep, h) or self.v.shape[:2] != (n_keep, h):
            raise ValueError(
                f"DroppedKV: kept_positions [{h}, {n_keep}] does not match "
                f"k{tuple(self.k.shape)} / v{tuple(self.v.shape)}"
            )

    @property
    def n_keep(self) -> int:
        return self.kept_positions.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.kept_positions.shape[0]

    def dropped_positions(self) -> Tensor:
        """``[num_kv_heads, num_tokens - n_keep]`` ascending: Listing 1's ``dropped_indices``."""
        keep = torch.zeros(self.num_kv_heads, self.num_tokens, dtype=torch.bool, device=self.k.device)
        keep.scatter_(1, self.kept_positions, True)
        pos = torch.arange(self.num_tokens, device=self.k.device).expand_as(keep)
        return pos[~keep].view(self.num_kv_heads, self.num_tokens - self.n_keep)

    def nbytes(self, include_positions: bool = True) -> int:
        """K + V bytes, plus the int64 position index unless ``include_positions=False``."""
        return _nbytes(self.k, self.v) + (_nbytes(self.kept_positions) if include_positions else 0)

    def bits_per_element(self, include_positions: bool = True) -> float:
        full = self.num_tokens * self.num_kv_heads * (self.k.shape[2] + self.v.shape[2])
        return 8 * self.nbytes(include_positions) / full


@dataclass(frozen=True, eq=False)
class QuantizedKV(CompressedKV):
    """Quantized (KIVI-layout) result for one layer.

    The first ``num_quantized`` tokens are quantized, the last ``residual_length`` tokens
    are kept in full precision (``num_quantized + residual_length == num_tokens``).

    * Keys, per channel: codes ``k_payload`` uint8 ``[num_quantized, H, ceil(D*bits/8)]``
      (``8 // bits`` codes per byte along ``head_dim``, lowest bits first); ``k_scales`` /
      ``k_zeros`` ``[num_quantized // group_size, H, D]``, one per channel per group of
      ``group_size`` consecutive tokens.
    * Values, per token: ``v_payload`` uint8 ``[num_quantized, H, ceil(Dv*bits/8)]``;
      ``v_scales`` / ``v_zeros`` ``[num_quantized, H, Dv // value_group_size]``, one per
      token per group of ``value_group_size`` consecutive channels.
    * Dequantization: ``x = code * scale + zero``; scales/zeros are stored in ``dtype``.
    * ``k_residual`` / ``v_residual``: ``[residual_length, H, D]`` in ``dtype``. When nothing
      is quantized (16 bits, or too few tokens for one group past the residual window)
      these are the input tensors themselves (no copy).
    """

    group_size: int
    value_group_size: int
    num_quantized: int
    residual_length: int
    dtype: torch.dtype
    k_payload: Tensor
    k_scales: Tensor
    k_zeros: Tensor
    v_payload: Tensor
    v_scales: Tensor
    v_zeros: Tensor
    k_residual: Tensor
    v_residual: Tensor

    scenario: ClassVar[Scenario] = "quantization"

    @property
    def bits(self) -> int:
        return self.bit_scheme

    def nbytes(self) -> int:
        return _nbytes(
            self.k_payload, self.k_scales, self.k_zeros, self.v_payload, self.v_scales,
            self.v_zeros, self.k_residual, self.v_residual,
        )

    def bits_per_element(self) -> float:
        h, d, dv = self.k_residual.shape[1], self.k_residual.shape[2], self.v_residual.shape[2]
        return 8 * self.nbytes() / (self.num_tokens * h * (d + dv))


# ----------------------------------------------------------------------------- compressor


class Compressor(ABC):
    """A KV-cache compression method (VeriCache Listing 1).

    Class attributes:
      ``name``: registry name. ``scenario``: ``"token_dropping"`` or ``"quantization"``.
      ``mode``: ``"offline"`` (one-shot ``compress``, ``update`` is a no-op) or
      ``"online"`` (``update`` is called after each layer's forward during decode).
      ``needs_queries``: which queries ``compress`` needs, or ``None``:
      ``"observation_window"`` (last W queries of the prompt), ``"prefill"`` (all prompt
      queries, or the last T of them) or ``"reconstruction"`` (queries of a KVzip
      context-reconstruction pass).
      ``extra_inputs``: names of method-specific keyword inputs ``compress`` accepts.
      ``needs_full_rows``: attention reads the payload together with full-precision rows
      fetched from a host copy of the KV (SpeCache's device copy): only a server that
      keeps such a copy may serve it.

    Queries are ``[num_q, num_q_heads, head_dim]`` with the same RoPE as the keys;
    ``num_q_heads`` must be a multiple of ``num_kv_heads`` (GQA groups consecutive q heads).
    """

    name: ClassVar[str]
    scenario: ClassVar[Scenario]
    mode: ClassVar[Mode] = "offline"
    needs_queries: ClassVar[str | None] = None
    extra_inputs: ClassVar[tuple[str, ...]] = ()
    needs_full_rows: ClassVar[bool] = False

    @abstractmethod
    def compress(
        self,
        layer_idx: int,
        k: Tensor,
        v: Tensor,
        ratio_or_bits: float | int,
        *,
        queries: Tensor | None = None,
        req_id: Any = None,
        **inputs: Any,
    ) -> CompressedKV:
        """Compress one layer of one request.

        ``ratio_or_bits``: keep ratio in (0, 1] for token dropping, bit width for
        quantization (``ValueError`` on the wrong kind). ``queries`` is ignored by methods
        that do not need it. ``req_id`` keys per-request state of online methods.
        ``inputs``: the method's ``extra_inputs``; anything else is a ``ValueError``.
        """

    @abstractmethod
    def decompress(self, ckv: CompressedKV) -> tuple[Tensor, Tensor, Tensor]:
        """Dense tensors for attention: ``(k, v, positions)``.

        Token dropping: the kept rows ``[n_keep, H, D]`` and ``positions [H, n_keep]``.
        Quantization: the dequantized full-length ``[num_tokens, H, D]`` and
        ``positions = arange(num_tokens)`` expanded to ``[H, num_tokens]``.
        """

    def update(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor | Sequence[Tensor],
        v: Tensor | Sequence[Tensor],
        hidden: Tensor | None = None,
        req_offsets: Tensor | Sequence[int] | None = None,
        **kwargs: Any,
    ) -> list[Tensor]:
        """Online step after a layer's forward; returns per request the positions newly
        dropped, ``[num_kv_heads, n_new_drops]``. Offline methods: no-op, returns ``[]``."""
        return []

    def release(self, req_id: Any = None) -> None:
        """Forget per-request state (call when a request finishes). No-op if stateless."""

    def compress_layers(
        self,
        k_layers: Sequence[Tensor],
        v_layers: Sequence[Tensor],
        ratio_or_bits: float | int,
        *,
        queries: Sequence[Tensor] | None = None,
        req_id: Any = None,
        **per_layer_inputs: Sequence[Any],
    ) -> list[CompressedKV]:
        """``compress`` every layer; ``queries`` and each extra input are per-layer lists."""
        if len(k_layers) != len(v_layers):
            raise ValueError(f"{self.name}: {len(k_layers)} key layers but {len(v_layers)} value layers")
        for key, seq in [("queries", queries), *per_layer_inputs.items()]:
            if seq is not None and len(seq) != len(k_layers):
                raise ValueError(f"{self.name}: {key} has {len(seq)} layers, expected {len(k_layers)}")
        return [
            self.compress(
                i, k, v, ratio_or_bits,
                queries=None if queries is None else queries[i],
                req_id=req_id,
                **{key: seq[i] for key, seq in per_layer_inputs.items()},
            )
            for i, (k, v) in enumerate(zip(k_layers, v_layers))
        ]

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        unknown = sorted(set(inputs) - set(self.extra_inputs))
        if unknown:
            accepted = ", ".join(self.extra_inputs) or "none"
            raise ValueError(f"{self.name}: unknown inputs {unknown}; extra inputs accepted: {accepted}")

    def __repr__(self) -> str:  # dataclass subclasses override this with their fields
        return f"{type(self).__name__}()"
