"""``python -m sglang_vc.bench.heldout --out PROMPTS.jsonl``: real text for acceptance
measurements that the project's workloads never read, so that nothing is tuned to it.

``bench.workloads`` builds every workload from Python sources (the standard library and
site-packages) and the CPython licence. The held-out prompts come from elsewhere on the
machine, three kinds (round robin):

* ``c-header``: C headers under ``/usr/include`` (code to continue);
* ``api-doc``: Markdown API documentation under ``/usr/share/doc`` (prose with code);
* ``licence``: Debian ``copyright`` files under ``/usr/share/doc`` (legal prose).

Each prompt is one file's first ``--tokens`` tokens (files shorter than that are skipped),
followed by the instruction to continue. Files are taken in sorted order, spread over the
list, so the same machine gives the same prompts. Writes a JSONL of ``{"prompt", "source",
"kind"}`` for ``bench.fidelity --input``; exits non-zero when the machine has too little of
that text.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# kind -> (the files, what the model is asked to continue)
SOURCES: dict[str, tuple[str, str, str]] = {
    "c-header": ("/usr/include", "*.h", "C header"),
    "api-doc": ("/usr/share/doc", "**/api/*.md", "API documentation page"),
    "licence": ("/usr/share/doc", "*/copyright", "licence file"),
}


@dataclass
class Prompt:
    prompt: str
    source: str
    kind: str


def _candidates(kind: str) -> list[Path]:
    root, pattern, _ = SOURCES[kind]
    if not Path(root).is_dir():
        return []
    return sorted(p for p in Path(root).glob(pattern) if p.is_file())


def build(tokenizer, n: int, tokens: int) -> list[Prompt]:
    """``n`` prompts of ``tokens`` tokens each, the kinds in turn."""
    pools = {kind: _candidates(kind) for kind in SOURCES}
    per_kind = {kind: -(-n // len(SOURCES)) for kind in SOURCES}
    chosen: dict[str, list[Prompt]] = {kind: [] for kind in SOURCES}
    for kind, files in pools.items():
        want = per_kind[kind]
        stride = max(1, len(files) // max(1, 4 * want))  # spread over the list, with spares
        for path in files[::stride] + files:
            if len(chosen[kind]) >= want:
                break
            if any(p.source == str(path) for p in chosen[kind]):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) < tokens:
                continue
            body = tokenizer.decode(ids[:tokens])
            label = SOURCES[kind][2]
            chosen[kind].append(Prompt(f"Continue this {label} exactly where it stops.\n\n{body}", str(path), kind))
    out = [chosen[kind][i] for i in range(max(per_kind.values())) for kind in SOURCES if i < len(chosen[kind])]
    return out[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.heldout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSONL to write")
    ap.add_argument("--model", default=None, help="built-in model name or HF folder whose tokenizer counts tokens "
                                                  "(default: the embedded model)")
    ap.add_argument("--n", type=int, default=6, help="prompts (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=1500, help="tokens of text per prompt (default %(default)s)")
    args = ap.parse_args(argv)
    if args.n < 1 or args.tokens < 16:
        ap.error("--n >= 1 and --tokens >= 16")
    from transformers import AutoTokenizer

    from sglang_vc import models

    tok = AutoTokenizer.from_pretrained(models.resolve(args.model or models.DEFAULT_MODEL))
    prompts = build(tok, args.n, args.tokens)
    if len(prompts) < args.n:
        print(f"[heldout] only {len(prompts)} of {args.n} prompts of {args.tokens} tokens: this machine lacks "
              f"the text ({', '.join(f'{r}/{g}' for r, g, _ in SOURCES.values())})", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))
    for p in prompts:
        print(f"[heldout] {p.kind}: {p.source}", file=sys.stderr)
    print(f"[heldout] wrote {len(prompts)} prompts to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
