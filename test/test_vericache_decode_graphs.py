"""SGLang's decode CUDA graphs for VERICACHE's DECODE iterations (#63 item 1), on the CPU.

The CPU platform captures no decode graphs, so what is checked here is every seam the GPU
path goes through: the launcher leaves decode graphs on (verifies and offload drafts
eager, a warning that says so), the model runner builds VERICACHE's runner class, that
runner is SGLang's built as a non-speculative server builds it (``DECODE`` mode, one token
per request: what its constructor reads off the model runner), and it replays ``DECODE``
batches only. The capture itself has not run on a GPU.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_vc.vericache import decode_graphs
from sglang_vc.vericache.decode_graphs import (MAX_VERIFY_GRAPH_WIDTH, CaptureOrEager, NoDecodeGraphs,
                                               UniformVerifyGraphRunner, VeriCacheDecodeGraphRunner, VerifyGraphs,
                                               capture_verify_graphs, mark_replayable, runner_cls_for,
                                               verify_graph_widths, verify_graphs_captured)


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


class _Spec(SimpleNamespace):
    """SGLang's spec bag as the capture reads it: the draft-token count (the verify width
    X + 1), overridden while each width's backend and runner are built."""

    @contextlib.contextmanager
    def override(self, **kwargs):
        saved = dict(vars(self))
        vars(self).update(kwargs)
        try:
            yield self
        finally:
            vars(self).update(saved)


def test_verify_runners_are_sglangs_target_verify_runners_at_each_width_over_their_own_backends(monkeypatch):
    """What SGLang's constructor reads: a speculative algorithm (``TARGET_VERIFY`` mode) and
    the width ``W``, one runner per width 2 .. X + 1; each captures over a new instance of
    the full-KV backend, built while SGLang's draft-token count reads ``W`` (FA3 sizes its
    verify metadata from it then); the count is X + 1 again afterwards."""
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.speculative.spec_utils as spec_utils

    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    spec = _Spec(speculative_num_draft_tokens=5)  # X = 4
    seen, made = [], []

    def sglangs_init(self, model_runner, **kwargs):
        width = model_runner.decode_num_tokens_per_req(num_draft_tokens=kwargs["speculative_num_draft_tokens"])
        seen.append((model_runner.spec_algorithm.is_speculative(), width, kwargs["attn_backend"]))
        self.captured_req_width, self.capture_bs = width, [1, 2]

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", sglangs_init)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    monkeypatch.setattr(spec_utils, "get_spec", lambda: spec)  # where SGLang's width rule reads it
    monkeypatch.setattr(VCTorchAttnBackend, "_make_full_kv_backend", staticmethod(
        lambda mr, name: made.append((name, spec.speculative_num_draft_tokens)) or SimpleNamespace(name=name)))
    model_runner = _model_runner(_Algorithm("VERICACHE"))
    model_runner.attn_backend = SimpleNamespace(full_kv=SimpleNamespace(name="fa3"), full_kv_name="fa3")
    graphs = capture_verify_graphs(model_runner)
    assert isinstance(graphs, VerifyGraphs) and sorted(graphs.runners) == [2, 3, 4, 5] and graphs.max_drafts == 4
    assert all(isinstance(r, UniformVerifyGraphRunner) for r in graphs.runners.values())
    assert [(speculative, width) for speculative, width, _ in seen] == [(True, w) for w in (2, 3, 4, 5)]
    assert made == [("fa3", w) for w in (2, 3, 4, 5)] and spec.speculative_num_draft_tokens == 5
    backends = [backend for _, _, backend in seen]
    assert len({id(b) for b in backends}) == 4 and all(b is not model_runner.attn_backend.full_kv for b in backends)
    # auto X (32 drafts): graphs at the widths a cohort verifies at from a graph only
    assert verify_graph_widths(33) == list(range(2, MAX_VERIFY_GRAPH_WIDTH + 1))


def test_no_verify_graphs_over_torch_native_and_a_failed_capture_is_a_warning(monkeypatch, caplog):
    import sglang.srt.runtime_context as runtime_context

    from sglang_vc import stats
    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    with caplog.at_level("WARNING", logger="sglang_vc.vericache.decode_graphs"):
        assert capture_verify_graphs(_model_runner(_Algorithm("VERICACHE"))) is None
    assert "no verify CUDA graphs" in caplog.text

    def init_failing_at_3(self, model_runner, **kwargs):
        if kwargs["speculative_num_draft_tokens"] == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured_req_width = kwargs["speculative_num_draft_tokens"]

    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", init_failing_at_3)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: _Spec(speculative_num_draft_tokens=4))
    monkeypatch.setattr(VCTorchAttnBackend, "_make_full_kv_backend", staticmethod(lambda mr, name: object()))
    monkeypatch.setattr(UniformVerifyGraphRunner, "capture_bs", [1], raising=False)
    model_runner = _model_runner(_Algorithm("VERICACHE"))
    model_runner.attn_backend = SimpleNamespace(full_kv=object(), full_kv_name="fa3")
    before = stats.snapshot().get("vericache", {}).get("verify_graph_capture_failures", 0)
    with caplog.at_level("WARNING", logger="sglang_vc.vericache.decode_graphs"):
        graphs = capture_verify_graphs(model_runner)
    # the width that failed runs eagerly, counted; the others replay
    assert sorted(graphs.runners) == [2, 4]
    assert "capture at width 3 failed" in caplog.text and "run eagerly" in caplog.text
    assert stats.snapshot()["vericache"]["verify_graph_capture_failures"] == before + 1
    monkeypatch.setattr(DecodeCudaGraphRunner, "__init__", lambda self, mr, **kw: (_ for _ in ()).throw(
        RuntimeError("out of memory")))
    assert capture_verify_graphs(model_runner) is None  # none captured: every verify eager
    assert stats.snapshot()["vericache"]["verify_graph_capture_failures"] == before + 4


def _verify_batch(replayable: bool, width: int = 3):
    spec_info = SimpleNamespace(num_tokens_per_req=width)
    if replayable:
        mark_replayable(spec_info)
    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info)


@pytest.mark.parametrize("marked", [True, False])
def test_only_marked_verifies_replay_the_verify_graphs(monkeypatch, marked):
    """A verify the worker marked (uniform, over resident full KV) goes to the verify runner
    captured at its width, whose SGLang check (width, batch size) then decides; a ragged
    one is refused before it, one of a width not captured too."""
    asked = []
    monkeypatch.setattr(DecodeCudaGraphRunner, "can_run_graph", lambda self, fb: asked.append(self) or True)
    runner = object.__new__(VeriCacheDecodeGraphRunner)
    by_width = {w: object.__new__(UniformVerifyGraphRunner) for w in (2, 3)}
    runner.verify = VerifyGraphs(by_width)
    assert runner.can_run_graph(_verify_batch(marked)) is marked
    assert asked == ([by_width[3]] if marked else [])
    assert not runner.can_run_graph(_verify_batch(marked, width=4))
    assert not object.__new__(VeriCacheDecodeGraphRunner).can_run_graph(_verify_batch(True))  # none captured
    assert not runner.verify.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=None))


def test_verify_replays_go_to_the_verify_runner_and_are_counted(monkeypatch):
    from sglang_vc import stats

    monkeypatch.setattr(DecodeCudaGraphRunner, "execute", lambda self, fb, pp_proxy_tensors=None: self)
    runner = object.__new__(VeriCacheDecodeGraphRunner)
    by_width = {w: object.__new__(UniformVerifyGraphRunner) for w in (2, 3)}
    runner.verify = VerifyGraphs(by_width)
    before = stats.snapshot().get("vericache", {}).get("verify_graph_replays", 0)
    assert runner.execute(_verify_batch(True, width=2)) is by_width[2]
    assert runner.execute(SimpleNamespace(forward_mode=ForwardMode.DECODE)) is runner
    assert stats.snapshot()["vericache"]["verify_graph_replays"] == before + 1
    assert verify_graphs_captured(SimpleNamespace(decode_cuda_graph_runner=runner))
    assert not verify_graphs_captured(SimpleNamespace(decode_cuda_graph_runner=NoDecodeGraphs(RuntimeError())))
