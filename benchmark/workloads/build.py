#!/usr/bin/env python
"""Write the benchmark workloads as JSONL, with their provenance.

    python benchmark/workloads/build.py --out benchmark/workloads/generated [--tokenizer DIR]

For each workload NAME this writes ``NAME.jsonl`` (one item a line) and
``NAME.provenance.json`` (source paths, sizes, sha256, licenses, parameters, seed, token
counting method), plus one ``PROVENANCE.md`` summarising all of them. The generated files
are not committed (``benchmark/workloads/generated/`` is ignored by git): rebuild them.
Read them back with ``sglang_vc.bench.workloads.load_workload("OUT/NAME.jsonl")``.

Workload options are passed with ``--set NAME.KEY=VALUE`` (lists comma-separated), e.g.
``--set needle.lengths=512,1024,2048 --set needle.depths=0,0.5,1 --set code.roots=stdlib,site-packages``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

try:
    from sglang_vc.bench import workloads as W
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from sglang_vc.bench import workloads as W


def _value(text: str):
    def one(x: str):
        for cast in (int, float):
            try:
                return cast(x)
            except ValueError:
                pass
        return x

    return [one(x) for x in text.split(",") if x != ""] if "," in text else one(text)


_LIST_KEYS = {"lengths", "depths", "tasks", "roots", "kinds", "tool_counts"}


def parse_sets(items: list[str], names: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {n: {} for n in names}
    for it in items:
        if "=" not in it or "." not in it.split("=", 1)[0]:
            raise SystemExit(f"--set expects NAME.KEY=VALUE, got {it!r}")
        key, val = it.split("=", 1)
        name, k = key.split(".", 1)
        if name not in out:
            raise SystemExit(f"--set {it!r}: unknown workload {name!r} (known: {', '.join(out)})")
        v = _value(val)
        if k in _LIST_KEYS and not isinstance(v, list):
            v = [v]
        out[name][k] = v
    return out


def provenance_md(results: list[tuple[W.Workload, dict]], args) -> str:
    lines = [
        "# Workload provenance",
        "",
        f"Generated {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} by "
        f"`benchmark/workloads/build.py` (sglang_vc.bench.workloads v{W.WORKLOADS_VERSION}), "
        f"Python {sys.version.split()[0]}.",
        "",
        f"Command: `{' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}`",
        "",
        "Items are deterministic given the seed, the token counter and the source files below "
        "(compare the sha256 values to know whether two machines built the same prompts).",
        "",
    ]
    for wl, paths in results:
        p = wl.provenance
        tc = p["token_count"]
        lines += [
            f"## {wl.name}",
            "",
            p["description"],
            "",
            f"- file: `{os.path.basename(paths['jsonl'])}` ({len(wl)} items, sha256 `{p.get('output', {}).get('sha256', '')}`)",
            f"- items sha256: `{p['items_sha256']}`",
            f"- seed: {p['seed']}, max_tokens: {p['max_tokens']}, params: `{json.dumps(p['params'])}`",
            f"- token counts: {tc['method']}" + (f" ({tc['note']})" if tc.get("note") else ""),
            f"- prompt tokens: min {p['n_tokens'].get('min')}, mean {p['n_tokens'].get('mean')}, "
            f"max {p['n_tokens'].get('max')}, total {p['n_tokens'].get('total')}",
            "",
        ]
        if p["sources"]:
            lines += ["| source | size | sha256 | license | items |", "|---|---:|---|---|---:|"]
            for s in p["sources"]:
                lic = s["license"].replace("|", "/")
                lines.append(f"| `{s['path']}` | {s['size']} | `{s['sha256'][:16]}...` | {lic} | {s['used_by_items']} |")
            lines.append("")
        else:
            lines += ["Synthetic (no source files): generated from the tool library in "
                      "`python/sglang_vc/bench/workloads/` (one module per workload).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (else token counts are approximated)")
    ap.add_argument("--workloads", default=",".join(W.list_workloads()),
                    help=f"comma-separated subset of {','.join(W.list_workloads())}")
    ap.add_argument("--max-tokens", type=int, default=W.DEFAULT_MAX_TOKENS, help="prompt token budget")
    ap.add_argument("--n", type=int, default=None, help="items per workload (default: one pass over its grid)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME.KEY=VALUE")
    args = ap.parse_args(argv)

    names = [x for x in args.workloads.split(",") if x]
    for name in names:
        if name not in W.list_workloads():
            ap.error(f"unknown workload {name!r}; known: {', '.join(W.list_workloads())}")
    params = parse_sets(args.sets, names)
    out = Path(args.out)
    results = []
    for name in names:
        t0 = time.time()
        wl = W.load_workload(name, tokenizer=args.tokenizer, max_tokens=args.max_tokens, n=args.n,
                             seed=args.seed, **params[name])
        paths = W.write_workload(wl, out)
        wl.provenance["output"] = json.loads(Path(paths["provenance"]).read_text())["output"]
        results.append((wl, paths))
        st = wl.provenance["n_tokens"]
        print(f"{name:11s} {len(wl):4d} items  tokens min/mean/max {st.get('min')}/{st.get('mean')}/{st.get('max')}  "
              f"{len(wl.provenance['sources'])} sources  {time.time() - t0:.1f}s -> {paths['jsonl']}")
    (out / "PROVENANCE.md").write_text(provenance_md(results, args) + "\n", encoding="utf-8")
    print(f"provenance: {out / 'PROVENANCE.md'}")
    if args.tokenizer is None:
        print("note: no --tokenizer given, token counts are approximations (words*1.3 for prose)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
