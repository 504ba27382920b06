"""The decode CUDA graphs' can-run gate for the project's backends (registered on SGLang's
``DecodeCudaGraphRunner.can_run_graph`` in :mod:`sglang_vc.hooks`, with the reason)."""

from __future__ import annotations


def no_graph_for_compressed_batches(original, runner, forward_batch) -> bool:
    """SGLang's decode graphs replay its own backend's kernels over every request's whole
    row; a request reading compressed rows (dropped positions null, a quantized payload
    beside the pool) needs the project's attention, which runs eagerly. SGLang's can-run
    gate has no seam for an attention backend to refuse a batch, so the project's
    backends answer here; batches without such a request keep their graphs."""
    if not original(runner, forward_batch):
        return False
    holds_compressed = getattr(runner.attn_backend, "holds_compressed", None)
    return holds_compressed is None or not holds_compressed(forward_batch)


GRAPH_GATE_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph"


def graph_gate_in_place() -> bool:
    """Whether :func:`no_graph_for_compressed_batches` wraps SGLang's can-run gate now
    (HookRegistry only logs a patch it failed to apply; a backend relying on the gate
    asks before it captures graphs)."""
    import pkgutil

    owner, attr = GRAPH_GATE_TARGET.rsplit(".", 1)
    fn = getattr(pkgutil.resolve_name(owner), attr)
    while fn is not None:
        if any(getattr(c, "cell_contents", None) is no_graph_for_compressed_batches
               for c in (getattr(fn, "__closure__", None) or ())):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False
