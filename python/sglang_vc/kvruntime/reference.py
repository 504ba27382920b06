"""Offline reference of lossy decoding with HF transformers: prefill with full KV,
compress each layer's KV with the same compressor, then decode greedily from the
compressed cache at the real positions. The server's lossy serving must produce the same
tokens (up to near-ties, see ``sglang_vc.testing.reference``).

Only for methods that need no queries (StreamingLLM, KNorm, KeyDiff) and for the
quantizers (KIVI, with the server's streaming rule: once the full-precision tail reaches
``residual_length + group_size`` tokens its oldest group is quantized); the queries
SnapKV/H2O/KVzip score with are not exposed by HF.
"""

from __future__ import annotations

import torch

from sglang_vc.compress import QuantizedKV, get_compressor
from sglang_vc.compress.kivi import KIVI
from sglang_vc.testing.reference import Reference, load_hf_model


@torch.inference_mode()
def lossy_greedy_reference(model_dir: str, input_ids: list[int], max_new_tokens: int,
                           compressor: str, amount, dtype: str = "float32") -> Reference:
    from transformers import DynamicCache

    model = load_hf_model(model_dir, dtype)
    comp = get_compressor(compressor)
    if comp.needs_queries is not None or comp.mode != "offline":
        raise ValueError(f"{compressor}: no offline reference (needs queries or is online)")
    n = len(input_ids)
    out = model(torch.tensor([input_ids]), use_cache=True)
    full = out.past_key_values
    cache = DynamicCache(config=model.config)
    n_quant = 0
    for layer, cached in enumerate(full.layers):
        k = cached.keys[0].transpose(0, 1)  # [n, H, D], RoPE applied
        v = cached.values[0].transpose(0, 1)
        ckv = comp.compress(layer, k, v, amount)
        n_quant = ckv.num_quantized if isinstance(ckv, QuantizedKV) else 0
        kk, vv, _ = comp.decompress(ckv)
        cache.update(kk.transpose(0, 1).unsqueeze(0).contiguous(),
                     vv.transpose(0, 1).unsqueeze(0).contiguous(), layer)
    logits = out.logits[0, -1]
    tokens, gaps, tops = [], [], []
    for step in range(max_new_tokens):
        top2 = torch.topk(logits.float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
        tops.append(float(top2[0]))
        tokens.append(int(logits.argmax()))
        if step == max_new_tokens - 1:
            break
        kv_len = cache.get_seq_length()
        out = model(
            torch.tensor([[tokens[-1]]]),
            position_ids=torch.tensor([[n + step]]),  # the real position, not the cache length
            cache_position=torch.tensor([kv_len]),
            attention_mask=torch.ones(1, kv_len + 1, dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[0, -1]
        if comp.scenario == "quantization" and amount < 16:
            n_quant = _quantize_tail(cache, compressor, amount, n_quant)
    return Reference(tokens, gaps, tops)


def _quantize_tail(cache, compressor: str, bits: int, n_quant: int) -> int:
    comp = get_compressor(compressor)
    g, r = comp.group_size, comp.residual_length
    if cache.get_seq_length() - n_quant < r + g:
        return n_quant
    whole = get_compressor(compressor, residual_length=0)
    for layer_idx, layer in enumerate(cache.layers):
        k = layer.keys[0, :, n_quant : n_quant + g].transpose(0, 1)
        v = layer.values[0, :, n_quant : n_quant + g].transpose(0, 1)
        kk, vv = KIVI.dequantize(whole.compress(layer_idx, k, v, bits))
        layer.keys[0, :, n_quant : n_quant + g] = kk.transpose(0, 1)
        layer.values[0, :, n_quant : n_quant + g] = vv.transpose(0, 1)
    return n_quant + g
