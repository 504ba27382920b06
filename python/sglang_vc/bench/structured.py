"""``python -m sglang_vc.bench.structured --json OUT``: structured output under VERICACHE on
the ``json_calls`` workload (JSON tool schemas and a request whose answer is one call).

Each request carries a JSON schema that admits a call of any tool its prompt offers
(``tool_choice: required``: ``{"name": <a tool>, "arguments": <its parameters>}``). The
same requests go, ``--concurrency`` at a time, to three servers one after the other:

- ``plain``: SGLang itself (``sglang.launch_server``, with only the CPU platform plugin on a
  CPU), the reference;
- ``vericache``: VERICACHE with ``--vc-draft-grammar on`` (drafts drawn under the mask);
- ``vericache-nomask``: the same with ``--vc-draft-grammar off`` (only the verify masked);
- ``vericache-default`` (only when named in ``--servers``): VERICACHE with its default flags,
  where memory does not bind (requests stay in the pool; the mode policy decides).

Both VERICACHE servers compress every request (``--vc-compress-when always``) so that
every request drafts, at a fixed draft length (``--draft-len``) so that the two acceptance
lengths compare. Reported per server: output tokens per second over the whole run, each
output's tokens against the plain server's, whether each output validates against its
schema, and for the VERICACHE servers ``A`` = committed tokens per verify round, pooled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

SERVERS = ("plain", "vericache", "vericache-nomask", "vericache-default")


def call_schema(tools: list[dict]) -> dict:
    """A JSON schema for one call of any of ``tools`` (OpenAI's ``tool_choice: required``)."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def run_server(server, prompts: list[list[int]], schemas: list[dict], max_new_tokens: int, concurrency: int) -> dict:
    def one(i: int) -> dict:
        r = requests.post(server.url + "/generate", json={"input_ids": prompts[i], "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": json.dumps(schemas[i])}}, timeout=7200)
        r.raise_for_status()
        return r.json()

    one(0)  # warm-up: the grammar backend's first compile and the first forwards
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, range(len(prompts))))
    return {"seconds": time.perf_counter() - started, "outs": outs}


def summarise(name: str, run: dict, schemas: list[dict], ref: dict | None) -> dict:
    import jsonschema

    rows = []
    for i, out in enumerate(run["outs"]):
        meta = out["meta_info"]
        try:
            jsonschema.validate(json.loads(out["text"]), schemas[i])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        row = {"item": i, "prompt_tokens": meta["prompt_tokens"], "output_tokens": meta["completion_tokens"],
               "finish": (meta.get("finish_reason") or {}).get("type"), "valid": valid, "text": out["text"]}
        if ref is not None:
            row["identical"] = out["output_ids"] == ref["outs"][i]["output_ids"]
        vc = (meta.get("sglang_vc_vericache") or [None])[-1]
        if vc:
            row.update({k: vc[k] for k in ("verify_rounds", "committed", "drafted", "accepted")})
        rows.append(row)
    tokens = sum(r["output_tokens"] for r in rows)
    report = {"server": name, "seconds": run["seconds"], "output_tokens": tokens,
              "output_tok_s": tokens / run["seconds"], "valid": sum(r["valid"] for r in rows), "n": len(rows),
              "per_item": rows}
    if ref is not None:
        report["identical"] = sum(r["identical"] for r in rows)
    if any(r.get("verify_rounds") for r in rows):
        rounds = sum(r.get("verify_rounds", 0) for r in rows)
        report.update(verify_rounds=rounds, acceptance=sum(r.get("committed", 0) for r in rows) / max(1, rounds),
                      drafted=sum(r.get("drafted", 0) for r in rows), accepted=sum(r.get("accepted", 0) for r in rows))
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {r["server"]: r for r in report["servers"]}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    vc = [s for s in SERVERS if "acceptance" in res.get(s, {})]
    a1.bar(vc, [res[s]["acceptance"] for s in vc])
    a1.set(ylabel=f"A({report['draft_len']}): tokens per verify round", title="drafts with / without the grammar mask")
    names = [s for s in SERVERS if s in res]
    a2.bar(names, [res[s]["output_tok_s"] / res["plain"]["output_tok_s"] for s in names])
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set(ylabel="output tokens/s vs plain SGLang", title=f"json_calls, concurrency {report['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=12, help="json_calls items")
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--vc-args", default="", help="extra VERICACHE flags (e.g. --vc-compressor snapkv)")
    ap.add_argument("--servers", default=",".join(SERVERS[:3]), help=f"a subset of {','.join(SERVERS)} (plain always runs)")
    args = ap.parse_args(argv)
    servers = ["plain", *[s for s in args.servers.split(",") if s and s != "plain"]]
    if bad := [s for s in servers if s not in SERVERS]:
        ap.error(f"unknown --servers {bad}; known: {', '.join(SERVERS)}")
    if args.n < 1 or args.concurrency < 1 or args.draft_len < 1 or args.max_new_tokens < 2:
        ap.error("--n, --concurrency, --draft-len >= 1 and --max-new-tokens >= 2")
    from transformers import AutoTokenizer

    from sglang_vc import models
    from sglang_vc.bench.fidelity_run import encode
    from sglang_vc.bench.serving import PLATFORM_ONLY
    from sglang_vc.bench.workloads import load_workload
    from sglang_vc.testing.server import ServerProcess

    model_dir = models.resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    items = load_workload("json_calls", tokenizer=tok, max_tokens=args.max_prompt_tokens, n=args.n)
    prompts = [encode(tok, it["prompt"], chat=True) for it in items]
    schemas = [call_schema(it["tools"]) for it in items]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = ["--model-path", model_dir, "--device", args.device, "--dtype", "float32", "--grammar-backend", "xgrammar"]
    vc = ["--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", str(args.draft_len),
          "--vc-compress-when", "always", *args.vc_args.split()]
    launch = {"plain": ("sglang", base), "vericache": ("sglang-vc", [*base, *vc, "--vc-draft-grammar", "on"]),
              "vericache-nomask": ("sglang-vc", [*base, *vc, "--vc-draft-grammar", "off"]),
              "vericache-default": ("sglang-vc", [*base, "--speculative-algorithm", "VERICACHE", *args.vc_args.split()])}
    results: dict[str, dict] = {}
    for name in servers:
        launcher, flags = launch[name]
        print(f"[structured] {name}: {len(items)} requests, concurrency {args.concurrency}", file=sys.stderr, flush=True)
        server = ServerProcess(flags, launcher=launcher, log_path=out.parent / f"{out.stem}-{name}.log",
                               env={"SGLANG_PLUGINS": PLATFORM_ONLY} if name == "plain" else None)
        try:
            results[name] = run_server(server, prompts, schemas, args.max_new_tokens, args.concurrency)
        finally:
            server.stop()
    rows = [summarise(name, results[name], schemas, None if name == "plain" else results["plain"]) for name in servers]
    for r in rows:
        r["vs_plain"] = r["output_tok_s"] / rows[0]["output_tok_s"]
        msg = f"[structured] {r['server']}: {r['output_tok_s']:.2f} tok/s ({r['vs_plain']:.2f}x plain), valid {r['valid']}/{r['n']}"
        if "identical" in r:
            msg += f", identical {r['identical']}/{r['n']}"
        if "acceptance" in r:
            msg += f", A({args.draft_len}) {r['acceptance']:.2f}"
        print(msg, file=sys.stderr)
    report = {"benchmark": "structured", "workload": "json_calls", "model": args.model, "draft_len": args.draft_len,
              "concurrency": args.concurrency, "command": " ".join(["python -m sglang_vc.bench.structured",
                                                                    *(argv if argv is not None else sys.argv[1:])]),
              "settings": vars(args), "servers": rows}
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
