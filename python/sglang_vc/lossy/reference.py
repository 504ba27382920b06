"""Offline reference of lossy decoding with HF transformers: prefill with full KV,
compress each layer's KV with the same compressor, then decode greedily from the
compressed cache at the real positions. The server's lossy serving must produce the same
tokens (up to near-ties, see ``sglang_vc.testing.reference``).

Only for methods that need no queries (StreamingLLM, KNorm, KeyDiff) and for the
quantizers (KIVI): the queries SnapKV/H2O/KVzip score with are not exposed by HF.
"""

from __future__ import annotations

import torch

from sglang_vc.compress import get_compressor
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
    for layer, cached in enumerate(full.layers):
        k = cached.keys[0].transpose(0, 1)  # [n, H, D], RoPE applied
        v = cached.values[0].transpose(0, 1)
        kk, vv, _ = comp.decompress(comp.compress(layer, k, v, amount))
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
    return Reference(tokens, gaps, tops)
