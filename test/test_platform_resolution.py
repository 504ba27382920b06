"""The project's flags select their SGLang backends on any platform, not only through the
CPU platform's defaults: resolved here under a stand-in for SGLang's own CUDA platform."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter: SGLang's platform is a process-wide singleton, set here to
# SGLang's CUDA platform before anything resolves it (no GPU is needed to resolve flags).
RESOLVE = r"""
import json, sys
import sglang.srt.platforms as platforms
from sglang.srt.platforms.cuda import CudaSRTPlatform
platforms._current_platform = CudaSRTPlatform()
from sglang.srt.platforms import current_platform
from sglang_vc.launch_server import parse_args
model = sys.argv[1]
cases = {
    "plain": [],
    "lossy": ["--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25"],
    "vericache": ["--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4",
                  "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25"],
    "lossy_fa3": ["--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25",
                  "--vc-full-kv-attention-backend", "fa3"],
    "evicpress_drop": ["--enable-hierarchical-cache", "--hicache-ratio", "2",
                       "--radix-cache-backend", "evicpress", "--evicpress-disk-dir", "/tmp/unused",
                       "--evicpress-policy", "fixed", "--evicpress-fixed-config", "knorm@0.5"],
    "vericache_remote": ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--radix-cache-backend", "evicpress",
                         "--evicpress-disk-dir", "/tmp/unused", "--evicpress-load-copy", "kivi@4b",
                         "--speculative-algorithm", "VERICACHE_REMOTE", "--vc-remote-verifier", "http://h:1"],
}
out = {"platform": type(current_platform).__name__, "is_cuda": current_platform.is_cuda()}
for name, argv in cases.items():
    # the two sizing flags spare the resolution a query of GPU memory
    vc, sa = parse_args(["--model-path", model, "--device", "cuda", "--mem-fraction-static", "0.5",
                         "--max-total-tokens", "4096", *argv])
    sa.resolve_once()  # SGLang's whole resolution pipeline, as run_server runs it
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.configs.model_config import ModelConfig
    from sglang_vc.kvruntime.backend import full_kv_backend_name
    mc = ModelConfig.from_server_args(sa)
    out[name] = {
        "full_kv_backend": full_kv_backend_name(sa, mc, False) if sa.attention_backend else None,
        "attention_backend": sa.attention_backend,
        "radix_cache_backend": sa.radix_cache_backend,
        "page_size": sa.page_size,
        "graphs": [sa.cuda_graph_backend_decode, sa.cuda_graph_backend_prefill],
        "mechanisms": sorted(vc.enabled_mechanisms()),
        # what an algorithm's handle_server_args declared (run_server applies it)
        "overlap": not resolution_result(sa, "disable_overlap_schedule"),
        "draft_tokens": resolution_result(sa, "speculative_num_draft_tokens"),
    }
print("RESULT " + json.dumps(out))
"""


def test_backends_resolve_under_sglangs_cuda_platform(model_dir):
    r = subprocess.run([sys.executable, "-c", RESOLVE, model_dir], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["platform"] == "CudaSRTPlatform" and out["is_cuda"]
    assert out["plain"]["attention_backend"] is None and out["plain"]["graphs"] == [None, None]
    lossy = out["lossy"]
    assert (lossy["attention_backend"], lossy["radix_cache_backend"], lossy["page_size"]) == ("vc_torch", "vc", 1)
    # decode graphs stay SGLang's (None: its default) for batches without compressed
    # requests; prefill graphs are off (the prefill compresses layer by layer)
    assert lossy["graphs"] == [None, "disabled"] and "lossy_serving" in lossy["mechanisms"]
    vc = out["vericache"]
    assert (vc["attention_backend"], vc["radix_cache_backend"], vc["page_size"]) == ("vc_verify", "vc", 1)
    # VERICACHE's DECODE iterations (full KV, in-pool drafts over view rows) replay SGLang's
    # decode graphs (None: its default); verifies and offload drafts run eager
    assert vc["graphs"] == [None, "disabled"] and "vericache" in vc["mechanisms"]
    # --speculative-num-draft-tokens 4 (drafts): SGLang's count is the verify width
    assert vc["draft_tokens"] == 5, vc
    assert vc["overlap"], vc  # SGLang's overlap scheduler stays on (test_vericache_overlap.py)
    # full-KV attention under the project's backends is SGLang's own choice for CUDA
    # (Triton here: FlashInfer is not installed; FlashInfer or FA3 on a GPU install), or
    # the one the flag names
    for case in ("lossy", "vericache", "evicpress_drop"):
        assert out[case]["full_kv_backend"] == "triton", (case, out[case])
    assert out["lossy_fa3"]["full_kv_backend"] == "fa3"
    ep = out["evicpress_drop"]
    assert (ep["attention_backend"], ep["radix_cache_backend"]) == ("vc_torch", "evicpress")
    assert ep["graphs"] == [None, "disabled"] and "evicpress" in ep["mechanisms"]
    # the remote drafts with SGLang's own CUDA attention backend over the EvicPress tree
    rm = out["vericache_remote"]
    assert (rm["attention_backend"], rm["radix_cache_backend"]) == (None, "evicpress"), rm
    assert not rm["overlap"] and rm["draft_tokens"] == 8, rm


def test_platform_plugin_steps_aside_on_a_cuda_machine(monkeypatch):
    """On a machine with CUDA the entry point returns None: SGLang keeps its CUDA platform."""
    import torch

    from sglang_vc.platform import activate

    assert activate() == "sglang_vc.platform.cpu.TorchCpuPlatform"  # this machine: no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert activate() is None
