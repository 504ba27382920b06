"""The configurations ``bench.throughput`` compares (``--configs``) and its ``--long``
presets: each a set of server flags beside the shared ones."""

from __future__ import annotations

from dataclasses import dataclass


def parse_config(spec: str) -> dict:
    """``full`` | ``lossy:NAME@AMOUNT`` | ``vericache[:always|:uniform]`` (the default drafter;
    ``always``: every request compressed; ``uniform``: in-pool drafters verify together,
    ``--vc-in-pool-verify uniform``) | ``vericache:NAME@AMOUNT[:X|:auto]`` (AMOUNT is the kept
    ratio of a token-dropping method, or ``Nbit`` for a quantizer) | ``specache[:Nbit[:kK]]``
    (SpeCache, default 2 bits and top-64)."""
    kind, _, rest = spec.partition(":")
    if kind == "full" and not rest:
        return {"name": "full", "kind": "full", "flags": []}
    if kind == "vericache" and rest in ("", "always", "uniform"):  # the default flags: the mode policy decides
        # (vericache:always compresses every request at its prefill, --vc-compress-when always)
        extra = {"always": ["--vc-compress-when", "always"], "uniform": ["--vc-in-pool-verify", "uniform"]}
        return {"name": spec, "kind": "vericache", "compressor": None, "kept": None, "draft_tokens": None,
                "flags": ["--speculative-algorithm", "VERICACHE", *extra.get(rest, [])]}
    if kind == "inpool":  # forced in-pool self-speculation over a view: inpool:VIEW@B[:X|:auto]
        view, _, budget = rest.partition("@")
        budget, _, x = budget.partition(":")
        if view not in ("window", "shared", "reselect") or not budget.isdigit() or (
                x and x != "auto" and not x.isdigit()):
            raise ValueError(f"bad config {spec!r}: want inpool:window|shared|reselect@BUDGET[:X|:auto], "
                             "e.g. inpool:window@512")
        flags = ["--speculative-algorithm", "VERICACHE", "--vc-in-pool", "always", "--vc-draft-budget", budget,
                 "--vc-draft-view", view]
        if x and x != "auto":
            flags += ["--speculative-num-draft-tokens", x]
        return {"name": spec, "kind": "vericache", "compressor": None, "kept": None, "budget": int(budget),
                "draft_tokens": int(x) if x and x != "auto" else None, "flags": flags}
    if kind == "specache":
        bits, _, k = (rest or "2bit").partition(":")
        if not bits.endswith("bit") or not bits[:-3].isdigit() or (k and not (k[:1] == "k" and k[1:].isdigit())):
            raise ValueError(f"bad config {spec!r}: want specache[:Nbit[:kK]], e.g. specache:1bit:k64")
        flags = ["--speculative-algorithm", "SPECACHE", "--specache-kv-bits", bits[:-3]]
        if k:
            flags += ["--specache-topk", k[1:]]
        return {"name": spec, "kind": "specache", "compressor": "kivi1" if bits == "1bit" else "kivi",
                "kept": int(bits[:-3]) / 16, "flags": flags}
    if kind not in ("lossy", "vericache") or "@" not in rest:
        raise ValueError(f"bad config {spec!r}: want full, lossy:NAME@AMOUNT or vericache:NAME@AMOUNT[:X]")
    method, _, amount = rest.partition("@")
    amount, _, x = amount.partition(":")
    if amount.endswith("bit"):
        flags = ["--vc-compressor", method, "--vc-kv-bits", str(int(amount[:-3]))]
        kept = int(amount[:-3]) / 16
    else:
        kept = float(amount)
        flags = ["--vc-compressor", method, "--vc-compression-ratio", str(kept)]
    cfg = {"name": spec, "kind": kind, "compressor": method, "kept": kept, "flags": flags}
    if kind == "vericache":
        if x == "auto":  # the server chooses X from data (no --speculative-num-draft-tokens)
            cfg["draft_tokens"] = None
            cfg["flags"] += ["--speculative-algorithm", "VERICACHE"]
        else:
            if x and not x.isdigit():
                raise ValueError(f"bad config {spec!r}: the draft length is a positive integer or auto")
            cfg["draft_tokens"] = int(x or 4)
            cfg["flags"] += ["--speculative-algorithm", "VERICACHE",
                             "--speculative-num-draft-tokens", str(cfg["draft_tokens"])]
    elif x:
        raise ValueError(f"bad config {spec!r}: a draft length only applies to vericache")
    return cfg


def with_schedules(cfgs: list[dict], schedules: list[str]) -> list[dict]:
    """One entry per (VERICACHE configuration, schedule); other kinds have no schedule."""
    out = []
    for cfg in cfgs:
        if cfg["kind"] != "vericache":
            out.append({**cfg, "schedule": None})
            continue
        for sched in schedules:
            if sched == "lockstep" and cfg["draft_tokens"] is None:
                raise ValueError(f"{cfg['name']}: lock-step drafts one fixed X for the whole batch; "
                                 "give X (vericache:NAME@AMOUNT:X) or --schedule staggered")
            out.append({**cfg, "name": f"{cfg['name']} [{sched}]", "base": cfg["name"], "schedule": sched,
                        "flags": [*cfg["flags"], "--vc-schedule", sched]})
    return out



@dataclass(frozen=True)
class Mode:
    """A preset of ``--long``: the KV pool holds ``full_kv_batch`` full requests of the
    ``requests`` submitted, so device memory binds full KV's batch."""

    requests: int
    prompt_tokens: int
    max_new_tokens: int
    full_kv_batch: int
    configs: str
    schedule: str

    def describe(self) -> str:
        return (f"{self.requests} requests of {self.prompt_tokens} tokens of real text, {self.max_new_tokens} new "
                f"tokens, a KV pool for {self.full_kv_batch} full requests; {self.configs.replace(',', ', ')} "
                f"({self.schedule.replace(',', ' and ')})")


# VERICACHE chooses X from data (auto): lock-step needs a fixed X, so --long runs staggered
LONG = Mode(8, 6144, 128, 3, "full,lossy:snapkv@0.25,lossy:kivi@2bit,vericache:specache@2bit:auto,"
            "vericache:snapkv@0.25:auto,vericache:kivi@2bit:auto", "staggered")
LONG_QUICK = Mode(8, 4096, 128, 3, "full,lossy:snapkv@0.25,vericache:specache@2bit:auto", "staggered")
# --long --fits: the pool holds every request's full KV (full_kv_batch = requests); prompts as
# long as the model's context allows with the new tokens (0: from the model's config)
FITS_CONFIGS = "full,vericache,inpool:window@512,inpool:reselect@512"
LONG_FITS = Mode(8, 0, 128, 8, FITS_CONFIGS, "staggered")
LONG_FITS_QUICK = Mode(8, 4096, 128, 8, FITS_CONFIGS, "staggered")
