"""Fidelity lab (python -m sglang_vc.bench.fidelity): exactness of the lossy-attention
simulation, identity runs, lossy runs, JSON schema and CLI errors.

Short prompts (~200 tokens with the chat template), N <= 16, and the embedded model cut
to 4 layers keep this to a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_vc.bench import fidelity, fidelity_run
from sglang_vc.bench.fidelity_run import CompressorSpec, parse_compressors, run_prompt
from sglang_vc.bench.lossy_hf import PromptCapture, Session, build_cache, cache_kv, compress_prompt, load_model
from sglang_vc.compress import get_compressor


TINY_LAYERS = 4


@pytest.fixture(scope="module")
def tiny_dir(model_dir, tmp_path_factory):
    """The embedded model cut to its first TINY_LAYERS layers (same weights, tokenizer and
    chat template): exercises every code path of the simulation at a fraction of the cost
    (what is tested, mask, dequantized K/V, online updates, is per layer)."""
    d = tmp_path_factory.mktemp("tiny_model")
    src = Path(model_dir)
    for f in src.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = TINY_LAYERS
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Session(load_model(tiny_dir))


@pytest.fixture(scope="module")
def plain(tiny_dir):
    """The same (cut) model with transformers' stock eager attention and no controller."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def items():
    """A needle prompt (real license text with a passkey) and a code prompt (a stdlib
    function and a question about it), ~200 tokens each with the chat template."""
    import inspect
    import textwrap

    from conftest import real_text_passages

    a, b = real_text_passages(2, words=70)
    needle = (f"{a}\nThe secret passkey is 48213.\n{b}\n\n"
              "What is the secret passkey mentioned in the text above? Answer with the number only.")
    code = (f"```python\n{inspect.getsource(textwrap.indent)}```\n\n"
            "Question: What does the function `indent` return? Answer with the returned expression.")
    return {"needle": {"id": "needle-test", "prompt": needle}, "code": {"id": "code-test", "prompt": code}}


def _ids(tokenizer, item):
    return fidelity_run.encode(tokenizer, item["prompt"], chat=True)


def _spec(name, value):
    return parse_compressors(f"{name}:{value}", None, None)[0]


# ----------------------------------------------------------------------------- exactness


def test_identity_is_bit_identical_to_plain_eager(plain, tiny, tokenizer, items):
    """Keep ratio 1.0 (mask path with every position visible), 16 bits (prompt K/V
    replaced by the compressor's output) and H2O 1.0 (online updates) give logits
    bit-identical to transformers' stock eager attention."""
    from transformers import DynamicCache

    ids = _ids(tokenizer, items["needle"])
    steps = [int(t) for t in tokenizer(" The passkey is", add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        c = DynamicCache(config=plain.config)
        first = plain(input_ids=torch.tensor([ids]), past_key_values=c, use_cache=True, logits_to_keep=1).logits[0, -1]
        ref = [plain(input_ids=torch.tensor([[t]]), past_key_values=c, use_cache=True).logits[0, -1] for t in steps]
    tiny.prefill_chunk = len(ids)  # one chunk, like the plain forward
    try:
        cache, logits, qs, _ = tiny.prefill(ids, capture=True)
    finally:
        tiny.prefill_chunk = 512
    assert torch.equal(logits, first)
    base = cache_kv(cache)
    cap = PromptCapture(k=[k[0].transpose(0, 1) for k, _ in base], v=[v[0].transpose(0, 1) for _, v in base],
                        queries=qs)
    for name, value in [("streamingllm", 1.0), ("snapkv", 1.0), ("h2o", 1.0), ("kivi", 16), ("kivi1", 16)]:
        lossy, stats = compress_prompt(get_compressor(name), value, cap, req_id=0)
        if name in ("streamingllm", "snapkv", "h2o"):
            assert all(v is not None and bool(v.all()) for v in lossy.visible)  # the mask path really runs
        else:
            assert all(k is not None for k in lossy.k_prompt)
        tiny.activate(lossy)
        try:
            c2 = build_cache(base, len(ids), lossy)
            out = [tiny.step(c2, t) for t in steps]
        finally:
            tiny.activate(None)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), name
        if name == "h2o":
            assert lossy.updates == len(steps) * tiny.num_layers


def test_mask_equals_physically_dropped_cache(plain, tiny, tokenizer, items):
    """StreamingLLM keeps the same positions on every head, so its compacted cache can be
    built for real: attention over the kept rows == the masked simulation."""
    from transformers import DynamicCache

    ids = _ids(tokenizer, items["code"])
    T = len(ids)
    cache, _, _, _ = tiny.prefill(ids)
    base = cache_kv(cache)
    cap = PromptCapture(k=[k[0].transpose(0, 1) for k, _ in base], v=[v[0].transpose(0, 1) for _, v in base])
    lossy, stats = compress_prompt(get_compressor("streamingllm"), 0.25, cap)
    assert stats["kept_fraction"] == pytest.approx(max(1, int(0.25 * T)) / T)
    kept = lossy.visible[0][0].nonzero()[:, 0]
    physical = DynamicCache([(k[:, :, kept], v[:, :, kept]) for k, v in base])
    tiny.activate(lossy)
    try:
        sim = build_cache(base, T, lossy)
        toks = [int(t) for t in tokenizer(" return x", add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            for i, t in enumerate(toks):
                a = tiny.step(sim, t)
                b = plain(input_ids=torch.tensor([[t]]), past_key_values=physical, use_cache=True,
                          position_ids=torch.tensor([[T + i]])).logits[0, -1]
                assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (i, float((a - b).abs().max()))
    finally:
        tiny.activate(None)


# ----------------------------------------------------------------------------- runs


def test_identity_run_has_zero_kl_and_full_acceptance(tiny, tokenizer, items):
    ids = _ids(tokenizer, items["needle"])
    specs = [_spec("streamingllm", 1.0), _spec("h2o", 1.0), _spec("kvzip", 1.0), _spec("kivi", 16)]
    xs = [1, 4, 8]
    info, res = run_prompt(tiny, tokenizer, ids, specs, 16, xs, log=lambda m: None)
    assert len(info["reference_tokens"]) == 16
    assert info["trajectory_tokens"] == 16 + 8
    for r in res:
        assert r["kl"] == [0.0] * 16, r["label"]
        assert r["cumulative_kl"] == [0.0] * 16
        assert r["first_divergence"] is None
        assert r["acceptance_length"] == {str(x): float(x + 1) for x in xs}, r["label"]
        assert r["acceptance_rate"] == {str(x): 1.0 for x in xs}


@pytest.mark.parametrize("prompt, methods", [
    ("needle", "all,kivi1:1"),  # every registered method
    ("code", "streamingllm,snapkv,h2o,kvzip,kivi,kivi1:1"),
])
def test_lossy_methods_have_positive_kl(tiny, tokenizer, items, prompt, methods):
    ids = _ids(tokenizer, items[prompt])
    specs = parse_compressors(methods, 0.25, 2)
    if methods.startswith("all"):
        assert {s.name for s in specs} >= {"streamingllm", "knorm", "snapkv", "keydiff", "h2o", "kvzip", "kivi",
                                           "kivi1"}
    n_new, xs = 12, [4]
    info, res = run_prompt(tiny, tokenizer, ids, specs, n_new, xs, log=lambda m: None)
    for spec, r in zip(specs, res):
        assert r["cumulative_kl"][-1] > 0, r["label"]
        assert all(k >= -1e-9 for k in r["kl"]) and r["kl"][0] == 0.0
        assert r["cumulative_kl"] == pytest.approx(fidelity_run._cumsum(r["kl"]))
        if spec.scenario == "token_dropping":
            assert r["kept_fraction"] <= 0.25
        else:
            assert r["stored_bits_per_element"] < 32
        al = r["acceptance_length"]["4"]
        assert 1.0 <= al <= 5.0
        # the first round starts from the prefill token with no committed decode KV, so for
        # offline methods its match length is the free-running one: first_divergence - 1
        if spec.mode == "offline":
            p1 = {p: (k, c) for p, k, c in r["match_lengths"]}[1]
            fd = r["first_divergence"]
            assert p1[0] == (p1[1] if fd is None or fd - 1 >= p1[1] else fd - 1), r["label"]
    # the ideal line is never exceeded, and lossy methods fall short of it somewhere
    assert any(r["acceptance_length"]["4"] < 5.0 for r in res)


# ----------------------------------------------------------------------------- CLI


def test_cli_json_schema_and_plots(tmp_path, items, tiny_dir):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "n0", "prompt": items["needle"]["prompt"]}) + "\n")
    out = tmp_path / "res" / "fid.json"
    rc = fidelity.main(["--model", tiny_dir, "--input", str(inp), "--compressors", "streamingllm,kivi", "--compression-ratio", "0.5",
                        "--kv-bits", "4", "--max-new-tokens", "6", "--draft-lengths", "1,3", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == tiny_dir and doc["settings"]["model_config"]["layers"] == TINY_LAYERS
    s = doc["settings"]
    assert s["max_new_tokens"] == 6 and s["draft_lengths"] == [1, 3] and s["compression_ratio"] == 0.5
    assert s["kv_bits"] == {"kivi@4bit": 4}
    assert [p["id"] for p in doc["prompts"]] == ["n0"]
    by = {r["compressor"]: r for r in doc["results"]}
    assert set(by) == {"streamingllm", "kivi"}
    assert by["streamingllm"]["ratio"] == 0.5 and "bits" not in by["streamingllm"]
    assert by["kivi"]["bits"] == 4 and "ratio" not in by["kivi"]
    for r in doc["results"]:
        assert r["prompts"] == 1 and len(r["per_prompt"]) == 1
        assert len(r["kl"]) == 6 and len(r["cumulative_kl"]) == 6
        assert all(b >= a - 1e-12 for a, b in zip(r["cumulative_kl"], r["cumulative_kl"][1:]))
        assert r["first_divergence"] is None or 1 <= r["first_divergence"] <= 6
        assert set(r["acceptance_length"]) == {"1", "3"}
        assert all(1 <= v <= int(x) + 1 for x, v in r["acceptance_length"].items())
        pp = r["per_prompt"][0]
        assert pp["id"] == "n0" and len(pp["kl"]) == 6
    for p in fidelity.plot_paths(out).values():
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, msg", [
    (["--compressors", "bogus"], "unknown compressor"),
    (["--compression-ratio", "0"], "(0, 1]"),
    (["--compression-ratio", "1.5"], "(0, 1]"),
    (["--compressors", "kivi", "--kv-bits", "3"], "unsupported bit width"),
    (["--compressors", "all", "--kv-bits", "2"], "kivi1:1"),
    (["--compressors", "snapkv", "--kv-bits", "2"], "no quantization method"),
    (["--compressors", "snapkv:2"], "bit width"),
    (["--compressors", "kivi:0.5"], "quantization method"),
    (["--compressors", "kivi", "--compression-ratio", "0.5"], "no token-dropping method"),
    (["--draft-lengths", "0,4"], "positive integers"),
    (["--max-new-tokens", "1"], "max-new-tokens"),
    (["--compressors", "window"], "needs a token budget"),
    (["--compressors", "reselect@0"], "positive integer"),
    (["--compressors", "window@512", "--compression-ratio", "0.5"], "only draft views"),
])
def test_cli_errors_exit_2(argv, msg, tmp_path, capsys):
    inp = tmp_path / "p.txt"
    inp.write_text("hello")
    with pytest.raises(SystemExit) as e:
        fidelity.main(["--input", str(inp), *argv, "--json", str(tmp_path / "o.json")])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_cli_errors_inputs(tmp_path, capsys):
    for argv, msg in [
        (["--input", str(tmp_path / "missing.txt")], "no such file"),
        (["--workload", "nope"], "unknown workload"),
        (["--input", "x", "--workload", "needle"], "not allowed with"),
        ([], "required"),
    ]:
        with pytest.raises(SystemExit) as e:
            fidelity.main([*argv, "--json", str(tmp_path / "o.json")])
        assert e.value.code == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_module_entry_point_error():
    proc = subprocess.run([sys.executable, "-m", "sglang_vc.bench.fidelity", "--input", "x", "--compressors", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown compressor" in proc.stderr


def test_parse_compressors():
    specs = parse_compressors("all,kivi1:1", 0.25, 2)
    by = {s.name: s for s in specs}
    assert by["kivi"].value == 2 and by["kivi1"].value == 1
    assert all(s.value == 0.25 for s in specs if s.scenario == "token_dropping")
    assert [s.label for s in parse_compressors("kivi:2,kivi:4,snapkv:0.5", None, None)] == \
        ["kivi@2bit", "kivi@4bit", "snapkv@0.5"]
    assert {s.value for s in parse_compressors("kivi,kivi1", None, None)} == {2, 1}  # lowest widths
    assert parse_compressors("h2o", None, None)[0] == CompressorSpec("h2o", "token_dropping", 0.25, "online", "prefill")
    with pytest.raises(ValueError, match="twice"):
        parse_compressors("snapkv,snapkv:0.25", None, None)


# ----------------------------------------------------------------------------- in-pool draft views


def test_window_view_positions():
    from sglang_vc.bench.draft_views import window_mask, window_positions

    assert window_positions(10, 16).tolist() == list(range(10))  # T <= B: everything
    assert window_positions(16, 16).tolist() == list(range(16))
    # T > B: the 4 sinks + the last B - 4 positions, the query's own included
    assert window_positions(100, 16).tolist() == [0, 1, 2, 3] + list(range(88, 100))
    assert window_positions(17, 16).tolist() == [0, 1, 2, 3] + list(range(5, 17))
    assert len(window_positions(3000, 512)) == 512
    # the per-query mask slides: row i is the view of T = q_start + i + 1, causal
    m = window_mask(10, 30, 45, 16)
    for i in range(30):
        assert m[i].nonzero()[:, 0].tolist() == window_positions(10 + i + 1, 16).tolist(), i


def test_parse_draft_views():
    from sglang_vc.bench.draft_views import ViewSpec

    specs = parse_compressors("window@512,snapkv:0.25,reselect:256,streamingllm@0.25,kivi@2bit", None, None)
    assert [s.label for s in specs] == ["window@512", "snapkv@0.25", "reselect@256", "streamingllm@0.25", "kivi@2bit"]
    assert specs[0] == ViewSpec("window", 512) and specs[2] == ViewSpec("reselect", 256)
    assert specs[0].key() == {"budget": 512} and specs[0].scenario == "draft_view"
    assert [s.label for s in parse_compressors("reselect@1024", None, None)] == ["reselect@1024"]
    assert not any(isinstance(s, ViewSpec) for s in parse_compressors("all", None, None))  # never added by all
    for bad, msg in [("window", "needs a token budget"), ("reselect@", "needs a token budget"),
                     ("window@0", "positive integer"), ("window@-8", "positive integer"),
                     ("window@1.5", "positive integer"), ("reselect@abc", "positive integer"),
                     ("window@512,window:512", "twice"), ("windo@512", "unknown compressor")]:
        with pytest.raises(ValueError, match=msg):
            parse_compressors(bad, None, None)
    with pytest.raises(ValueError, match="only draft views"):
        parse_compressors("window@512", 0.25, None)


def test_reselect_view_keeps_sinks_recent_and_top_scored():
    from sglang_vc.bench.draft_views import reselect_visible, verify_scores

    # B = 8: 4 sinks, the 2 most recent, the top 2 of the rest
    scores = torch.zeros(2, 20)
    scores[0, [7, 12, 9]] = torch.tensor([5.0, 3.0, 1.0])
    scores[0, 1] = scores[0, 19] = 100.0  # sink / recent: kept anyway, no top slot spent on them
    scores[1, [15, 5, 6]] = torch.tensor([2.0, 4.0, 0.5])
    vis = reselect_visible(scores, 8)
    assert vis[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 7, 12, 18, 19]
    assert vis[1].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 5, 15, 18, 19]
    assert reselect_visible(scores, 20) is None  # n <= B: all visible
    assert int(reselect_visible(torch.rand(3, 3000), 512).sum(1).unique()) == 512
    # scores: softmax mass, summed over the queries and each kv head's q heads
    q, k = torch.randn(3, 4, 8), torch.randn(10, 2, 8)
    sc = verify_scores(q, k, torch.tensor([7, 8, 9]), 10, 8 ** -0.5)
    assert sc.shape == (2, 10) and torch.allclose(sc.sum(1), torch.full((2,), 3.0 * 2))
    first = verify_scores(q[:1], k, torch.tensor([7]), 10, 8 ** -0.5)
    assert float(first[:, 8:].abs().sum()) == 0.0  # causal


def test_window_hook_equals_physically_windowed_cache(plain, tiny, tokenizer, items):
    """window@B attention == plain attention over a cache holding only the view's rows
    (sinks + the last B - S, at their original positions); and a multi-token forward under
    the sliding view equals decoding the same tokens one by one (each row has its own view)."""
    from transformers import DynamicCache

    from sglang_vc.bench.draft_views import WindowAttention, window_positions

    ids = _ids(tokenizer, items["code"])
    T, B = len(ids), 64
    cache, _, _, _ = tiny.prefill(ids)
    base = cache_kv(cache)
    toks = [int(t) for t in tokenizer(" return the lines", add_special_tokens=False)["input_ids"]]
    tiny.ctl.specache = WindowAttention(B)
    try:
        stepped = build_cache(base, T)
        one = [tiny.step(stepped, t) for t in toks]
        batched = tiny.forward(build_cache(base, T), toks)
    finally:
        tiny.ctl.specache = None
    for i, row in enumerate(batched):
        assert torch.allclose(row, one[i], atol=2e-4, rtol=1e-4), i
    kept = window_positions(T + 1, B)[:-1]  # the first query's view, less its own (new) row
    physical = DynamicCache([(k[:, :, kept], v[:, :, kept]) for k, v in base])
    with torch.no_grad():
        ref = plain(input_ids=torch.tensor([[toks[0]]]), past_key_values=physical, use_cache=True,
                    position_ids=torch.tensor([[T]])).logits[0, -1]
    assert torch.allclose(one[0], ref, atol=2e-4, rtol=1e-4), float((one[0] - ref).abs().max())


def test_draft_views_end_to_end(tiny, tokenizer, items):
    """B >= the context: the view is full KV, every draft is accepted (A(x) = x + 1) and the
    KL is 0; a small budget moves the model and is never above the ideal line."""
    ids = _ids(tokenizer, items["needle"])
    n_new, xs = 12, [1, 4, 8]
    big = len(ids) + n_new + max(xs) + 1
    specs = parse_compressors(f"window@{big},reselect@{big},window@32,reselect@32", None, None)
    info, res = run_prompt(tiny, tokenizer, ids, specs, n_new, xs, log=lambda m: None)
    assert tiny.ctl.specache is None and tiny.ctl.lossy is None  # the hooks are released
    by = {r["label"]: r for r in res}
    for lb in (f"window@{big}", f"reselect@{big}"):
        r = by[lb]
        assert r["acceptance_length"] == {str(x): float(x + 1) for x in xs}, lb
        assert r["acceptance_rate"] == {str(x): 1.0 for x in xs}, lb
        assert r["kl"] == [0.0] * n_new and r["first_divergence"] is None, lb
        assert r["kept_fraction"] == 1.0 and r["budget"] == big
    for lb in ("window@32", "reselect@32"):
        r = by[lb]
        assert r["cumulative_kl"][-1] > 0, lb
        assert r["kept_fraction"] == pytest.approx(32 / (len(ids) + 1))
        assert all(1.0 <= r["acceptance_length"][str(x)] <= x + 1 for x in xs), lb
    out = fidelity_run.aggregate(specs[2], [{"id": "n", "workload": "w", **by["window@32"]}], n_new)
    assert out["label"] == "window@32" and out["budget"] == 32 and out["scenario"] == "draft_view"
