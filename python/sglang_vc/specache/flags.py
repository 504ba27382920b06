"""SpeCache's flags (``--specache-*``), registered as a flag group. The algorithm is
chosen the SGLang way, ``--speculative-algorithm SPECACHE``: each decode step forwards
two tokens per request (the output token and the speculative one), which is SGLang's
speculative-decoding shape (slots reserved past each request's committed length, a
chain-masked verify forward, a variable number of tokens committed per step)."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from typing import Optional

from sglang_vc.config import ConfigError, FlagGroup, register_flag_group
from sglang_vc.vericache.names import ALGORITHM as VERICACHE

from .config import DEFAULT_GROUP, DEFAULT_RESIDUAL, DEFAULT_TOPK, SUPPORTED_BITS, SpeCacheConfig
from .names import ALGORITHM, ATTENTION_BACKEND

GROUP = "specache"
DEFAULT_BITS = 2


class Fetch(str, enum.Enum):
    SPECULATIVE = "speculative"  # the paper: rows picked by the speculative token, prefetched
    NONSPECULATIVE = "nonspeculative"  # table 4: the output token's own rows, fetched, recomputed


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SpeCache (--speculative-algorithm SPECACHE; --specache-topk and "
                                  "--specache-residual also set VERICACHE's --vc-compressor specache drafter)")
    g.add_argument("--specache-kv-bits", type=int, choices=SUPPORTED_BITS, default=None,
                   help=f"SPECACHE: bits of the device KV copy, 2 (KIVI) or 1 (KIVI with SpeCache's "
                        f"eq. 3 zero-point and scale); default {DEFAULT_BITS}")
    g.add_argument("--specache-topk", type=int, default=None,
                   help=f"SPECACHE: full-precision rows prefetched per layer and KV head each step "
                        f"(default {DEFAULT_TOPK})")
    g.add_argument("--specache-residual", type=int, default=None,
                   help=f"SPECACHE: most recent tokens kept in full precision on the device "
                        f"(default {DEFAULT_RESIDUAL})")
    g.add_argument("--specache-fetch", choices=[f.value for f in Fetch], default=None,
                   help="SPECACHE: 'speculative' (default) prefetches the rows the speculative token "
                        "attends to, overlapping the step; 'nonspeculative' (the comparison mode) "
                        "fetches the output token's own rows after its attention and recomputes it")
    g.add_argument("--specache-host-kv-gb", type=float, default=None,
                   help="SPECACHE: host memory for the full-precision KV (GiB; default unbounded). A "
                        "request that does not fit keeps its full KV on the device.")


def from_cli_args(args: argparse.Namespace) -> Optional[dict]:
    given = {"bits": args.specache_kv_bits, "topk": args.specache_topk, "residual": args.specache_residual,
             "fetch": args.specache_fetch, "host_kv_gb": args.specache_host_kv_gb}
    if all(v is None for v in given.values()):
        return None
    if args.specache_host_kv_gb is not None and not args.specache_host_kv_gb >= 0:
        raise ConfigError(f"--specache-host-kv-gb must be >= 0, got {args.specache_host_kv_gb}")
    settings = {k: v for k, v in given.items() if v is not None}
    try:
        config_of(settings)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('specache: ', 'specache-')}") from None
    return settings


def config_of(settings: Optional[dict]) -> SpeCacheConfig:
    s = settings or {}
    return SpeCacheConfig(bits=s.get("bits", DEFAULT_BITS), topk=s.get("topk", DEFAULT_TOPK),
                          residual=s.get("residual", DEFAULT_RESIDUAL),
                          speculative=Fetch(s.get("fetch", Fetch.SPECULATIVE.value)) is Fetch.SPECULATIVE)


def host_kv_bytes(settings: Optional[dict]) -> Optional[int]:
    gb = (settings or {}).get("host_kv_gb")
    return None if gb is None else int(gb * 2**30)


@dataclass(frozen=True)
class DrafterSettings:
    """VERICACHE's SpeCache drafter (``--vc-compressor specache --vc-kv-bits B``, the bits
    being each request's compression spec): ``--specache-topk`` and
    ``--specache-residual``. Its fetch is the non-speculative one: a draft forward
    carries one token per request, so each draft token attends, fetches its own top-k
    rows and attends again."""

    topk: int = DEFAULT_TOPK
    residual: int = DEFAULT_RESIDUAL
    group_size: int = DEFAULT_GROUP


def drafter_settings(settings: Optional[dict]) -> DrafterSettings:
    s = settings or {}
    return DrafterSettings(topk=s.get("topk", DEFAULT_TOPK), residual=s.get("residual", DEFAULT_RESIDUAL))


DRAFTER_FLAGS = ("topk", "residual")  # the --specache-* flags VERICACHE's drafter reads


def check_usage(settings: Optional[dict], argv: list[str], vc_compressor: Optional[str] = None) -> None:
    """``--specache-*`` flags mean nothing without SpeCache: refused, not ignored. With
    ``--speculative-algorithm VERICACHE --vc-compressor specache`` (SpeCache as the
    drafter) the drafter's ``--specache-topk`` and ``--specache-residual`` apply; its
    bits are ``--vc-kv-bits`` and its host copy VERICACHE's (``--vc-host-kv-gb``)."""
    from sglang_vc.compress.specache_copy import SpeCacheCopy
    from sglang_vc.kvruntime.select import flag_value

    algorithm = (flag_value(argv, "--speculative-algorithm")[1] or "").upper()
    drafter = (vc_compressor or "").lower() == SpeCacheCopy.name
    if drafter and algorithm != VERICACHE:
        raise ConfigError(f"--vc-compressor {SpeCacheCopy.name} is SpeCache as VERICACHE's drafter: it needs "
                          f"--speculative-algorithm {VERICACHE} (SpeCache decoding alone is "
                          f"--speculative-algorithm {ALGORITHM})")
    if not settings or algorithm == ALGORITHM:
        return
    if not drafter:
        raise ConfigError(f"--specache-* flags need --speculative-algorithm {ALGORITHM} (or "
                          f"{VERICACHE} with --vc-compressor {SpeCacheCopy.name})")
    other = sorted(k for k in settings if k not in DRAFTER_FLAGS)
    if other:
        flags_ = ", ".join("--specache-" + ("kv-bits" if k == "bits" else k.replace("_", "-")) for k in other)
        raise ConfigError(f"{flags_}: not used by VERICACHE's SpeCache drafter (its bits are --vc-kv-bits, "
                          "its host copy --vc-host-kv-gb, and it fetches each draft token's own rows)")


def backend_choice(argv: list[str]):
    """SPECACHE forwards with the ``specache`` attention backend over the ``vc`` radix
    cache (a :class:`~sglang_vc.kvruntime.select.BackendChoice`)."""
    from sglang_vc.kvruntime import RADIX_CACHE_BACKEND
    from sglang_vc.kvruntime.select import BackendChoice, flag_value

    algorithm = flag_value(argv, "--speculative-algorithm")[1]
    if algorithm is None or algorithm.upper() != ALGORITHM:
        return None
    return BackendChoice(ATTENTION_BACKEND, RADIX_CACHE_BACKEND, f"--speculative-algorithm {ALGORITHM}")


register_flag_group(FlagGroup(GROUP, add_cli_args, from_cli_args))
