"""Lossy serving: decoding directly from the compressed KV cache (``--vc-compressor``).

One lossy server (SnapKV at 0.25 by default) serves every method through the per-request
override ``sampling_params.custom_params``; the shared plain server is the full-KV
reference for the identity checks.
"""

from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import real_text_passages
from sglang_vc.compress import num_kept
from sglang_vc.compress.kivi import kivi_split
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import compare, finish_type
from sglang_vc.testing.server import ServerProcess

RATIO = 0.25
CHUNK = 256
META = "sglang_vc_compression"
TOKEN_DROPPING = ["streamingllm", "knorm", "snapkv", "keydiff", "h2o", "kvzip"]
QUANTIZERS = [("kivi", 2), ("kivi", 4), ("kivi1", 1)]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def lossy_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("lossy") / "server.log"
    proc = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000",
         # prompts longer than CHUNK tokens are prefilled in chunks (compressed after the last)
         "--chunked-prefill-size", str(CHUNK),
         "--vc-compressor", "snapkv", "--vc-compression-ratio", str(RATIO)],
        log_path=log,
    )
    yield proc
    proc.stop()


def vc_section(server):
    return requests.get(server.url + "/server_info", timeout=60).json()["sglang_vc"]


def pool(server):
    return vc_section(server)["counters"]["kv_pool"]


def flush(server, attempts=60):
    """Flush the radix cache (only succeeds once the server is idle)."""
    for _ in range(attempts):
        if requests.post(server.url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.5)
    raise AssertionError("server never became idle enough to flush its cache")


def meta_of(out):
    info = out["meta_info"].get(META)
    assert info, f"no {META} in meta_info: {out['meta_info']}"
    return info[0]


@functools.lru_cache(maxsize=1)
def _corpus() -> list[str]:
    """Words of real text every CPython install carries: its license, module docstrings
    and the source of a few pure-Python stdlib modules."""
    import argparse, dataclasses, textwrap  # noqa: E401

    words = " ".join(real_text_passages(1, words=10**6)).split()
    for module in (argparse, dataclasses, textwrap):
        words += Path(module.__file__).read_text().split()
    return words


def prompt_ids(tokenizer, index: int, tokens: int) -> list[int]:
    """``tokens`` prompt tokens of passage ``index``; passages are disjoint, so no test
    reuses another's cached prefix by accident."""
    words = _corpus()[index * 1200 : index * 1200 + tokens]
    ids = tokenizer(" ".join(words))["input_ids"][:tokens]
    assert len(ids) == tokens, f"corpus too small for passage {index}"
    return ids


# ----------------------------------------------------------------------------- unit level


def test_attend_kernel_matches_sdpa_causal():
    """The kernel with a compressed prefix of 0 rows is plain causal attention; a prefix
    is visible to every query."""
    from sglang_vc.kvruntime.kernels import attend

    torch.manual_seed(0)
    q, k, v = torch.randn(5, 6, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    out = attend(q, k, v, num_prefix=0, key_positions=torch.arange(9), q_start=4, scale=None, enable_gqa=True)
    qh, kh, vh = q.movedim(0, 1), k.movedim(0, 1).repeat_interleave(3, 0), v.movedim(0, 1).repeat_interleave(3, 0)
    logits = qh @ kh.transpose(1, 2) / 8 ** 0.5
    logits = logits.masked_fill(torch.arange(9).view(1, 9) > torch.arange(4, 9).view(5, 1), float("-inf"))
    ref = (logits.softmax(-1) @ vh).movedim(0, 1)
    torch.testing.assert_close(out, ref)
    # 3 prefix rows always visible, then tail rows at positions 10.. (queries at 12..13)
    out = attend(q[:2], k[:6], v[:6], num_prefix=3, key_positions=torch.arange(10, 13), q_start=12,
                 scale=None, enable_gqa=True)
    logits = qh[:, :2] @ kh[:, :6].transpose(1, 2) / 8 ** 0.5
    hidden = torch.tensor([[False] * 3 + [False, False, False], [False] * 6])  # pos 10,11,12 <= 12
    ref = (logits.masked_fill(hidden, float("-inf")).softmax(-1) @ vh[:, :6]).movedim(0, 1)
    torch.testing.assert_close(out, ref)


def test_null_slots_are_not_rows():
    """Row positions pointing at NULL_SLOT (dropped tokens) are skipped; the others keep
    their row positions for the causal mask."""
    from sglang_vc.kvruntime import NULL_SLOT
    from sglang_vc.kvruntime.kernels import attend, live_rows

    row = torch.tensor([7, 8, NULL_SLOT, NULL_SLOT, 3, 4, 9], dtype=torch.int32)
    slots, pos = live_rows(row, 1, 7)
    assert slots.tolist() == [8, 3, 4, 9] and pos.tolist() == [1, 4, 5, 6]
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    out = attend(q, k, v, num_prefix=0, key_positions=pos, q_start=5, scale=None, enable_gqa=False)
    # the query at 5 sees positions 1, 4, 5; the one at 6 sees all four rows
    ref0 = attend(q[:1], k[:3], v[:3], num_prefix=0, key_positions=pos[:3], q_start=5, scale=None, enable_gqa=False)
    ref1 = attend(q[1:], k, v, num_prefix=0, key_positions=pos, q_start=6, scale=None, enable_gqa=False)
    torch.testing.assert_close(out, torch.cat([ref0, ref1]))


def test_per_request_override_resolution():
    from sglang_vc.kvruntime.plan import make_spec, resolve_spec

    default = make_spec("snapkv", ratio=0.25)
    assert resolve_spec(default, None) == (default, None)
    assert resolve_spec(default, {"vc_compressor": "none"}) == (None, None)
    spec, err = resolve_spec(default, {"vc_compressor": "h2o"})
    assert err is None and (spec.compressor, spec.ratio, spec.mode) == ("h2o", 0.25, "online")
    spec, err = resolve_spec(default, {"vc_compression_ratio": 0.5})
    assert (spec.compressor, spec.ratio) == ("snapkv", 0.5)
    spec, err = resolve_spec(default, {"vc_compressor": "kivi", "vc_kv_bits": 4})
    assert (spec.compressor, spec.bits, spec.scenario) == ("kivi", 4, "quantization")
    for bad in ({"vc_compressor": "kivi"}, {"vc_compressor": "nope"}, {"vc_compression_ratio": 3}):
        spec, err = resolve_spec(default, bad)
        assert spec == default and err  # the scheduler's side: it cannot reject any more


BAD_OVERRIDES = [({"vc_compressor": "kivi"}, "needs vc_kv_bits"),
                 ({"vc_compressor": "nope"}, "nope"),
                 ({"vc_compression_ratio": 3}, "(0, 1]"),
                 ({"vc_compressor": "kivi", "vc_kv_bits": 3}, "bit")]


def test_per_request_override_is_checked_against_the_server():
    from sglang_vc.kvruntime.plan import check_request, make_spec

    default = make_spec("snapkv", ratio=0.25)
    for good in (None, {}, {"other": 1}, {"vc_compressor": "none"}, {"vc_compression_ratio": 0.5},
                 {"vc_compressor": "kivi", "vc_kv_bits": 2}):
        check_request(good, default, serves_overrides=True)
    for bad, why in BAD_OVERRIDES:
        with pytest.raises(ValueError, match=re.escape(why)):
            check_request(bad, default, serves_overrides=True)
    with pytest.raises(ValueError, match="without vc_compressor"):
        check_request({"vc_kv_bits": 2}, None, serves_overrides=True)
    # a server whose cache does not apply per-request compression would ignore it
    with pytest.raises(ValueError, match="only by a server with --vc-compressor"):
        check_request({"vc_compressor": "knorm", "vc_compression_ratio": 0.5}, None, serves_overrides=False)
    check_request({"temperature_hint": 1}, None, serves_overrides=False)


def test_bad_per_request_compression_is_http_400(server, lossy_server, tokenizer):
    """Refused before it is queued, with the reason; never served with another setting."""
    ids = prompt_ids(tokenizer, 0, 40)
    for target, custom, why in [(lossy_server, bad, w) for bad, w in BAD_OVERRIDES] + [
            (server, {"vc_compressor": "knorm", "vc_compression_ratio": 0.5}, "--vc-compressor")]:
        r = requests.post(target.url + "/generate", timeout=60, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "custom_params": custom}})
        assert r.status_code == 400, (custom, r.status_code, r.text)
        assert why in r.text, (custom, r.text)
    assert generate(lossy_server, ids, 2, {"vc_compressor": "none"})["output_ids"]  # still serving


def test_config_needs_the_amount_that_fits_the_compressor():
    from sglang_vc.config import ConfigError, VCConfig

    VCConfig(vc_compressor="snapkv", vc_compression_ratio=0.25).validate()
    VCConfig(vc_compressor="kivi", vc_kv_bits=2).validate()
    for kwargs, message in [
        ({"vc_compressor": "snapkv"}, "needs --vc-compression-ratio"),
        ({"vc_compressor": "kivi"}, "needs --vc-kv-bits"),
        ({"vc_compressor": "kivi", "vc_kv_bits": 3}, "unsupported bit width"),
        ({"vc_compressor": "kivi", "vc_compression_ratio": 0.5}, "give --vc-kv-bits"),
    ]:
        with pytest.raises(ConfigError, match=message):
            VCConfig(**kwargs).validate()
    assert "lossy_serving" not in VCConfig(vc_compressor="knorm", vc_compression_ratio=0.5).enabled_mechanisms()


# ----------------------------------------------------------------------------- server


def test_server_info_shows_lossy_mode(lossy_server):
    section = vc_section(lossy_server)
    lossy = section["mechanisms"]["lossy_serving"]
    assert lossy["compressor"] == "snapkv" and lossy["compression_ratio"] == RATIO
    assert lossy["attention_backend"] == "vc_torch" and lossy["radix_cache_backend"] == "vc"
    kv = section["counters"]["kv_pool"]
    assert kv["total_tokens"] > 0 and kv["available_tokens"] + kv["evictable_tokens"] == kv["total_tokens"]


def test_identity_at_ratio_one_and_16_bits(server, lossy_server, tokenizer):
    """Keeping everything (ratio 1.0; KIVI at 16 bits) through the whole lossy path gives
    the plain server's tokens exactly."""
    overrides = [{"vc_compression_ratio": 1.0}, {"vc_compressor": "kivi", "vc_kv_bits": 16},
                 {"vc_compressor": "none"}]
    for index in (0, 1):
        ids = prompt_ids(tokenizer, index, 160)
        full = generate(server, ids, 12)["output_ids"]
        for custom in overrides:
            out = generate(lossy_server, ids, 12, custom)
            assert out["output_ids"] == full, (custom, out["output_ids"], full)
            if custom.get("vc_compressor") != "none":
                info = meta_of(out)
                assert info["prompt_tokens"] == len(ids) and info["slots_freed"] == 0


@pytest.mark.parametrize("method, amount, max_new", [
    ("streamingllm", RATIO, 12), ("knorm", RATIO, 12), ("keydiff", RATIO, 12),
    ("kivi", 4, 12),
    ("kivi", 2, 40),  # the tail reaches residual + group: one more group is quantized while decoding
])
def test_lossy_decoding_matches_offline_reference(lossy_server, model_dir, tokenizer, method, amount, max_new):
    """The server's compressed decoding == HF transformers decoding from the same
    compressed cache (prefill full, compress each layer, decode at the real positions)."""
    from sglang_vc.kvruntime.reference import lossy_greedy_reference

    ids = prompt_ids(tokenizer, 2, 200)
    key = "vc_compression_ratio" if isinstance(amount, float) else "vc_kv_bits"
    out = generate(lossy_server, ids, max_new, {"vc_compressor": method, key: amount})
    ref = lossy_greedy_reference(model_dir, ids, max_new, method, amount)
    result = compare(ref, out["output_ids"], finish_type(out))
    assert result.identical, f"wrong token at {result.wrong_token_at}: {out['output_ids']} vs {ref.tokens}"
    info = meta_of(out)
    if key == "vc_compression_ratio":
        assert info["tokens_kept"] == num_kept(len(ids), RATIO)
        assert info["slots_freed"] == len(ids) - info["tokens_kept"]
    else:
        n_quant = kivi_split(len(ids), 32, 128)[0]
        streamed = 32 if len(ids) - n_quant + max_new - 1 >= 128 + 32 else 0
        assert n_quant > 0 and info["tokens_quantized"] == n_quant + streamed
        assert info["slots_freed"] == n_quant + streamed


def test_every_method_serves_concurrently(lossy_server, tokenizer):
    """All methods at once in one batch, through the HTTP API, on the same prompt."""
    ids = prompt_ids(tokenizer, 3, 200)
    n = len(ids)
    cases = [({"vc_compressor": m}, m) for m in TOKEN_DROPPING]
    cases += [({"vc_compressor": m, "vc_kv_bits": b}, m) for m, b in QUANTIZERS]
    outs = concurrently(lambda custom: generate(lossy_server, ids, 10, custom), [(c,) for c, _ in cases])
    for (custom, method), out in zip(cases, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "length", (custom, out["meta_info"])
        assert len(out["output_ids"]) == 10 and out["text"], custom
        info = meta_of(out)
        assert info["compressor"] == method and info["prompt_tokens"] == n
        if method in TOKEN_DROPPING and method != "h2o":
            assert info["tokens_kept"] == num_kept(n, RATIO)
        elif method == "h2o":  # online: the budget follows the length, evictions continue
            # n + 9 positions after 9 decode steps (+1 if an overlapped extra step ran)
            assert info["tokens_kept"] in (num_kept(n + 9, RATIO), num_kept(n + 10, RATIO))
            assert info["online_evicted"] > 0
        else:
            assert info["tokens_quantized"] > 0 and info["payload_bytes"] > 0
    counters = vc_section(lossy_server)["counters"]["compression"]
    assert all(counters.get(f"requests_{m}", 0) >= 1 for m in TOKEN_DROPPING + ["kivi", "kivi1"])


def _used_tokens_while_decoding(server, ids, custom, max_new=24):
    """Pool tokens in use (not free, not evictable cache) once the request's prefill is
    done (its first token has streamed back), read while it decodes."""
    flush(server)
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "custom_params": custom}
    used, first = None, None
    with requests.post(server.url + "/generate", json={"input_ids": ids, "stream": True,
                       "sampling_params": params}, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            if used is None:
                first = json.loads(line[6:])
                kv = pool(server)
                used = kv["total_tokens"] - kv["available_tokens"] - kv["evictable_tokens"]
    assert used is not None, "no output streamed"
    return used, first  # first chunk: its meta_info has the compression summary


def test_memory_is_freed_in_the_device_pool(lossy_server, tokenizer):
    """After prefill, a compressed request holds ~ratio of the pool slots of a full one; a
    quantized one its full-precision residual and the slots leased for its payload."""
    ids = prompt_ids(tokenizer, 4, 600)  # three prefill chunks
    n = len(ids)
    full, _ = _used_tokens_while_decoding(lossy_server, ids, {"vc_compressor": "none"})
    lossy, out = _used_tokens_while_decoding(lossy_server, ids, {"vc_compressor": "knorm"})
    quant, qout = _used_tokens_while_decoding(lossy_server, ids, {"vc_compressor": "kivi", "vc_kv_bits": 2})
    keep = num_kept(n, RATIO)
    residual = n - kivi_split(n, 32, 128)[0]
    print(f"pool tokens in use after prefill of {n} tokens: full {full}, knorm@{RATIO} {lossy} "
          f"(kept {keep}), kivi2 {quant} (full-precision residual {residual}, payload "
          f"{meta_of(qout)['payload_bytes']} B in {meta_of(qout)['payload_slots']} leased slots)")
    assert full >= n
    assert keep <= lossy <= keep + 24 + 2  # kept rows + tokens generated while polling
    leased = meta_of(qout)["payload_slots"]
    assert 0 < leased < n // 4  # 2-bit codes of the fp32 pool's rows, with their scales
    assert residual + leased <= quant <= residual + leased + 24 + 2
    assert meta_of(out)["slots_freed"] == n - keep


def test_shared_full_prefix_is_reused_not_corrupted(lossy_server, tokenizer):
    """A lossy request may start from a full prefix cached by a full request; it is
    compressed into its own slots, and the cached prefix stays intact."""
    flush(lossy_server)
    base = prompt_ids(tokenizer, 5, 200)
    a = base + prompt_ids(tokenizer, 6, 16)
    b = base + prompt_ids(tokenizer, 7, 80)
    full = {"vc_compressor": "none"}
    lossy = {"vc_compressor": "streamingllm"}
    a1 = generate(lossy_server, a, 10, full)
    b_shared = generate(lossy_server, b, 10, lossy)
    info = meta_of(b_shared)
    assert b_shared["meta_info"]["cached_tokens"] >= len(base) - 1
    assert info["cached_prefix_tokens"] == b_shared["meta_info"]["cached_tokens"]
    assert info["tokens_kept"] == num_kept(len(b), RATIO)
    a2 = generate(lossy_server, a, 10, full)
    assert a2["meta_info"]["cached_tokens"] >= len(a) - 1  # the full prefix is still cached
    assert a2["output_ids"] == a1["output_ids"]  # ... and not overwritten
    c = generate(lossy_server, b, 4, full)  # b's compressed KV was never inserted
    assert c["meta_info"]["cached_tokens"] < len(b) - 1
    flush(lossy_server)
    b_fresh = generate(lossy_server, b, 10, lossy)
    assert meta_of(b_fresh)["cached_prefix_tokens"] == 0
    assert b_fresh["output_ids"] == b_shared["output_ids"]


def test_no_slot_leak_after_many_requests(lossy_server, tokenizer):
    """A mixed batch (every method, full KV, requests that end at their prefill, streamed
    ones) gives every pool slot back."""
    flush(lossy_server)
    initial = pool(lossy_server)
    assert initial["available_tokens"] == initial["total_tokens"]
    ids = [prompt_ids(tokenizer, i, n) for i, n in ((8, 48), (9, 120), (10, 200))]
    customs = ([{"vc_compressor": m} for m in TOKEN_DROPPING]
               + [{"vc_compressor": m, "vc_kv_bits": b} for m, b in QUANTIZERS]
               + [{"vc_compressor": "none"}, None])
    jobs = [(ids[i % 3], 1 if i % 4 == 0 else 8, custom, i % 5 == 1) for i, custom in enumerate(customs)]
    for custom in ({"vc_compressor": "h2o", "vc_compression_ratio": 0.5}, {"vc_compressor": "kivi", "vc_kv_bits": 2}):
        jobs.append((ids[2] + ids[1], 8, custom, False))  # 320 tokens: a chunked prefill

    def run(ids_, max_new, custom, stream):
        if not stream:
            return generate(lossy_server, ids_, max_new, custom)
        params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "custom_params": custom}
        with requests.post(lossy_server.url + "/generate", json={"input_ids": ids_, "stream": True,
                           "sampling_params": params}, stream=True, timeout=600) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line]

    concurrently(run, jobs)
    kv = pool(lossy_server)
    assert kv["protected_tokens"] == 0
    assert kv["available_tokens"] + kv["evictable_tokens"] == kv["total_tokens"]
    flush(lossy_server)
    assert pool(lossy_server)["available_tokens"] == initial["available_tokens"]
