"""VERICACHE's verify graphs fit SGLang's buffers and read the right tokens on a GPU
(#74 item 3), checked with SGLang's own code under its CUDA platform (no GPU needed):

- SGLang's draft-token count is VERICACHE's verify width X + 1 (NGRAM's convention), so
  the shared logits buffer SGLang sizes (``ModelRunner.max_decode_logits_rows``) holds
  every verify graph the project captures, at every width (it held X rows per request
  while the runner asked for X + 1: the capture's assert fired, every verify ran eager);
- each width's FA3 backend, built by :func:`capture_verify_graphs`, lays out exactly
  ``W`` query tokens per request in its ``TARGET_VERIFY`` metadata (FA3 reads the width
  from SGLang's draft-token count when it is built, not from the verify input).

FA3's kernels are not called: ``sgl_kernel`` (absent on the CPU) is stood in for by
empty modules; the metadata is plain torch on CPU tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys, types
from types import SimpleNamespace
import sglang.srt.platforms as platforms
from sglang.srt.platforms.cuda import CudaSRTPlatform
platforms._current_platform = CudaSRTPlatform()
fa = types.ModuleType("sgl_kernel.flash_attn")
fa.flash_attn_varlen_func = fa.flash_attn_with_kvcache = fa.get_scheduler_metadata = None
sk = types.ModuleType("sgl_kernel")
sk.merge_state_v2, sk.flash_attn, sk.__path__ = None, fa, []
sys.modules.update({"sgl_kernel": sk, "sgl_kernel.flash_attn": fa})

import torch
from sglang.srt import runtime_context
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_vc.kvruntime.backend import VCTorchAttnBackend
from sglang_vc.launch_server import parse_args
from sglang_vc.vericache import decode_graphs


def widths_for(model, x):
    vc, sa = parse_args(["--model-path", model, "--device", "cuda", "--mem-fraction-static", "0.5",
                         "--max-total-tokens", "4096", "--speculative-algorithm", "VERICACHE",
                         "--speculative-num-draft-tokens", x, "--vc-compressor", "snapkv",
                         "--vc-compression-ratio", "0.25"])
    sa.resolve_once()
    runtime_context.publish(sa, role="scheduler")
    spec = runtime_context.get_spec()
    mc = ModelConfig.from_server_args(sa)
    pool = SimpleNamespace(req_to_token=torch.arange(8 * 128, dtype=torch.int32).view(8, 128), size=64)
    mr = SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.from_string("VERICACHE"), is_draft_worker=False, server_args=sa,
        model_config=mc, sliding_window_size=None, device="cpu", req_to_token_pool=pool, token_to_kv_pool=object(),
        kv_cache_dtype=torch.float16, kv_cache_dtype_str="auto", page_size=1,
        kv_index_translator=SimpleNamespace(is_translating=False),
        decode_graph_gather_requirements=lambda: (False, False),
    )
    mr.decode_num_tokens_per_req = lambda **kw: ModelRunner.decode_num_tokens_per_req(mr, **kw)
    out = {"sglang_draft_tokens": spec.speculative_num_draft_tokens,
           "logits_rows": ModelRunner.max_decode_logits_rows(mr), "widths": {}}

    # the project's capture, with SGLang's FA3 backend built where it builds the full-KV one
    # and the graph runner's construction reduced to what it sizes: rows of the logits buffer
    def runner_init(self, model_runner, *, width, attn_backend):
        self.width, self.backend = width, attn_backend
        capture_bs, _ = get_batch_sizes_to_capture(model_runner, model_runner.decode_num_tokens_per_req(
            num_draft_tokens=width))
        self.rows = max(capture_bs) * width

    decode_graphs.UniformVerifyGraphRunner.__init__ = runner_init
    VCTorchAttnBackend._make_full_kv_backend = staticmethod(lambda model_runner, name: FlashAttentionBackend(model_runner))
    mr.attn_backend = SimpleNamespace(full_kv=object(), full_kv_name="fa3")
    graphs = decode_graphs.capture_verify_graphs(mr)
    seq_lens = torch.tensor([10, 20, 30])
    for w, runner in graphs.runners.items():
        n = len(seq_lens)
        spec_info = NgramVerifyInput(draft_token=None, custom_mask=torch.ones(n * w * 128, dtype=torch.bool),
                                     positions=None, retrieve_index=None, retrieve_next_token=None,
                                     retrieve_next_sibling=None, draft_token_num=w)
        fb = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=seq_lens, batch_size=n, encoder_lens=None,
                             forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info,
                             req_pool_indices=torch.tensor([1, 2, 3]))
        runner.backend.init_forward_metadata(fb)
        m = runner.backend.forward_metadata
        out["widths"][w] = {"rows": runner.rows, "max_seq_len_q": m.max_seq_len_q,
                            "cu_seqlens_q": m.cu_seqlens_q.tolist(), "cache_seqlens": m.cache_seqlens_int32.tolist()}
    return out


print("RESULT " + json.dumps({x: widths_for(sys.argv[1], x) for x in sys.argv[2:]}))
"""


def _run(model_dir, *xs: int) -> dict:
    """X (drafts) -> what SGLang sized and FA3 laid out at each width the project captures."""
    r = subprocess.run([sys.executable, "-c", SCRIPT, model_dir, *map(str, xs)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_verify_graphs_fit_sglangs_logits_buffer_and_fa3_reads_each_width(model_dir):
    from sglang_vc.vericache.decode_graphs import MAX_VERIFY_GRAPH_WIDTH

    runs = _run(model_dir, 4, 32)
    out = runs["4"]
    assert out["sglang_draft_tokens"] == 5  # X + 1: the verify width
    widths = {int(w): v for w, v in out["widths"].items()}
    assert sorted(widths) == [2, 3, 4, 5]  # every width a uniform cohort verifies at
    for w, got in widths.items():
        assert got["rows"] <= out["logits_rows"], (w, got["rows"], out["logits_rows"])
        # FA3: W query tokens per request, each request's keys its prefix plus its W tokens
        assert got["max_seq_len_q"] == w
        assert got["cu_seqlens_q"] == [0, w, 2 * w, 3 * w]
        assert got["cache_seqlens"] == [10 + w, 20 + w, 30 + w]
    # the widest verify fills the buffer: nothing sized for a width never verified
    assert max(v["rows"] for v in widths.values()) == out["logits_rows"]
    # auto X (up to 32 drafts): graphs at 2 .. MAX_VERIFY_GRAPH_WIDTH only
    out = runs["32"]
    assert out["sglang_draft_tokens"] == 33
    assert sorted(int(w) for w in out["widths"]) == list(range(2, MAX_VERIFY_GRAPH_WIDTH + 1))
