"""EvicPress with token-dropping configs on a real server (``--evicpress-policy fixed
--evicpress-fixed-config knorm@0.5``, which selects the ``vc_torch`` attention backend):
a context is stored with half its rows, a hit serves it from the kept rows without
prefilling it again, the kept rows move between tiers bit-exact, and at ratio 1 the
answer equals the full-KV answer token for token."""

from __future__ import annotations

import pytest
import requests

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.evicpress import CTX_TOKENS

FULL_BYTES = CTX_TOKENS * 46080  # float32 KV of SmolLM2-135M


@pytest.fixture(scope="module")
def drop_server(model_dir, tmp_path_factory):
    from sglang_vc.testing.server import ServerProcess

    root = tmp_path_factory.mktemp("evicpress-drop")
    gb = FULL_BYTES / (1 << 30)
    args = [
        "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "2048",
        # the README's flags only: the launcher sets the CPU platform's HiCache transfers
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--radix-cache-backend", "evicpress",
        "--evicpress-policy", "fixed", "--evicpress-fixed-config", "knorm@0.5",
        "--evicpress-disk-dir", str(root / "disk"),
        "--evicpress-host-size-gb", f"{3 * gb:.6f}", "--evicpress-disk-size-gb", f"{3 * gb:.6f}",
        "--evicpress-no-profiler", "--evicpress-auto-context-tokens", "0",
        "--evicpress-device-size-gb", "0",  # device copies: SGLang's LRU (tier tests: test_evicpress_tree)
        "--admin-api-key", "evicpress-dropping-admin",  # the digests its tests read
    ]
    proc = ServerProcess(args, log_path=root / "server.log", timeout=420)
    proc.admin_key = "evicpress-dropping-admin"
    yield proc
    proc.stop()


def _hit(server, tokenizer, ids, tier):
    """Ask with the device tree emptied first (except for a device hit); check that the
    hit came from ``tier`` and that the context was not prefilled again."""
    if tier != "device":
        epx.api(server, "POST", "/evicpress/evict_device")
    before = epx.counters(server)
    out = epx.ask(server, tokenizer, ids)
    after = epx.counters(server)
    assert after.get(f"hits_{tier}", 0) == before.get(f"hits_{tier}", 0) + 1, (before, after)
    assert after.get("misses", 0) == before.get("misses", 0)
    assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS, out["meta_info"]
    # ... and that it attended over the kept rows as a compressed prefix
    assert after.get("dropped_prefix_requests", 0) == before.get("dropped_prefix_requests", 0) + 1
    assert len(out["output_ids"]) == 8
    return out


def test_dropped_context_half_stored_served_from_kept_rows_across_tiers(drop_server, tokenizer):
    from conftest import real_text_passages

    s = drop_server
    assert "vc_torch" in s.log_path.read_text(errors="replace")  # the backend EvicPress chose
    ids = epx.register(s, tokenizer, "d1", real_text_passages(4, words=220)[0])[0]
    epx.ask(s, tokenizer, ids)  # miss: prefilled, then stored as knorm@0.5
    p = epx.placement(s, "d1")
    assert p["tier"] == "host" and p["config"] == "knorm@0.5", p
    assert 0.5 * FULL_BYTES < p["stored_bytes"] < 0.53 * FULL_BYTES, p  # rows + positions

    host = _hit(s, tokenizer, ids, "host")  # host -> device: the kept rows
    d0 = epx.api(s, "GET", "/evicpress/contexts/d1/digest")
    assert d0["device_tokens"] == CTX_TOKENS and d0["device_config"] == "knorm@0.5"
    # the device copy holds the kept rows only: n_keep pool slots for the n tokens
    kv = s.server_info()["sglang_vc"]["counters"]["kv_pool"]
    assert d0["device_slots"] == CTX_TOKENS // 2 == kv["evictable_tokens"], (d0, kv)
    assert kv["available_tokens"] == kv["total_tokens"] - CTX_TOKENS // 2, kv
    assert d0["device"] == d0["stored"]  # the device's kept rows are the stored ones
    assert epx.api(s, "GET", "/evicpress/contexts/d1")["device_config"] == "knorm@0.5"
    assert _hit(s, tokenizer, ids, "device")["output_ids"] == host["output_ids"]

    epx.api(s, "POST", "/evicpress/contexts/d1/placement", {"tier": "disk", "config": "knorm@0.5"})  # host -> disk
    assert epx.placement(s, "d1")["tier"] == "disk"
    d1 = epx.api(s, "GET", "/evicpress/contexts/d1/digest")
    assert d1["blob"] == d0["blob"] and d1["stored"] == d0["stored"]
    disk = _hit(s, tokenizer, ids, "disk")  # disk -> device
    d2 = epx.api(s, "GET", "/evicpress/contexts/d1/digest")
    assert d2["device"] == d0["device"]
    assert disk["output_ids"] == host["output_ids"]

    # shrinking a token-dropped copy re-selects among its kept rows
    epx.api(s, "POST", "/evicpress/contexts/d1/placement", {"tier": "host", "config": "knorm@0.3"})
    p = epx.placement(s, "d1")
    assert p["config"] == "knorm@0.3" and p["stored_bytes"] < 0.32 * FULL_BYTES, p
    _hit(s, tokenizer, ids, "host")
    d3 = epx.api(s, "GET", "/evicpress/contexts/d1/digest")
    assert d3["device"] == d3["stored"] != d0["stored"]
    # a token-dropped copy cannot become another method or a larger one
    for config in ("kivi@2b", "knorm@0.6", "keydiff@0.3"):
        r = requests.post(s.url + "/evicpress/contexts/d1/placement",
                          json={"tier": "host", "config": config}, headers=epx.auth(s), timeout=60)
        assert r.status_code >= 400, (config, r.text)


def test_ratio_one_answer_equals_full_kv_answer(drop_server, tokenizer):
    """knorm@1 keeps every row: served as a compressed prefix, the answer is the one
    the full KV gives (the miss computed it), token for token; a batch mixing such a
    request with an ordinary one answers both as when alone."""
    from conftest import real_text_passages

    s = drop_server
    epx.api(s, "POST", "/evicpress/reconfigure", {"policy": "fixed", "fixed_config": "knorm@1"})
    passages = real_text_passages(4, words=220)
    ids = epx.register(s, tokenizer, "r1", passages[1])[0]
    full = epx.ask(s, tokenizer, ids, n=16)  # miss: full KV
    assert epx.placement(s, "r1")["config"] == "knorm@1"
    epx.api(s, "POST", "/evicpress/evict_device")
    before = epx.counters(s)
    again = epx.ask(s, tokenizer, ids, n=16)
    assert epx.counters(s).get("hits_host", 0) == before.get("hits_host", 0) + 1
    assert again["meta_info"]["cached_tokens"] >= CTX_TOKENS
    assert again["output_ids"] == full["output_ids"]

    # batched with an ordinary request (the backend's per-request path for both)
    other = tokenizer(passages[2])["input_ids"][:120]
    alone = s.generate(input_ids=other, max_new_tokens=8)
    epx.api(s, "POST", "/evicpress/evict_device")
    import threading

    outs = {}
    threads = [threading.Thread(target=lambda: outs.__setitem__("ctx", epx.ask(s, tokenizer, ids, n=16))),
               threading.Thread(target=lambda: outs.__setitem__("other", s.generate(input_ids=other, max_new_tokens=8)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs["ctx"]["output_ids"] == full["output_ids"]
    assert outs["other"]["output_ids"] == alone["output_ids"]


@pytest.mark.slow
def test_profiler_answers_on_the_token_dropped_kv(drop_server, tokenizer):
    """The profiler's request for a token-dropping candidate (namespace
    ``evicpress:cfg:knorm@.../p1``) is served from the kept rows of the context's full KV,
    like a user hit: not prefilled again, and at ratio 1 the reference answer."""
    from conftest import real_text_passages

    from sglang_vc.evicpress.context import ref_namespace, variant_namespace

    s = drop_server
    ids = epx.register(s, tokenizer, "p1", real_text_passages(4, words=220)[3])[0]
    prompt = ids + tokenizer(epx.QUESTION, add_special_tokens=False)["input_ids"]

    def gen(ns):
        r = requests.post(s.url + "/generate", timeout=300, json={
            "input_ids": prompt, "extra_key": ns,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12}})
        assert r.status_code == 200, r.text
        return r.json()

    ref = gen(ref_namespace("p1"))  # full KV, kept as the source of the variants
    for label in ("knorm@1", "knorm@0.5"):
        before = epx.counters(s)
        out = gen(variant_namespace(label, "p1"))
        after = epx.counters(s)
        assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS, (label, out["meta_info"])
        for key in ("profile_loads", "dropped_prefix_requests"):
            assert after.get(key, 0) == before.get(key, 0) + 1, (label, key, before, after)
        if label == "knorm@1":
            assert out["output_ids"] == ref["output_ids"]
