"""The project's own server flags (``--vc-*``, ``--specache-*``, ``--evicpress-*``,
``--speccache-*``), parsed before SGLang's and carried to SGLang's spawned processes on
the ``server_args`` record.

This module holds the shared compressor flags (``--vc-compressor``,
``--vc-compression-ratio``, ``--vc-kv-bits``: the compressed-KV runtime's) and a registry
of flag groups: each mechanism registers its own family with :func:`register_flag_group`
(``sglang_vc.registrations.register_flag_groups`` imports them), so this module imports no
mechanism. A flag is validated where it is parsed, so that a bad value is an
argparse-style error (exit 2) before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Optional

FLAG_PREFIXES = ("--vc-", "--specache-", "--evicpress-", "--speccache-")
SERVER_ARGS_ATTR = "_sglang_vc"  # underscore attrs of ServerArgs survive the pickling to children


class ConfigError(ValueError):
    """An invalid or inconsistent project flag; the launcher reports it and exits 2."""


@dataclasses.dataclass(frozen=True)
class FlagGroup:
    """One mechanism's flag family.

    ``from_cli_args`` returns the validated settings as plain data (they cross process
    boundaries on ``server_args``), or None when none of the group's flags is in use; it
    raises :class:`ConfigError` on a bad value. ``describe`` gives the group's entry in
    the ``mechanisms`` of ``/server_info`` (None: not shown)."""

    name: str
    add_cli_args: Callable[[argparse.ArgumentParser], None]
    from_cli_args: Callable[[argparse.Namespace], Optional[dict]]
    describe: Callable[[dict], Optional[dict]] = lambda settings: None


_GROUPS: dict[str, FlagGroup] = {}


def register_flag_group(group: FlagGroup) -> None:
    _GROUPS[group.name] = group


def flag_groups() -> tuple[FlagGroup, ...]:
    return tuple(_GROUPS.values())


@dataclasses.dataclass
class VCConfig:
    # The compressor of the device KV copy, shared by lossy serving, VeriCache's drafter
    # and the compressed-KV runtime.
    vc_compressor: Optional[str] = None
    vc_compression_ratio: Optional[float] = None
    vc_kv_bits: Optional[int] = None
    # SGLang attention backend for full-KV attention under the project's backends (None:
    # the one SGLang itself would choose for the platform and model).
    vc_full_kv_attention_backend: Optional[str] = None
    # Validated settings of each registered flag group that is in use (plain data).
    groups: dict = dataclasses.field(default_factory=dict)
    # What SGLang's argument resolution decided, per mechanism (lossy serving, VeriCache);
    # shown in /server_info.
    resolved: dict = dataclasses.field(default_factory=dict)
    # SGLang capabilities the mechanisms switched off, with the reason (sglang_vc.notices).
    switched_off: list = dataclasses.field(default_factory=list)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sglang-vc: KV compression")
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
            "--vc-full-kv-attention-backend",
            type=str,
            default=None,
            help="SGLang attention backend that runs full-KV attention (prefills, batches "
            "without compressed requests) under the project's backends. Default: the one "
            "SGLang itself chooses for the platform and model (FlashInfer, FA3 or Triton on "
            "CUDA; torch_native on the CPU).",
        )
        for flag_group in flag_groups():
            flag_group.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "VCConfig":
        global _parsed
        config = cls(
            vc_compressor=args.vc_compressor,
            vc_compression_ratio=args.vc_compression_ratio,
            vc_kv_bits=args.vc_kv_bits,
            vc_full_kv_attention_backend=args.vc_full_kv_attention_backend,
        )
        for flag_group in flag_groups():
            settings = flag_group.from_cli_args(args)
            if settings is not None:
                config.groups[flag_group.name] = settings
        config.validate()
        _parsed = config
        return config

    def group(self, name: str) -> Optional[dict]:
        """The validated settings of flag group ``name``, None when it is not in use."""
        return self.groups.get(name)

    def validate(self) -> None:
        if self.vc_full_kv_attention_backend is not None:
            _validate_full_kv_backend(self.vc_full_kv_attention_backend)
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
        built before SGLang resolves its args then also shows what resolution decided."""
        mechanisms = self.__dict__.setdefault("_mechanisms", {})
        mechanisms.clear()
        if self.vc_compressor:
            mechanisms["compression"] = {
                "compressor": self.vc_compressor,
                "compression_ratio": self.vc_compression_ratio,
                "kv_bits": self.vc_kv_bits,
            }
        for name, settings in self.groups.items():
            group = _GROUPS.get(name)
            described = group.describe(settings) if group is not None else None
            if described is not None:
                mechanisms[name] = described
        for name, settings in self.resolved.items():
            mechanisms[name] = {**mechanisms.get(name, {}), **settings}
        return mechanisms

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate_full_kv_backend(name: str) -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    from sglang_vc.kvruntime.names import PROJECT_ATTENTION_BACKENDS

    choices = [c for c in ATTENTION_BACKEND_CHOICES if c not in PROJECT_ATTENTION_BACKENDS]
    if name not in choices:
        raise ConfigError(f"--vc-full-kv-attention-backend must be one of SGLang's attention backends "
                          f"({', '.join(choices)}), got {name!r}")


def _validate_compressor(name: str, ratio: Optional[float], bits: Optional[int]) -> None:
    from sglang_vc.compress import check_bits
    from sglang_vc.compress.registry import get_compressor

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
    flags are parsed; resolution hooks read the project config from here because it is
    not on ``server_args`` yet at that point. Later processes use ``get_vc_config``."""
    return _parsed


def get_vc_config(server_args) -> VCConfig:
    """The project's config as carried on a (possibly unpickled) ``server_args``."""
    raw = getattr(server_args, SERVER_ARGS_ATTR, None) or {}
    return VCConfig(**raw)
