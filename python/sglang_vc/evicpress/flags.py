"""``--evicpress-*`` server flags: parsing, validation (argparse-style errors, exit 2 in
the launcher) and the :class:`~.context.Settings` they build.

The flags only take effect with ``--radix-cache-backend evicpress`` (and SGLang's
hierarchical-cache flags, which give EvicPress its host tier); the launcher checks that
combination in :func:`sglang_vc.evicpress.service.check_server_args`.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Optional

from sglang_vc.config import ConfigError, FlagGroup, register_flag_group
from sglang_vc.kvruntime.names import ATTENTION_BACKEND

from .config import FULL, QUANT_METHODS, CompressionConfig
from .probes import ProbeSource
from .profiler import ProfileMetric

GROUP = "evicpress"
POLICIES = ("evicpress", "lru", "fixed")
GB = 1 << 30


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("EvicPress (--radix-cache-backend evicpress)")
    a = g.add_argument
    a("--evicpress-disk-dir", type=str, default=None,
      help="Directory of the disk tier (one checksummed file per context).")
    a("--evicpress-disk-size-gb", type=float, default=10.0,
      help="Byte budget of the disk tier, in GiB (default 10).")
    a("--evicpress-device-size-gb", type=float, default=None,
      help="Byte budget of the device tier, in GiB: context copies the utility policy "
      "keeps on the device (pinned radix-tree nodes; full or token-dropped). Default: a "
      "quarter of the device KV pool; 0 turns the device tier off (device copies are then "
      "only SGLang's LRU cache of what requests loaded).")
    a("--evicpress-host-size-gb", type=float, default=None,
      help="Byte budget of the host tier, in GiB; default: the whole HiCache host pool "
      "(--hicache-size / --hicache-ratio).")
    a("--evicpress-alpha", type=float, default=1.0,
      help="Quality-vs-TTFT trade-off of the utility (alpha*quality - TTFT)*frequency; "
      "a 0.1 quality drop is worth 0.1/alpha s (default 1).")
    a("--evicpress-methods", type=str, default="kivi",
      help="Comma-separated compression methods the profiler tries (compressor "
      "registry names): quantization kivi, kivi1; token dropping knorm, keydiff, "
      "streamingllm (served from the kept rows by the vc_torch attention backend, which "
      "EvicPress then selects). Default: kivi. Methods that score keys with queries "
      "(snapkv, kvzip, h2o) are not supported: a stored context keeps no queries.")
    a("--evicpress-ratios", type=str, default="0.3,0.6,0.9",
      help="Kept fractions for token-dropping methods (default 0.3,0.6,0.9, as in the paper).")
    a("--evicpress-bits", type=str, default="2,4",
      help="Bit widths for quantization methods (default 2,4; kivi1 always uses 1).")
    a("--evicpress-policy", type=str, default="evicpress", choices=POLICIES,
      help="evicpress (utility knapsack), lru (eviction only, full KV) or fixed "
      "(one compression config + LRU, see --evicpress-fixed-config).")
    a("--evicpress-fixed-config", type=str, default=None,
      help="Config of the fixed policy, e.g. kivi@4b or knorm@0.5 (kept fraction).")
    a("--evicpress-host-bandwidth", type=float, default=None,
      help="Host tier load bandwidth in GB/s for the delay model (default: measured at start).")
    a("--evicpress-disk-bandwidth", type=float, default=None,
      help="Disk tier load bandwidth in GB/s for the delay model (default: measured at start).")
    a("--evicpress-decompress-bandwidth", type=float, default=None,
      help="Dequantization rate in GB/s of expanded KV, for every quantization method, "
      "for the delay model (default: measured at start per method).")
    a("--evicpress-prefill-tokens-per-s", type=float, default=None,
      help="Prefill throughput for the recompute term of the delay model "
      "(default: measured online from misses).")
    a("--evicpress-throttle", action="store_true",
      help="Make loads take at least bytes/bandwidth of their tier (emulates slower "
      "tiers given with --evicpress-*-bandwidth).")
    a("--evicpress-reprofile-threshold", type=float, default=0.3,
      help="Re-profile a context when its observed quality falls this far below its "
      "profiled quality (quality units; 0.3 as in the paper, section 6.3).")
    a("--evicpress-profile-queries", type=int, default=4,
      help="Queries per context used to profile it (default 4).")
    a("--evicpress-generate-queries", type=int, default=4,
      help="Profiling questions made for a context registered without a query set "
      "(0: never profile such contexts; default 4).")
    a("--evicpress-profile-source", type=str, default=ProbeSource.CONTEXT.value,
      choices=[s.value for s in ProbeSource],
      help="Where those questions come from: context (recall and entity questions built "
      "from the context's own text, no generation; default) or model (the served model "
      "writes them).")
    a("--evicpress-profile-metric", type=str, default=ProfileMetric.ANSWER.value,
      choices=[m.value for m in ProfileMetric],
      help="How a config is scored on a profiling question: answer (its answer against "
      "the full-KV answer, MiniLM cosine; default) or likelihood (the cheaper proxy: how "
      "much less likely the full-KV answer's tokens are over the compressed KV, "
      "exp(-gap / --evicpress-likelihood-scale); no decoding per config).")
    a("--evicpress-likelihood-scale", type=float, default=1.0,
      help="Scale of the likelihood metric (nats per token for a quality of 1/e).")
    a("--evicpress-profile-max-new-tokens", type=int, default=24,
      help="Answer length when profiling (default 24).")
    a("--evicpress-observe-rate", type=float, default=0.25,
      help="Fraction of answers served from compressed KV that are checked against "
      "the full-KV answer in idle time, feeding the re-profiling trigger.")
    a("--evicpress-idle-seconds", type=float, default=1.0,
      help="Profiling waits until no user request ran for this long.")
    a("--evicpress-auto-context-tokens", type=int, default=256,
      help="Treat a prompt of at least this many tokens that matches no registered "
      "context as a new context (0: only registered contexts).")
    a("--evicpress-storage-copies", type=str, default="full,kivi@4b",
      help="Copies of every newly computed context written to the storage tier "
      "(--hicache-storage-backend, shared by the model's servers) whatever the policy "
      "places: comma-separated configs, default full,kivi@4b (the full KV for another "
      "server's exact hit, KIVI 4-bit for a server behind a slow link to draft from); "
      "'none' writes none. Outside the disk tier's budget: the backend's own "
      "retention bounds them, as it bounds HiCache's writes.")
    a("--evicpress-load-copy", type=str, default=None,
      help="The storage copy a hit on another server's context loads first, e.g. "
      "kivi@4b (default: the full KV). A server behind a slow link to the store loads "
      "the compressed copy; with --speculative-algorithm VERICACHE_REMOTE it drafts from "
      "it and a server near the store verifies.")
    a("--evicpress-no-profiler", action="store_true",
      help="Do not run the background profiler (profiles come only from the API).")


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ValueError(f"{name} is empty")
    return vals


def from_cli_args(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The validated EvicPress settings as a plain dict; ``enabled`` and
    ``control_port`` are set by :func:`storage_argv` once the launcher knows that
    ``--radix-cache-backend evicpress`` is in use."""
    names = [n for n in vars(args) if n.startswith("evicpress_")]
    raw = {n[len("evicpress_"):]: getattr(args, n) for n in names}
    try:
        out = _validate(raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out["enabled"] = False
    return out


STORAGE_BACKEND = "evicpress_file"  # our checksummed file backend (see .storage_backend)


def storage_argv(ep: dict[str, Any], argv: list[str]) -> list[str]:
    """``argv`` with the storage tier resolved, in the launcher (the composition root):

    * with ``--radix-cache-backend evicpress``, EvicPress is enabled (and gets the port of
      the scheduler's control server); its storage tier is the HiCache storage backend:
      ``--hicache-storage-backend NAME`` as given (SGLang's ``file``, ``seaweedfs``...),
      or, with ``--evicpress-disk-dir DIR`` and no backend, ``evicpress_file`` at DIR
      bounded by ``--evicpress-disk-size-gb``;
    * ``--hicache-storage-backend evicpress_file`` (any radix cache) becomes SGLang's
      ``dynamic`` backend with the class named in its extra config, the only way SGLang's
      parser lets an outside backend in."""
    import json

    from sglang_vc.kvruntime.select import flag_value, without_flag

    argv = list(argv)
    backend = flag_value(argv, "--hicache-storage-backend")[1]
    extra = flag_value(argv, "--hicache-storage-backend-extra-config")[1]
    if flag_value(argv, "--radix-cache-backend")[1] == "evicpress":
        # the scheduler binds it seconds later: below the ephemeral range, as SGLang
        # picks its own such port, or any outgoing connection may take it meanwhile
        from sglang.srt.utils.network import get_free_port_below_ephemeral

        ep["enabled"] = True
        ep["control_port"] = get_free_port_below_ephemeral()
        if backend is None and ep.get("disk_dir"):
            backend = STORAGE_BACKEND
            extra = json.dumps({"path": str(ep["disk_dir"]), "capacity_gb": ep["disk_size_gb"]})
    if backend != STORAGE_BACKEND:
        return argv
    from .storage_backend import dynamic_extra_config

    try:
        given = json.loads(extra) if extra else {}
    except ValueError:
        raise ConfigError(f"--hicache-storage-backend-extra-config is not JSON: {extra!r}") from None
    argv = without_flag(without_flag(argv, "--hicache-storage-backend"), "--hicache-storage-backend-extra-config")
    return argv + ["--hicache-storage-backend", "dynamic",
                   "--hicache-storage-backend-extra-config", json.dumps(dynamic_extra_config(given))]


def _validate(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for key in ("disk_size_gb", "alpha", "reprofile_threshold", "observe_rate", "idle_seconds"):
        v = out[key]
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"--evicpress-{key.replace('_', '-')} must be a finite number >= 0, got {v}")
    if out["disk_size_gb"] <= 0:
        raise ValueError("--evicpress-disk-size-gb must be > 0")
    if not 0 <= out["observe_rate"] <= 1:
        raise ValueError(f"--evicpress-observe-rate must be in [0, 1], got {out['observe_rate']}")
    v = out.get("device_size_gb")
    if v is not None and (not math.isfinite(v) or v < 0):
        raise ValueError(f"--evicpress-device-size-gb must be a finite number >= 0, got {v}")
    for key in ("host_size_gb", "host_bandwidth", "disk_bandwidth", "decompress_bandwidth",
                "prefill_tokens_per_s", "likelihood_scale"):
        v = out[key]
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise ValueError(f"--evicpress-{key.replace('_', '-')} must be > 0, got {v}")
    for key in ("profile_queries", "profile_max_new_tokens"):
        if out[key] < 1:
            raise ValueError(f"--evicpress-{key.replace('_', '-')} must be >= 1, got {out[key]}")
    for key in ("generate_queries", "auto_context_tokens"):
        if out[key] < 0:
            raise ValueError(f"--evicpress-{key.replace('_', '-')} must be >= 0, got {out[key]}")
    if 0 < out["auto_context_tokens"] < 16:
        raise ValueError("--evicpress-auto-context-tokens must be 0 or >= 16")
    copies = str(out.get("storage_copies") or "none").strip().lower()
    try:
        parsed = () if copies == "none" else tuple(
            dict.fromkeys(CompressionConfig.parse(c.strip()) for c in copies.split(",") if c.strip()))
    except ValueError as exc:
        raise ValueError(f"--evicpress-storage-copies: {exc}") from None
    from sglang_vc.compress.registry import standalone_compressors

    for c in parsed:
        if not c.is_full and c.method not in standalone_compressors():
            raise ValueError(f"--evicpress-storage-copies: unknown method {c.method!r}; "
                             f"known: {', '.join(standalone_compressors())}")
    out["storage_copies"] = [c.label for c in parsed]
    if out.get("load_copy"):
        try:
            cfg = CompressionConfig.parse(out["load_copy"])
        except ValueError as exc:
            raise ValueError(f"--evicpress-load-copy: {exc}") from None
        if not cfg.is_full and cfg.method not in standalone_compressors():
            raise ValueError(f"--evicpress-load-copy: unknown method {cfg.method!r}")
        out["load_copy"] = cfg.label
    ratios = _floats(out["ratios"], "--evicpress-ratios")
    for r in ratios:
        if not 0 < r <= 1:
            raise ValueError(f"--evicpress-ratios: {r} is not a kept fraction in (0, 1]")
    try:
        bits = tuple(int(b) for b in out["bits"].split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--evicpress-bits must be comma-separated integers, got {out['bits']!r}") from None
    if not bits:
        raise ValueError("--evicpress-bits is empty")
    methods = tuple(m.strip().lower() for m in out["methods"].split(",") if m.strip())
    if not methods:
        raise ValueError("--evicpress-methods is empty")
    from sglang_vc.compress.registry import get_compressor, standalone_compressors

    candidates = []
    for m in methods:
        if m not in standalone_compressors():
            raise ValueError(f"--evicpress-methods: unknown method {m!r}; known: {', '.join(standalone_compressors())}")
        comp = get_compressor(m)
        if comp.scenario == "quantization":
            for b in (bits if m == "kivi" else (1,)):
                if b not in comp.supported_bits or b >= 16:
                    raise ValueError(f"--evicpress-bits: {m} supports {comp.supported_bits[:-1]}, got {b}")
                candidates.append(CompressionConfig(m, bits=b))
        else:
            _check_token_dropping(m, "--evicpress-methods")
            candidates.extend(CompressionConfig(m, ratio=r) for r in ratios if r < 1)
    out["candidates"] = [c.label for c in sorted(set(candidates), key=CompressionConfig.sort_key)]
    fixed = out["fixed_config"]
    if out["policy"] == "fixed":
        if not fixed:
            raise ValueError("--evicpress-policy fixed needs --evicpress-fixed-config (e.g. kivi@4b)")
        try:
            cfg = validate_fixed(fixed)
        except ValueError as exc:
            raise ValueError(f"--evicpress-fixed-config: {exc}") from None
        out["fixed_config"] = cfg.label
    elif fixed:
        raise ValueError("--evicpress-fixed-config needs --evicpress-policy fixed")
    if out["disk_dir"] is not None and not str(out["disk_dir"]).strip():
        raise ValueError("--evicpress-disk-dir is empty")
    return out


def validate_fixed(label: str) -> CompressionConfig:
    """A fixed-policy config (``kivi@4b``, ``knorm@0.5``...), ``ValueError`` if unusable."""
    from sglang_vc.compress.registry import get_compressor, standalone_compressors

    cfg = CompressionConfig.parse(label)
    if cfg.method is not None:
        if cfg.method not in standalone_compressors():
            raise ValueError(f"unknown method {cfg.method!r}")
        if cfg.is_quantized and cfg.bits not in get_compressor(cfg.method).supported_bits:
            raise ValueError(f"{cfg.method} supports bits {get_compressor(cfg.method).supported_bits}")
        if cfg.drops_tokens:
            _check_token_dropping(cfg.method, "token dropping")
    return cfg


def _check_token_dropping(method: str, flag: str) -> None:
    """A stored context is compressed from its KV alone (``codec.encode``), long after
    its prefill: methods that score keys with the prompt's queries (SnapKV's window,
    KVzip) or evict online while decoding (H2O) cannot compress it."""
    from sglang_vc.compress.registry import get_compressor

    comp = get_compressor(method)
    if comp.needs_queries is not None or comp.mode != "offline":
        raise ValueError(
            f"{flag}: {method} scores keys with the prompt's queries (or evicts while "
            "decoding); a stored context keeps only its KV. Query-free token-dropping "
            "methods: knorm, keydiff, streamingllm."
        )


def drops_tokens(ep: Optional[dict[str, Any]]) -> bool:
    """Whether validated EvicPress settings can store a token-dropped context (a
    candidate or the fixed config): the server then needs the vc_torch attention
    backend, which serves the kept rows as a compressed prefix."""
    if not ep:
        return False
    labels = list(ep.get("candidates") or ())
    if ep.get("policy") == "fixed" and ep.get("fixed_config"):
        labels.append(ep["fixed_config"])
    return any(CompressionConfig.parse(label).drops_tokens for label in labels)


def backend_choice(ep: Optional[dict[str, Any]], argv: list[str]):
    """The attention backend EvicPress needs (a :class:`~sglang_vc.kvruntime.select.BackendChoice`),
    or None: with a token-dropping config (a candidate or the fixed config) a stored
    context is served from its kept rows, which needs the ``vc_torch`` attention backend
    (SGLang's torch-native one plus attention over a compressed prefix) and
    ``--page-size 1``. Another explicit attention backend is then refused rather than
    silently serving nothing from a token-dropped copy."""
    from sglang_vc.kvruntime.select import BackendChoice, flag_value

    if flag_value(argv, "--radix-cache-backend")[1] != "evicpress" or not drops_tokens(ep):
        return None
    return BackendChoice(ATTENTION_BACKEND, None, "token-dropping EvicPress configs", decode_graphs=True)


DEFAULT_DEVICE_FRACTION = 0.25  # of the device KV pool's bytes, without --evicpress-device-size-gb


def settings_from_dict(d: dict[str, Any], device_pool_bytes: int = 0, **measured):
    """Build :class:`~.context.Settings` from the validated dict plus measured values
    (``host_bandwidth``, ``disk_bandwidth``, ``decompress_bytes_per_s`` in B/s) and the
    device KV pool's size (for the default device-tier budget)."""
    from .context import Settings

    gb = d.get("device_size_gb")
    device_bytes = DEFAULT_DEVICE_FRACTION * device_pool_bytes if gb is None else gb * GB

    s = Settings(
        alpha=float(d["alpha"]),
        policy=d["policy"],
        fixed_config=CompressionConfig.parse(d["fixed_config"]) if d.get("fixed_config") else FULL,
        candidates=tuple(CompressionConfig.parse(c) for c in d["candidates"]),
        device_capacity=int(device_bytes),
        host_capacity=None if d["host_size_gb"] is None else int(d["host_size_gb"] * GB),
        disk_capacity=int(d["disk_size_gb"] * GB),
        reprofile_threshold=float(d["reprofile_threshold"]),
        profile_queries=int(d["profile_queries"]),
        generate_queries=int(d["generate_queries"]),
        profile_source=ProbeSource(d.get("profile_source") or ProbeSource.CONTEXT.value),
        profile_metric=ProfileMetric(d.get("profile_metric") or ProfileMetric.ANSWER.value),
        likelihood_scale=float(d.get("likelihood_scale") or 1.0),
        profile_max_new_tokens=int(d["profile_max_new_tokens"]),
        observe_rate=float(d["observe_rate"]),
        idle_seconds=float(d["idle_seconds"]),
        auto_context_tokens=int(d["auto_context_tokens"]),
        throttle=bool(d["throttle"]),
        storage_copies=tuple(CompressionConfig.parse(c) for c in d.get("storage_copies", ())),
        load_copy=CompressionConfig.parse(d["load_copy"]) if d.get("load_copy") else None,
    )
    if d.get("host_bandwidth"):
        s.host_bandwidth = d["host_bandwidth"] * 1e9
    elif measured.get("host_bandwidth"):
        s.host_bandwidth = measured["host_bandwidth"]
    if d.get("disk_bandwidth"):
        s.disk_bandwidth = d["disk_bandwidth"] * 1e9
    elif measured.get("disk_bandwidth"):
        s.disk_bandwidth = measured["disk_bandwidth"]
    if d.get("prefill_tokens_per_s"):
        s.prefill_tokens_per_s = float(d["prefill_tokens_per_s"])
        s.prefill_measured = False
    if d.get("decompress_bandwidth"):
        s.decompress_bytes_per_s = {m: d["decompress_bandwidth"] * 1e9 for m in QUANT_METHODS}
    elif measured.get("decompress_bytes_per_s"):
        s.decompress_bytes_per_s = dict(measured["decompress_bytes_per_s"])
    return s


def settings_of(vc_config) -> dict:
    """EvicPress's validated settings on a :class:`~sglang_vc.config.VCConfig` ({} when
    the config was made without the launcher's parser)."""
    return vc_config.group(GROUP) or {}


def describe(ep: dict) -> Optional[dict]:
    """The ``evicpress`` entry of ``/server_info``'s mechanisms."""
    if not ep.get("enabled"):
        return None
    return {"policy": ep["policy"], "alpha": ep["alpha"], "candidates": ep["candidates"],
            "fixed_config": ep["fixed_config"], "disk_dir": ep["disk_dir"],
            "storage_copies": ep.get("storage_copies", [])}


register_flag_group(FlagGroup(GROUP, add_cli_args, from_cli_args, describe))
