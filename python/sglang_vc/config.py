"""The project's own server flags (``--vc-*``, ``--specache-*``, ``--evicpress-*``,
``--speccache-*``), parsed before SGLang's and carried to SGLang's spawned processes on
the ``server_args`` record.

Each mechanism adds its flags here as it lands; a flag is validated where it is parsed so
that a bad value is an argparse-style error (exit 2) before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

FLAG_PREFIXES = ("--vc-", "--specache-", "--evicpress-", "--speccache-")
SERVER_ARGS_ATTR = "_sglang_vc"  # underscore attrs of ServerArgs survive the pickling to children


class ConfigError(ValueError):
    """An invalid or inconsistent project flag; the launcher reports it and exits 2."""


@dataclasses.dataclass
class VCConfig:
    # Compressor shared by lossy mode, VeriCache and EvicPress (issue: compressor library).
    vc_compressor: Optional[str] = None
    vc_compression_ratio: Optional[float] = None
    vc_kv_bits: Optional[int] = None
    # VERICACHE: capacity of the host store of full KV (None = unbounded).
    vc_host_kv_gb: Optional[float] = None
    # EvicPress settings (``--evicpress-*``, see sglang_vc.evicpress.flags), a plain dict.
    evicpress: Optional[dict] = None
    # Resolved, not a flag: True when the compressor serves requests directly from the
    # compressed cache (lossy serving: no speculative algorithm owns the compressor).
    # Set while SGLang resolves the server args (sglang_vc.lossy.select).
    lossy_serving: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sglang-vc")
        group.add_argument(
            "--vc-compressor",
            type=str,
            default=None,
            help="KV compression method for the device copy of the KV cache "
            "(lossy serving, or the VERICACHE drafter).",
        )
        group.add_argument(
            "--vc-compression-ratio",
            type=float,
            default=None,
            help="Fraction of the KV kept by a token-dropping compressor, in (0, 1].",
        )
        group.add_argument(
            "--vc-kv-bits",
            type=int,
            default=None,
            help="Bits per KV element for a quantization compressor.",
        )
        group.add_argument(
            "--vc-host-kv-gb",
            type=float,
            default=None,
            help="VERICACHE: host memory for the full KV that compression replaces on the "
            "device (GiB; default unbounded). A request that does not fit decodes from its "
            "full device KV instead of being compressed.",
        )
        from sglang_vc.evicpress.flags import add_cli_args as add_evicpress_args

        add_evicpress_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "VCConfig":
        global _parsed
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in vars(args).items() if k in names})
        from sglang_vc.evicpress.flags import from_cli_args as evicpress_from_args

        config.evicpress = evicpress_from_args(args)
        config.validate()
        _parsed = config
        return config

    def validate(self) -> None:
        if self.vc_host_kv_gb is not None and not self.vc_host_kv_gb >= 0:
            raise ConfigError(f"--vc-host-kv-gb must be >= 0, got {self.vc_host_kv_gb}")
        if self.vc_compression_ratio is not None and not 0 < self.vc_compression_ratio <= 1:
            raise ConfigError(
                f"--vc-compression-ratio must be in (0, 1] (fraction of KV kept), "
                f"got {self.vc_compression_ratio}"
            )
        if self.vc_compressor is None:
            if self.vc_compression_ratio is not None or self.vc_kv_bits is not None:
                raise ConfigError(
                    "--vc-compression-ratio/--vc-kv-bits need --vc-compressor"
                )
            return
        _validate_compressor(self.vc_compressor, self.vc_compression_ratio, self.vc_kv_bits)

    def enabled_mechanisms(self) -> dict[str, dict[str, Any]]:
        """The mechanisms this config enables, with their settings.

        Returns the same dict object on every call, refreshed: a ``/server_info`` section
        built before SGLang resolves its args then also shows what resolution decided
        (``lossy_serving``, set by the platform defaults)."""
        mechanisms = self.__dict__.setdefault("_mechanisms", {})
        mechanisms.clear()
        if self.vc_compressor:
            mechanisms["compression"] = {
                "compressor": self.vc_compressor,
                "compression_ratio": self.vc_compression_ratio,
                "kv_bits": self.vc_kv_bits,
            }
        if self.lossy_serving:
            from sglang_vc.lossy import ATTENTION_BACKEND, RADIX_CACHE_BACKEND, REQUEST_KEYS

            mechanisms["lossy_serving"] = {
                "compressor": self.vc_compressor,
                "compression_ratio": self.vc_compression_ratio,
                "kv_bits": self.vc_kv_bits,
                "attention_backend": ATTENTION_BACKEND,
                "radix_cache_backend": RADIX_CACHE_BACKEND,
                "per_request_keys": list(REQUEST_KEYS),  # in sampling_params.custom_params
            }
        vericache = self.__dict__.get("vericache")  # set when VERICACHE is resolved
        if vericache:
            mechanisms["vericache"] = dict(vericache)
        if self.evicpress and self.evicpress.get("enabled"):
            ep = self.evicpress
            mechanisms["evicpress"] = {
                "policy": ep["policy"], "alpha": ep["alpha"], "candidates": ep["candidates"],
                "fixed_config": ep["fixed_config"], "disk_dir": ep["disk_dir"],
            }
        return mechanisms

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate_compressor(name: str, ratio: Optional[float], bits: Optional[int]) -> None:
    try:
        from sglang_vc.compress.registry import get_compressor
    except ImportError:  # the compressor library has not landed in this build
        raise ConfigError("--vc-compressor: no compressor library in this build") from None
    try:
        compressor = get_compressor(name)
    except ValueError as exc:
        raise ConfigError(f"--vc-compressor: {exc}") from None
    if compressor.scenario == "quantization":
        if ratio is not None:
            raise ConfigError(
                f"--vc-compressor {name} quantizes: give --vc-kv-bits, not --vc-compression-ratio"
            )
        if bits is None:
            raise ConfigError(f"--vc-compressor {name} quantizes: it needs --vc-kv-bits")
        from sglang_vc.compress import check_bits

        try:
            check_bits(bits, compressor.supported_bits, name)
        except ValueError as exc:
            raise ConfigError(f"--vc-kv-bits: {exc}") from None
    elif bits is not None:
        raise ConfigError(
            f"--vc-compressor {name} drops tokens: give --vc-compression-ratio, not --vc-kv-bits"
        )
    elif ratio is None:
        raise ConfigError(f"--vc-compressor {name} drops tokens: it needs --vc-compression-ratio")


_parsed: Optional[VCConfig] = None


def parsed_config() -> Optional[VCConfig]:
    """The config the launcher parsed in *this* process (None where no launcher ran).

    SGLang resolves its server args in the launcher process right after the project's
    flags are parsed; platform defaults read the project config from here because it is
    not on ``server_args`` yet at that point. Later processes use ``get_vc_config``."""
    return _parsed


def get_vc_config(server_args) -> VCConfig:
    """The project's config as carried on a (possibly unpickled) ``server_args``."""
    raw = getattr(server_args, SERVER_ARGS_ATTR, None) or {}
    return VCConfig(**raw)
