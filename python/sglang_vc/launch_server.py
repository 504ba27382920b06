"""``python -m sglang_vc.launch_server``: SGLang's launcher plus the project's flags.

Every SGLang flag keeps its meaning. On top of SGLang this launcher
- serves the built-in default model when no ``--model-path`` is given, and accepts a
  built-in alias as ``--model-path``;
- parses and validates the ``--vc-*``/``--specache-*``/``--evicpress-*``/``--speccache-*``
  flags and carries them to SGLang's spawned processes on ``server_args``;
- serves :func:`cpu_default_dtype` on the CPU when no ``--dtype`` is given;
- adds a ``sglang_vc`` section to ``GET /server_info`` and ``GET /get_server_info``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from sglang_vc import notices
from sglang_vc.config import FLAG_PREFIXES, SERVER_ARGS_ATTR, ConfigError, VCConfig
from sglang_vc.kvruntime.select import BackendChoice, flag_value

PROG = "python -m sglang_vc.launch_server"



def cpu_default_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The dtype served on the CPU platform when no ``--dtype`` is given (SGLang's ``auto``
    serves a float32 checkpoint in float16). ``python -m sglang_vc.bench.dtype`` measured,
    on a CPU with AVX512-BF16, bfloat16 at 1.44x float32's decode tokens/s (float16 1.08x,
    slower than float32 at concurrency 8), with greedy output equal to HF float32 for 94 of
    128 tokens (float32: 128; benchmark/README.md, "Serving dtype on the CPU"). So:
    bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16 or AMX-BF16), float32
    elsewhere (torch then emulates bfloat16; not measured here)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def build_vc_parser() -> argparse.ArgumentParser:
    from sglang_vc.registrations import register_flag_groups

    register_flag_groups()
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    VCConfig.add_cli_args(parser)
    return parser


def resolve_model_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Serve the default model when none is given; turn a built-in alias into its folder."""
    from sglang_vc import models

    argv = list(argv)
    index, value = flag_value(argv, "--model-path", "--model")
    name = value if index >= 0 else models.DEFAULT_MODEL
    if index >= 0 and (os.path.exists(value) or "/" in value):
        return argv  # a local folder, or a hub id that SGLang resolves itself
    try:
        path = models.resolve(name)
    except ValueError as exc:  # an unknown alias: a usage error
        parser.error(str(exc))
    except models.ModelPrepareError as exc:  # download or checksum failed
        print(f"{PROG}: error: could not prepare model {name!r}: {exc}", file=sys.stderr)
        sys.exit(1)
    if index < 0:
        argv += ["--model-path", path]
    elif argv[index].startswith("--"):
        if "=" in argv[index]:
            argv[index] = f"--model-path={path}"
        else:
            argv[index + 1] = path
    if flag_value(argv, "--served-model-name")[0] < 0:
        argv += ["--served-model-name", name]
    return argv


def _platform_device() -> str:
    from sglang.srt.platforms import current_platform

    return current_platform.device_type


def parse_args(argv: list[str]):
    """Split argv into the project's config and SGLang's ServerArgs (exits 2 on errors)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()  # our backends must be registered choices before SGLang parses

    parser = build_vc_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print()
        prepare_server_args(["--help"])  # prints SGLang's flags and exits 0
    vc_args, sglang_argv = parser.parse_known_args(argv)
    unknown = [a for a in sglang_argv if a.split("=", 1)[0].startswith(FLAG_PREFIXES)]
    if unknown:
        parser.error(f"unrecognized sglang-vc argument: {unknown[0]}")
    try:
        vc_config = VCConfig.from_cli_args(vc_args)
    except ConfigError as exc:
        parser.error(str(exc))
    sglang_argv = resolve_model_argv(sglang_argv, parser)
    from sglang_vc.vericache import flags as vericache_flags

    vericache_flags.apply_default_drafter(vc_config, sglang_argv)
    try:
        sglang_argv += backend_flags(vc_config, sglang_argv)
        from sglang_vc.evicpress import flags as evicpress_flags

        sglang_argv = evicpress_flags.storage_argv(evicpress_flags.settings_of(vc_config), sglang_argv)
        from sglang_vc import storage_link

        sglang_argv = storage_link.storage_argv(vc_config.group(storage_link.GROUP), sglang_argv)
    except ConfigError as exc:
        parser.error(str(exc))
    if flag_value(sglang_argv, "--device")[0] < 0 and _platform_device() == "cpu":
        # SGLang's default device falls through to the platform's torch.device object,
        # which its resolution then treats as a string; name the device explicitly.
        sglang_argv += ["--device", "cpu"]
    if flag_value(sglang_argv, "--dtype")[0] < 0 and flag_value(sglang_argv, "--device")[1] == "cpu":
        sglang_argv += ["--dtype", cpu_default_dtype()]  # an explicit --dtype always wins
    if flag_value(sglang_argv, "--device")[1] == "cpu":
        try:
            sglang_argv += cpu_hicache_flags(sglang_argv)
        except ConfigError as exc:
            parser.error(str(exc))
    server_args = prepare_server_args(sglang_argv)
    try:
        vericache_flags.check_parallelism(server_args)
    except ConfigError as exc:
        parser.error(str(exc))
    vc_config.switched_off = [dataclasses.asdict(n) for n in notices.all_switched_off()]
    setattr(server_args, SERVER_ARGS_ATTR, vc_config.to_dict())
    return vc_config, server_args


# HiCache's host transfers on the CPU platform: SGLang's defaults (``kernel`` I/O,
# ``page_first`` layout) are sgl-kernel's CUDA copies, which a CPU build does not have
CPU_HICACHE = {"--hicache-io-backend": "direct", "--hicache-mem-layout": "layer_first"}


def cpu_hicache_flags(argv: list[str]) -> list[str]:
    """With ``--enable-hierarchical-cache`` on the CPU platform: the HiCache I/O backend and
    memory layout it supports, where not given (said as a notice); a ConfigError naming the
    flag where one is given that it cannot run."""
    if "--enable-hierarchical-cache" not in argv:
        return []
    added = []
    for flag, value in CPU_HICACHE.items():
        given = flag_value(argv, flag)[1]
        if given is None:
            added += [flag, value]
        elif given != value:
            raise ConfigError(f"{flag} {given}: HiCache on the CPU platform needs {flag} {value} "
                              "(the other choices are sgl-kernel's CUDA transfers)")
    if added:
        notices.switched_off("HiCache's CUDA transfer kernels", "the CPU platform",
                             "set " + " ".join(added) + " (the host transfers it supports)")
    return added


def backend_choice(vc_config: VCConfig, argv: list[str]) -> BackendChoice | None:
    """Which of the project's SGLang backends the flags select (at most one)."""
    from sglang_vc.evicpress import flags as evicpress_flags
    from sglang_vc.kvruntime import ATTENTION_BACKEND
    from sglang_vc.kvruntime.select import lossy_choice
    from sglang_vc.speccache import flags as speccache_flags
    from sglang_vc.specache import flags as specache_flags
    from sglang_vc.vericache import flags as vericache_flags

    specache_flags.check_usage(vc_config.group(specache_flags.GROUP), argv, vc_config.vc_compressor)
    choices = [c for c in (
        lossy_choice(vc_config, argv),
        vericache_flags.backend_choice(argv),
        specache_flags.backend_choice(argv),
        evicpress_flags.backend_choice(evicpress_flags.settings_of(vc_config), argv),
        speccache_flags.backend_choice(vc_config.group(speccache_flags.GROUP)),
    ) if c is not None]
    if len(choices) > 1:
        raise ConfigError(f"{choices[0].reason} and {choices[1].reason} cannot be combined")
    if choices:
        return choices[0]
    given = flag_value(argv, "--attention-backend")[1]
    if given in (ATTENTION_BACKEND, vericache_flags.ATTENTION_BACKEND, specache_flags.ATTENTION_BACKEND,
                 speccache_flags.ATTENTION_BACKEND):
        return BackendChoice(given, None, f"--attention-backend {given}", decode_graphs=given == ATTENTION_BACKEND)
    return None


def backend_flags(vc_config: VCConfig, argv: list[str]) -> list[str]:
    """SGLang flags the project's flags imply, whatever the platform (see
    :mod:`sglang_vc.kvruntime.select`)."""
    from sglang_vc.kvruntime.select import sglang_flags

    choice = backend_choice(vc_config, argv)
    if choice is None:
        return []
    if vc_config.vc_full_kv_attention_backend == "torch_native":  # it captures no graphs
        choice = dataclasses.replace(choice, decode_graphs=False)
    return sglang_flags(choice, argv)


def main(argv: list[str] | None = None) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.utils import configure_logger

    from sglang_vc.server_info import install_server_info_routes

    vc_config, server_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logger(server_args)  # SGLang's own format; it configures the same again later
    notices.flush()  # what the flags switched off, as warnings
    drafter = vc_config.resolved.get("vericache_drafter")
    if drafter:
        import logging

        logging.getLogger(__name__).info(
            "VERICACHE without --vc-compressor: drafting with %s at %d bits, the default drafter "
            "(--vc-compressor chooses another)", drafter["compressor"], drafter["kv_bits"])
    install_server_info_routes(vc_config)
    from sglang_vc.evicpress.service import install as install_evicpress

    install_evicpress(vc_config, server_args)  # /evicpress/* routes and the profiler
    from sglang_vc.speccache.service import install as install_speccache

    install_speccache(vc_config)  # POST /speccache/chunks
    try:
        run_server(server_args)
    except ConfigError as exc:  # a project check run while SGLang resolves its args
        build_vc_parser().error(str(exc))  # usage error, exit 2
    finally:
        stop_children()


def stop_children() -> None:
    """Kill SGLang's processes (waiting until they are reaped), then stop
    multiprocessing's resource tracker the way Python itself does at a clean exit
    (closing its pipe: it releases what the children left registered, and is waited
    for). Killed with the rest, it would be relaunched by the launcher's own exit and
    outlive it: a supervisor waiting for the launcher would see a stop not finished."""
    from multiprocessing import resource_tracker

    from sglang.srt.utils import kill_process_tree

    tracker = resource_tracker._resource_tracker  # stdlib: the process-wide tracker
    kill_process_tree(os.getpid(), include_parent=False, skip_pid=tracker._pid)
    tracker._stop()


if __name__ == "__main__":
    main()
