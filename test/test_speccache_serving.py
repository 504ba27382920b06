"""SpecCache's server path: RAG prompts whose chunks are marked with the separator reuse
the chunks' KV from the radix tree and recompute the selected tokens.

* With every chunk token recomputed (``full-recompute``, rho = 1) the tokens equal a full
  prefill of the same token ids, token for token.
* With reuse, the server's greedy tokens equal the lab's exact HF simulation of the same
  selection (float32), and the counters prove the reuse path: chunks hit in the tree,
  rows reused, only the selected tokens computed.
* Bad chunk layouts and options are HTTP 400s.
"""

from __future__ import annotations

import pytest
import requests
import torch

from sglang_vc.speccache import layout
from sglang_vc.speccache.names import DEFAULT_SEPARATOR as SEP
from sglang_vc.testing.server import ServerProcess

from conftest import assert_refused_then_serves, real_text_passages

N = 8  # answer tokens compared


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speccache")
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "12000", "--enable-metrics",
                          "--speccache-selector", "epic", "--speccache-ratio", "0.2"],
                         log_path=folder / "server.log")
    yield proc
    proc.stop()


def _pieces(tag: str, k: int = 3, words: int = 90):
    """A prefix, ``k`` chunks and a query; ``tag`` makes the prefix (so the prompt) of each
    test its own: a prompt another test cached in full would be an exact prefix hit."""
    passages = real_text_passages(k + 1, words=words)
    return f"Answer from the documents below ({tag}).\n", [p + "\n" for p in passages[:k]], \
        "Question: what is the first document about?\nAnswer:"


def _prompt(prefix, chunks, query) -> str:
    return prefix + SEP + SEP.join(chunks) + SEP + query


def _generate(proc, payload: dict, n: int = N, **custom):
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if custom:
        sampling["custom_params"] = custom
    return requests.post(proc.url + "/generate", json={**payload, "sampling_params": sampling})


def _counters(proc) -> dict:
    return requests.get(proc.url + "/server_info").json()["sglang_vc"]["counters"].get("speccache", {})


def test_full_recompute_equals_a_full_prefill(rag, tokenizer):
    prefix, chunks, query = _pieces("full")
    prompt = layout.tokenize(tokenizer, prefix, chunks, query)
    full = _generate(rag, {"input_ids": prompt.ids})
    assert full.status_code == 200, full.text
    got = _generate(rag, {"text": _prompt(prefix, chunks, query)}, speccache_selector="full-recompute")
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == full.json()["output_ids"]
    meta = got.json()["meta_info"]["sglang_vc_speccache"][0]
    assert meta["tokens_reused"] == 0 and meta["chunks"] == 3 and meta["chunks_lost"] == 0


def _lab_answer(model_dir, prompt: layout.Prompt, recompute: torch.Tensor, n: int) -> list[int]:
    from sglang_vc.bench import speccache_hf as sc
    from sglang_vc.bench.lossy_hf import Session, load_model
    from sglang_vc.speccache import rope

    sess = Session(load_model(model_dir, "float32"))
    kvs = [sc.chunk_kv(sess, ids) for ids in prompt.chunk_ids]
    reused = sc.assemble(len(prompt.ids), prompt.chunks.starts, kvs, rope.hf_cos_sin(sess.model))
    logits, fused = sc.selective_prefill(sess, prompt.ids, reused, recompute)
    out = [int(logits.argmax())]
    cache = fused.cache()
    while len(out) < n:
        out.append(int(sess.step(cache, out[-1]).argmax()))
    return out


def test_reuse_matches_the_lab_token_for_token(rag, tokenizer, model_dir):
    """``epic`` at rho = 0.2 (the server's flags): each chunk's first 20% recomputed, the
    rest reused at its position. The answer equals the HF simulation of the same
    selection; the meta says the chunks were hit and their rows reused."""
    from sglang_vc.speccache.selectors import SelectionInput, get_selector

    prefix, chunks, query = _pieces("epic")
    prompt = layout.tokenize(tokenizer, prefix, chunks, query)
    before = _counters(rag)
    got = _generate(rag, {"text": _prompt(prefix, chunks, query)})
    assert got.status_code == 200, got.text
    after = _counters(rag)
    mask = get_selector("epic").select(SelectionInput(prompt.chunks), 0.2)
    recompute = mask | ~prompt.chunks.mask()
    assert got.json()["output_ids"] == _lab_answer(model_dir, prompt, recompute, N)
    meta = got.json()["meta_info"]["sglang_vc_speccache"][0]
    chunk_tokens = prompt.chunks.num_chunk_tokens
    # the front end's fetch found the chunks (another test's) or computed them; the prefill found them
    assert meta["chunk_hits_device"] + meta["chunk_misses"] == 3 and meta["chunks_lost"] == 0
    assert meta["tokens_reused"] == chunk_tokens - int(mask.sum())
    cached = got.json()["meta_info"]["cached_tokens"]  # an exact prefix from the tree (e.g. the prefix's words)
    assert meta["tokens_recomputed"] + cached == len(prompt.ids) - meta["tokens_reused"]
    assert after["tokens_reused"] - before.get("tokens_reused", 0) == meta["tokens_reused"]


def test_cacheblend_selects_in_the_prefill_as_the_lab_does(rag, tokenizer, model_dir):
    """``cacheblend`` at rho = 0.2: the server's first pass (layer 0 over every token,
    stopped at layer 1's attention) picks the chunk tokens whose layer-1 K/V deviate most
    from the reused ones; the answer equals the HF simulation of the same selector (the
    lab's own deviation and selection), and exactly the budget is recomputed."""
    from sglang_vc.bench import speccache_hf as sc
    from sglang_vc.bench.lossy_hf import Session, load_model
    from sglang_vc.speccache import rope
    from sglang_vc.speccache.selectors import SelectionInput, get_selector

    prefix, chunks, query = _pieces("cacheblend")
    prompt = layout.tokenize(tokenizer, prefix, chunks, query)
    got = _generate(rag, {"text": _prompt(prefix, chunks, query)}, speccache_selector="cacheblend")
    assert got.status_code == 200, got.text
    meta = got.json()["meta_info"]["sglang_vc_speccache"][0]
    budget = prompt.chunks.budget(0.2)
    assert meta["selector"] == "cacheblend" and meta["probe_s"] > 0
    assert meta["tokens_reused"] == prompt.chunks.num_chunk_tokens - budget

    sess = Session(load_model(model_dir, "float32"))
    kvs = [sc.chunk_kv(sess, ids) for ids in prompt.chunk_ids]
    reused = sc.assemble(len(prompt.ids), prompt.chunks.starts, kvs, rope.hf_cos_sin(sess.model))
    deviation = sc.first_layer_deviation(sess, prompt.ids, reused)
    mask = get_selector("cacheblend").select(SelectionInput(prompt.chunks, first_layer_deviation=deviation), 0.2)
    assert got.json()["output_ids"] == _lab_answer(model_dir, prompt, mask | ~prompt.chunks.mask(), N)


def test_speccache_selector_scores_with_the_small_model(rag, tokenizer):
    prefix, chunks, query = _pieces("speccache")
    got = _generate(rag, {"text": _prompt(prefix, chunks, query)}, speccache_selector="speccache",
                    speccache_ratio=0.15, speccache_return_selection=True)
    assert got.status_code == 200, got.text
    meta = got.json()["meta_info"]["sglang_vc_speccache"][0]
    assert meta["selector"] == "speccache" and meta["ratio"] == 0.15
    assert meta["front_end"]["score_s"] > 0 and "align_s" in meta["front_end"]
    prompt = layout.tokenize(tokenizer, prefix, chunks, query)
    budget = prompt.chunks.budget(0.15)
    assert meta["tokens_reused"] == prompt.chunks.num_chunk_tokens - budget
    # the positions it chose, asked for: the budget's worth, all inside chunks
    chosen = meta["selected_positions"]
    assert len(chosen) == budget and len(set(chosen)) == budget
    assert all(any(a <= p < b for a, b in zip(prompt.chunks.starts, prompt.chunks.ends)) for p in chosen)


def test_registered_chunks_are_hits(rag):
    fresh = [p + " (registered)\n" for p in real_text_passages(2, words=60)]
    r = requests.post(rag.url + "/speccache/chunks", json={"chunks": fresh})
    assert r.status_code == 200, r.text
    assert r.json()["chunks"] == 2 and r.json()["sources"] == ["computed", "computed"]
    again = requests.post(rag.url + "/speccache/chunks", json={"chunks": fresh})
    assert again.json()["sources"] == ["device", "device"]
    got = _generate(rag, {"text": _prompt("Docs:\n", fresh, "Q: why?\nA:")}, n=2)
    assert got.status_code == 200, got.text
    meta = got.json()["meta_info"]["sglang_vc_speccache"][0]
    assert meta["chunk_hits_device"] == 2 and meta["chunk_misses"] == 0 and meta["tokens_reused"] > 0


@pytest.mark.parametrize("text, custom, message", [
    ("no chunks" + SEP + "only one separator", {}, "need at least 2"),
    ("p" + SEP + "  " + SEP + "q", {}, "is empty"),
    (_prompt("p", ["chunk"], "q"), {"speccache_selector": "nope"}, "unknown selector"),
    (_prompt("p", ["chunk"], "q"), {"speccache_ratio": 1.5}, "in [0, 1]"),
    (_prompt("p", ["chunk"], "q"), {"speccache_ration": 0.1}, "unknown SpecCache request keys"),
    (_prompt("p", ["chunk"], "q"), {"_speccache_plan": {}}, "set by the server"),
    (_prompt("p", ["chunk"], "q"), {"speccache_overlap": "no"}, "true or false"),
    ("a prompt without chunks", {"speccache_ratio": 0.1}, "need a prompt whose chunks are marked"),
    (_prompt("p", [f"chunk {i}" for i in range(65)], "q"), {}, "at most 64 chunks"),
])
def test_bad_chunk_requests_are_400(rag, text, custom, message):
    r = _generate(rag, {"text": text}, n=1, **custom)
    assert r.status_code == 400, r.text
    assert message in r.text


def test_chunked_prompt_with_an_id_outside_the_vocabulary_is_400(rag, tokenizer):
    """A SpecCache prompt given as token ids is decoded to find its chunks: an id that is
    not a token of the model is refused before that, naming it."""
    ids = tokenizer(_prompt(*_pieces("oov")))["input_ids"] + [len(tokenizer) + 10**6]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert_refused_then_serves(rag, "/generate", body, str(len(tokenizer) + 10**6))


def test_logprobs_and_bad_registrations_are_400(rag):
    r = requests.post(rag.url + "/generate", json={"text": _prompt("p", ["chunk"], "q"), "return_logprob": True,
                                                    "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "log-probabilities" in r.text
    for body in ({}, {"chunks": []}, {"chunks": ["ok", ""]}, {"chunks": "text"}, {"chunks": ["c"] * 65}):
        r = requests.post(rag.url + "/speccache/chunks", json=body)
        assert r.status_code == 400, (body, r.text)
    # a chunk holding the separator could never be marked in a prompt (it was a 500)
    r = requests.post(rag.url + "/speccache/chunks", json={"chunks": [f"source quoting {SEP} in its text"]})
    assert r.status_code == 400 and "separator" in r.text, r.text


@pytest.mark.parametrize("argv, message", [
    (["--speccache-ratio", "1.5"], "--speccache-ratio"),
    (["--speccache-selector", "nope"], "unknown selector"),
    (["--speccache-spec-model", "gpt-9"], "unknown built-in model"),
    (["--speccache-separator", " "], "non-blank"),
    (["--speccache-ratio", "0.2", "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.5"], "cannot be combined"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_readme_dsl_example_runs(rag):
    """The documented DSL program (``examples/speccache_rag.py``, shown verbatim in
    ``docs/speccache.md``) runs against the server and its prompt is served by SpecCache."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    example = root / "examples" / "speccache_rag.py"
    assert example.read_text().strip() in (root / "docs" / "speccache.md").read_text()
    before = _counters(rag).get("prefills", 0)
    out = subprocess.run([sys.executable, str(example), rag.url], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
    assert _counters(rag)["prefills"] > before


def test_chat_messages_carry_chunks(rag):
    """The OpenAI chat API: the separator inside a message marks the chunks (the chat
    template is applied around them)."""
    before = _counters(rag).get("prefills", 0)
    content = _prompt("Use the documents.\n", ["Alpha is a red planet.\n", "Beta is a blue moon.\n"],
                      "What colour is Alpha?")
    r = requests.post(rag.url + "/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert _counters(rag)["prefills"] == before + 1


def test_a_flush_makes_the_front_end_fetch_its_chunks_again(rag):
    """A cache flush empties the tree after the chunks were fetched: the front end hears
    of it and forgets them, so the next request fetches them again (computed alone:
    misses) instead of finding them gone in its prefill (nothing lost), reuses them, and
    answers as the request before the flush did. (Chunks lost to eviction, which the
    front end does not hear of: ``test_speccache_tiers``.)"""
    prefix, chunks, query = _pieces("flushed", k=2, words=60)
    chunks = [f"(flushed {i}) {c}" for i, c in enumerate(chunks)]  # no other test's chunk starts so
    text = _prompt(prefix, chunks, query)
    first = _generate(rag, {"text": text})
    assert first.json()["meta_info"]["sglang_vc_speccache"][0]["chunk_misses"] == 2
    fetched = _counters(rag).get("chunks_fetched", 0)
    assert fetched >= 2, fetched  # the counter sees the first request's fetch
    hit = _generate(rag, {"text": text})
    meta = hit.json()["meta_info"]["sglang_vc_speccache"][0]
    assert meta["chunk_hits_device"] == 2 and meta["chunk_misses"] == 0
    assert _counters(rag).get("chunks_fetched", 0) == fetched  # known chunks: no fetch sent
    assert requests.post(rag.url + "/flush_cache").status_code == 200
    again = _generate(rag, {"text": text})
    meta = again.json()["meta_info"]["sglang_vc_speccache"][0]
    assert meta["chunk_misses"] == 2 and meta["chunks_lost"] == 0 and meta["tokens_reused"] > 0
    assert again.json()["output_ids"] == hit.json()["output_ids"] == first.json()["output_ids"]


def test_scoring_beside_or_after_the_fetch_selects_the_same_tokens(rag):
    """``speccache_overlap: false`` runs the small model's scoring after the chunks'
    fetch instead of beside it: the same positions chosen, the same answer, and the
    front end's measured time holds both parts one after the other."""
    prefix, chunks, query = _pieces("overlap", k=2, words=60)
    chunks = [f"(overlap {i}) {c}" for i, c in enumerate(chunks)]
    text = _prompt(prefix, chunks, query)
    got = {}
    for overlap in (True, False):
        assert requests.post(rag.url + "/flush_cache").status_code == 200  # each fetch computes its chunks
        r = _generate(rag, {"text": text}, speccache_selector="speccache", speccache_ratio=0.2,
                      speccache_return_selection=True, speccache_overlap=overlap)
        assert r.status_code == 200, r.text
        got[overlap] = r.json()
    for overlap, out in got.items():
        meta = out["meta_info"]["sglang_vc_speccache"][0]
        times = meta["front_end"]
        assert meta["chunk_misses"] == 2 and times["fetch_s"] > 0 and times["score_s"] > 0, meta
        parts = times["tokenize_s"] + times["score_s"] + times["fetch_s"]
        if not overlap:  # sequential: at least the sum (rounded to the microsecond)
            assert times["front_end_s"] >= parts - 1e-5, times
        assert times["front_end_s"] >= times["tokenize_s"] + max(times["score_s"], times["fetch_s"]) - 1e-5
    assert got[True]["output_ids"] == got[False]["output_ids"]
    assert (got[True]["meta_info"]["sglang_vc_speccache"][0]["selected_positions"]
            == got[False]["meta_info"]["sglang_vc_speccache"][0]["selected_positions"])
