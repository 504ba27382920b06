"""VeriCache's own flags (``--vc-host-kv-gb``, ``--vc-schedule``,
``--vc-compress-when``, ``--vc-schedule-trace``), registered as a flag group; the drafter's
compressor is the shared ``--vc-compressor`` family, and the algorithm is chosen the
SGLang way (``--speculative-algorithm VERICACHE --speculative-num-draft-tokens X``)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from typing import Optional

from sglang_vc.config import ConfigError, FlagGroup, register_flag_group

from .draft_view import DEFAULT_BUDGET, DraftBudget, View
from .names import ALGORITHM, ATTENTION_BACKEND
from .remote.stream import RemotePath

GROUP = "vericache"
# the device memory of reloads staged ahead of their verify, per byte of the KV pool
DEFAULT_STAGING_FRACTION = 0.125


class Schedule(str, enum.Enum):
    STAGGERED = "staggered"  # §4.2/§5: drafts and verifies interleaved, ADMIT-driven
    LOCKSTEP = "lockstep"  # the comparison mode: the whole batch drafts X, then verifies


class CompressWhen(str, enum.Enum):
    """Which VERICACHE requests draft from compressed KV (appendix B.1's split of the
    batch into requests decoding from full KV on the device and offloaded ones)."""

    MEMORY_BINDS = "memory-binds"  # only once the pool could not hold the waiting ones and another in full
    ALWAYS = "always"  # every request with a compressor


class InPool(str, enum.Enum):
    """Whether a VERICACHE request whose full KV stays in the pool self-speculates over a
    sparse view of its own rows (:mod:`.draft_view`, :mod:`.policy`)."""

    AUTO = "auto"  # where the measured costs say drafting pays, else full-KV decoding
    ALWAYS = "always"  # every request whose full KV is resident (for measurements)
    NEVER = "never"  # full-KV decoding until memory binds (the behaviour before in-pool drafting)


class InPoolVerify(str, enum.Enum):
    """When in-pool drafters verify under the staggered schedule (:mod:`.staggered_schedule`)."""

    AUTO = "auto"  # uniform where SGLang captured VERICACHE's verify graphs (a GPU), else staggered
    UNIFORM = "uniform"  # together, one TARGET_VERIFY at one width: a captured verify graph replays it
    STAGGERED = "staggered"  # spread over the iterations (about B/x per iteration), as offload drafters


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("VeriCache (--speculative-algorithm VERICACHE)")
    _add_offload_args(g)
    _add_in_pool_args(g)
    _add_remote_args(g)


def _add_offload_args(g) -> None:
    """Where the full KV lives, and when a request is compressed and offloaded."""
    g.add_argument(
        "--vc-host-kv-gb",
        type=float,
        default=None,
        help="VERICACHE: host memory for the full KV that compression replaces on the "
        "device (GiB; default half of the machine's memory, logged at start-up). A request that "
        "does not fit decodes from its full device KV instead of being compressed.",
    )
    g.add_argument(
        "--vc-staging-fraction",
        type=float,
        default=DEFAULT_STAGING_FRACTION,
        metavar="F",
        help="VERICACHE: the most KV pool slots reloads started ahead of their verify may hold "
        "at once (the staggered schedule's HBM ring), as a fraction of the KV pool's bytes "
        f"(default {DEFAULT_STAGING_FRACTION}; never less than the longest compressed request's "
        "span). A cap, not a reservation: a reload takes its slots from SGLang's allocator "
        "when it starts and its verify frees them.",
    )
    g.add_argument(
        "--vc-schedule",
        choices=[s.value for s in Schedule],
        default=Schedule.STAGGERED.value,
        help="VERICACHE: 'staggered' (default) interleaves drafting and verifying across "
        "requests, each verify placed by ADMIT over the link-bandwidth and device-memory "
        "rings; 'lockstep' drafts X tokens for the whole batch, then verifies it.",
    )
    g.add_argument(
        "--vc-compress-when",
        choices=[c.value for c in CompressWhen],
        default=CompressWhen.MEMORY_BINDS.value,
        help="VERICACHE: 'memory-binds' (default) compresses a request after its prefill (offload) only "
        "when the device KV pool (free plus evictable rows) could not then hold the waiting "
        "requests' prompts at full KV and, under the staggered schedule, the mode policy's fitted costs "
        "predict that offloading it (and admitting waiting requests into the rows it frees) raises the "
        "batch's tokens/s, within appendix B.1's cap (Eq. 9; before offload is measured, one request is "
        "offloaded to measure it); otherwise it keeps its full KV in the pool (full-KV decoding or in-pool "
        "drafting, --vc-in-pool) and waiting requests wait, as on a plain server. 'always' compresses every "
        "request.",
    )


def _add_in_pool_args(g) -> None:
    """In-pool drafting, grammars and the schedule trace."""
    g.add_argument(
        "--vc-in-pool",
        choices=[c.value for c in InPool],
        default=InPool.AUTO.value,
        help="VERICACHE: a request whose full KV stays in the device pool may draft over a "
        "sparse view of its own rows (attention sinks + a recent window, --vc-draft-budget) "
        "and verify in place. 'auto' (default) drafts where the costs measured by the server "
        "and the acceptance seen so far say it pays (long contexts), else decodes full KV; "
        "'always' drafts for every such request; 'never' decodes them from full KV.",
    )
    g.add_argument(
        "--vc-in-pool-verify",
        choices=[c.value for c in InPoolVerify],
        default=InPoolVerify.AUTO.value,
        help="VERICACHE in-pool drafting under the staggered schedule: 'uniform' aligns the "
        "in-pool drafters' cycles so that they draft in the same iterations (DECODE forwards "
        "over view rows) and verify together in one TARGET_VERIFY forward at one width, which "
        "SGLang's verify CUDA graph replays; 'staggered' spreads their verifies over the "
        "iterations (ragged forwards, eager). 'auto' (default): uniform where verify graphs "
        "were captured (a GPU), staggered otherwise.",
    )
    g.add_argument(
        "--vc-draft-budget",
        default=str(DEFAULT_BUDGET),
        metavar="N|R",
        help=f"VERICACHE in-pool drafting: the rows a draft step attends to, a token count "
        f"(default {DEFAULT_BUDGET}) or a ratio in (0, 1) of the request's length.",
    )
    g.add_argument(
        "--vc-draft-view",
        choices=[v.value for v in View],
        default=View.WINDOW.value,
        help="VERICACHE in-pool drafting: 'window' (default) attends the sinks and the most "
        "recent rows; 'shared' keeps a quarter of the budget recent and fills the rest with "
        "the rows the last verify attended most, summed over every layer and KV head (one "
        "row list per request, read by SGLang's attention backend like the window); "
        "'reselect' (SparseSpec's PillarAttn) selects per layer and KV head (the project's "
        "attention).",
    )
    g.add_argument(
        "--vc-draft-grammar",
        choices=["on", "off"],
        default="on",
        help="VERICACHE: with a request's grammar (JSON schema, regex, EBNF), 'on' (default) "
        "draws its drafts under the grammar's mask too, so they stay inside the grammar and "
        "are accepted more often; 'off' masks only the verify (the output is the same).",
    )
    g.add_argument(
        "--vc-schedule-trace",
        default=None,
        metavar="PATH",
        help="VERICACHE staggered schedule: write one JSON line per decode iteration (each "
        "request's role, drafts, commits and ADMIT's reservation) to PATH.",
    )


def _add_remote_args(g) -> None:
    """VERICACHE_REMOTE and lossless tiering."""
    g.add_argument(
        "--vc-remote-verifier",
        default=None,
        metavar="URL",
        help="VERICACHE_REMOTE: the server near the shared store (its radix tree holds the full "
        "KV of the stored prefixes) that verifies this server's drafts, e.g. http://local:30000.",
    )
    g.add_argument(
        "--vc-remote-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="VERICACHE_REMOTE: seconds a verify round may take on the remote verifier before "
        "the request falls back to reading the full copy of its prefix from the store (slower, "
        "exact; HTTP 503 if that fails too; default 60).",
    )
    g.add_argument(
        "--vc-remote-path",
        choices=[p.value for p in RemotePath],
        default=RemotePath.AUTO.value,
        help="VERICACHE_REMOTE: 'p1' verifies every round on the remote verifier; 'p2' also "
        "streams the prefix's full copy here while drafting and, once it has arrived, decodes "
        "without the verifier; 'auto' (default) picks per request from the measured link "
        "speed, verify round and draft step (P1 for short outputs, P2 for long ones). "
        "'tiering': lossless tiering inside this server, no verifier elsewhere: a request "
        "served a compressed copy drafts from it while the full copy loads from this "
        "server's storage, then verifies the drafts against it (--vc-tiering-drafts).",
    )
    g.add_argument(
        "--vc-tiering-drafts",
        type=int,
        default=32,
        metavar="N",
        help="VERICACHE_REMOTE, --vc-remote-path tiering: the most tokens a request drafts from "
        "the compressed copy while its full copy loads (default 32; 0 waits without drafting).",
    )

def from_cli_args(args: argparse.Namespace) -> Optional[dict]:
    host = args.vc_host_kv_gb
    if host is not None and not host >= 0:
        raise ConfigError(f"--vc-host-kv-gb must be >= 0, got {host}")
    url = args.vc_remote_verifier
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ConfigError(f"--vc-remote-verifier must be an http(s) URL, got {url!r}")
    if not args.vc_remote_timeout > 0:
        raise ConfigError(f"--vc-remote-timeout must be > 0, got {args.vc_remote_timeout}")
    if not 0 < args.vc_staging_fraction <= 1:
        raise ConfigError(f"--vc-staging-fraction must be in (0, 1], got {args.vc_staging_fraction}")
    if args.vc_tiering_drafts < 0:
        raise ConfigError(f"--vc-tiering-drafts must be >= 0, got {args.vc_tiering_drafts}")
    try:
        DraftBudget.parse(args.vc_draft_budget)
    except ValueError as exc:
        raise ConfigError(str(exc))
    return {"host_kv_gb": host, "schedule": args.vc_schedule, "schedule_trace": args.vc_schedule_trace,
            "in_pool": args.vc_in_pool, "in_pool_verify": args.vc_in_pool_verify, "draft_budget": str(args.vc_draft_budget), "draft_view": args.vc_draft_view,
            "draft_grammar": args.vc_draft_grammar == "on",
            "compress_when": args.vc_compress_when, "remote_verifier": url,
            "remote_timeout": float(args.vc_remote_timeout), "remote_path": args.vc_remote_path,
            "tiering_drafts": int(args.vc_tiering_drafts), "staging_fraction": float(args.vc_staging_fraction)}


def staging_fraction(settings: Optional[dict]) -> float:
    """``--vc-staging-fraction``: the cap on pool slots reloads started ahead may hold."""
    f = (settings or {}).get("staging_fraction")
    return DEFAULT_STAGING_FRACTION if f is None else float(f)


def remote_verifier(settings: Optional[dict]) -> Optional[str]:
    return (settings or {}).get("remote_verifier")


def remote_path(settings: Optional[dict]) -> RemotePath:
    return RemotePath((settings or {}).get("remote_path") or RemotePath.AUTO.value)


def tiering_drafts(settings: Optional[dict]) -> int:
    return int((settings or {}).get("tiering_drafts", 32))


def remote_timeout(settings: Optional[dict]) -> float:
    return float((settings or {}).get("remote_timeout") or 60.0)


def compress_when(settings: Optional[dict]) -> CompressWhen:
    return CompressWhen((settings or {}).get("compress_when") or CompressWhen.MEMORY_BINDS.value)


def in_pool(settings: Optional[dict]) -> InPool:
    return InPool((settings or {}).get("in_pool") or InPool.AUTO.value)


def in_pool_verify(settings: Optional[dict]) -> InPoolVerify:
    return InPoolVerify((settings or {}).get("in_pool_verify") or InPoolVerify.AUTO.value)


def draft_grammar(settings: Optional[dict]) -> bool:
    return bool((settings or {}).get("draft_grammar", True))


def draft_budget(settings: Optional[dict]) -> DraftBudget:
    budget = DraftBudget.parse((settings or {}).get("draft_budget") or str(DEFAULT_BUDGET))
    return dataclasses.replace(budget, view=View((settings or {}).get("draft_view") or View.WINDOW.value))


def settings_of(server_args) -> Optional[dict]:
    """This group's settings as carried on a (possibly unpickled) ``server_args``."""
    from sglang_vc.config import get_vc_config

    return get_vc_config(server_args).group(GROUP)


def draft_len_auto(server_args) -> bool:
    """Whether X is chosen from data (no --speculative-num-draft-tokens was given; decided
    at argument resolution, :func:`.worker_spec.handle_server_args`)."""
    from sglang_vc.config import get_vc_config

    return bool(get_vc_config(server_args).resolved.get(GROUP, {}).get("draft_len_auto"))


def schedule(settings: Optional[dict]) -> Schedule:
    return Schedule((settings or {}).get("schedule") or Schedule.STAGGERED.value)


def check_parallelism(server_args) -> None:
    """A VERICACHE server runs one rank: each rank would choose its requests' modes, draft
    lengths and offloads from its own wall-clock cost fit, so ranks could run different
    forwards and wait on each other in NCCL for good (a ConfigError; the launcher exits 2)."""
    if str(getattr(server_args, "speculative_algorithm", None) or "").upper() != ALGORITHM:
        return
    sizes = {"--tp-size": getattr(server_args, "tp_size", 1), "--pp-size": getattr(server_args, "pp_size", 1)}
    if getattr(server_args, "enable_dp_attention", False):  # plain data-parallel replicas never sync
        sizes["--dp-size"] = getattr(server_args, "dp_size", 1)
    over = [f"{flag} {n}" for flag, n in sizes.items() if (n or 1) > 1]
    if over:
        raise ConfigError(f"--speculative-algorithm {ALGORITHM} runs on one rank ({', '.join(over)} given): its "
                          "ranks would decide their forwards from their own timings and could hang; "
                          "run one server per GPU")


def trace_path(settings: Optional[dict]) -> Optional[str]:
    return (settings or {}).get("schedule_trace")


DEFAULT_HOST_FRACTION = 0.5  # of the machine's memory, when --vc-host-kv-gb is not given


def host_kv_bytes(settings: Optional[dict]) -> int:
    """The host store's capacity in bytes: ``--vc-host-kv-gb``, by default
    :data:`DEFAULT_HOST_FRACTION` of the machine's memory (pinned host memory is not
    swappable: an unbounded store could take the machine)."""
    gb = (settings or {}).get("host_kv_gb")
    if gb is not None:
        return int(gb * 2**30)
    import psutil

    return int(DEFAULT_HOST_FRACTION * psutil.virtual_memory().total)


# The drafter without --vc-compressor: SpeCache 2-bit, the one that drafts longest on real
# text at about the device bytes of the others (docs/vericache.md, "VeriCache's default drafter").
DEFAULT_DRAFTER = ("specache", 2)


def apply_default_drafter(config, argv: list[str]) -> bool:
    """``--speculative-algorithm VERICACHE`` without ``--vc-compressor`` drafts with
    :data:`DEFAULT_DRAFTER` (set on ``config``, recorded in ``config.resolved``); True when
    it was applied."""
    from sglang_vc.kvruntime.select import flag_value

    algorithm = flag_value(argv, "--speculative-algorithm")[1]
    if config.vc_compressor or algorithm is None or algorithm.upper() != ALGORITHM:
        return False
    config.vc_compressor, config.vc_kv_bits = DEFAULT_DRAFTER
    config.resolved["vericache_drafter"] = {"compressor": DEFAULT_DRAFTER[0], "kv_bits": DEFAULT_DRAFTER[1],
                                            "default": True}
    return True


def backend_choice(argv: list[str]):
    """VERICACHE drafts and verifies with the ``vc_verify`` attention backend over the
    ``vc`` radix cache (a :class:`~sglang_vc.kvruntime.select.BackendChoice`)."""
    from sglang_vc.kvruntime import RADIX_CACHE_BACKEND
    from sglang_vc.kvruntime.select import BackendChoice, flag_value

    algorithm = flag_value(argv, "--speculative-algorithm")[1]
    if algorithm is None or algorithm.upper() != ALGORITHM:
        return None
    # DECODE iterations (every request at full KV, or in-pool drafts over view rows) replay
    # SGLang's decode graphs, uniform in-pool verifies its verify graphs (:mod:`.decode_graphs`);
    # ragged verifies and offload drafts stay eager
    return BackendChoice(ATTENTION_BACKEND, RADIX_CACHE_BACKEND, f"--speculative-algorithm {ALGORITHM}",
                         decode_graphs=True, eager_forwards=(
                             "CUDA graphs for VERICACHE's ragged verify forwards and offload drafts",
                             "ragged verifies (drafters, full-KV or offload requests beside them) have no "
                             "fixed width and offload drafts attend over compressed rows; DECODE iterations "
                             "(full KV, in-pool drafts over view rows) replay SGLang's decode graphs and "
                             "uniform in-pool verifies its verify graphs"))


register_flag_group(FlagGroup(GROUP, add_cli_args, from_cli_args))
