"""SGLang's CUDA graphs for VERICACHE's ``DECODE`` iterations and uniform in-pool verifies.

VERICACHE forwards a plain SGLang ``DECODE`` batch in two cases (:mod:`.staggered_round`):
every request decodes one token from its full KV, or in-pool drafters read their views
from view rows of ``req_to_token`` (:mod:`.view_rows`) beside full-KV requests. Both are
one token per request over rows of ``req_to_token`` at any ``seq_lens``: what SGLang's
decode graphs replay for a plain server. SGLang 0.5.23 builds a speculative target's
decode graph runner in ``TARGET_VERIFY`` mode only, at the algorithm's draft width, so
such a batch would never match a captured graph.

:class:`VeriCacheDecodeGraphRunner` is SGLang's ``DecodeCudaGraphRunner`` built as a
non-speculative server builds it (``DECODE`` mode, one token per request), installed
through the model runner's own seam for a specialised runner class
(``ModelRunner._decode_cuda_graph_runner_cls``, wrapped in :mod:`sglang_vc.hooks`). It
replays ``DECODE`` batches, and a batch holding an offload drafter (compressed rows) is
refused by the project's can-run gate (:mod:`sglang_vc.kvruntime.graphs`). The graphs
attend with the full-KV backend's kernels (``--vc-full-kv-attention-backend``, SGLang's
default on the GPU), whose graph protocol ``vc_verify`` hands over
(:class:`~sglang_vc.kvruntime.backend.VCTorchAttnBackend`).

Beside it, :class:`VerifyGraphs` holds SGLang's runner built as a speculative target's
is (``TARGET_VERIFY`` mode, as EAGLE's and NGRAM's) at each verify width ``W`` from 2 to
``min(X + 1, MAX_VERIFY_GRAPH_WIDTH)`` (:class:`UniformVerifyGraphRunner`), each over an
instance of the full-KV backend of its own (a runner's graph state lives in its backend),
built while SGLang's draft-token count reads ``W``. SGLang's count is the verify width
under VERICACHE (NGRAM's convention, :mod:`.worker_spec`), so its shared logits buffer
holds the widest verify, and FA3 sizes each width's metadata for ``W`` query tokens. A
runner replays only the verifies the worker marked (:func:`mark_replayable`): every
request of the forward verifies ``W`` tokens over its full KV resident in the pool
(in-pool drafters aligned by ``--vc-in-pool-verify uniform``, :mod:`.staggered_schedule`, their
cohort's X capped at the widest captured), nothing staged, nothing compressed, no
re-selection scored in the forward. Ragged verifies (drafters, full-KV requests or
offload verifiers beside them) stay eager.

Not run on a GPU yet: on the CPU platform SGLang captures no graphs (the runner is never
built), so its seams are tested here and its capture is not. A capture that fails leaves
the server serving those iterations eagerly, with a warning (:class:`CaptureOrEager`).
"""

from __future__ import annotations

import contextlib
import logging

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_vc import stats

logger = logging.getLogger(__name__)

ALGORITHM = "VERICACHE"
# uniform verifies are captured at widths 2 .. 9 (X <= 8 drafts): what a cohort verifies at
# where graphs replay it (its leader's X capped there); each width is a set of graphs
MAX_VERIFY_GRAPH_WIDTH = 9
_REPLAYABLE = "vc_replayable"  # set on a verify input whose forward a verify graph may replay


def mark_replayable(spec_info) -> None:
    """The worker's word that this uniform verify needs no project attention: every
    request verifies its run over full KV resident in the pool (module docstring)."""
    setattr(spec_info, _REPLAYABLE, True)


def is_replayable(spec_info) -> bool:
    return bool(getattr(spec_info, _REPLAYABLE, False))


def is_vericache(model_runner) -> bool:
    algorithm = getattr(model_runner, "spec_algorithm", None)
    return algorithm is not None and not model_runner.is_draft_worker and (
        getattr(algorithm, "name", None) or str(algorithm)).upper() == ALGORITHM


@contextlib.contextmanager
def as_plain_decode(model_runner):
    """``model_runner`` seen as a non-speculative one while a graph runner is built: its
    capture mode (``DECODE``) and width (``decode_num_tokens_per_req`` = 1) are read from
    ``spec_algorithm``. Restored whatever happens (start-up, scheduler thread, nothing
    else forwards meanwhile)."""
    algorithm = model_runner.spec_algorithm
    model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
    try:
        yield
    finally:
        model_runner.spec_algorithm = algorithm


class UniformVerifyGraphRunner(DecodeCudaGraphRunner):
    """SGLang's graph runner in ``TARGET_VERIFY`` mode at width ``width``, as SGLang builds
    a speculative target's, over ``attn_backend`` (module docstring)."""

    def __init__(self, model_runner, *, width: int, attn_backend):
        super().__init__(model_runner, attn_backend=attn_backend, speculative_num_draft_tokens=width)
        logger.info("VERICACHE: verify CUDA graphs captured in TARGET_VERIFY mode at width %d for batch sizes "
                    "%s (uniform in-pool verifies replay them)", self.captured_req_width, self.capture_bs)

    def get_spec_info(self, num_tokens: int):
        # the chain verify input SGLang captures NGRAM's verifies with (one chain per
        # request, its mask in the runner's buffer): what the worker's verifies carry
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        spec_info = NgramVerifyInput(draft_token=None, custom_mask=self.buffers.custom_mask, positions=None,
                                     retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
                                     draft_token_num=self.captured_req_width)
        spec_info.capture_hidden_mode = CaptureHiddenMode.NULL
        return spec_info

    def can_run_graph(self, forward_batch) -> bool:
        # SGLang's own check then matches the width (num_tokens_per_req) and the batch size
        return (forward_batch.forward_mode.is_target_verify() and is_replayable(forward_batch.spec_info)
                and super().can_run_graph(forward_batch))


def verify_graph_widths(max_width: int) -> list[int]:
    """The verify widths graphs are captured at: ``2 .. min(max_width, MAX_VERIFY_GRAPH_WIDTH)``,
    every width a uniform cohort verifies at (its leader's X is capped to the widest,
    :meth:`VerifyGraphs.max_drafts`; a request joining it drafts fewer)."""
    return list(range(2, min(int(max_width), MAX_VERIFY_GRAPH_WIDTH) + 1))


class VerifyGraphs:
    """The uniform verifies' graph runners, one per width: a marked verify replays the
    runner captured at its width (``spec_info.num_tokens_per_req``), SGLang's own check
    (batch size) deciding."""

    def __init__(self, runners: dict[int, UniformVerifyGraphRunner]):
        self.runners = runners

    @property
    def max_drafts(self) -> int:
        """The most drafts a uniform cohort may verify from a graph."""
        return max(self.runners) - 1

    def runner_for(self, forward_batch) -> "UniformVerifyGraphRunner | None":
        spec_info = forward_batch.spec_info
        return self.runners.get(getattr(spec_info, "num_tokens_per_req", -1))

    def can_run_graph(self, forward_batch) -> bool:
        runner = self.runner_for(forward_batch)
        return runner is not None and runner.can_run_graph(forward_batch)

    def execute(self, forward_batch, pp_proxy_tensors=None):
        return self.runner_for(forward_batch).execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)


def capture_verify_graphs(model_runner) -> "VerifyGraphs | None":
    """The uniform verifies' graph runners at each width of :func:`verify_graph_widths`,
    each over a new instance of the full-KV backend built while SGLang's draft-token count
    reads that width (FA3 sizes its ``TARGET_VERIFY`` metadata and graph buffers from it at
    construction), or None (and a warning) where that backend captures nothing or every
    capture fails. A width whose capture fails is counted (``/server_info``:
    ``verify_graph_capture_failures``) and its verifies run eagerly."""
    from sglang.srt.runtime_context import get_spec

    from sglang_vc.kvruntime.backend import VCTorchAttnBackend

    name = getattr(model_runner.attn_backend, "full_kv_name", None)
    if getattr(model_runner.attn_backend, "full_kv", None) is None:
        logger.warning("VERICACHE: no verify CUDA graphs (the full-KV backend %s captures none); in-pool "
                       "verifies run eagerly", name)
        return None
    spec = get_spec()
    runners = {}
    for width in verify_graph_widths(spec.speculative_num_draft_tokens):  # NGRAM's convention: X + 1
        try:
            with spec.override(speculative_num_draft_tokens=width):
                backend = VCTorchAttnBackend._make_full_kv_backend(model_runner, name)
                runners[width] = UniformVerifyGraphRunner(model_runner, width=width, attn_backend=backend)
        except Exception as exc:  # noqa: BLE001 (any failure of a capture: those verifies run eagerly)
            logger.warning("VERICACHE: verify CUDA graph capture at width %d failed (%s: %s); uniform verifies "
                           "of that width run eagerly", width, type(exc).__name__, exc)
            stats.add("vericache", verify_graph_capture_failures=1)
    return VerifyGraphs(runners) if runners else None


class VeriCacheDecodeGraphRunner(DecodeCudaGraphRunner):
    """SGLang's decode graph runner in ``DECODE`` mode under VERICACHE, and beside it the
    uniform verifies' (:attr:`verify`; module docstring)."""

    verify: "VerifyGraphs | None" = None

    def __init__(self, model_runner, **kwargs):
        with as_plain_decode(model_runner):
            super().__init__(model_runner, **kwargs)
        logger.info("VERICACHE: decode CUDA graphs captured in DECODE mode for batch sizes %s (full-KV "
                    "iterations and in-pool drafts over view rows replay them; ragged verifies and offload "
                    "drafts run eagerly)", self.capture_bs)
        self.verify = capture_verify_graphs(model_runner)

    def can_run_graph(self, forward_batch) -> bool:
        # a TARGET_VERIFY (or IDLE) batch has one token per request in the ragged layout too:
        # only a DECODE batch may replay a DECODE graph, only a marked verify a verify graph
        if forward_batch.forward_mode.is_target_verify():
            return self.verify is not None and self.verify.can_run_graph(forward_batch)
        return forward_batch.forward_mode.is_decode() and super().can_run_graph(forward_batch)

    def execute(self, forward_batch, pp_proxy_tensors=None):
        if forward_batch.forward_mode.is_target_verify():
            stats.add("vericache", verify_graph_replays=1)
            return self.verify.execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)
        stats.add("vericache", decode_graph_replays=1)
        return super().execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)


def verify_graphs_of(model_runner) -> "VerifyGraphs | None":
    """The target's uniform verify graphs, None where none were captured."""
    return getattr(getattr(model_runner, "decode_cuda_graph_runner", None), "verify", None)


def verify_graphs_captured(model_runner) -> bool:
    """Whether the target replays uniform verifies from graphs (``--vc-in-pool-verify auto``)."""
    return verify_graphs_of(model_runner) is not None


class NoDecodeGraphs:
    """In place of a decode graph runner whose capture failed: nothing replays, every
    iteration runs eagerly (what SGLang reads of a runner: its batch sizes, ``can_run_graph``)."""

    capture_bs: list = []
    bs = None
    verify = None

    def __init__(self, error: BaseException):
        self.error = error

    def can_run_graph(self, forward_batch) -> bool:
        return False


class CaptureOrEager(VeriCacheDecodeGraphRunner):
    """What the model runner constructs for VERICACHE's target: its decode graph runner,
    or, where the capture fails (it has not run on a GPU yet), :class:`NoDecodeGraphs` and
    a warning: the server then serves every iteration eagerly instead of not starting.
    A subclass so that SGLang's class-level queries (``decode_graph_gather_requirements``)
    answer as the runner's."""

    def __new__(cls, model_runner, **kwargs):
        try:
            return VeriCacheDecodeGraphRunner(model_runner, **kwargs)
        except Exception as exc:  # noqa: BLE001 (any failure of the capture: serve eagerly)
            logger.warning("VERICACHE: decode CUDA graph capture failed (%s: %s); CUDA graphs disabled, every "
                           "iteration runs eagerly", type(exc).__name__, exc)
            stats.add("vericache", decode_graph_capture_failures=1)
            return NoDecodeGraphs(exc)


def runner_cls_for(original, model_runner):
    """The decode graph runner class for ``model_runner``: VERICACHE's target gets
    :class:`CaptureOrEager` (:class:`VeriCacheDecodeGraphRunner`), anything else SGLang's
    choice."""
    if is_vericache(model_runner):
        return CaptureOrEager
    return original(model_runner)
