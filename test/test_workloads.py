"""Fast tests of the benchmark workloads (sglang_vc.bench.workloads, benchmark/workloads/build.py).

No tokenizer download and no transformers import: token counts use the built-in
approximation, and the tokenizer path is tested with a small ``tokenizers`` model built
here in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_vc.bench import workloads as W
from sglang_vc.bench.workloads import code as W_code, common as W_common, json_calls as W_json

REPO = Path(__file__).resolve().parents[1]

# small but complete grids, so the whole file runs in a few seconds
PARAMS = {
    "code": dict(lengths=[512, 1024, 2048]),
    "reading": dict(lengths=[512, 1024, 2048]),
    "needle": dict(lengths=[256, 512, 1024, 2048], depths=[0.0, 0.1, 0.5, 0.9, 1.0]),
    "json_calls": dict(tool_counts=[2, 8, 30]),
    "rag": dict(chunks=3, chunk_tokens=128),
    "rag_multihop": dict(chunks=5, chunk_tokens=128),
}
N = {"code": 12, "reading": 12, "needle": 20, "json_calls": 30, "rag": 4, "rag_multihop": 6}


@pytest.fixture(scope="module")
def built():
    return {name: W.load_workload(name, n=N[name], seed=1, **PARAMS[name]) for name in W.list_workloads()}


def test_list_and_unknown():
    assert set(W.list_workloads()) == {"code", "reading", "needle", "json_calls", "rag", "rag_multihop"}
    with pytest.raises(ValueError, match="unknown workload"):
        W.load_workload("no_such_workload")
    with pytest.raises(ValueError, match="code, reading, needle, json_calls, rag, rag_multihop"):
        W.load_workload("Needle")
    with pytest.raises(TypeError):
        W.load_workload("needle", n=1, no_such_param=3)
    with pytest.raises(ValueError):
        W.load_workload("code", n=1, tasks=["nonsense"])
    with pytest.raises(ValueError):
        W.load_workload("needle", n=1, max_tokens=10)


@pytest.mark.parametrize("name", ["code", "reading", "needle", "json_calls", "rag", "rag_multihop"])
def test_deterministic(name, built):
    again = W.load_workload(name, n=N[name], seed=1, **PARAMS[name])
    assert [it["prompt"] for it in again] == [it["prompt"] for it in built[name]]
    assert again == built[name]
    assert again.provenance["items_sha256"] == built[name].provenance["items_sha256"]
    other = W.load_workload(name, n=N[name], seed=2, **PARAMS[name])
    assert [it["prompt"] for it in other] != [it["prompt"] for it in built[name]]
    # item i does not depend on n
    assert W.load_workload(name, n=3, seed=1, **PARAMS[name]) == built[name][:3]


def test_deterministic_across_processes(built):
    """Another interpreter (another hash seed) builds the same items."""
    code = (
        "import json; from sglang_vc.bench import workloads as W\n"
        f"P = {PARAMS!r}; N = {N!r}\n"
        "print(json.dumps({n: W.load_workload(n, n=N[n], seed=1, **P[n]).provenance['items_sha256'] "
        "for n in W.list_workloads()}))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {n: built[n].provenance["items_sha256"] for n in W.list_workloads()}


@pytest.mark.parametrize("name", ["code", "reading", "needle", "json_calls", "rag", "rag_multihop"])
def test_items_well_formed(name, built):
    wl = built[name]
    assert len(wl) == N[name]
    assert len({it["id"] for it in wl}) == len(wl)
    counter = W_common._get_counter(None)
    for it in wl:
        for key in ("id", "prompt", "task", "answer", "question", "source", "n_tokens", "max_new_tokens", "context_id"):
            assert key in it, (it["id"], key)
        assert it["prompt"].endswith(it["question"])
        assert it["answer"] is not None and it["answer"] != ""
        json.dumps(it)  # serialisable
        assert it["n_tokens"] == counter.count(it["prompt"])
        assert it["n_tokens"] <= wl.provenance["max_tokens"]
        L = it["target_tokens"]
        if L is not None:
            assert math.ceil(L * (1 - W_common.LENGTH_TOLERANCE)) <= it["n_tokens"] <= L, (it["id"], L, it["n_tokens"])
        # an exact answer scores 1 with the workload's own scorer
        assert W.score(it, it["answer"]) == 1.0, it["id"]
    if name in ("code", "reading", "needle"):
        assert {it["target_tokens"] for it in wl} == set(PARAMS[name]["lengths"])


def test_max_tokens_clamps_and_bounds():
    for name in W.list_workloads():
        wl = W.load_workload(name, n=4, max_tokens=600)
        assert all(it["n_tokens"] <= 600 for it in wl), name
        if name != "json_calls":
            assert all(it["target_tokens"] is None or it["target_tokens"] <= 600 for it in wl)
    wl = W.load_workload("needle", n=5)  # defaults: 8192 is clamped to the default budget
    assert max(it["target_tokens"] for it in wl) == W.DEFAULT_MAX_TOKENS < W.MODEL_CONTEXT


def test_needles_at_stated_depth(built):
    counter = W_common._get_counter(None)
    depths = set()
    for it in built["needle"]:
        nd = it["needle"]
        p = it["prompt"]
        off, text = nd["char_offset"], nd["text"]
        assert p[off : off + len(text)] == text
        assert text == f"The secret passkey is {it['answer']}."
        assert len(re.findall(rf"(?<!\d){it['answer']}(?!\d)", p)) == 1
        hs, he = nd["haystack_span"]
        assert hs <= off and off + len(text) + len(nd["separator"]) <= he
        before = p[hs:off]
        hay = before + p[off + len(text) + len(nd["separator"]) : he]
        actual = counter.count(before) / counter.count(hay)
        assert abs(actual - nd["depth_actual"]) < 1e-3
        assert abs(actual - nd["depth"]) <= 0.05, (it["id"], nd["depth"], actual)
        if nd["depth"] == 0.0:
            assert off == hs
        depths.add(nd["depth"])
        assert W.needle_found(f"The passkey is {it['answer']}.", it)
        assert not W.needle_found("The passkey is 12.", it)
        assert not W.needle_found(f"1{it['answer']}", it)
    assert depths == set(PARAMS["needle"]["depths"])


def test_code_answers_are_in_the_code(built):
    tasks = set()
    for it in built["code"]:
        p, a, src = it["prompt"], it["answer"], it["source"]
        ctx = p[: -len(it["question"])]
        name = src["function"]["name"]
        tasks.add(it["task"])
        assert os.path.isfile(src["primary"])
        assert sum(f["primary"] for f in src["files"]) == 1
        if it["task"] == "complete_body":
            assert W_code._BODY_MARKER in ctx and a not in ctx
            assert len(re.findall(rf"\bdef {re.escape(name)}\(", ctx)) == 1
            original = Path(src["primary"]).read_text().splitlines(keepends=True)
            s, e = src["removed_lines"]
            assert "".join(original[s - 1 : e]) == a
        elif it["task"] == "function_return":
            assert len(re.findall(rf"\bdef {re.escape(name)}\(", ctx)) == 1
            assert f"return {a}" in ctx
        elif it["task"] == "class_of_method":
            assert len(re.findall(rf"\bdef {re.escape(name)}\(", ctx)) == 1
            assert re.search(rf"\bclass {re.escape(a)}\b", ctx)
        elif it["task"] == "caller":
            assert a == name
            assert len(re.findall(rf"\bdef {re.escape(a)}\(", ctx)) == 1
            assert re.search(rf"\b{re.escape(src['callee'])}\(", ctx)
    assert tasks == set(W_code._CODE_TASKS)


def test_reading_answers_are_in_the_text(built):
    for it in built["reading"]:
        ctx = W_common._norm_space(it["prompt"][: -len(it["question"])])
        src = it["source"]
        if it["task"] == "quote_completion":
            assert ctx.count(" " + src["prefix"] + " ") == 1
            assert (" " + src["prefix"] + " " + it["answer"] + " ") in ctx
        else:
            k = int(it["answer"])
            assert 1 <= k <= len(src["documents"])
            section = it["prompt"].split(f"### Document {k}: ", 1)[1].split("### Document ", 1)[0]
            assert (" " + src["sentence"] + " ") in W_common._norm_space(section)
            assert ctx.count(" " + src["sentence"] + " ") == 1


def test_json_calls_answers_parse(built):
    names = {t["name"] for t, _ in W_json._TOOLS}
    for it in built["json_calls"]:
        call = json.loads(it["answer"])
        assert set(call) == {"name", "arguments"} and call["name"] in names
        schema = next(t for t in it["tools"] if t["name"] == call["name"])
        params = schema["parameters"]
        assert set(params["required"]) <= set(call["arguments"]) <= set(params["properties"])
        assert call["name"] in it["prompt"] and it["question"].startswith("User request: ")
        assert json.dumps(it["tools"], indent=1) in it["prompt"]
        # scorer: exact, with chatter and code fences, wrong args, wrong name, garbage
        assert W.json_call_score(it["answer"], it)["score"] == 1.0
        assert W.json_call_score("Sure!\n```json\n" + it["answer"] + "\n```", it)["score"] == 1.0
        bad_args = {k: "zzz-wrong" for k in call["arguments"]}
        r = W.json_call_score(json.dumps({"name": call["name"], "arguments": bad_args}), it)
        assert r["name_ok"] and not r["args_ok"] and r["score"] == 0.5
        r = W.json_call_score(json.dumps({"name": "no_such_tool", "arguments": call["arguments"]}), it)
        assert r["parsed"] and r["score"] == 0.0
        assert not W.json_call_score("I cannot do that.", it)["parsed"]
    assert len({json.loads(it["answer"])["name"] for it in built["json_calls"]}) == N["json_calls"]


def test_json_call_score_leniency():
    it = next(x for x in W.load_workload("json_calls", n=len(W_json._TOOLS)) if x["call"]["name"] == "get_weather")
    call = it["call"]
    args = dict(call["arguments"])
    args.setdefault("unit", "celsius")  # the schema's default: allowed even if not asked for
    assert W.json_call_score(json.dumps({"name": "get_weather", "arguments": args}), it)["args_ok"]
    openai = {"function": {"name": "get_weather", "arguments": json.dumps(call["arguments"])}}
    assert W.json_call_score(json.dumps(openai), it)["score"] == 1.0
    extra = dict(call["arguments"], unit="kelvin")
    assert not W.json_call_score(json.dumps({"name": "get_weather", "arguments": extra}), it)["args_ok"] or (
        call["arguments"].get("unit") == "kelvin"
    )


@pytest.mark.parametrize("name", ["code", "reading", "needle", "json_calls", "rag", "rag_multihop"])
def test_provenance(name, built):
    wl = built[name]
    p = wl.provenance
    assert p["workload"] == name and p["seed"] == 1 and p["n"] == len(wl)
    assert p["token_count"]["exact"] is False and "approx" in p["token_count"]["method"]
    assert "note" in p["token_count"]
    assert p["params"]
    if name == "json_calls":
        assert p["sources"] == []
        return
    assert p["sources"]
    for s in p["sources"]:
        assert os.path.isfile(s["path"]), s["path"]
        data = Path(s["path"]).read_bytes()
        assert s["size"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
        assert s["license"]
    paths = {s["path"] for s in p["sources"]}
    for it in wl:
        recs = it["source"].get("files") or it["source"].get("documents") or it["source"].get("haystack")
        assert recs and all(r["path"] in paths for r in recs)


def test_write_and_read_back(tmp_path, built):
    wl = built["needle"]
    paths = W.write_workload(wl, tmp_path)
    back = W.load_workload(paths["jsonl"])
    assert list(back) == list(wl)
    assert back.name == "needle" and back.provenance["items_sha256"] == wl.provenance["items_sha256"]
    out = back.provenance["output"]
    assert out["sha256"] == hashlib.sha256(Path(paths["jsonl"]).read_bytes()).hexdigest()
    assert len(W.load_workload(paths["jsonl"], n=2)) == 2


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+ and punctuation runs
    return tok


def test_with_a_tokenizer_object():
    tok = _word_tokenizer()
    counter = W.TokenCounter(tok)
    assert counter.exact
    text = "Hello, world! def f(x): return x"
    assert counter.count(text) == len(tok.encode(text).ids) == 11
    assert counter.count_many(["a b", "c"]) == [2, 1]
    wl = W.load_workload("needle", tokenizer=tok, n=4, lengths=[300, 600], depths=[0.0, 0.5])
    assert wl.provenance["token_count"]["exact"] is True
    for it in wl:
        assert it["n_tokens"] == len(tok.encode(it["prompt"]).ids)
        assert math.ceil(it["target_tokens"] * 0.9) <= it["n_tokens"] <= it["target_tokens"]
    code = W.load_workload("code", tokenizer=tok, n=2, lengths=[700])
    assert all(630 <= it["n_tokens"] <= 700 for it in code)


def test_with_a_tokenizer_dir(tmp_path):
    """A directory with only tokenizer.json works (transformers, else tokenizers)."""
    tok = _word_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = W.TokenCounter(str(tmp_path / "tokenizer.json"))  # a file: tokenizers, no transformers
    assert counter.exact and counter.count("a, b") == 3
    wl = W.load_workload("reading", tokenizer=str(tmp_path / "tokenizer.json"), n=2, lengths=[400])
    assert all(360 <= it["n_tokens"] <= 400 for it in wl)
    with pytest.raises(FileNotFoundError):
        W.TokenCounter(str(tmp_path / "missing"))


def test_build_cli(tmp_path):
    sys.path.insert(0, str(REPO / "benchmark" / "workloads"))
    try:
        import build  # benchmark/workloads/build.py
    finally:
        sys.path.pop(0)
    rc = build.main(["--out", str(tmp_path), "--workloads", "needle,json_calls", "--n", "3",
                     "--set", "needle.lengths=256,512", "--set", "needle.depths=0.5"])
    assert rc == 0
    for name in ("needle", "json_calls"):
        items = W.read_jsonl(tmp_path / f"{name}.jsonl")
        assert len(items) == 3
        prov = json.loads((tmp_path / f"{name}.provenance.json").read_text())
        assert prov["workload"] == name and prov["n"] == 3
    prov = json.loads((tmp_path / "needle.provenance.json").read_text())
    assert prov["params"]["lengths"] == [256, 512] and prov["params"]["depths"] == [0.5]
    md = (tmp_path / "PROVENANCE.md").read_text()
    assert "## needle" in md and "## json_calls" in md and "sha256" in md
    with pytest.raises(SystemExit):
        build.main(["--out", str(tmp_path), "--workloads", "bogus"])


def test_rag_facts_sit_in_their_chunks(built):
    """The prompt is the intro, the chunks and the question; the code is only in the
    fact's chunk (two-hop: the link and the code in two different chunks)."""
    for it in built["rag"]:
        assert it["prompt"] == it["chunk_prefix"] + "".join(it["chunks"]) + it["question"]
        holders = [k for k, c in enumerate(it["chunks"]) if it["answer"] in c]
        assert holders == [it["answer_chunks"][-1]], it["id"]
        name = re.search(r"project (\S+?)\?", it["question"]).group(1)
        assert [k for k, c in enumerate(it["chunks"]) if name in c] == [it["answer_chunks"][0]]
        assert len(it["answer_chunks"]) == (2 if it["task"] == "rag_two_hop" else 1)
    assert W.token_f1("B1234 is it", "B1234") == 0.5 and W.token_f1("", "B1234") == 0.0


def test_rag_multihop_needs_the_bridge_and_the_answer_chunk_and_lures_the_rest(built):
    """The code is only in the answer chunk; the asked project is named in the bridge and
    the lure chunks (the lure with another team and that team's code); the bridge team is
    named in the bridge, answer and distractor chunks; 24 items by default, 512-token chunks."""
    for it in built["rag_multihop"]:
        roles, chunks = it["chunk_roles"], it["chunks"]
        assert it["prompt"] == it["chunk_prefix"] + "".join(chunks) + it["question"]
        assert sorted(r for r in roles if r != "plain") == ["answer", "bridge", "distractor", "lure"] and len(roles) == 5
        assert it["answer_chunks"] == [roles.index("bridge"), roles.index("answer")]
        project = re.search(r"project (\S+?)\?", it["question"]).group(1)
        assert [roles[k] for k, c in enumerate(chunks) if it["answer"] in c] == ["answer"]
        assert [roles[k] for k, c in enumerate(chunks) if it["lure_answer"] in c] == ["lure"]
        assert sorted(roles[k] for k, c in enumerate(chunks) if project in c) == ["bridge", "lure"]
        assert sorted(roles[k] for k, c in enumerate(chunks) if f"the {it['bridge_entity']} team" in c) == \
            ["answer", "bridge", "distractor"]
        assert W.score(it, it["answer"]) == 1.0 and W.score(it, it["lure_answer"]) == 0.0
    default = W.load_workload("rag_multihop")
    assert len(default) == 24 and default.provenance["params"]["chunk_tokens"] == 512
    # no special-token markup in a passage: "<|vc_chunk|>" (SpecCache's separator, found in
    # this project's own source) cannot be carried as one chunk; chat tokens would tokenize as specials
    assert all("<|" not in c for it in default for c in it["chunks"])
    with pytest.raises(ValueError, match="chunks >= 4"):
        W.load_workload("rag_multihop", chunks=3)


def test_rag_multihop_near_puts_the_answer_sentence_right_after_the_bridge_sentence():
    """``hop="near"``: the answer chunk follows the bridge chunk, whose last sentence is the
    bridge fact, and the answer chunk opens with the answer fact; the same entities and
    lures as ``far``."""
    far = W.load_workload("rag_multihop", n=6, chunks=5, chunk_tokens=128)
    near = W.load_workload("rag_multihop", n=6, chunks=5, chunk_tokens=128, hop="near")
    assert near.provenance["params"]["hop"] == "near" and far.provenance["params"]["hop"] == "far"
    adjacent_in_far = 0
    for f, it in zip(far, near):
        b, a = it["answer_chunks"]
        assert a == b + 1 and it["chunk_roles"][b:b + 2] == ["bridge", "answer"]
        team = it["bridge_entity"]
        assert it["chunks"][b].rstrip().endswith(f"is maintained by the {team} team.")
        assert it["chunks"][a].startswith(f"\nPassage {a + 1}: The archive code of the {team} team is {it['answer']}.")
        assert (f["answer"], f["lure_answer"], f["bridge_entity"]) == (it["answer"], it["lure_answer"], team)
        assert sorted(it["chunk_roles"]) == sorted(f["chunk_roles"])
        adjacent_in_far += f["answer_chunks"][1] == f["answer_chunks"][0] + 1
    assert adjacent_in_far < len(far)  # far is not near by chance
    with pytest.raises(ValueError, match="hop must be one of far, near"):
        W.load_workload("rag_multihop", hop="close")

