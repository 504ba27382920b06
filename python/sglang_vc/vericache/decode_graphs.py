"""SGLang's decode CUDA graphs for VERICACHE's ``DECODE`` iterations.

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
replays ``DECODE`` batches only; verifies (ragged ``TARGET_VERIFY``) stay eager, and a
batch holding an offload drafter (compressed rows) is refused by the project's can-run
gate (:mod:`sglang_vc.kvruntime.graphs`). The graphs attend with the full-KV backend's
kernels (``--vc-full-kv-attention-backend``, SGLang's default on the GPU), whose graph
protocol ``vc_verify`` hands over (:class:`~sglang_vc.kvruntime.backend.VCTorchAttnBackend`).

Not run on a GPU yet: on the CPU platform SGLang captures no decode graphs (the runner is
never built), so its seams are tested here and its capture is not. A capture that fails
leaves the server serving every iteration eagerly, with a warning (:class:`CaptureOrEager`).
"""

from __future__ import annotations

import contextlib
import logging

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_vc import stats

logger = logging.getLogger(__name__)

ALGORITHM = "VERICACHE"


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


class VeriCacheDecodeGraphRunner(DecodeCudaGraphRunner):
    """SGLang's decode graph runner in ``DECODE`` mode under VERICACHE (module docstring)."""

    def __init__(self, model_runner, **kwargs):
        with as_plain_decode(model_runner):
            super().__init__(model_runner, **kwargs)
        logger.info("VERICACHE: decode CUDA graphs captured in DECODE mode for batch sizes %s (full-KV "
                    "iterations and in-pool drafts over view rows replay them; verifies and offload "
                    "drafts run eagerly)", self.capture_bs)

    def can_run_graph(self, forward_batch) -> bool:
        # a TARGET_VERIFY (or IDLE) batch has one token per request in the ragged layout too:
        # only a DECODE batch may replay a DECODE graph
        return forward_batch.forward_mode.is_decode() and super().can_run_graph(forward_batch)

    def execute(self, forward_batch, pp_proxy_tensors=None):
        stats.add("vericache", decode_graph_replays=1)
        return super().execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)


class NoDecodeGraphs:
    """In place of a decode graph runner whose capture failed: nothing replays, every
    iteration runs eagerly (what SGLang reads of a runner: its batch sizes, ``can_run_graph``)."""

    capture_bs: list = []
    bs = None

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
