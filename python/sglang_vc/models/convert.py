"""GGUF file -> Hugging Face folder (config.json, model.safetensors, tokenizer files).

transformers can read GGUF, but ``from_pretrained(..., gguf_file=...)`` insists on
``accelerate``, which the CPU environment does not install. So the model is rebuilt from
the GGUF's config (no quantization settings: the folder holds plain dequantized weights)
and the dequantized tensors are loaded with transformers' own GGUF reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_vc.models.fetch import ModelPrepareError, log
from sglang_vc.models.registry import ModelSpec

# tokenizer_config keys transformers 5 writes that describe the loading call, not the tokenizer
_TOKENIZER_NOISE = ("is_local", "local_files_only")


def convert_gguf(spec: ModelSpec, gguf_path: Path, out_dir: Path) -> None:
    """Write the HF folder for ``spec`` into ``out_dir`` (which must not exist yet)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dtype = getattr(torch, spec.dtype)
    src_dir, name = str(gguf_path.parent), gguf_path.name

    log(f"{spec.name}: reading tokenizer and config from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)  # plain weights; GGUF's general.name is not a path

    log(f"{spec.name}: dequantizing the weights to {spec.dtype}")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=dtype
    )["tensors"]
    _load_weights(model, tensors)
    del tensors

    log(f"{spec.name}: checking a forward pass on the chat template")
    _smoke_test(model, tokenizer)

    log(f"{spec.name}: saving the HF folder")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # template in tokenizer_config
    _fix_config(out_dir / "config.json", spec)
    _fix_tokenizer_config(out_dir / "tokenizer_config.json", model.config)


def _load_weights(model, tensors: dict) -> None:
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ModelPrepareError(
            f"GGUF weights do not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    model.tie_weights()


def _smoke_test(model, tokenizer) -> None:
    """One forward pass: catches a broken tokenizer, template or weight mapping early."""
    import torch

    if not tokenizer.chat_template:
        raise ModelPrepareError("the GGUF carries no chat template")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise ModelPrepareError("the converted model produces non-finite logits")


def _float32_repr(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.999999747378752e-06; keep the short decimal
    import numpy as np

    return float(str(np.float32(value)))


def _fix_config(path: Path, spec: ModelSpec) -> None:
    config = json.loads(path.read_text())
    for key in ("rms_norm_eps", "layer_norm_eps"):
        if isinstance(config.get(key), float):
            config[key] = _float32_repr(config[key])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        rope["rope_theta"] = _float32_repr(rope["rope_theta"])
        # loaders older than transformers 5 read the top-level key (Qwen needs 1e6, not 1e4)
        config["rope_theta"] = rope["rope_theta"]
    config["torch_dtype"] = spec.dtype  # the name older loaders read
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fix_tokenizer_config(path: Path, model_config) -> None:
    config = json.loads(path.read_text())
    for key in _TOKENIZER_NOISE:
        config.pop(key, None)
    # transformers 5 names its class TokenizersBackend; this alias loads in 4.x and 5.x
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = model_config.max_position_embeddings
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
