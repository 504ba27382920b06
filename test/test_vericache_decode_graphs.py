"""SGLang's decode CUDA graphs for VERICACHE's DECODE iterations (#63 item 1), on the CPU.

The CPU platform captures no decode graphs, so what is checked here is every seam the GPU
path goes through: the launcher leaves decode graphs on (verifies and offload drafts
eager, a warning that says so), the model runner builds VERICACHE's runner class, that
runner is SGLang's built as a non-speculative server builds it (``DECODE`` mode, one token
per request: what its constructor reads off the model runner), and it replays ``DECODE``
batches only. The capture itself has not run on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_vc.vericache import decode_graphs
from sglang_vc.vericache.decode_graphs import (CaptureOrEager, NoDecodeGraphs, UniformVerifyGraphRunner,
                                               VeriCacheDecodeGraphRunner, capture_verify_graphs, mark_replayable,
                                               runner_cls_for, verify_graphs_captured)


class _Algorithm:
    """A registered project algorithm as SGLang's ``CustomSpecAlgo``: speculative, named."""

    def __init__(self, name: str):
        self.name = name

    def is_speculative(self) -> bool:
        return True

    def is_none(self) -> bool:
        return False

    def is_dspark(self) -> bool:
        return False

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
        return num_draft_tokens


def _model_runner(algorithm, draft: bool = False):
    runner = SimpleNamespace(spec_algorithm=algorithm, is_draft_worker=draft,
                             server_args=SimpleNamespace(dllm_algorithm=None),
                             attn_backend=SimpleNamespace(full_kv=None, full_kv_name="torch_native"))
    # SGLang's own width rule, read the way its graph runner reads it
    runner.decode_num_tokens_per_req = lambda **kw: ModelRunner.decode_num_tokens_per_req(runner, **kw)
    return runner


def test_only_vericaches_target_gets_the_decode_mode_runner():
    def sglangs(model_runner):
        return DecodeCudaGraphRunner

    cls = runner_cls_for(sglangs, _model_runner(_Algorithm("VERICACHE")))
    assert cls is CaptureOrEager and issubclass(cls, VeriCacheDecodeGraphRunner)
    assert runner_cls_for(sglangs, _model_runner(_Algorithm("SPECACHE"))) is DecodeCudaGraphRunner
    assert runner_cls_for(sglangs, _model_runner(SpeculativeAlgorithm.NONE)) is DecodeCudaGraphRunner
    assert runner_cls_for(sglangs, _model_runner(_Algorithm("VERICACHE"), draft=True)) is DecodeCudaGraphRunner


def test_the_runner_is_built_as_a_plain_decode_runner(monkeypatch):
    """What SGLang's constructor reads to choose its capture mode (``is_speculative``:
    ``TARGET_VERIFY`` if so) and width (``decode_num_tokens_per_req``) reads ``DECODE`` and
    1 while VERICACHE's runner is built, and the algorithm is VERICACHE again after."""
    seen = {}

    def sglangs_init(self, model_runner, **kwargs):
        seen["speculative"] = model_runner.spec_algorithm.is_speculative()
        seen["width"] = model_runner.decode_num_tokens_per_req(num_draft_tokens=None)
        self.capture_bs = [1, 2, 4]

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", sglangs_init)
    algorithm = _Algorithm("VERICACHE")
    model_runner = _model_runner(algorithm)
    assert model_runner.spec_algorithm.is_speculative()
    VeriCacheDecodeGraphRunner(model_runner)
    assert seen == {"speculative": False, "width": 1}
    assert model_runner.spec_algorithm is algorithm


def test_a_failed_capture_leaves_the_algorithm_in_place(monkeypatch):
    def failing_init(self, model_runner, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", failing_init)
    algorithm = _Algorithm("VERICACHE")
    model_runner = _model_runner(algorithm)
    with pytest.raises(RuntimeError, match="capture failed"):
        VeriCacheDecodeGraphRunner(model_runner)
    assert model_runner.spec_algorithm is algorithm


def test_a_failed_capture_serves_eagerly_with_a_warning(monkeypatch, caplog):
    """The first GPU run cannot crash on the capture: what the model runner constructs is
    then a runner that replays nothing, and the log says CUDA graphs are off."""
    from sglang_vc import stats

    def failing_init(self, model_runner, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", failing_init)
    algorithm = _Algorithm("VERICACHE")
    model_runner = _model_runner(algorithm)
    before = stats.snapshot().get("vericache", {}).get("decode_graph_capture_failures", 0)
    with caplog.at_level("WARNING", logger="sglang_vc.vericache.decode_graphs"):
        runner = runner_cls_for(None, model_runner)(model_runner)
    assert isinstance(runner, NoDecodeGraphs) and runner.capture_bs == []
    assert not runner.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.DECODE))
    assert model_runner.spec_algorithm is algorithm
    assert "decode CUDA graph capture failed" in caplog.text and "runs eagerly" in caplog.text
    assert stats.snapshot()["vericache"]["decode_graph_capture_failures"] == before + 1


def test_a_capture_that_works_is_vericaches_runner(monkeypatch):
    def sglangs_init(self, model_runner, **kwargs):
        self.capture_bs = [1, 2]

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", sglangs_init)
    model_runner = _model_runner(_Algorithm("VERICACHE"))
    runner = CaptureOrEager(model_runner)
    assert type(runner) is VeriCacheDecodeGraphRunner and runner.capture_bs == [1, 2]


@pytest.mark.parametrize("mode, replays", [(ForwardMode.DECODE, True), (ForwardMode.TARGET_VERIFY, False),
                                           (ForwardMode.IDLE, False), (ForwardMode.EXTEND, False)])
def test_only_decode_batches_replay_the_decode_graphs(monkeypatch, mode, replays):
    """A ragged verify has one token per request too (SGLang's own width check passes it):
    the runner refuses it before SGLang's gate is asked, which then decides for DECODE."""
    asked = []
    monkeypatch.setattr(DecodeCudaGraphRunner, "can_run_graph", lambda self, fb: asked.append(fb) or True)
    runner = object.__new__(VeriCacheDecodeGraphRunner)
    batch = SimpleNamespace(forward_mode=mode)
    assert runner.can_run_graph(batch) is replays
    assert asked == ([batch] if replays else [])


def test_replays_are_counted(monkeypatch):
    from sglang_vc import stats

    monkeypatch.setattr(DecodeCudaGraphRunner, "execute", lambda self, fb, pp_proxy_tensors=None: "logits")
    before = stats.snapshot().get("vericache", {}).get("decode_graph_replays", 0)
    assert object.__new__(VeriCacheDecodeGraphRunner).execute(SimpleNamespace(forward_mode=ForwardMode.DECODE)) == "logits"
    assert stats.snapshot()["vericache"]["decode_graph_replays"] == before + 1


def test_the_launcher_keeps_decode_graphs_for_vericache_and_says_what_stays_eager():
    from sglang_vc import notices
    from sglang_vc.config import VCConfig
    from sglang_vc.launch_server import backend_flags

    argv = ["--speculative-algorithm", "VERICACHE"]
    extra = backend_flags(VCConfig(), argv)
    assert "--cuda-graph-backend-decode" not in extra
    assert extra[extra.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    eager = [n for n in notices.all_switched_off() if n.capability.startswith("CUDA graphs for VERICACHE")]
    assert eager and "verif" in eager[-1].capability and "replay SGLang's decode graphs" in eager[-1].reason
    # a full-KV backend that captures no graphs: decode graphs off, with that reason
    extra = backend_flags(VCConfig(vc_full_kv_attention_backend="torch_native"), argv)
    assert extra[extra.index("--cuda-graph-backend-decode") + 1] == "disabled"
    # the model runner's seam is the one the hook wraps
    assert callable(getattr(ModelRunner, "_decode_cuda_graph_runner_cls"))
    assert decode_graphs.ALGORITHM == "VERICACHE"


# ----------------------------------------------------------------------------- uniform verifies (#63 item 3)


def _spec(num_draft_tokens: int):
    return lambda: SimpleNamespace(speculative_num_draft_tokens=num_draft_tokens)


def test_the_verify_runner_is_sglangs_target_verify_runner_at_the_verify_width_over_its_own_backend(monkeypatch):
    """What SGLang's constructor reads: a speculative algorithm (``TARGET_VERIFY`` mode) and
    the width ``X + 1``; the attention backend it captures over is a new instance of the
    full-KV backend (a runner's graph state is its backend's: the decode graphs keep theirs)."""
    import sglang.srt.runtime_context as runtime_context

    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    seen, made = {}, []

    def sglangs_init(self, model_runner, **kwargs):
        seen["speculative"] = model_runner.spec_algorithm.is_speculative()
        seen["width"] = model_runner.decode_num_tokens_per_req(num_draft_tokens=kwargs["speculative_num_draft_tokens"])
        seen["backend"] = kwargs["attn_backend"]
        self.captured_req_width, self.capture_bs = seen["width"], [1, 2]

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", sglangs_init)
    import sglang.srt.speculative.spec_utils as spec_utils

    monkeypatch.setattr(runtime_context, "get_spec", _spec(4))
    monkeypatch.setattr(spec_utils, "get_spec", _spec(4))  # where SGLang's width rule reads it
    monkeypatch.setattr(VCTorchAttnBackend, "_make_full_kv_backend",
                        staticmethod(lambda mr, name: made.append(name) or SimpleNamespace(name=name)))
    model_runner = _model_runner(_Algorithm("VERICACHE"))
    model_runner.attn_backend = SimpleNamespace(full_kv=SimpleNamespace(name="fa3"), full_kv_name="fa3")
    runner = capture_verify_graphs(model_runner)
    assert isinstance(runner, UniformVerifyGraphRunner)
    assert seen["speculative"] and seen["width"] == 5 and made == ["fa3"]
    assert seen["backend"] is not model_runner.attn_backend.full_kv and seen["backend"].name == "fa3"


def test_no_verify_graphs_over_torch_native_and_a_failed_capture_is_a_warning(monkeypatch, caplog):
    import sglang.srt.runtime_context as runtime_context

    from sglang_vc import stats
    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    with caplog.at_level("WARNING", logger="sglang_vc.vericache.decode_graphs"):
        assert capture_verify_graphs(_model_runner(_Algorithm("VERICACHE"))) is None
    assert "no verify CUDA graphs" in caplog.text

    def failing_init(self, model_runner, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", failing_init)
    monkeypatch.setattr(runtime_context, "get_spec", _spec(4))
    monkeypatch.setattr(VCTorchAttnBackend, "_make_full_kv_backend", staticmethod(lambda mr, name: object()))
    model_runner = _model_runner(_Algorithm("VERICACHE"))
    model_runner.attn_backend = SimpleNamespace(full_kv=object(), full_kv_name="fa3")
    before = stats.snapshot().get("vericache", {}).get("verify_graph_capture_failures", 0)
    with caplog.at_level("WARNING", logger="sglang_vc.vericache.decode_graphs"):
        assert capture_verify_graphs(model_runner) is None
    assert "verify CUDA graph capture failed" in caplog.text and "run eagerly" in caplog.text
    assert stats.snapshot()["vericache"]["verify_graph_capture_failures"] == before + 1


def _verify_batch(replayable: bool):
    spec_info = SimpleNamespace()
    if replayable:
        mark_replayable(spec_info)
    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info)


@pytest.mark.parametrize("marked", [True, False])
def test_only_marked_verifies_replay_the_verify_graphs(monkeypatch, marked):
    """A verify the worker marked (uniform, over resident full KV) goes to the verify runner,
    whose SGLang check (width, batch size) then decides; a ragged one is refused before it."""
    asked = []
    monkeypatch.setattr(DecodeCudaGraphRunner, "can_run_graph", lambda self, fb: asked.append(type(self)) or True)
    runner = object.__new__(VeriCacheDecodeGraphRunner)
    runner.verify = object.__new__(UniformVerifyGraphRunner)
    assert runner.can_run_graph(_verify_batch(marked)) is marked
    assert asked == ([UniformVerifyGraphRunner] if marked else [])
    assert not object.__new__(VeriCacheDecodeGraphRunner).can_run_graph(_verify_batch(True))  # none captured
    assert not runner.verify.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=None))


def test_verify_replays_go_to_the_verify_runner_and_are_counted(monkeypatch):
    from sglang_vc import stats

    monkeypatch.setattr(DecodeCudaGraphRunner, "execute",
                        lambda self, fb, pp_proxy_tensors=None: type(self).__name__)
    runner = object.__new__(VeriCacheDecodeGraphRunner)
    runner.verify = object.__new__(UniformVerifyGraphRunner)
    before = stats.snapshot().get("vericache", {}).get("verify_graph_replays", 0)
    assert runner.execute(_verify_batch(True)) == "UniformVerifyGraphRunner"
    assert runner.execute(SimpleNamespace(forward_mode=ForwardMode.DECODE)) == "VeriCacheDecodeGraphRunner"
    assert stats.snapshot()["vericache"]["verify_graph_replays"] == before + 1
    assert verify_graphs_captured(SimpleNamespace(decode_cuda_graph_runner=runner))
    assert not verify_graphs_captured(SimpleNamespace(decode_cuda_graph_runner=NoDecodeGraphs(RuntimeError())))
