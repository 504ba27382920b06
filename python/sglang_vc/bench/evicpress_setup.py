"""The server :mod:`.evicpress` measures on, and its profiles: the server's flags (tiers
sized in full contexts, the knapsack's candidates), its start (with ``--regime``: once to
measure this machine's prefill rate, then again with the tiers throttled), and the
profiling phase (register the contexts, let the server profile them, save the profiles
so a later run can reuse those measured on the very same tokens and questions).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .evicpress_client import Client
from .evicpress_regime import Emulated, Regime, emulate, measure_prefill

KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M, float32: 2 * 30 layers * 3 heads * 64 * 4
GB = 1 << 30


@dataclass
class Tiers:
    """The tiers, in tokens (device pool) and full contexts (host, disk, EvicPress's device tier)."""

    device_tokens: int
    host_contexts: float
    disk_contexts: float
    device_contexts: Optional[float] = None


def server_args(model_dir: str, tiers: Tiers, ctx_bytes: float, disk_dir: str, methods: list[str],
                ratios: str, profile_queries: int, profile_new: int, max_len: int, drops_tokens: bool) -> list[str]:
    """The EvicPress server's flags (one server serves every system in turn)."""
    args = [
        "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", str(tiers.device_tokens),
        "--enable-hierarchical-cache",
        "--hicache-ratio", str(max(2.0, 1.2 * tiers.host_contexts * ctx_bytes / KV_BYTES_PER_TOKEN / tiers.device_tokens)),
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--radix-cache-backend", "evicpress", "--sleep-on-idle",
        "--evicpress-disk-dir", disk_dir,
        "--evicpress-host-size-gb", f"{tiers.host_contexts * ctx_bytes / GB:.6f}",
        "--evicpress-disk-size-gb", f"{tiers.disk_contexts * ctx_bytes / GB:.6f}",
        "--evicpress-methods", ",".join(methods), "--evicpress-bits", "2,4", "--evicpress-ratios", ratios,
        "--evicpress-profile-queries", str(profile_queries),
        "--evicpress-profile-max-new-tokens", str(profile_new),
        "--evicpress-generate-queries", str(profile_queries), "--evicpress-profile-source", "context",
        "--evicpress-observe-rate", "0",
        "--evicpress-auto-context-tokens", "0", "--evicpress-idle-seconds", "0.2",
        # each system serves its own policy's copies only: with storage copies (a
        # multi-server feature, on by default) a fixed config would load the full or
        # 4-bit copy an earlier system left on the store
        "--evicpress-storage-copies", "none",
        "--chunked-prefill-size", str(max(1024, 2 * max_len)),
    ]
    if tiers.device_contexts is not None:
        args += ["--evicpress-device-size-gb", f"{tiers.device_contexts * ctx_bytes / GB:.6f}"]
    if drops_tokens:  # token-dropped contexts are served by the lossy attention backend
        args += ["--attention-backend", "vc_torch"]
    return args


@dataclass
class Started:
    client: Client
    prefill_tokens_per_s: float  # measured on this server, nothing cached
    regime: Optional[Emulated] = None
    servers: list = field(default_factory=list)


def start(args: list[str], log_path: Path, probes: list[list[int]], regime: Optional[Regime],
          url: Optional[str], log) -> Started:
    """Start the server (or use ``url``) and measure its prefill rate on ``probes``; with
    ``regime``, restart it with the tiers throttled to the regime's ratios at that rate."""
    from sglang_vc.testing.server import ServerProcess

    servers = []
    if url:
        cl = Client(url)
    else:
        log("starting the server: " + " ".join(args))
        servers.append(ServerProcess(args, log_path=log_path, timeout=900))
        cl = Client(servers[-1].url)
    rate = measure_prefill(cl, probes)
    log(f"prefill here: {rate:.0f} tokens/s")
    if regime is None:
        return Started(cl, rate, None, servers)
    emu = emulate(regime, rate, KV_BYTES_PER_TOKEN)
    log(f"regime {regime.name}: host {emu.host_bytes_per_s / 1e6:.1f} MB/s, disk {emu.disk_bytes_per_s / 1e6:.1f} "
        f"MB/s ({regime.source})")
    servers.pop().stop()
    args.extend(emu.server_flags())
    servers.append(ServerProcess(args, log_path=log_path, timeout=900))
    return Started(Client(servers[-1].url), rate, emu, servers)


def fingerprint(context: dict, method: str, queries: int, answer_tokens: int) -> str:
    """What a saved profile was measured on: the context's tokens, its profile queries and
    the answer length (longer answers diverge more)."""
    asked = {"generic": context["profile"], "asked": [context["test"], *context["profile"]]}.get(
        method, [method, queries])
    return hashlib.sha256(json.dumps([context["token_ids"], asked, answer_tokens]).encode()).hexdigest()[:16]


class Profiles:
    """method -> context -> config -> profiled quality, saved to ``path`` as it grows."""

    def __init__(self, contexts: list[dict], methods: list[str], queries: int, answer_tokens: int, path: Path):
        self.contexts, self.path = contexts, path
        self.by_method: dict = {m: {} for m in methods}
        self.prints = {m: {c["id"]: fingerprint(c, m, queries, answer_tokens) for c in contexts} for m in methods}

    def reuse(self, log) -> None:
        """Take the saved profiles measured on the very same tokens and queries (the
        contexts are rebuilt from text on this machine, which can change)."""
        if not self.path.exists():
            return
        saved = json.loads(self.path.read_text())
        for m, per in self.by_method.items():
            for cid, entry in (saved.get(m) or {}).items():
                if isinstance(entry, dict) and entry.get("fingerprint") == self.prints[m].get(cid):
                    per[cid] = entry["quality"]
            log(f"{m}: reusing {len(per)} saved profiles ({len(self.contexts) - len(per)} profiled again)")

    def save(self) -> None:
        self.path.write_text(json.dumps({m: {cid: {"fingerprint": self.prints[m][cid], "quality": q}
                                             for cid, q in per.items()} for m, per in self.by_method.items()},
                                        indent=1))

    def register(self, cl: Client, method: str) -> None:
        """(Re-)register the contexts for ``method``; its saved profiles go with the
        registration, so only the rest is profiled."""
        metric = "likelihood" if method.endswith("-likelihood") else "answer"
        cl.api("POST", "/evicpress/reconfigure", {"profile_metric": metric})
        for c in self.contexts:
            cl.api("DELETE", f"/evicpress/contexts/{c['id']}", allow=(404,))
            body = {"id": c["id"], "token_ids": c["token_ids"]}
            if method == "generic":
                body["query_suffix_ids"] = c["profile"]
            elif method == "asked":
                body["query_suffix_ids"] = [c["test"], *c["profile"]]
            if c["id"] in self.by_method[method]:
                body["quality"] = self.by_method[method][c["id"]]
            cl.api("POST", "/evicpress/contexts", body)

    def wait(self, cl: Client, method: str, log, poll_s: float = 5.0) -> None:
        """Until the server has profiled every context, keeping each profile it reports."""
        import time

        while True:
            for c in cl.api("GET", "/evicpress/contexts")["contexts"]:
                if c["profiled"]:
                    self.by_method[method][c["id"]] = {k: v for k, v in c["quality"].items() if k != "full"}
            self.save()
            st = cl.api("GET", "/evicpress/status")
            if st["pending_profiles"] == 0:
                return
            log(f"profiling ({method}): {st['pending_profiles']} contexts left")
            time.sleep(poll_s)
