"""A context's KV as bytes, under a compression config (EvicPress's stored form).

The KV of one context is two tensors, ``k`` of shape ``[layers, tokens, heads, head_dim]``
and ``v`` of shape ``[layers, tokens, heads, v_head_dim]``, gathered from SGLang's device
pool (``k_buffer[layer][slots]``). :func:`encode` turns it into one self-describing blob
for a :class:`~.config.CompressionConfig`; :func:`decode` reverses it (lossy configs come
back dequantized / with the kept rows only).

* ``full``: the two tensors, bit-exact.
* quantization (``kivi@2b``, ``kivi@4b``, ``kivi1@1b``): the compressor library's KIVI on
  all layers at once -- a layer's heads become extra heads (``[tokens, layers*heads,
  dim]``), which is exactly per-layer KIVI because KIVI groups never span heads. The
  residual window is 0: a stored context is complete, nothing is appended to it
  afterwards (the KIVI residual exists for decoding). Tokens past the last whole group
  of 32 stay in full precision.
* token dropping (``knorm@0.5``, ``keydiff@0.3``...): the compressor's :class:`DroppedKV`
  on all layers at once, layers as extra heads again (the scorers rank each head's keys
  on their own, so this is per-layer, per-head selection): every (layer, head) keeps
  ``max(1, floor(ratio * tokens))`` rows. The blob holds the kept rows and their
  original positions (int64, ~1.6% of the rows' bytes at fp32), so it is about
  ``ratio`` of the full size. :func:`decode` gives the kept rows ``[L, n_keep, H, D]``;
  they are served as a compressed prefix by the lossy attention backend (keys carry
  their RoPE already, so row order does not matter; see :mod:`.radix`).
  :func:`transcode` shrinks such a blob to a smaller ratio of the same method by
  selecting among the kept rows (exact for ``knorm``, whose ranking is per row; the
  others re-score the kept rows only); any other change needs the full KV.

Blob layout: safetensors, with every tensor field of the compressor's result and a
``__meta__`` uint8 tensor holding JSON (config label, shapes, the result's scalar
fields). Pure torch; no SGLang import.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .config import QUANT_GROUP_SIZE, CompressionConfig

__all__ = ["FullKV", "encode", "decode", "transcode", "estimate_bytes", "full_bytes", "blob_config"]

_META = "__meta__"
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class FullKV(NamedTuple):
    """A context's dense KV: ``k [L, N, H, D]``, ``v [L, N, Hv, Dv]`` (CPU tensors)."""

    k: Tensor
    v: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def prefix(self, n: int) -> "FullKV":
        return FullKV(self.k[:, :n], self.v[:, :n])


def full_bytes(num_layers: int, num_tokens: int, heads: int, head_dim: int,
               v_heads: int, v_head_dim: int, itemsize: int) -> int:
    return num_layers * num_tokens * (heads * head_dim + v_heads * v_head_dim) * itemsize


def _compressor(method: str):
    from sglang_vc.compress.registry import get_compressor

    if method in ("kivi", "kivi1"):
        # Stored contexts are complete: no full-precision residual window.
        return get_compressor(method, residual_length=0, group_size=QUANT_GROUP_SIZE)
    return get_compressor(method)


def _merge_layers(x: Tensor) -> Tensor:
    """[L, N, H, D] -> [N, L*H, D] (layers become extra heads)."""
    L, N, H, D = x.shape
    return x.permute(1, 0, 2, 3).reshape(N, L * H, D)


def _split_layers(x: Tensor, L: int) -> Tensor:
    """[N, L*H, D] -> [L, N, H, D]."""
    N, LH, D = x.shape
    return x.reshape(N, L, LH // L, D).permute(1, 0, 2, 3).contiguous()


def encode(kv: FullKV, config: CompressionConfig) -> bytes:
    """The blob of ``kv`` under ``config`` (see the module docstring)."""
    from safetensors.torch import save

    k, v = kv.k.detach().cpu().contiguous(), kv.v.detach().cpu().contiguous()
    if k.dim() != 4 or v.dim() != 4 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"expected k [L,N,H,D] and v [L,N,Hv,Dv], got {tuple(k.shape)} {tuple(v.shape)}")
    L, N = int(k.shape[0]), int(k.shape[1])
    meta = {
        "config": config.label,
        "layers": L,
        "tokens": N,
        "k_shape": list(k.shape),
        "v_shape": list(v.shape),
        "dtype": str(k.dtype),
    }
    if config.is_full:
        tensors = {"k": k, "v": v}
    else:
        comp = _compressor(config.method)
        knob = config.bits if config.is_quantized else config.ratio
        res = comp.compress(0, _merge_layers(k), _merge_layers(v), knob)
        return _save_result(meta, res)
    tensors[_META] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return save(tensors)


def encode_kept(rows: FullKV, positions: Tensor, config: CompressionConfig, num_tokens: int) -> bytes:
    """The blob of a token-dropped copy given by its kept rows ``[L, n_keep, H, D]`` and
    their positions ``[L, H, n_keep]`` (what :func:`decode` returns for such a blob), e.g.
    read back from a device copy: equal to the blob it was loaded from."""
    from sglang_vc.compress.base import DroppedKV

    if not config.drops_tokens:
        raise ValueError(f"{config.label} is not a token-dropping config")
    k, v = rows.k.detach().cpu().contiguous(), rows.v.detach().cpu().contiguous()
    L, n_keep, H, D = (int(x) for x in k.shape)
    meta = {
        "config": config.label,
        "layers": L,
        "tokens": int(num_tokens),
        "k_shape": [L, int(num_tokens), H, D],
        "v_shape": [L, int(num_tokens), int(v.shape[2]), int(v.shape[3])],
        "dtype": str(k.dtype),
    }
    res = DroppedKV(layer_idx=0, num_tokens=int(num_tokens), bit_scheme=8 * k.element_size(),
                    kept_positions=positions.reshape(L * H, n_keep).to(torch.int64).contiguous(),
                    k=_merge_layers(k).contiguous(), v=_merge_layers(v).contiguous())
    return _save_result(meta, res)


def _save_result(meta: dict, res) -> bytes:
    """The blob of a compressor result (every tensor field, the scalars in the meta)."""
    from safetensors.torch import save

    tensors, scalars = {}, {}
    for f in dataclasses.fields(res):
        val = getattr(res, f.name)
        if isinstance(val, Tensor):
            tensors[f.name] = val.contiguous()
        elif isinstance(val, torch.dtype):
            scalars[f.name] = str(val)
        else:
            scalars[f.name] = val
    meta = dict(meta, result=type(res).__name__, fields=scalars)
    tensors[_META] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return save(tensors)


def _load(blob: bytes) -> tuple[dict, dict]:
    from safetensors.torch import load

    tensors = load(bytes(blob))
    meta = json.loads(bytes(tensors.pop(_META).numpy()).decode())
    return meta, tensors


def blob_config(blob: bytes) -> CompressionConfig:
    """The config a blob was encoded with."""
    return CompressionConfig.parse(_load(blob)[0]["config"])


def blob_tokens(blob: bytes) -> int:
    """The number of context tokens a blob stands for."""
    return int(_load(blob)[0]["tokens"])


def decode(blob: bytes) -> tuple[CompressionConfig, FullKV, Optional[Tensor]]:
    """``(config, kv, positions)``. For full and quantized configs ``kv`` has every
    token and ``positions`` is None; for token dropping ``kv`` holds the kept rows
    ``[L, n_keep, H, D]`` and ``positions [L, H, n_keep]`` the original positions."""
    meta, tensors = _load(blob)
    config = CompressionConfig.parse(meta["config"])
    if config.is_full:
        return config, FullKV(tensors["k"], tensors["v"]), None
    L = int(meta["layers"])
    res = _result(meta, tensors)
    k, v, pos = _compressor(config.method).decompress(res)
    kv = FullKV(_split_layers(k, L), _split_layers(v, L))
    if config.is_quantized:
        return config, kv, None
    H = int(meta["k_shape"][2])
    return config, kv, pos.reshape(L, H, -1)


def _result(meta: dict, tensors: dict):
    """The compressor result a lossy blob holds."""
    from sglang_vc.compress.base import DroppedKV, QuantizedKV

    fields = dict(meta["fields"])
    if "dtype" in fields:
        fields["dtype"] = _DTYPES[fields["dtype"]]
    cls = {"QuantizedKV": QuantizedKV, "DroppedKV": DroppedKV}[meta["result"]]
    return cls(**fields, **tensors)


def transcode(blob: bytes, config: CompressionConfig) -> bytes:
    """``blob`` re-encoded under ``config`` (``config.reachable_from`` its own config;
    ``ValueError`` otherwise). Full and quantized blobs are decoded and encoded again;
    a token-dropped blob keeps ``max(1, floor(ratio * tokens))`` of its rows per
    (layer, head), chosen by the same method among the rows it kept."""
    from fractions import Fraction

    from sglang_vc.compress.base import DroppedKV, num_kept

    meta, tensors = _load(blob)
    src = CompressionConfig.parse(meta["config"])
    if src == config:
        return blob
    if not config.reachable_from(src):
        raise ValueError(f"a {src.label} blob cannot become {config.label} without the full KV")
    if not src.drops_tokens:
        _, kv, _ = decode(blob)
        return encode(kv, config)
    res = _result(meta, tensors)
    keep = num_kept(int(meta["tokens"]), config.ratio)
    if keep < res.n_keep:
        sub = _compressor(config.method).compress(0, res.k, res.v, Fraction(keep, res.n_keep))
        res = DroppedKV(
            layer_idx=res.layer_idx, num_tokens=res.num_tokens, bit_scheme=res.bit_scheme,
            kept_positions=res.kept_positions.gather(1, sub.kept_positions), k=sub.k, v=sub.v,
        )
    meta = {k: v for k, v in meta.items() if k not in ("result", "fields")}
    return _save_result(dict(meta, config=config.label), res)


def estimate_bytes(full: int, num_tokens: int, config: CompressionConfig, itemsize: int = 4) -> int:
    """Blob size of a context of ``full`` dense bytes and ``num_tokens`` tokens under
    ``config``, without encoding it (within a few hundred bytes of the real blob).

    Quantized: codes of ``bits`` per element plus a scale and a zero-point in the KV
    dtype per group of 32 (keys per channel over 32 tokens, values per token over 32
    channels), and the tail past the last whole group of tokens in full precision.
    """
    header = 512
    if config.is_full:
        return full + header
    if config.is_quantized:
        g = QUANT_GROUP_SIZE
        n_q = num_tokens // g * g
        per_tok = full / max(num_tokens, 1)  # dense bytes per token
        elems = per_tok / itemsize  # K and V elements per token
        quant = n_q * elems * (config.bits / 8 + 2 * itemsize / g)
        tail = (num_tokens - n_q) * per_tok
        return int(math.ceil(quant + tail)) + header
    # token dropping: kept rows (all heads keep the same count) + an int64 position per
    # kept row and (layer, head); layers*heads read off the bytes assuming head_dim 64
    keep = max(1, math.floor(config.ratio * num_tokens))
    per_tok = full / max(num_tokens, 1)
    return int(keep * per_tok + keep * per_tok / (16 * itemsize)) + header
