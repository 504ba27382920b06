"""``python -m sglang_vc.bench.speccache_serve --json OUT``: SpecCache's TTFT and quality
through the server (SGLang's scheduler, the radix tree, the ``vc_speccache`` prefill),
every selector against full recompute in the same run.

One sglang-vc server per model pair (``--speccache-spec-model`` = the pair's small
model), serving the ``rag`` workload (:mod:`.workloads`). Per item:

1. the cache is flushed and the plain prompt (the same token ids, no chunk marks) is
   sent: full recompute, SGLang's ordinary prefill;
2. the cache is flushed again, the chunks are registered (``POST /speccache/chunks``:
   their KV precomputed, not timed);
3. the marked prompt is sent once per selector and ratio (``custom_params``).

With ``--chunks-from storage`` the server runs HiCache with a ``file`` storage backend
and the cache is flushed before each SpecCache request: its chunks' KV is only in the
files, and its fetch prefetches them while the small model scores (the paper's regime:
KV streamed in while the speculative model runs). ``--serial`` adds ``speccache`` with the
scoring after the fetch (``speccache-serial``): the TTFT difference is what the overlap
buys, and ``score_mean_s`` / ``fetch_mean_s`` / ``after_front_end_mean_s`` (the target's
prefill, the fill, the transport) are reported side by side.

TTFT is the client's time from sending the request to the first streamed token; it
includes the front end's tokenization, the chunks' fetch (none by default: the
registration fetched them, and the front end skips chunks it has fetched), the
speculative model's scoring and the alignment, and cacheblend's first pass. ``breakdown_s`` is what the server
reports in ``meta_info["sglang_vc_speccache"]`` (front-end times, the fill's ``load_s``,
cacheblend's first pass ``probe_s``).
Quality is token F1 / exact match of the greedy answer; the KL column of the lab
(:mod:`.speccache`) needs log-probabilities, which SpecCache requests cannot return.
Goodput is the same Poisson-replay model as the lab's, fed with these TTFTs. The JSON's
``results`` have the lab's fields, the PNG its TTFT-quality plane.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import requests

from sglang_vc.speccache import layout
from sglang_vc.speccache.names import DEFAULT_SEPARATOR as SEP
from sglang_vc.testing.files import wait_for_files
from sglang_vc.testing.server import ServerProcess

from .speccache import GOOD_FRACTION, HOP_HELP, HOPS, WORKLOAD_CHOICES, log, log_results, plot, summarize
from .workloads import load_workload, score, token_f1


def _ttft(url: str, payload: dict) -> tuple[float, dict]:
    """(seconds to the first streamed token, the last streamed object)."""
    t0 = time.perf_counter()
    first, last = None, None
    with requests.post(url + "/generate", json={**payload, "stream": True}, stream=True, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            last = json.loads(line[5:])
    if first is None or last is None:
        raise RuntimeError("the stream ended without a token")
    return first, last


def _fact_spans(item: dict, prompt) -> dict[str, tuple[int, int]]:
    """Character spans (in ``prompt.text``) of a ``rag_multihop`` item's facts: the
    bridge ("Project P is maintained by the T team."), the answer ("The archive code of
    the T team is C.") and the lure's code sentence."""
    roles = item.get("chunk_roles")
    if not roles:
        return {}
    team, code, lure_code = re.escape(item["bridge_entity"]), re.escape(item["answer"]), re.escape(item["lure_answer"])
    patterns = {"bridge": rf"Project [^.]*? is maintained by the {team} team\.",
                "answer": rf"The archive code of the {team} team is {code}\.",
                "lure": rf"The archive code of the [^.]*? team is {lure_code}\."}
    spans = {}
    for fact, pattern in patterns.items():
        k = roles.index(fact)
        a = prompt.offsets[prompt.chunks.starts[k]][0]
        b = prompt.offsets[prompt.chunks.ends[k] - 1][1]
        m = re.search(pattern, prompt.text[a:b])
        if m:
            spans[fact] = (a + m.start(), a + m.end())
    return spans


def selection_report(item: dict, prompt, positions: list[int]) -> dict:
    """What a selector recomputed on a ``rag_multihop`` item: the fraction of each fact's
    tokens, and the share of the selection in each chunk by role."""
    chosen = set(positions)
    facts = {}
    for fact, (a, b) in _fact_spans(item, prompt).items():
        toks = [i for i, (x, y) in enumerate(prompt.offsets) if x < b and y > a]
        facts[fact] = sum(i in chosen for i in toks) / max(1, len(toks))
    share = {}
    for k, role in enumerate(item.get("chunk_roles") or ()):
        lo, hi = prompt.chunks.starts[k], prompt.chunks.ends[k]
        share[role] = share.get(role, 0.0) + sum(lo <= i < hi for i in chosen) / max(1, len(chosen))
    return {"fact_recomputed": facts, "selection_share": share}


def front_end_s(breakdown: dict) -> float:
    """The front end's share of a TTFT: tokenization, then the selection (the small
    model's scoring, the alignment, the choice) and the chunks' fetch, side by side or
    one after the other. The server measures it (``front_end_s``); rows of runs before
    it did are estimated from the parts, side by side."""
    if "front_end_s" in breakdown:
        return breakdown["front_end_s"]
    select = sum(breakdown.get(k, 0.0) for k in ("score_s", "align_s", "select_s"))
    return breakdown.get("tokenize_s", 0.0) + max(select, breakdown.get("fetch_s", 0.0))


def add_costs(results: list[dict], rows: list[dict]) -> None:
    """Per result: the scoring's and the fetch's cost beside the rest of the TTFT (the
    target's prefill, the fill, the transport), and for ``rag_multihop`` the mean
    fraction of each fact's tokens the selector recomputed."""
    for res in results:
        rs = [r for r in rows if (r["target"], r["spec_model"], r["selector"], r["ratio"])
              == (res["target"], res["spec_model"], res["selector"], res["ratio"])]
        fe = [front_end_s(r["breakdown_s"]) for r in rs]
        res["front_end_mean_s"] = sum(fe) / len(fe)
        res["after_front_end_mean_s"] = sum(r["ttft_s"] for r in rs) / len(rs) - res["front_end_mean_s"]
        for part in ("score_s", "fetch_s"):
            res[part.replace("_s", "_mean_s")] = sum(r["breakdown_s"].get(part, 0.0) for r in rs) / len(rs)
        src = [r["chunk_sources"] for r in rs if "chunk_sources" in r]
        if src:  # --chunks-from storage: where the fetches found the chunks, summed
            res["chunk_sources"] = {k: sum(x[k] for x in src) for k in src[0]}
        sel = [r["selection"] for r in rs if "selection" in r]
        if sel:
            facts = sorted({f for x in sel for f in x["fact_recomputed"]})
            res["fact_recomputed_mean"] = {f: sum(x["fact_recomputed"].get(f, 0.0) for x in sel) / len(sel)
                                           for f in facts}


def add_separating(results: list[dict], rows: list[dict]) -> None:
    """Per result: its exact matches on the items that separate reuse from recompute
    (full recompute right, full reuse wrong): where what a selector recomputes decides."""
    em: dict = {}
    for r in rows:
        em.setdefault((r["target"], r["spec_model"], r["item"]), {})[(r["selector"], r["ratio"])] = r["exact_match"]
    separating = {k for k, runs in em.items()
                  if runs.get(("full-recompute", 1.0)) == 1 and runs.get(("full-reuse", 0.0)) == 0}
    for res in results:
        run = (res["selector"], res["ratio"])
        got = [em[k][run] for k in sorted(separating)
               if k[:2] == (res["target"], res["spec_model"]) and run in em[k]]
        res["separating"] = {"n": len(got), "right": int(sum(got))}


SERIAL = "speccache-serial"  # speccache with its selection after the fetch, not beside it


def server_flags(target: str, spec: str, chunks_from: str, storage: Path) -> list[str]:
    flags = ["--model-path", target, "--dtype", "float32", "--max-total-tokens", "32768",
             "--speccache-spec-model", spec, "--speccache-selector", "speccache"]
    if chunks_from == "storage":  # chunk KV precomputed into files, prefetched by HiCache
        flags += ["--enable-hierarchical-cache", "--hicache-size", "4",
                  "--hicache-storage-backend", "file", "--file-storage-path", str(storage),
                  "--hicache-storage-prefetch-policy", "wait_complete",
                  # SGLang prefetches only runs of 256 tokens or more by default: a shorter chunk
                  # would be computed, not loaded
                  "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 32})]
        if not _cuda():
            flags += ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
    return flags


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _flush(url: str) -> None:
    """Empty the device tree (and HiCache's host pool), once the scheduler is idle."""
    requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=90).raise_for_status()


def _speccache_runs(item: dict, selectors, ratios, sampling: dict) -> list[tuple]:
    """``(selector, ratio, payload)`` of each SpecCache request of an item: the prompt as
    text, so the server's front end finds the chunks in it."""
    text = item["chunk_prefix"] + SEP + SEP.join(item["chunks"]) + SEP + item["question"]
    runs = []
    for name in selectors:
        for ratio in ([0.0] if name == "full-reuse" else ratios):
            custom = {"speccache_selector": name, "speccache_ratio": ratio, "speccache_return_selection": True}
            if name == SERIAL:
                custom.update(speccache_selector="speccache", speccache_overlap=False)
            runs.append((name, ratio, {"text": text, "sampling_params": {**sampling, "custom_params": custom}}))
    return runs


def _row(item: dict, prompt, name: str, ratio: float, target: str, spec: str, ttft: float, answer: str,
         meta: dict) -> dict:
    """One request's row: its TTFT and the parts of it the server reported, its answer."""
    breakdown = dict(meta.get("front_end") or {})
    for part in ("load_s", "probe_s"):  # the fill; cacheblend's first pass
        if meta.get(part):
            breakdown[part] = meta[part]
    return {"item": item["id"], "task": item["task"], "selector": name, "ratio": ratio,
            "target": target, "spec_model": spec, "ttft_s": ttft, "breakdown_s": breakdown,
            "answer": answer, "exact_match": score(item, answer),
            "f1": token_f1(answer, item["answer"]), "kl_first": float("nan"),
            "prompt_tokens": len(prompt.ids), "chunk_tokens": prompt.chunks.num_chunk_tokens,
            "tokens_reused": meta.get("tokens_reused", 0),
            "tokens_recomputed": meta.get("tokens_recomputed", len(prompt.ids))}


def run_pair(target: str, spec: str, items, selectors, ratios, max_new: int, log_dir: Path,
             stop: Optional[list[str]] = None, full_rows: Optional[dict] = None,
             chunks_from: str = "device", progress=None) -> list[dict]:
    """Every run of every item on one server. ``full_rows`` (item id -> row) holds the
    full-recompute runs of an earlier pair with the same target: the plain prompt's
    prefill does not involve the small model, so it is measured once per target and
    item in a run, and filled in here (its row's ``measured_with`` says where).

    ``chunks_from="storage"``: the chunks' KV is in HiCache's storage backend only when
    each SpecCache request arrives (the cache is flushed before it), so the request's
    fetch prefetches it from there while the small model scores: the paper's regime."""
    from transformers import AutoTokenizer

    from sglang_vc import models

    if not items:  # (--n 0 --merge EARLIER.json: only report the earlier run again)
        return []
    tok = AutoTokenizer.from_pretrained(models.resolve(target))
    rows = []
    storage = log_dir / f"{target}--{spec}-storage"
    if chunks_from == "storage":
        shutil.rmtree(storage, ignore_errors=True)
        storage.mkdir(parents=True)
    flags = server_flags(target, spec, chunks_from, storage)
    with ServerProcess(flags, log_path=log_dir / f"{target}--{spec}.log", timeout=600) as server:
        url = server.url
        sampling = {"max_new_tokens": max_new, "temperature": 0, **({"stop": stop} if stop else {})}
        for i, item in enumerate(items):
            prompt = layout.tokenize(tok, item["chunk_prefix"], item["chunks"], item["question"])
            log(f"{target} <- {spec}: item {i + 1}/{len(items)} ({len(prompt.ids)} tokens)")
            requests.post(url + "/flush_cache", timeout=60).raise_for_status()
            runs = [("full-recompute", 1.0, {"input_ids": prompt.ids, "sampling_params": sampling})]
            earlier = (full_rows or {}).get(item["id"])
            if earlier is not None:
                rows.append({**earlier, "spec_model": spec, "measured_with": earlier["measured_with"]})
                runs[0] = None
            runs += _speccache_runs(item, selectors, ratios, sampling)
            for k, run in enumerate(runs):
                if run is None:
                    continue
                name, ratio, payload = run
                if k == 1:  # after the plain prompt: nothing of it cached, the chunks' KV precomputed
                    _flush(url)
                    if chunks_from == "storage":  # the plain prompt's KV was written there too
                        requests.post(url + "/hicache/storage-backend/clear", timeout=60).raise_for_status()
                    r = requests.post(url + "/speccache/chunks", json={"chunks": item["chunks"]}, timeout=600)
                    r.raise_for_status()
                    if chunks_from == "storage":
                        wait_for_files(storage, sum(r.json()["tokens"]) // 2, timeout=300, quiet_s=2.0)
                if k >= 1 and chunks_from == "storage":  # device and host emptied; the files stay
                    _flush(url)
                ttft, last = _ttft(url, payload)
                meta = (last.get("meta_info", {}).get("sglang_vc_speccache") or [{}])[0]
                details = last.get("meta_info", {}).get("cached_tokens_details") or {}
                if k >= 1 and int(details.get("storage") or 0) > 0:
                    raise RuntimeError(f"{name}: the prompt itself was loaded from storage ({details}), "
                                       "not its chunks: the run would measure a prefix hit")
                rows.append(_row(item, prompt, name, ratio, target, spec, ttft, last.get("text", ""), meta))
                if name == "full-recompute":
                    rows[-1]["measured_with"] = spec
                    if full_rows is not None:
                        full_rows[item["id"]] = rows[-1]
                if chunks_from == "storage" and name != "full-recompute":
                    got = {t: meta.get(f"chunk_hits_{t}", 0) for t in ("storage", "host", "device")}
                    rows[-1]["chunk_sources"] = {**got, "computed": meta.get("chunk_misses", 0),
                                                 "lost": meta.get("chunks_lost", 0)}
                    if got["storage"] != len(item["chunks"]):
                        log(f"WARNING: {item['id']} {name}: chunks not all from storage: {rows[-1]['chunk_sources']}")
                if "selected_positions" in meta and item.get("chunk_roles"):
                    rows[-1]["selection"] = selection_report(item, prompt, meta["selected_positions"])
                    # the positions themselves: bench.speccache_oracle --served scores them against the oracle
                    rows[-1]["selection"]["positions"] = list(meta["selected_positions"])
            if progress is not None:  # the items so far, kept if the run dies (hours of CPU)
                progress(rows)
    if chunks_from == "storage":
        shutil.rmtree(storage, ignore_errors=True)  # GBs of float32 KV
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.speccache_serve",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output JSON (a PNG is written beside it)")
    ap.add_argument("--pairs", default=None, help="TARGET:SPEC,... (default as bench.speccache)")
    ap.add_argument("--selectors", default="speccache,cacheblend,epic,random,full-reuse",
                    help="server selectors besides full recompute")
    ap.add_argument("--ratios", default="0.15,0.2")
    ap.add_argument("--n", type=int, default=None,
                    help="RAG items per pair (default 12, --quick 4; 0 with --merge reports the earlier run again)")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out the workload's first K items (to extend an earlier run with --merge)")
    ap.add_argument("--merge", default=None, metavar="EARLIER.json",
                    help="add the rows of an earlier run on other items of the same workload and pairs "
                    "(each item's runs, full recompute included, come from one run)")
    ap.add_argument("--workload", choices=WORKLOAD_CHOICES, default="rag",
                    help="rag (one fact or two linked facts per item) or rag_multihop (a bridge entity, the "
                    "answer in another chunk, a lure and a distractor on the same entities)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--hop", choices=HOPS, default="far", help=HOP_HELP)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rates", default="0.05,0.1,0.2")
    ap.add_argument("--chunks-from", choices=("device", "storage"), default="device",
                    help="where each SpecCache request finds its chunks' KV: on the device (registered "
                    "just before), or only in HiCache's file storage backend (the cache flushed before "
                    "each request: its fetch loads them while the small model scores)")
    ap.add_argument("--serial", action="store_true",
                    help=f"also run speccache with its scoring after the chunks' fetch instead of beside it "
                    f"(reported as {SERIAL}): what the overlap buys")
    ap.add_argument("--quick", action="store_true", help="the 0.5B target with smollm2-135m, 4 items")
    return ap


def _earlier_rows(ap, args, selectors, ratios) -> list[dict]:
    """The rows of the run ``--merge`` names, refused unless it was run the same way."""
    try:
        prev = json.loads(Path(args.merge).read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"--merge: cannot read {args.merge}: {exc}")
    # a partial run (it died) holds whole items: extend it with --skip past them
    if prev.get("workload") != args.workload or not isinstance(prev.get("rows"), list):
        ap.error(f"--merge: {args.merge} is not a run of workload {args.workload!r}")
    same = {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "ratios": ratios,
            "selectors": ["full-recompute", *selectors], "max_new_tokens": args.max_new_tokens,
            "chunks_from": args.chunks_from}
    differ = [k for k, v in same.items() if prev.get(k, v) != v]
    if (prev.get("hop") or "far") != args.hop:  # runs from before --hop (and rag's) were far
        differ.append("hop")
    if differ:
        ap.error(f"--merge: {args.merge} was run with other {', '.join(differ)}")
    return prev["rows"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    from .speccache import parse_pairs, workload_params

    params = workload_params(ap, args)

    selectors = [s.strip() for s in args.selectors.split(",") if s.strip()]
    if "full-recompute" in selectors:
        ap.error("--selectors: full recompute always runs (the plain prompt)")
    if args.serial and args.chunks_from != "storage":
        ap.error("--serial needs --chunks-from storage: with the chunks registered on the device a "
                 "request has nothing to fetch, so scoring after the fetch is scoring beside it")
    if args.serial and SERIAL not in selectors:
        selectors.append(SERIAL)
    ratios = [float(r) for r in args.ratios.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    pairs = parse_pairs(ap, args.pairs, args.quick)
    n = args.n if args.n is not None else (4 if args.quick else 12)
    if args.skip < 0 or n < 0:
        ap.error("--skip and --n must be >= 0")
    earlier = _earlier_rows(ap, args, selectors, ratios) if args.merge else []
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / (out.stem + "-logs")
    log_dir.mkdir(exist_ok=True)
    started = time.perf_counter()
    rows: list[dict] = []
    full_rows: dict = {}

    def write(rows: list[dict], partial: bool) -> None:
        report = _report(args, pairs, selectors, ratios, n, rates, earlier + rows, started, partial)
        out.write_text(json.dumps(report, indent=2))
        plot(report["results"], out.with_suffix(".png"), title="SpecCache served: TTFT vs quality")

    from transformers import AutoTokenizer

    from sglang_vc import models

    work = []
    for target, spec in pairs:
        tok = AutoTokenizer.from_pretrained(models.resolve(target))
        items = load_workload(args.workload, tokenizer=tok, n=args.skip + n, **params)[args.skip:]
        clash = {r["item"] for r in earlier if r["target"] == target and r["spec_model"] == spec} & \
            {it["id"] for it in items}
        if clash:  # checked for every pair before any runs
            ap.error(f"--merge: {args.merge} already has items {sorted(clash)} of {target} <- {spec}")
        work.append((target, spec, items))
    for target, spec, items in work:
        # rag_multihop's answer is one code on one line: what follows is not the answer
        stop = ["\n"] if args.workload == "rag_multihop" else None
        done = list(rows)
        rows += run_pair(target, spec, items, selectors, ratios, args.max_new_tokens, log_dir, stop,
                         full_rows.setdefault(target, {}), args.chunks_from,
                         progress=lambda pair_rows: write(done + pair_rows, partial=True))
        write(rows, partial=True)  # a pair's results are kept if a later pair fails
    write(rows, partial=False)
    log_results(summarize(earlier + rows, rates))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _report(args, pairs, selectors, ratios, n, rates, rows, started, partial: bool) -> dict:
    results = summarize(rows, rates)
    add_costs(results, rows)
    add_separating(results, rows)
    return {"benchmark": "speccache_serve", "workload": args.workload,
            "mode": "served (sglang-vc server, streamed TTFT)", "partial": partial, "pairs": pairs,
            "selectors": ["full-recompute", *selectors], "ratios": ratios, "n": n, "skip": args.skip,
            "max_new_tokens": args.max_new_tokens,
            "merged_from": args.merge, "chunks": args.chunks, "chunks_from": args.chunks_from,
            "chunk_tokens": args.chunk_tokens,
            "hop": args.hop if args.workload == "rag_multihop" else None, "rates": rates, "good_fraction": GOOD_FRACTION,
            "elapsed_s": time.perf_counter() - started, "results": results, "rows": rows}

if __name__ == "__main__":
    sys.exit(main())
