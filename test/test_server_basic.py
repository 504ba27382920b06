"""The foundation, end to end on a real server with the embedded model (float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from conftest import assert_refused_then_serves, bad_token_requests, real_text_passages
from sglang_vc.testing.reference import compare, finish_type, greedy_reference

MAX_NEW = 32


def test_greedy_matches_transformers(server, model_dir, tokenizer):
    """Server greedy tokens == HF transformers greedy tokens, token by token."""
    prompts = real_text_passages(4)
    matched = compared = near_ties = 0
    for text in prompts:
        ids = tokenizer(text)["input_ids"]
        out = server.generate(input_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True)
        ref = greedy_reference(model_dir, ids, MAX_NEW)
        result = compare(ref, out["output_ids"], finish_type(out))
        assert result.identical, (
            f"wrong token at step {result.wrong_token_at}: server {out['output_ids']} "
            f"vs reference {ref.tokens}"
        )
        matched += result.matched
        compared += result.compared
        near_ties += result.near_tie_divergence
    print(f"greedy match: {matched}/{compared} tokens, near-tie divergences: {near_ties}")
    assert compared == 4 * MAX_NEW
    assert matched >= compared - MAX_NEW * near_ties


def test_default_model_is_served(server):
    info = requests.get(server.url + "/model_info", timeout=30).json()
    assert info["model_path"].rstrip("/").endswith("smollm2-135m")
    models = requests.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "smollm2-135m"


def test_responses_api_answers(server, tokenizer):
    """OpenAI's Responses API (``/v1/responses``, enabled by ``openai-harmony``): the
    input goes through the chat template, and the greedy output text is the chat API's
    (SGLang's Responses API may stop a few tokens sooner at the same ``max`` tokens)."""
    question = "Name one primary color."
    r = requests.post(server.url + "/v1/responses", json={
        "model": "smollm2-135m", "input": question, "max_output_tokens": 16, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")  # 16 tokens may cut it
    texts = [c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"]
             if c["type"] == "output_text"]
    chat = requests.post(server.url + "/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
        "temperature": 0}, timeout=120).json()
    assert len(texts) == 1 and texts[0].strip()  # the same greedy text, possibly cut sooner
    assert chat["choices"][0]["message"]["content"].startswith(texts[0])
    templated = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert body["usage"]["input_tokens"] == len(templated)


def test_chat_completion_uses_chat_template(server, tokenizer):
    messages = [{"role": "user", "content": "Name one primary color."}]
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "smollm2-135m", "messages": messages, "max_tokens": 16, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    templated = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert body["usage"]["prompt_tokens"] == len(templated)
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]


def test_chat_completion_streaming(server):
    payload = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Count from one to five."}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    chunks = []
    with requests.post(server.url + "/v1/chat/completions", json=payload, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert len(deltas) > 1, "streaming should deliver several chunks"
    streamed = "".join(deltas)
    plain = requests.post(
        server.url + "/v1/chat/completions", json={**payload, "stream": False}, timeout=120
    ).json()
    assert streamed == plain["choices"][0]["message"]["content"]


def test_frontend_dsl_program(server):
    import sglang as sgl

    @sgl.function
    def quiz(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))
        s += sgl.user("Is the sky blue or green? Answer with one word.")
        s += sgl.assistant(sgl.select("color", choices=["blue", "green"]))

    backend = sgl.RuntimeEndpoint(server.url)
    state = quiz.run(question="What is 2 + 2?", backend=backend)
    assert isinstance(state["answer"], str) and state["answer"]
    assert state["color"] in ("blue", "green")


def test_prefix_cache_reports_cached_tokens(server, tokenizer):
    prefix = " ".join(real_text_passages(3, words=150))
    ids = tokenizer(prefix)["input_ids"]
    first = server.generate(input_ids=ids + [13], max_new_tokens=4)
    second = server.generate(input_ids=ids + [29], max_new_tokens=4)
    assert first["meta_info"]["cached_tokens"] < len(ids) // 2
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 1


def test_server_info_has_sglang_vc_section(server):
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path, timeout=30).json()
        section = info["sglang_vc"]
        assert section["version"]
        assert section["platform"] == "TorchCpuPlatform"
        assert section["device"] == "cpu"
        assert section["mechanisms"] == {}
        assert "counters" in section


@pytest.mark.parametrize(
    "payload, raw",
    [
        (None, b'{"text": "hello", "sampling_params": {'),  # malformed JSON
        ({"text": "hello", "sampling_params": {"max_new_tokens": -3}}, None),
        ({"input_ids": [42] * 9000, "sampling_params": {"max_new_tokens": 4}}, None),
        ({"text": "hello", "sampling_params": {"temperature": -1.0}}, None),
    ],
    ids=["malformed-json", "negative-max-new-tokens", "prompt-longer-than-context", "negative-temperature"],
)
def test_bad_request_gets_4xx_and_server_keeps_serving(server, payload, raw):
    if raw is not None:
        r = requests.post(server.url + "/generate", data=raw,
                          headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = requests.post(server.url + "/generate", json=payload, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.text.strip(), "the error must carry a message"
    ok = server.generate(text="The capital of France is", max_new_tokens=4)
    assert len(ok["output_ids"]) == 4


VOCAB = 49152  # smollm2-135m


@pytest.mark.parametrize("case", list(bad_token_requests(VOCAB)))
def test_token_ids_outside_the_vocabulary_are_http_400(server, model_dir, case):
    """An id outside ``[0, vocab_size)`` used to reach the embedding lookup and kill the
    scheduler; it is refused with a 400 naming it, and the server keeps serving."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert cfg["vocab_size"] == VOCAB
    assert_refused_then_serves(server, *bad_token_requests(VOCAB)[case])
