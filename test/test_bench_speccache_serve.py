"""``bench.speccache_serve``'s own logic, without a server: what a selection recomputed
of a ``rag_multihop`` item's facts, the front end's share of a TTFT, and extending an
earlier run (``--skip``, ``--merge``)."""

from __future__ import annotations

import json

import pytest

from sglang_vc.bench import speccache_serve as bench
from sglang_vc.bench.workloads import load_workload
from sglang_vc.speccache import layout


@pytest.fixture(scope="module")
def item_and_prompt(tokenizer):
    item = load_workload("rag_multihop", tokenizer=tokenizer, n=1, chunks=4, chunk_tokens=128)[0]
    return item, layout.tokenize(tokenizer, item["chunk_prefix"], item["chunks"], item["question"])


def test_selection_report_counts_the_facts_tokens_and_the_chunks_shares(item_and_prompt):
    item, prompt = item_and_prompt
    spans = bench._fact_spans(item, prompt)
    assert set(spans) == {"bridge", "answer", "lure"}
    a, b = spans["answer"]
    assert item["answer"] in prompt.text[a:b]
    answer_tokens = [i for i, (x, y) in enumerate(prompt.offsets) if x < b and y > a]
    half = answer_tokens[: len(answer_tokens) // 2]
    report = bench.selection_report(item, prompt, half)
    assert report["fact_recomputed"]["answer"] == pytest.approx(len(half) / len(answer_tokens))
    assert report["fact_recomputed"]["bridge"] == 0.0 and report["fact_recomputed"]["lure"] == 0.0
    assert report["selection_share"]["answer"] == pytest.approx(1.0)
    assert report["selection_share"]["bridge"] == 0.0


def test_front_end_time_is_tokenization_then_the_longer_of_selection_and_fetch():
    assert bench.front_end_s({"tokenize_s": 0.1, "score_s": 2.0, "align_s": 0.1, "select_s": 0.1,
                              "fetch_s": 1.0}) == pytest.approx(2.3)
    assert bench.front_end_s({"tokenize_s": 0.1, "score_s": 0.5, "fetch_s": 3.0}) == pytest.approx(3.1)
    # the server's own measurement, when it gives one (scoring after the fetch: the sum)
    assert bench.front_end_s({"tokenize_s": 0.1, "score_s": 0.5, "fetch_s": 3.0, "front_end_s": 3.6}) == 3.6


def test_storage_runs_start_hicache_with_a_file_backend_and_wait_for_the_prefetch(tmp_path):
    flags = bench.server_flags("t", "s", "storage", tmp_path)
    at = flags.index("--hicache-storage-backend")
    assert flags[at + 1] == "file" and flags[flags.index("--file-storage-path") + 1] == str(tmp_path)
    assert flags[flags.index("--hicache-storage-prefetch-policy") + 1] == "wait_complete"
    assert "--enable-hierarchical-cache" not in bench.server_flags("t", "s", "device", tmp_path)
    # a chunk shorter than SGLang's default prefetch threshold (256 tokens) is still loaded
    extra = json.loads(flags[flags.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["prefetch_threshold"] < 256


def test_serial_needs_chunks_to_fetch(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--json", str(tmp_path / "x.json"), "--serial"])
    assert exc.value.code == 2 and "--chunks-from storage" in capsys.readouterr().err


def test_costs_put_scoring_and_fetch_beside_the_rest_of_the_ttft():
    row = {"target": "t", "spec_model": "s", "selector": bench.SERIAL, "ratio": 0.15, "ttft_s": 10.0,
           "breakdown_s": {"tokenize_s": 0.1, "score_s": 3.0, "fetch_s": 2.0, "front_end_s": 5.2},
           "chunk_sources": {"storage": 4, "host": 0, "device": 0, "computed": 0, "lost": 0}}
    res = [{"target": "t", "spec_model": "s", "selector": bench.SERIAL, "ratio": 0.15}]
    bench.add_costs(res, [row, {**row, "ttft_s": 12.0}])
    assert res[0]["score_mean_s"] == 3.0 and res[0]["fetch_mean_s"] == 2.0
    assert res[0]["front_end_mean_s"] == pytest.approx(5.2)
    assert res[0]["after_front_end_mean_s"] == pytest.approx(11.0 - 5.2)
    assert res[0]["chunk_sources"]["storage"] == 8


def test_merge_refuses_another_workload_other_settings_or_the_same_items(tmp_path, capsys):
    # (a partial run -- one that died -- holds whole items: it merges like a complete one)
    clash = {"item": "rag_multihop-0000", "target": "smollm2-135m", "spec_model": "smollm2-135m"}
    for bad in ({"workload": "rag", "partial": False, "rows": []},
                {"workload": "rag_multihop", "partial": False},
                {"workload": "rag_multihop", "partial": False, "rows": [], "chunk_tokens": 256},
                {"workload": "rag_multihop", "partial": False, "rows": [clash], "ratios": [0.15, 0.2]}):
        prev = tmp_path / "prev.json"
        prev.write_text(json.dumps(bad))
        with pytest.raises(SystemExit) as exc:
            bench.main(["--json", str(tmp_path / "x.json"), "--workload", "rag_multihop", "--merge", str(prev),
                        "--pairs", "smollm2-135m:smollm2-135m", "--n", "1", "--chunk-tokens", "128"])
        assert exc.value.code == 2
        assert "--merge" in capsys.readouterr().err
    prev.write_text(json.dumps({"workload": "rag_multihop", "partial": False, "rows": []}))  # from before --hop: far
    with pytest.raises(SystemExit) as exc:
        bench.main(["--json", str(tmp_path / "x.json"), "--workload", "rag_multihop", "--hop", "near",
                    "--merge", str(prev), "--pairs", "smollm2-135m:smollm2-135m", "--n", "1"])
    assert exc.value.code == 2 and "other hop" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--json", str(tmp_path / "x.json"), "--skip", "-1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # only rag_multihop has hops
        bench.main(["--json", str(tmp_path / "x.json"), "--workload", "rag", "--hop", "near"])
    assert exc.value.code == 2 and "only rag_multihop has hops" in capsys.readouterr().err


def test_skipped_items_are_the_workloads_later_ones(tokenizer):
    """A run of N items and a --skip N run complete a run of 2N: an item does not depend
    on how many are built (each is built from its own index)."""
    all4 = load_workload("rag_multihop", tokenizer=tokenizer, n=4, chunks=4, chunk_tokens=128)
    first2 = load_workload("rag_multihop", tokenizer=tokenizer, n=2, chunks=4, chunk_tokens=128)
    assert [it["prompt"] for it in first2] == [it["prompt"] for it in all4[:2]]
    assert len({it["id"] for it in all4}) == 4


def test_separating_items_are_those_full_recompute_gets_right_and_full_reuse_wrong():
    """Item a separates (recompute right, reuse wrong); b (both right) and c (reuse right,
    recompute wrong) do not: each selector is counted on a alone."""
    em = {"a": {"full-recompute": 1, "full-reuse": 0, "epic": 1, "random": 0},
          "b": {"full-recompute": 1, "full-reuse": 1, "epic": 0, "random": 1},
          "c": {"full-recompute": 0, "full-reuse": 1, "epic": 0, "random": 1}}
    ratio = {"full-recompute": 1.0, "full-reuse": 0.0, "epic": 0.15, "random": 0.15}
    rows = [{"target": "t", "spec_model": "s", "item": i, "selector": name, "ratio": ratio[name], "exact_match": float(v)}
            for i, runs in em.items() for name, v in runs.items()]
    res = [{"target": "t", "spec_model": "s", "selector": name, "ratio": ratio[name]} for name in ratio]
    bench.add_separating(res, rows)
    got = {r["selector"]: r["separating"] for r in res}
    assert got["epic"] == {"n": 1, "right": 1} and got["random"] == {"n": 1, "right": 0}
    assert got["full-recompute"] == {"n": 1, "right": 1} and got["full-reuse"] == {"n": 1, "right": 0}


def test_n_0_with_merge_reports_the_earlier_run_again_without_a_server(tmp_path):
    """``--n 0 --merge EARLIER.json`` starts no server: the earlier rows, summarized by
    this version (here: the separating items, which older runs did not count)."""
    def row(item, name, ratio, em):
        return {"item": item, "task": "rag_multihop", "target": "smollm2-135m", "spec_model": "smollm2-135m",
                "selector": name, "ratio": ratio, "ttft_s": 2.0 if ratio < 1 else 8.0, "breakdown_s": {},
                "exact_match": em, "f1": em, "kl_first": 0.0}
    rows = [row(i, name, r, em) for i, ems in (("rag_multihop-0000", (1.0, 0.0, 1.0)), ("rag_multihop-0001", (1.0, 1.0, 0.0)))
            for (name, r), em in zip((("full-recompute", 1.0), ("full-reuse", 0.0), ("epic", 0.15)), ems)]
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"workload": "rag_multihop", "hop": "near", "partial": True, "rows": rows}))
    out = tmp_path / "again.json"
    assert bench.main(["--json", str(out), "--workload", "rag_multihop", "--hop", "near", "--merge", str(prev),
                       "--n", "0", "--pairs", "smollm2-135m:smollm2-135m", "--selectors", "epic,full-reuse",
                       "--ratios", "0.15"]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == rows and not report["partial"]
    epic = next(r for r in report["results"] if r["selector"] == "epic")
    assert epic["separating"] == {"n": 1, "right": 1} and epic["ttft_speedup_vs_full"] == 4.0
    assert not (tmp_path / "again-logs" / "smollm2-135m--smollm2-135m.log").exists()
