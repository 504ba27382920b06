"""One request served end to end through sgl-kernel-ext's Triton kernels (in Triton's
interpreter: ``SGL_KERNEL_EXT_BACKEND=triton`` on a CPU server): lossy KIVI 2-bit serving,
whose decode reads the pool through index lists built by the index kernel and the 2-bit
payload inside the fused attention. Its greedy tokens equal the torch path's (the HF
reference that ``test_lossy_serving`` proves the torch server equal to)."""

from __future__ import annotations

import pytest

from sglang_vc.kvruntime.reference import lossy_greedy_reference
from sglang_vc.testing.client import generate
from sglang_vc.testing.reference import compare, finish_type
from sglang_vc.testing.server import ServerProcess

pytestmark = pytest.mark.slow  # about 2 minutes: the interpreter runs every kernel in numpy


def test_kivi_serving_through_triton_kernels_equals_torch_path(model_dir, tokenizer, tmp_path):
    from test_lossy_serving import prompt_ids

    ids = prompt_ids(tokenizer, 2, 200)
    log = tmp_path / "server.log"
    with ServerProcess(["--dtype", "float32", "--max-total-tokens", "4096", "--vc-compressor", "kivi",
                        "--vc-kv-bits", "2"], log_path=log, env={"SGL_KERNEL_EXT_BACKEND": "triton"}) as server:
        out = generate(server, ids, 8)
    text = log.read_text()
    for kernel in ("build_kv_indices", "paged_attention", "kivi_attention_batch"):
        assert f"sgl-kernel-ext: Triton kernel {kernel} on the CPU (Triton interpreter)" in text, kernel
    info = out["meta_info"]["sglang_vc_compression"][0]
    assert info["tokens_quantized"] > 0  # decoded from the 2-bit payload
    ref = lossy_greedy_reference(model_dir, ids, 8, "kivi", 2)
    result = compare(ref, out["output_ids"], finish_type(out))
    assert result.identical, f"wrong token at {result.wrong_token_at}: {out['output_ids']} vs {ref.tokens}"


def test_vericache_specache_drafts_through_triton_kernels_equal_full_kv(tokenizer, tmp_path):
    """VERICACHE with SpeCache drafting, end to end on the Triton path (the GPU's code,
    in Triton's interpreter here): two requests of different lengths draft together in
    each layer (``SpeCacheDrafter.attend_batch``: payloads by address, one top-k, the rows
    read from the host copy by a kernel), and the output equals full-KV decoding (a plain
    server) token by token, with some drafts rejected (the compressed path was taken).
    The embedded model cut to 2 layers on both servers: the interpreter runs every kernel
    in numpy (the full 30 layers took 23 minutes)."""
    import json

    import requests
    from test_vericache_serving import ALWAYS, SPECACHE_DRAFTER

    from sglang_vc.testing.text import real_text_passages

    passages = real_text_passages(12, words=400)
    ids_list = [tokenizer(passages[5])["input_ids"][:300], tokenizer(passages[6])["input_ids"][:400]]
    common = ["--dtype", "float32", "--max-total-tokens", "4096", "--skip-server-warmup",
              "--json-model-override-args", json.dumps({"num_hidden_layers": 2})]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}

    def run(server, custom=None):  # one /generate call with both prompts: one batch, drafting together
        sampling = {**params, "custom_params": custom} if custom else params
        r = requests.post(server.url + "/generate", json={"input_ids": ids_list, "sampling_params": sampling},
                          timeout=1800)
        assert r.status_code == 200, r.text
        return r.json()

    with ServerProcess(common, log_path=tmp_path / "plain.log") as plain:
        want = run(plain)
    log = tmp_path / "vericache.log"
    with ServerProcess([*common, "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4",
                        *ALWAYS, "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25"],
                       log_path=log, env={"SGL_KERNEL_EXT_BACKEND": "triton"}) as server:
        outs = run(server, SPECACHE_DRAFTER)
        counters = server.server_info()["sglang_vc"]["counters"]["vericache"]
    text = log.read_text()
    for kernel in ("kivi_attention_batch", "payload_scores_batch", "specache_fetch_rows", "specache_rows_attention"):
        assert f"sgl-kernel-ext: Triton kernel {kernel} on the CPU (Triton interpreter)" in text, kernel
    assert counters["specache_rows_fetched"] > 0, counters
    infos = [out["meta_info"]["sglang_vc_vericache"][-1] for out in outs]
    assert sum(i["accepted"] for i in infos) < sum(i["drafted"] for i in infos), infos
    for got, ref in zip(outs, want):
        assert len(got["output_ids"]) == len(ref["output_ids"]) == 16
        assert got["output_ids"] == ref["output_ids"], (got["output_ids"], ref["output_ids"])
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
