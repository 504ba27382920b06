"""KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024, arXiv:2402.02750).

Rule: asymmetric uniform quantization ``Q(X) = round((X - z) / s)``, ``X' = Q(X) s + z``
with ``z = min X`` and ``s = (max X - min X) / (2^B - 1)`` over each group (SpeCache eq. 2).
Keys are quantized *per channel* (a group = ``group_size`` consecutive tokens of one
channel: key outliers live in fixed channels), values *per token* (a group =
``group_size`` consecutive channels of one token). The most recent tokens stay in full
precision (the residual). Codes are bit-packed into uint8.

Split (same for K and V, so attention sees one boundary): the residual is the last
``residual_length`` tokens plus the ``(n - residual_length) mod group_size`` tokens before
them, so every key group is complete; the quantized prefix has
``floor((n - R) / G) * G`` tokens. (KIVI's own code keeps ``n mod R`` key tokens and
exactly ``R`` value tokens in full precision; we use one boundary for both.)
Value groups use ``min(group_size, head_dim)`` channels, which must divide ``head_dim``.
16 bits = no quantization: the identity, returning the input tensors.
Error bound: ``|X - X'| <= s / 2`` per group (plus float rounding of the stored s, z).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Compressor, QuantizedKV, check_bits, check_kv
from .bitpack import pack_bits, unpack_float


def kivi_split(num_tokens: int, group_size: int, residual_length: int) -> tuple[int, int]:
    """``(num_quantized, num_residual)`` for a sequence of ``num_tokens``."""
    n_q = max(0, num_tokens - residual_length) // group_size * group_size
    return n_q, num_tokens - n_q


@dataclass
class KIVI(Compressor):
    name: ClassVar[str] = "kivi"
    scenario: ClassVar[str] = "quantization"
    supported_bits: ClassVar[tuple[int, ...]] = (2, 4, 16)

    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"{self.name}: group_size must be >= 1, got {self.group_size}")
        if self.residual_length < 0:
            raise ValueError(f"{self.name}: residual_length must be >= 0, got {self.residual_length}")

    def zero_scale(self, mn: Tensor, mx: Tensor, bits: int) -> tuple[Tensor, Tensor]:
        """Zero-point and scale of a group from its min and max (KIVI: eq. 2)."""
        return mn, (mx - mn) / (2**bits - 1)

    def _quantize(self, x: Tensor, dim: int, bits: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """Quantize ``x`` (float32) with groups reduced over ``dim``: (codes, scale, zero)."""
        zero, scale = self.zero_scale(x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), bits)
        zero, scale = zero.to(dtype), scale.to(dtype)  # stored precision is what dequant uses
        s = scale.float()
        codes = ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round().clamp_(0, 2**bits - 1)
        return codes.to(torch.uint8), scale, zero

    def compress(self, layer_idx, k, v, ratio_or_bits, *, queries=None, req_id=None, **inputs) -> QuantizedKV:
        bits = check_bits(ratio_or_bits, self.supported_bits, self.name)
        check_kv(k, v, self.name)
        self._check_inputs(inputs)
        n, h, d = k.shape
        dv = v.shape[2]
        gv = min(self.group_size, dv)
        if dv % gv:
            raise ValueError(f"{self.name}: value group size {gv} must divide head_dim {dv}")
        n_q, n_r = (0, n) if bits == 16 else kivi_split(n, self.group_size, self.residual_length)
        g = self.group_size
        kq = k[:n_q].float().view(n_q // g, g, h, d)
        k_codes, k_scales, k_zeros = self._quantize(kq, 1, bits, k.dtype)
        vq = v[:n_q].float().view(n_q, h, dv // gv, gv)
        v_codes, v_scales, v_zeros = self._quantize(vq, 3, bits, v.dtype)
        # 16 bits: n_q == 0, the (empty) codes stand in for the payload
        pack = (lambda c: pack_bits(c, bits)) if bits < 16 else (lambda c: c)
        return QuantizedKV(
            layer_idx=layer_idx, num_tokens=n, bit_scheme=bits,
            group_size=g, value_group_size=gv, num_quantized=n_q, residual_length=n_r, dtype=k.dtype,
            k_payload=pack(k_codes.view(n_q, h, d)),
            k_scales=k_scales.view(n_q // g, h, d), k_zeros=k_zeros.view(n_q // g, h, d),
            v_payload=pack(v_codes.view(n_q, h, dv)),
            v_scales=v_scales.view(n_q, h, dv // gv), v_zeros=v_zeros.view(n_q, h, dv // gv),
            k_residual=k if n_q == 0 else k[n_q:], v_residual=v if n_q == 0 else v[n_q:],
        )

    def decompress(self, ckv: QuantizedKV) -> tuple[Tensor, Tensor, Tensor]:
        if not isinstance(ckv, QuantizedKV):
            raise ValueError(f"{self.name}: expected a QuantizedKV, got {type(ckv).__name__}")
        h = ckv.k_residual.shape[1]
        positions = torch.arange(ckv.num_tokens, device=ckv.k_residual.device).expand(h, -1)
        if ckv.num_quantized == 0:
            return ckv.k_residual, ckv.v_residual, positions
        k, v = self.dequantize(ckv)
        return torch.cat([k, ckv.k_residual]), torch.cat([v, ckv.v_residual]), positions

    @staticmethod
    def dequantize(ckv: QuantizedKV) -> tuple[Tensor, Tensor]:
        """The quantized prefix only, ``[num_quantized, H, D]`` each, in ``ckv.dtype``."""
        n_q, g, gv, bits = ckv.num_quantized, ckv.group_size, ckv.value_group_size, ckv.bits
        h, d, dv = ckv.k_residual.shape[1], ckv.k_residual.shape[2], ckv.v_residual.shape[2]
        kc = unpack_float(ckv.k_payload, bits, d).reshape(n_q // g, g, h, d)
        # in place on the fresh codes; multiply then add (not fused), as the kernels do
        k = kc.mul_(ckv.k_scales.float().unsqueeze(1)).add_(ckv.k_zeros.float().unsqueeze(1))
        vc = unpack_float(ckv.v_payload, bits, dv).reshape(n_q, h, dv // gv, gv)
        v = vc.mul_(ckv.v_scales.float().unsqueeze(-1)).add_(ckv.v_zeros.float().unsqueeze(-1))
        return k.view(n_q, h, d).to(ckv.dtype), v.view(n_q, h, dv).to(ckv.dtype)
