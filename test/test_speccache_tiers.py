"""SpecCache's chunk KV in every tier of SGLang's cache (``--enable-hierarchical-cache``
with a ``file`` storage backend): the same request is answered from chunks found on
the device, loaded back from HiCache's host pool after the device evicted them, and
prefetched from storage after the device and host were flushed. Each tier is counted
in the response, and the answer is the same token for token (the reused rows are byte
copies of the chunk's KV, wherever it was kept). The request that first finds its
chunks evicted from the device recomputes them (lost: its answer is a full prefill's)
and reports them; the next one fetches them from where HiCache kept them. A flush the
front end hears of: the next request fetches them at once."""

from __future__ import annotations

import json

import pytest
import requests

from sglang_vc.speccache import layout
from sglang_vc.speccache.names import DEFAULT_SEPARATOR as SEP
from sglang_vc.testing.files import wait_for_files
from sglang_vc.testing.server import ServerProcess

from conftest import real_text_passages

DEVICE_TOKENS = 1200  # two 130-token chunks plus a query fit; ten more chunks do not


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speccache_tiers")
    storage = folder / "storage"
    storage.mkdir()
    proc = ServerProcess([
        "--dtype", "float32", "--max-total-tokens", str(DEVICE_TOKENS),
        "--speccache-selector", "epic", "--speccache-ratio", "0.2",
        "--enable-hierarchical-cache", "--hicache-size", "1",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--hicache-storage-backend", "file", "--file-storage-path", str(storage),
        # SGLang prefetches from storage only runs of at least this many tokens (256 by default)
        "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 32}),
    ], log_path=folder / "server.log")
    yield proc, storage
    proc.stop()


@pytest.mark.slow  # 15-min default budget: host and storage chunk hits are served only here
def test_chunks_hit_from_device_host_and_storage(tiered, tokenizer):
    proc, storage = tiered
    passages = real_text_passages(12, words=100)
    chunks = [p + "\n" for p in passages[:2]]
    text = "Answer from the documents.\n" + SEP + SEP.join(chunks) + SEP + "Question: what is it about?\nAnswer:"

    def ask(lost: int = 0):
        r = requests.post(proc.url + "/generate", json={
            "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]["sglang_vc_speccache"][0]
        assert meta["chunks_lost"] == lost and (meta["tokens_reused"] > 0) == (lost == 0), meta
        hits = {tier: meta[f"chunk_hits_{tier}"] for tier in ("device", "host", "storage")}
        return r.json()["output_ids"], {**hits, "computed": meta["chunk_misses"]}

    first, where = ask()
    assert where == {"device": 0, "host": 0, "storage": 0, "computed": 2}
    answer, where = ask()
    assert where == {"device": 2, "host": 0, "storage": 0, "computed": 0} and answer == first

    # ten other chunks (about 1700 tokens) push the first two out of the device pool;
    # HiCache wrote them through to the host when they were inserted
    others = requests.post(proc.url + "/speccache/chunks", json={"chunks": [p + "\n" for p in passages[2:]]})
    assert others.status_code == 200 and set(others.json()["sources"]) == {"computed"}, others.text
    lost, _ = ask(lost=2)  # the prefill finds them gone from the device and recomputes them
    answer, where = ask()
    assert where == {"device": 0, "host": 2, "storage": 0, "computed": 0}, proc.log_tail()
    assert answer == first

    # a flush empties the device and the host pool; the storage backend keeps every chunk
    tokens = sum(others.json()["tokens"]) + 2 * 100
    wait_for_files(storage, at_least=tokens)
    assert requests.post(proc.url + "/flush_cache").status_code == 200
    answer, where = ask()  # the front end forgot the flushed chunks: fetched from storage
    assert where == {"device": 0, "host": 0, "storage": 2, "computed": 0}, proc.log_tail()
    assert answer == first

    counters = requests.get(proc.url + "/server_info").json()["sglang_vc"]["counters"]["speccache"]
    assert counters["chunk_hits_host"] >= 2 and counters["chunk_hits_storage"] >= 2
    # last (the plain prompt enters the tree): the lost request's answer is a full prefill's
    prefix, *rest = text.split(SEP)
    prompt = layout.tokenize(tokenizer, prefix, rest[:-1], rest[-1])
    plain = requests.post(proc.url + "/generate", json={
        "input_ids": prompt.ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert plain.json()["output_ids"] == lost
