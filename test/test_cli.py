"""Bad command lines get a clear message and exit 2, before any server process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

LAUNCH = [sys.executable, "-m", "sglang_vc.launch_server"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-path", "no-such-model"], "unknown model"),
        (["--vc-compression-ratio", "1.5", "--vc-compressor", "knorm"], "--vc-compression-ratio"),
        (["--vc-compression-ratio", "0.5"], "need --vc-compressor"),
        (["--vc-no-such-flag", "1"], "unrecognized sglang-vc argument"),
        (["--vc-compression-ratio", "abc"], "invalid float value"),
    ],
    ids=["unknown-alias", "ratio-out-of-range", "ratio-without-compressor", "unknown-vc-flag", "not-a-number"],
)
def test_launcher_rejects_bad_flags(args, message, capsys):
    """The launcher's argument parsing, in process (the same code ``main`` runs first)."""
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


@pytest.mark.parametrize("argv, dtype", [([], "CPU_DEFAULT"), (["--dtype", "float16"], "float16"),
                                         (["--dtype=float32"], "float32")], ids=["default", "explicit", "explicit-eq"])
def test_cpu_dtype_default_and_explicit_dtype(argv, dtype):
    """On the CPU, no ``--dtype`` serves the measured default (not SGLang's ``auto``,
    which serves a float32 checkpoint in float16); an explicit ``--dtype`` always wins."""
    from sglang_vc.launch_server import cpu_default_dtype, parse_args

    _, server_args = parse_args(argv)
    assert server_args.dtype == (cpu_default_dtype() if dtype == "CPU_DEFAULT" else dtype)


def test_cpu_hicache_gets_the_transfers_the_platform_supports(capsys):
    """``--enable-hierarchical-cache`` on the CPU platform: the launcher sets the HiCache
    I/O backend and layout it supports (SGLang's defaults are CUDA transfers, which crashed
    the scheduler at start-up) and says so; one given that it cannot run is a CLI error."""
    from sglang_vc import notices
    from sglang_vc.launch_server import parse_args

    _, server_args = parse_args(["--enable-hierarchical-cache", "--radix-cache-backend", "evicpress",
                                 "--evicpress-disk-dir", "/tmp/unused-evicpress"])
    assert (server_args.hicache_io_backend, server_args.hicache_mem_layout) == ("direct", "layer_first")
    assert any("hicache-io-backend direct" in n.message() for n in notices.all_switched_off())
    _, plain = parse_args([])
    assert plain.hicache_io_backend == "kernel"  # untouched without HiCache
    with pytest.raises(SystemExit) as exc:
        parse_args(["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first"])
    assert exc.value.code == 2 and "--hicache-mem-layout layer_first" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--tp-size", "2"], ["--tensor-parallel-size=2"], ["--pp-size", "2"]],
                         ids=["tp", "tp-long", "pp"])
def test_vericache_on_more_than_one_rank_is_refused(extra, capsys):
    """Each rank would choose its forwards from its own timings (ranks could hang in
    NCCL): ``--tp-size 2`` (or pipeline ranks) under VERICACHE is a CLI error, exit 2,
    with the flag named; one rank parses."""
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--speculative-algorithm", "VERICACHE", *extra])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "one rank" in err and ("--pp-size 2" if extra == ["--pp-size", "2"] else "--tp-size 2") in err
    _, server_args = parse_args(["--speculative-algorithm", "VERICACHE"])
    assert server_args.tp_size == 1


@pytest.mark.parametrize("flags, dtype", [("fpu avx2 avx512f avx512_bf16 sse", "bfloat16"),
                                          ("fpu avx2 amx_tile amx_bf16", "bfloat16"), ("fpu avx2 avx512f", "float32")])
def test_cpu_default_dtype_follows_bf16_instructions(flags, dtype, tmp_path):
    from sglang_vc.launch_server import cpu_default_dtype

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_default_dtype(str(info)) == dtype
    assert cpu_default_dtype(str(tmp_path / "missing")) == "float32"


def test_launcher_process_exits_2_with_a_message():
    """End to end: a bad flag ends the real launcher process with exit 2 and a usage
    message, no traceback, before any server process starts."""
    result = run(LAUNCH + ["--vc-compression-ratio", "1.5", "--vc-compressor", "knorm"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--vc-compression-ratio" in result.stderr
    assert "Traceback" not in result.stderr


def test_models_cli_unknown_alias():
    result = run([sys.executable, "-m", "sglang_vc.models", "path", "no-such-model"])
    assert result.returncode == 2
    assert "smollm2-135m" in result.stderr  # the message lists the known models
    assert "Traceback" not in result.stderr


def test_models_cli_path_prints_prepared_folder(model_dir):
    result = run([sys.executable, "-m", "sglang_vc.models", "path", "smollm2-135m"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == model_dir


def test_plain_python_imports_sglang_and_transformers():
    """The venv's start-up shim lets users import sglang and transformers directly."""
    code = "import sglang, transformers; from transformers import AutoTokenizer; print('ok')"
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_cpu_platform_selected_without_env():
    code = (
        "import os; assert 'SGLANG_PLATFORM' not in os.environ\n"
        "from sglang.srt.platforms import current_platform\n"
        "print(type(current_platform).__module__, current_platform.is_out_of_tree())"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "SGLANG_PLATFORM"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["sglang_vc.platform.cpu", "True"]


def test_algorithms_warn_of_what_they_switch_off(caplog, monkeypatch):
    """A project algorithm turns off what it cannot run with where it was on: mixed
    chunks, and SGLang's overlap scheduler for a worker that does not keep its contract
    (SPECACHE; VERICACHE keeps it: ``test_vericache_overlap.py``). Each is a warning with
    its reason once the launcher has configured logging; what was already off is not."""
    import logging
    import types

    from sglang_vc import notices
    from sglang_vc.speculative import resolve_flags

    # A notice is said once per process: start from none, whatever ran before in this worker.
    monkeypatch.setattr(notices, "_all", [])
    monkeypatch.setattr(notices, "_pending", [])
    args = types.SimpleNamespace(speculative_algorithm="SPECACHE", disable_overlap_schedule=False,
                                 enable_mixed_chunk=True)
    resolve_flags(args, "vc_specache")
    assert args.disable_overlap_schedule and not args.enable_mixed_chunk
    with caplog.at_level(logging.WARNING, logger="sglang_vc"):
        notices.flush()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("the overlap scheduler disabled by --speculative-algorithm SPECACHE: ") for m in lines)
    assert any(m.startswith("mixed chunks (--enable-mixed-chunk) disabled by --speculative-algorithm SPECACHE: ")
               for m in lines), lines
    caplog.clear()
    resolve_flags(types.SimpleNamespace(speculative_algorithm="SPECACHE", disable_overlap_schedule=True,
                                        enable_mixed_chunk=False), "vc_specache")
    with caplog.at_level(logging.WARNING, logger="sglang_vc"):
        notices.flush()
    assert not caplog.records


def test_full_kv_attention_is_sglangs_choice_unless_named(model_dir, capsys):
    """On this CPU SGLang's platform choice (torch_native) runs full-KV attention under
    the project's backends; the flag names another of SGLang's backends, and anything
    else (one of the project's own, an unknown name) is a usage error."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_vc.kvruntime.backend import full_kv_backend_name
    from sglang_vc.launch_server import parse_args

    lossy = ["--model-path", model_dir, "--vc-compressor", "knorm", "--vc-compression-ratio", "0.5"]
    for extra, want in (([], "torch_native"), (["--vc-full-kv-attention-backend", "triton"], "triton")):
        vc, sa = parse_args([*lossy, *extra])
        sa.resolve_once()
        assert full_kv_backend_name(sa, ModelConfig.from_server_args(sa), False) == want
    for bad in ("vc_torch", "no-such-backend"):
        with pytest.raises(SystemExit) as exc:
            parse_args([*lossy, "--vc-full-kv-attention-backend", bad])
        assert exc.value.code == 2 and "--vc-full-kv-attention-backend must be one of" in capsys.readouterr().err
