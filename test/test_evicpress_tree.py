"""EvicPress's device tier: contexts the utility policy keeps on the device are nodes of
SGLang's radix tree that EvicPress pins; over the device budget the knapsack demotes
them (or, with a token-dropping config, keeps only their kept rows there).

The delay model is pinned (no start-up measurement decides a placement)."""

from __future__ import annotations

import json

import pytest

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.evicpress import CTX_TOKENS

FULL_BYTES = CTX_TOKENS * 46080  # float32 KV of SmolLM2-135M


def _server(tmp_path_factory, name: str, *extra: str):
    from sglang_vc.testing.server import ServerProcess

    root = tmp_path_factory.mktemp(name)
    gb = FULL_BYTES / (1 << 30)
    args = [
        "--dtype", "float32", "--max-total-tokens", "2048",
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--radix-cache-backend", "evicpress",
        *(() if "--hicache-storage-backend" in extra else ("--evicpress-disk-dir", str(root / "disk"))),
        "--evicpress-device-size-gb", f"{1.5 * gb:.6f}",  # one full context, not two
        "--evicpress-host-size-gb", f"{3 * gb:.6f}", "--evicpress-disk-size-gb", f"{3 * gb:.6f}",
        "--evicpress-no-profiler", "--evicpress-auto-context-tokens", "0",
        "--evicpress-host-bandwidth", "10", "--evicpress-disk-bandwidth", "1",
        "--evicpress-decompress-bandwidth", "5", "--evicpress-prefill-tokens-per-s", "200",
        *extra,
    ]
    return ServerProcess(args, log_path=root / "server.log", timeout=420)


@pytest.fixture(scope="module")
def tier_server(tmp_path_factory):
    proc = _server(tmp_path_factory, "evicpress-tree", "--evicpress-policy", "lru")
    yield proc
    proc.stop()


def test_device_tier_pins_demotes_and_promotes(tier_server, tokenizer):
    """LRU over device -> host -> disk: a computed context is kept on the device (its
    tree node pinned, so evicting the tree keeps it); a second one pushes the older to
    the host; a host hit brings it back to the device and pushes the other down."""
    from conftest import real_text_passages

    s = tier_server
    passages = real_text_passages(6, words=220)
    a = epx.register(s, tokenizer, "a", passages[0])[0]
    b = epx.register(s, tokenizer, "b", passages[1])[0]
    status = epx.api(s, "GET", "/evicpress/status")
    assert abs(status["tiers"]["device"]["capacity_bytes"] - 1.5 * FULL_BYTES) < 4096  # the flag is in GiB

    first_a = epx.ask(s, tokenizer, a, ignore_eos=True)["output_ids"]  # miss: stored on the device tier
    p = epx.placement(s, "a")
    assert (p["tier"], p["config"]) == ("device", "full"), p
    pool = epx.kv_pool(s)
    assert pool["protected_tokens"] >= CTX_TOKENS, pool  # pinned by EvicPress
    epx.api(s, "POST", "/evicpress/evict_device")
    c0 = epx.counters(s)
    assert epx.ask(s, tokenizer, a, ignore_eos=True)["output_ids"] == first_a
    assert epx.counters(s).get("hits_device", 0) == c0.get("hits_device", 0) + 1  # survived the eviction

    first_b = epx.ask(s, tokenizer, b, ignore_eos=True)["output_ids"]  # miss: b enters the device, a (older) goes down
    assert epx.placement(s, "b")["tier"] == "device" and epx.placement(s, "a")["tier"] == "host"
    status = epx.api(s, "GET", "/evicpress/status")
    assert status["host_backups"] == 1  # a's full host copy is SGLang's backup of its tree nodes
    assert status["tiers"]["device"]["used_bytes"] <= status["tiers"]["device"]["capacity_bytes"]
    assert status["tiers"]["device"]["contexts"] == 1

    epx.api(s, "POST", "/evicpress/evict_device")
    c0 = epx.counters(s)
    again = epx.ask(s, tokenizer, a, ignore_eos=True)  # host -> device, and promoted to the device tier
    c1 = epx.counters(s)
    assert c1.get("hits_host", 0) == c0.get("hits_host", 0) + 1
    assert again["output_ids"] == first_a and again["meta_info"]["cached_tokens"] >= CTX_TOKENS
    # SGLang's own host hit: its scheduler loaded the HiCache backup back (not EvicPress);
    # the question asked before was written through with the context, so it is a host hit too
    assert again["meta_info"]["cached_tokens_details"]["host"] >= CTX_TOKENS, again["meta_info"]
    assert epx.placement(s, "a")["tier"] == "device" and epx.placement(s, "b")["tier"] == "host"
    assert c1.get("promotions", 0) > c0.get("promotions", 0)
    epx.api(s, "POST", "/evicpress/evict_device")
    assert epx.ask(s, tokenizer, b, ignore_eos=True)["output_ids"] == first_b  # from the host again

    # Moved to the disk, a's host backup is released and evicted: a answers from the
    # disk, not from what is left in the host pool. The host pool also holds HiCache's
    # own backups of the plain rows after a context (the questions), written through
    # once their parent (the context's host copy) was backed up.
    def untracked(status):  # host pool bytes the host tier does not hold
        return status["host_pool_used_bytes"] - status["tiers"]["host"]["used_bytes"]

    status = epx.api(s, "GET", "/evicpress/status")
    assert epx.placement(s, "a")["tier"] == "host" and status["host_backups"] == 1
    before = untracked(status)  # b's released backup (its rows are on the device tier), questions
    epx.api(s, "POST", "/evicpress/contexts/a/placement", {"tier": "disk", "config": "full"})
    epx.api(s, "POST", "/evicpress/evict_device")
    status = epx.api(s, "GET", "/evicpress/status")
    assert status["host_backups"] == 0 and untracked(status) <= before, (before, status)
    c0 = epx.counters(s)
    out = epx.ask(s, tokenizer, a, ignore_eos=True)
    assert out["output_ids"] == first_a and out["meta_info"]["cached_tokens_details"]["host"] == 0, out["meta_info"]
    assert epx.counters(s).get("hits_disk", 0) == c0.get("hits_disk", 0) + 1


@pytest.fixture(scope="module")
def drop_tier_server(tmp_path_factory):
    """Its storage tier is SGLang's own ``file`` HiCache storage backend."""
    storage = tmp_path_factory.mktemp("hicache-file")
    proc = _server(tmp_path_factory, "evicpress-tree-drop", "--evicpress-policy", "fixed",
                   "--evicpress-fixed-config", "knorm@0.5",
                   "--hicache-storage-backend", "file",
                   "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(storage)}),
                   "--admin-api-key", "evicpress-tree-admin")  # the digest its test reads
    proc.storage_dir = storage
    proc.admin_key = "evicpress-tree-admin"
    yield proc
    proc.stop()


@pytest.mark.slow  # a second tree server; dropped contexts across tiers: test_evicpress_dropping
def test_token_dropped_device_copy_holds_only_its_kept_rows(drop_tier_server, tokenizer):
    """A context stored as knorm@0.5 on the device tier is its private node of kept rows,
    pinned: after the tree is evicted the pool holds exactly n_keep of its slots, and a
    request is served from them (no prefill of the context)."""
    from conftest import real_text_passages

    s = drop_tier_server
    ids = epx.register(s, tokenizer, "d", real_text_passages(6, words=220)[2])[0]
    epx.ask(s, tokenizer, ids, ignore_eos=True)  # miss: computed in full, stored as its kept rows
    p = epx.placement(s, "d")
    assert p["tier"] == "device" and p["config"] == "knorm@0.5", p
    epx.api(s, "POST", "/evicpress/evict_device")  # the full rows of the miss go; the kept rows stay
    pool = epx.kv_pool(s)
    assert pool["protected_tokens"] == CTX_TOKENS // 2 and pool["evictable_tokens"] == 0, pool
    assert pool["available_tokens"] == pool["total_tokens"] - CTX_TOKENS // 2, pool
    digest = epx.api(s, "GET", "/evicpress/contexts/d/digest")
    assert digest["device_slots"] == CTX_TOKENS // 2 and digest["device_tokens"] == CTX_TOKENS
    c0 = epx.counters(s)
    out = epx.ask(s, tokenizer, ids, ignore_eos=True)
    c1 = epx.counters(s)
    assert c1.get("hits_device", 0) == c0.get("hits_device", 0) + 1
    assert c1.get("dropped_prefix_requests", 0) == c0.get("dropped_prefix_requests", 0) + 1
    assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS and len(out["output_ids"]) == 8
    first = out["output_ids"]

    # the storage tier is SGLang's file backend: the kept rows go there and come back
    epx.api(s, "POST", "/evicpress/contexts/d/placement", {"tier": "disk", "config": "knorm@0.5"})
    assert epx.placement(s, "d")["tier"] == "disk"
    assert any(f.suffix == ".bin" for f in s.storage_dir.iterdir())  # HiCacheFile's objects
    epx.api(s, "POST", "/evicpress/evict_device")
    c0 = epx.counters(s)
    out = epx.ask(s, tokenizer, ids, ignore_eos=True)
    c1 = epx.counters(s)
    assert c1.get("hits_disk", 0) == c0.get("hits_disk", 0) + 1, (c0, c1)
    assert out["meta_info"]["cached_tokens"] >= CTX_TOKENS and out["output_ids"] == first


def test_without_an_admin_key_no_route_shows_what_requests_sent(tier_server):
    """On a server started without ``--admin-api-key`` a context's token ids and KV
    digests are refused (403, naming the flag); what it is may still be described."""
    import requests

    import sglang_vc.testing.evicpress as epx

    epx.api(tier_server, "POST", "/evicpress/contexts", {"id": "private", "token_ids": list(range(500, 700))})
    url = tier_server.url + "/evicpress/contexts/private"
    for r in (requests.get(url, params={"tokens": 1}, timeout=60), requests.get(url + "/digest", timeout=60)):
        assert r.status_code == 403 and "--admin-api-key" in r.text, r.text
    described = epx.api(tier_server, "GET", "/evicpress/contexts/private")
    assert "token_ids" not in described and described["num_tokens"] == 200, described
    epx.api(tier_server, "DELETE", "/evicpress/contexts/private")

