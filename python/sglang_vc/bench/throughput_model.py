"""Appendix B.1 of the VeriCache paper for ``bench.throughput``'s runs: the throughput it
predicts at the measured operating points (this machine, the servers' KV budget) and,
labelled a prediction, on a GPU from the acceptance lengths measured here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[throughput] {msg}", file=sys.stderr, flush=True)


# Nominal H100 SXM figures for appendix B.1's GPU prediction, and a 7-8B model
# (Llama-3-8B shapes: 32 layers, 8 KV heads of 128, fp16) at 32k context.
GPUS = {"h100": {"hbm_bw": 3.35e12, "interconnect_bw": 64e9, "gpu_mem_bytes": 80e9}}
GPU_MODEL = {"name": "8B (Llama-3-8B shapes, fp16)", "weights_bytes": 16e9,
             "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2, "context_tokens": 32768}


def gpu_prediction(rows: list[dict], gpu: str) -> dict:
    """Appendix B.1 on ``gpu`` for ``GPU_MODEL``, at each VERICACHE configuration's
    measured acceptance length ``A(x)``; full KV at the same memory as the baseline."""
    from sglang_vc.vericache import perf_model as pm

    hw = GPUS[gpu]
    kv_full = GPU_MODEL["kv_bytes_per_token"] * GPU_MODEL["context_tokens"]
    base_tps, base_b, _ = pm.full_kv_from_hardware(weights_bytes=GPU_MODEL["weights_bytes"], kv_full_bytes=kv_full,
                                                   hbm_bw=hw["hbm_bw"], gpu_mem_bytes=hw["gpu_mem_bytes"])
    out = {"gpu": gpu, **hw, "model": GPU_MODEL, "label": "PREDICTION (appendix B.1), not a measurement",
           "full": {"tokens_per_s": base_tps, "batch_size": base_b}, "configs": {}}
    for row in rows:
        if row.get("kind") != "vericache" or "mean_acceptance_length" not in row:
            continue
        x, a = row["draft_tokens"], row["mean_acceptance_length"]
        kept = row.get("kept")
        if kept is None:  # a report older than the "kept" field
            log(f"  {row['config']}: no compression ratio in the report, left out")
            continue
        # Eq. 11's best feasible point (Eqs. 6 and 9 hold) at the measured A(x)
        quantizer = any(name in row["config"] for name in ("kivi", "specache"))  # its verify reloads every row
        best = pm.best_feasible(weights_bytes=GPU_MODEL["weights_bytes"], kv_full_bytes=kv_full,
                                compression=kept, acceptance={x: a}, reload_fraction=1.0 if quantizer else None, **hw)
        out["configs"][row["config"]] = {"draft_tokens": x, "accept_len": a, "kept": kept,
                                         "batch_size": best.batch_size, "offloaded": best.offloaded,
                                         "on_device": best.on_device, "cycles_per_load": best.cycles_per_load,
                                         "tokens_per_s": best.tokens_per_s, "ratio_to_full": best.tokens_per_s / base_tps,
                                         "binding": [b.value for b in best.binding]}
    return out


def print_gpu_prediction(pred: dict) -> None:
    log(f"{pred['label']}: {pred['gpu']} ({pred['hbm_bw'] / 1e12:.2f} TB/s HBM, "
        f"{pred['interconnect_bw'] / 1e9:.0f} GB/s link, {pred['gpu_mem_bytes'] / 1e9:.0f} GB), "
        f"{pred['model']['name']} at {pred['model']['context_tokens']} tokens of context")
    log(f"  full KV: batch {pred['full']['batch_size']}, {pred['full']['tokens_per_s']:.0f} tok/s")
    for name, p in pred["configs"].items():
        log(f"  {name}: A={p['accept_len']:.2f} at X={p['draft_tokens']}: batch {p['batch_size']} "
            f"({p['offloaded']} offloaded), {p['tokens_per_s']:.0f} tok/s, x{p['ratio_to_full']:.2f} "
            f"(bound by {', '.join(p['binding'])})")


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write), the CPU stand-in for HBM and for
    the host->device link (both are the same DRAM here)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def model_sizes(model_dir: str) -> tuple[int, int]:
    """(weights bytes, KV bytes per token) from the model folder."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    elem = 4 if str(cfg.get("torch_dtype", "float32")) == "float32" else 2
    return weights, 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * elem


def predictions(rows: list[dict], cfgs: dict, *, weights: int, kv_per_token: int, budget_tokens: int,
                ctx_tokens: int, bw: float) -> dict:
    """Appendix B.1 at the measured operating points (same KV budget as the servers)."""
    from sglang_vc.vericache import perf_model as pm

    mem = weights + budget_tokens * kv_per_token
    kv_full = ctx_tokens * kv_per_token
    base_tps, base_b, _ = pm.full_kv_from_hardware(weights_bytes=weights, kv_full_bytes=kv_full,
                                                   hbm_bw=bw, gpu_mem_bytes=mem)
    out = {"full": {"tokens_per_s": base_tps, "batch_size": base_b}}
    for row in rows:
        cfg = cfgs[row["config"]]
        if cfg["kind"] != "vericache" or "mean_acceptance_length" not in row or cfg.get("kept") is None:
            continue
        x, a = row["draft_tokens"], row["mean_acceptance_length"]
        pred = pm.predict_from_hardware(weights_bytes=weights, kv_full_bytes=kv_full,
                                        compression=cfg["kept"], draft_len=x, accept_len=a,
                                        hbm_bw=bw, interconnect_bw=bw, gpu_mem_bytes=mem)
        at_measured_b = pm.predict_from_hardware(
            weights_bytes=weights, kv_full_bytes=kv_full, compression=cfg["kept"], draft_len=x,
            accept_len=a, hbm_bw=bw, interconnect_bw=bw, gpu_mem_bytes=mem,
            batch_size=max(1, round(row["mean_running"])))
        out[row["config"]] = {
            "tokens_per_s": pred.tokens_per_s, "batch_size": pred.batch_size,
            "ratio_to_full": pred.tokens_per_s / base_tps, "bottleneck": pred.bottleneck,
            "feasible": pred.feasible,
            "at_measured_batch": {"batch_size": at_measured_b.batch_size,
                                  "tokens_per_s": at_measured_b.tokens_per_s,
                                  "ratio_to_full": at_measured_b.tokens_per_s / base_tps},
        }
    return out
