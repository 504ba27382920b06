"""The CPU's full-KV backend is SGLang's ``torch_native``, whose extend pads every
request's queries to its whole length; the project's backends (its subclasses) attend
only the added queries, with the causal mask shifted by the prefix
(``VCTorchAttnBackend._run_sdpa_forward_extend``). The output is SGLang's, on a prefill,
a verify-sized window over a long prefix and a chunk over a cached prefix, batched with
a prefill, in GQA; other masks (sliding window) stay SGLang's code."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_vc.kvruntime.backend import VCTorchAttnBackend


@pytest.mark.parametrize("prefix, t", [(0, 120), (117, 3), (100, 20)])
@pytest.mark.parametrize("window", [None, 16])
def test_extend_equals_sglangs_torch_native(prefix, t, window):
    g = torch.Generator().manual_seed(prefix + t)
    h, hq, d = 2, 6, 16
    k_cache, v_cache = torch.randn(300, h, d, generator=g), torch.randn(300, h, d, generator=g)
    req_to_token = torch.zeros(4, 200, dtype=torch.int32)
    req_to_token[1, : prefix + t] = (torch.randperm(299, generator=g)[: prefix + t] + 1).int()
    req_to_token[3, :50] = (torch.randperm(299, generator=g)[:50] + 1).int()
    q = torch.randn(t + 50, hq, d, generator=g)
    args = (k_cache, v_cache, req_to_token, torch.tensor([1, 3]), torch.tensor([prefix + t, 50]),
            torch.tensor([prefix, 0]), torch.tensor([t, 50]))
    kwargs = dict(scaling=0.25, enable_gqa=True, causal=True, sliding_window_size=window)
    backend = object.__new__(VCTorchAttnBackend)
    want = TorchNativeAttnBackend._run_sdpa_forward_extend(backend, q, torch.empty_like(q), *args, **kwargs)
    got = backend._run_sdpa_forward_extend(q, torch.empty_like(q), *args, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
