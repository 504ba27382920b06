"""Full-KV attention under the project's backends is SGLang's own backend: forwards in
which no request reads compressed rows (prefills, opted-out or uncompressed decodes) run
it unchanged. On this CPU SGLang's ``triton`` backend -- the GPU route -- runs through
Triton's interpreter (``TRITON_INTERPRET=1``), named with ``--vc-full-kv-attention-backend``:
its tokens equal HF transformers', and compressed requests around it keep their own
attention (lossy serving equals its offline reference; VERICACHE equals full KV)."""

from __future__ import annotations

import pytest
import requests

from conftest import real_text_passages
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import compare, finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess

pytestmark = pytest.mark.slow  # the interpreter runs every attention kernel in numpy: minutes
INTERPRET = {"TRITON_INTERPRET": "1"}


def _ids(tokenizer, i: int, n: int) -> list[int]:
    ids = tokenizer(real_text_passages(6, words=200)[i])["input_ids"][:n]
    assert len(ids) == n
    return ids


def _full_kv_forwards(server, counter: str = "full_kv_backend_forwards") -> float:
    """Forwards the project's backend handed to SGLang's full-KV backend (its counter;
    ``full_kv_verify_forwards``: VERICACHE forwards whose verifying and uncompressed
    requests ran it)."""
    counters = requests.get(server.url + "/server_info", timeout=60).json()["sglang_vc"]["counters"]
    return counters.get("attention", {}).get(counter, 0)


def _identical(ref, out) -> None:
    result = compare(ref, out["output_ids"], finish_type(out))
    assert result.identical, (result, out["output_ids"], ref.tokens)


def test_lossy_server_runs_sglangs_triton_backend_for_full_kv(model_dir, tokenizer, tmp_path):
    from sglang_vc.kvruntime.reference import lossy_greedy_reference

    log = tmp_path / "server.log"
    with ServerProcess(["--dtype", "float32", "--max-total-tokens", "4000", "--vc-compressor", "knorm",
                        "--vc-compression-ratio", "0.5", "--vc-full-kv-attention-backend", "triton",
                        "--skip-server-warmup"], log_path=log, env=INTERPRET, timeout=400) as server:
        ids = _ids(tokenizer, 1, 120)
        _identical(greedy_reference(model_dir, ids, 6), generate(server, ids, 6, {"vc_compressor": "none"}))
        opted_out = _full_kv_forwards(server)
        assert opted_out >= 6  # its prefill and its decodes
        _identical(lossy_greedy_reference(model_dir, ids, 6, "knorm", 0.5), generate(server, ids, 6))
        assert _full_kv_forwards(server) == opted_out + 1  # the compressing prefill only
    assert "full-KV attention runs SGLang's triton backend" in log.read_text()


def test_vericache_prefills_and_verifies_through_sglangs_triton_backend(model_dir, tokenizer, tmp_path):
    """The verifies too: a verifying request's row points at its full KV staged in pool
    slots, and SGLang's triton extend kernel reads it there."""
    log = tmp_path / "server.log"
    with ServerProcess(["--dtype", "float32", "--max-total-tokens", "4000", "--speculative-algorithm", "VERICACHE",
                        "--speculative-num-draft-tokens", "3", "--vc-compress-when", "always", "--vc-compressor", "snapkv",
                        "--vc-compression-ratio", "0.25", "--vc-full-kv-attention-backend", "triton",
                        "--skip-server-warmup"], log_path=log, env=INTERPRET, timeout=400) as server:
        ids_list = [_ids(tokenizer, 1, 150), _ids(tokenizer, 2, 200)]
        outs = concurrently(lambda ids: generate(server, ids, 8), [(ids,) for ids in ids_list])
        assert _full_kv_forwards(server) >= 1  # the prefills
        verify_forwards = _full_kv_forwards(server, "full_kv_verify_forwards")
    for ids, out in zip(ids_list, outs):
        _identical(greedy_reference(model_dir, ids, 8), out)
    info = [out["meta_info"]["sglang_vc_vericache"][-1] for out in outs]
    assert sum(i["verify_rounds"] for i in info) > 0
    assert verify_forwards >= max(i["verify_rounds"] for i in info)  # each verify ran SGLang's backend
    assert "full-KV attention runs SGLang's triton backend" in log.read_text()
