"""Every patch sglang-vc applies to SGLang, in one place, each with the reason for it.

Patches are a last resort: the project extends SGLang through its registries. These are
the spots where SGLang 0.5.23 has no seam: mostly for a device without CUDA, plus request
checks, stopping, and the decode graphs' can-run gate.
"""

import logging
import signal

import torch

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


def _on_cpu_platform() -> bool:
    from sglang.srt.platforms import current_platform

    return type(current_platform).__module__.startswith("sglang_vc.platform")


def _host_pool_unpinned(original, self, *args, **kwargs):
    """HiCache host pools are built with ``pin_memory=True`` (no flag turns it off): they
    ``cudaHostRegister`` their buffers and allocate storage staging pages with torch's
    ``pin_memory=True``, both of which need an accelerator. Pinning only speeds up DMA to
    a GPU; on the CPU platform the host pool and the "device" pool are both RAM, so the
    pool is built unpinned."""
    kwargs["pin_memory"] = False
    return original(self, *args, **kwargs)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Pure-torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct``: copy token
    rows ``src_indices`` of every layer buffer into rows ``dst_indices``. The host pool
    imports the kernel only on CUDA/ROCm/XPU and uses it for the ``direct`` io backend."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_indices.to(dst.device), src.index_select(0, src_indices.to(src.device)).to(dst.device))


def _add_vc_counters(result, *args, **kwargs):
    """The scheduler's internal state has a fixed list of contributors and no seam for
    plugins; the ``sglang_vc`` counters of this scheduler process ride along on it to
    ``/server_info``, with a ``kv_pool`` gauge of the device KV pool (tokens), which
    compressed-KV serving changes."""
    from sglang_vc import stats
    from sglang_vc.kvruntime.runtime import current_runtime

    snapshot = stats.snapshot()
    scheduler = getattr(args[0], "scheduler", None) if args else None
    if scheduler is not None:
        try:
            allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
            snapshot["kv_pool"] = {
                "total_tokens": scheduler.max_total_num_tokens,
                "available_tokens": allocator.available_size(),
                "evictable_tokens": tree.evictable_size(),
                "protected_tokens": tree.protected_size(),
            }
            runtime = current_runtime()
            if runtime is not None:  # what compressed-KV serving holds beside the pool
                snapshot["kv_pool"].update(runtime.memory_split())
        except AttributeError:  # a scheduler without a token pool (e.g. embedding-only)
            pass
    result.internal_state["sglang_vc"] = snapshot
    return result


def _check_sampling_params(result, *args, **kwargs):
    """SGLang validates sampling parameters in the tokenizer manager (a ``ValueError``
    there is the client's HTTP 400) but has no seam for a plugin's own ``custom_params``
    keys, nor for a speculative algorithm to refuse what it cannot apply. Without this
    check an invalid per-request compression, one asked of a server that does not apply
    it, a penalty or grammar under VERICACHE or SPECACHE, or a compression SPECACHE does
    not read, would reach the scheduler, which cannot
    reject a request, and be served with something else than asked."""
    from sglang_vc.kvruntime.admission import check_sampling_params
    from sglang_vc.request_checks import check_custom_params
    from sglang_vc.specache.requests import check_sampling_params as check_specache
    from sglang_vc.vericache.requests import check_sampling_params as check_vericache

    check_custom_params(getattr(args[0], "custom_params", None))
    check_sampling_params(args[0])
    check_vericache(args[0])
    check_specache(args[0])
    return result


def _check_request(result, *args, **kwargs):
    """``_validate_one_request`` is where SGLang refuses a request with a 400, once its
    prompt is token ids; it checks their number but not their values, and an id outside
    the vocabulary kills the scheduler (:mod:`sglang_vc.request_checks`). The
    request-level options (``return_logprob``, a custom logit processor) are not sampling
    parameters; VERICACHE refuses here those it cannot honour."""
    from sglang_vc.request_checks import check_token_ids
    from sglang_vc.vericache.requests import check_request

    tokenizer_manager, obj, input_ids = args[:3]
    check_token_ids(input_ids, tokenizer_manager.model_config.vocab_size)
    check_request(obj)
    return result


def _speccache_prompt(original, tokenizer_manager, obj):
    """SGLang tokenizes a prompt in one piece and has no seam for a plugin to rewrite a
    request before it does. SpecCache must see the text first: its chunks are tokenized
    piece by piece (so that a chunk's token ids, its KV's key in the tree, are the same in
    every prompt), fetched onto the device, and the recomputed tokens selected; the request then goes
    on as token ids with its plan (:mod:`sglang_vc.speccache.frontend`). On a server
    without ``--speccache-*`` flags the original coroutine is returned as it is (no
    extra await on the request path)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_vc.speccache.frontend import frontend_for

    frontend = frontend_for(tokenizer_manager)
    if frontend is None or not isinstance(obj, GenerateReqInput):
        return original(tokenizer_manager, obj)
    return _prepared_then(original, frontend, tokenizer_manager, obj)


async def _prepared_then(original, frontend, tokenizer_manager, obj):
    await frontend.prepare(obj)  # requests without chunks pass through unchanged
    return await original(tokenizer_manager, obj)


def _speccache_responses(original, tokenizer_manager, obj, request=None):
    """SGLang's responses have no seam for a plugin to read its own ``meta_info`` in the
    front end. A SpecCache request whose prefill did not find one of its chunks on the
    device says so there; the front end must hear it to fetch the chunk again (otherwise
    every later request would trust it to be there and recompute it in full). On a server
    without SpecCache the original response stream is returned as it is: no generator
    layer per streamed chunk."""
    from sglang_vc.speccache.frontend import frontend_for

    responses = original(tokenizer_manager, obj, request)
    frontend = frontend_for(tokenizer_manager)
    return responses if frontend is None else _forget_lost_chunks(frontend, obj, responses)


async def _forget_lost_chunks(frontend, obj, responses):
    from sglang_vc.speccache.names import META_INFO_KEY

    async for out in responses:
        if isinstance(out, dict):
            report = (out.get("meta_info") or {}).get(META_INFO_KEY)
            if report and getattr(obj, "is_single", True):  # a batch's sub-requests are copies
                frontend.forget(obj, report[0])
        yield out


def _speccache_flush(original, tokenizer_manager, *args, **kwargs):
    """A cache flush empties the device (and HiCache's host pool) behind the front end's
    back: it has no seam for a plugin to hear of it. SpecCache's front end fetches only
    the chunks it has not fetched before, so after a flush every request would find its
    chunks gone and recompute them in full; it must forget them instead, and the next
    request fetches them (from storage, where HiCache keeps them). On a server without
    SpecCache the original coroutine is returned as it is."""
    from sglang_vc.speccache.frontend import frontend_for

    frontend = frontend_for(tokenizer_manager)
    result = original(tokenizer_manager, *args, **kwargs)
    return result if frontend is None else _forget_after_flush(frontend, result)


async def _forget_after_flush(frontend, flushed):
    result = await flushed
    if getattr(result, "success", False):
        frontend.forget_all()
    return result


def _abort_all(tokenizer_manager) -> None:
    if tokenizer_manager is not None and tokenizer_manager.event_loop is not None:
        # on the tokenizer manager's loop: its ZMQ socket is not to be used from a signal frame
        tokenizer_manager.event_loop.call_soon_threadsafe(lambda: tokenizer_manager.abort_request(abort_all=True))
        logger.warning("stopping: requests in flight aborted")


def _abort_in_flight_on_sigterm(result, *args, **kwargs):
    """SGLang's SIGTERM drains: the server waits, polling every 5 s, until every request in
    flight has finished, however long that takes. sglang-vc stops within seconds instead:
    the requests in flight are aborted at once (each client gets its response with an
    ``abort`` finish reason, nothing is cut mid-stream), and SGLang's own shutdown then
    finds nothing to wait for. SGLang's handler has no option for this (its force-exit
    path skips the aborts and drops the connections)."""
    _abort_all(args[0].tokenizer_manager)
    return result


def _abort_in_flight_on_ctrl_c(result, *args, **kwargs):
    """Ctrl-C (SIGINT) reaches the HTTP server (uvicorn), not SGLang: uvicorn's first one
    waits for open connections to close, so a request in flight kept the server up until
    it finished. Aborting the requests in flight answers them and lets it stop."""
    if args[1] == signal.SIGINT:
        from sglang.srt.entrypoints import http_server

        _abort_all(getattr(http_server.get_global_state(), "tokenizer_manager", None))
    return result


def _finish_check_of_new_tokens(original, req, new_accepted_len: int = 1):
    """A run of committed tokens is checked token by token, as plain decoding checks it:
    the request ends at the first token that meets any finish condition.

    SGLang checks a speculative run in one call, condition by condition: the first stop
    string *of the request's list* found anywhere in the run wins, not the one met first
    (stops ``[" ", "\\n"]`` over ``2003\\n\\n Q`` end at the space, past the newline plain
    decoding stops at), and a stop token is looked for only when no stop string matched.
    Each prefix of the run goes through SGLang's own check with one new token instead;
    its grammar, already advanced over the whole (termination-truncated) run, is read
    at the run's last token only.

    VERICACHE's staggered schedule commits nothing for a request in the iterations in
    which it only drafts; SGLang's spec-v2 output path then calls
    ``update_finish_state(0)``, which would read ``output_ids[-0:]`` (the whole output)
    as new. With no new token there is nothing to check; a pending ``to_finish`` (an
    abort) still applies."""
    if new_accepted_len == 0 and not req.to_finish:
        return None
    if new_accepted_len <= 1 or req.to_finish or req.finished():
        return original(req, new_accepted_len)
    run, grammar = req.output_ids, req.grammar
    first = len(run) - new_accepted_len
    try:
        req.grammar = None
        for end in range(first + 1, len(run)):
            req.output_ids = run[:end]
            original(req, 1)
            if req.finished():
                run[first:end] = req.output_ids[first:end]  # (a NaN token is rewritten in place)
                if req.finished_len is None:
                    req.finished_len = end
                return None
    finally:
        req.output_ids, req.grammar = run, grammar
    return original(req, 1)


def _no_output_without_new_tokens(original, accumulator, *, req):
    """A request that committed nothing since its last output is not output again.

    SGLang's output streamer sends a streamed request's state every iteration (at the
    default ``stream_interval`` of 1): plain decoding and SGLang's speculative
    algorithms commit at least one token each. VERICACHE commits nothing for a request
    in the iterations in which it only drafts, so each would repeat the last chunk: an
    empty delta to the client, and a repeated block of logprobs to SGLang's frontend
    (``test_stream_logprobs``). A finished request is always output."""
    n = len(req.output_ids)
    if not req.finished() and getattr(req, "vc_output_len", None) == n:
        return None
    sent = len(accumulator.rids)
    result = original(accumulator, req=req)
    if len(accumulator.rids) > sent:
        req.vc_output_len = n
    return result


def _correct_drafts_histogram(original, req, num_correct_drafts: int):
    """SGLang's spec-v2 output path counts every decode iteration as a verify
    (``spec_verify_ct += 1``, ``accept_len - 1`` correct drafts into a histogram). An
    iteration in which a VERICACHE request only drafted commits 0 tokens, i.e. -1
    "correct drafts", which would index the histogram at -1 (an IndexError on its first
    iteration); one in which it decoded a token from its full KV (``vc_verified`` False,
    set by the worker per forward: under the overlap scheduler the next forward runs
    before this result is processed) is no verify either. Both are taken out of the counts, so
    ``spec_verify_ct`` and ``spec_num_correct_drafts`` count VERICACHE's verifies and
    accepted drafts. The output path has no seam for a worker's per-request counts."""
    log = getattr(req, "vc_verify_log", None)  # the worker's flag per forward, in processing order
    verified = log.popleft() if log else getattr(req, "vc_verified", None)
    if num_correct_drafts < 0 or verified is False:
        req.spec_verify_ct -= 1
        req.spec_num_correct_drafts -= num_correct_drafts
        return None
    return original(req, num_correct_drafts)


_SPEC_FIELDS = ("spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts",
                "spec_verify_ct", "spec_correct_drafts_histogram")


def _overlap_only_where_nothing_drafts(result, scheduler, batch, *args, **kwargs):
    """SGLang's overlap loop launches decode batch ``k`` before it processes the result of
    ``k - 1``; a VERICACHE iteration that drafts, verifies or reloads plans from the
    tokens ``k - 1`` committed, so it needs them processed first -- what this method
    decides, as SGLang does for grammar batches. The worker says which batches
    (``needs_sync``: where every request decodes from its full KV, nothing drafts, they
    overlap as a plain server's). The method has no per-algorithm seam."""
    if result or batch is None or not batch.forward_mode.is_decode() or not scheduler.result_queue:
        return None
    decide = getattr(scheduler.model_worker, "needs_sync", None)
    return True if decide is not None and decide(batch) else None


def _settle_before_processing(scheduler, batch, result, *args, **kwargs):
    """A drafting VERICACHE iteration under SGLang's overlap loop is settled (its drafts
    kept, its verifiers' counts recorded, ``meta_info`` included) when its tokens are
    on the host: normally before the next decode batch launches, but where a prefill or
    nothing follows, SGLang processes its result first, and the request's reply must
    carry those counts. SGLang's result processing has no seam before it reads a
    request; ``settle`` does nothing unless ``result`` is the unsettled iteration's
    (:mod:`.vericache.deferred`)."""
    settle = getattr(getattr(scheduler, "model_worker", None), "settle", None)
    if settle is not None:
        settle(result)
    return None


def _keep_requests_that_commit_nothing_yet(original, scheduler, batch):
    """Under the overlap loop SGLang leaves out of decode batch ``k`` the requests whose
    queued result commits their last token by length (it counts one token per queued
    result); a VERICACHE request that only drafted in that iteration commits none, and
    left out it would never be scheduled again (its client hangs). The worker names
    them (``commits_nothing``); the rest are left out as SGLang does."""
    finishing = original(scheduler, batch)
    nothing = getattr(scheduler.model_worker, "commits_nothing", None)
    return [r for r in finishing if r.rid not in nothing] if finishing and nothing else finishing


def _spec_fields_of_vericache(result, *args, **kwargs):
    """A finished request's ``spec_*`` fields: SGLang prices every verify at
    ``speculative_num_draft_tokens - 1`` proposed drafts, but a VERICACHE request drafts
    X (up to ``--speculative-num-draft-tokens``, chosen per cycle) and verifies only some
    iterations. The worker's own per-request counts (the reply's ``sglang_vc_vericache``
    block) are the truth: proposed = drafted, correct = accepted, verify count = verify
    rounds, accept length = committed tokens per verify; a request that never verified
    (full KV, opted out) reports none."""
    from sglang_vc.vericache.names import META_INFO_KEY

    meta_info = args[1]
    block = meta_info.get(META_INFO_KEY)
    info = block[-1] if isinstance(block, list) and block else block
    if not isinstance(info, dict) or "verify_rounds" not in info:
        return result
    rounds, drafted, accepted = info["verify_rounds"], info["drafted"], info["accepted"]
    if not rounds:
        for key in _SPEC_FIELDS:
            meta_info.pop(key, None)
        return result
    meta_info.update(spec_verify_ct=rounds, spec_num_proposed_drafts=drafted, spec_num_correct_drafts=accepted,
                     spec_accept_rate=accepted / drafted if drafted else 0.0,
                     spec_accept_length=info["committed"] / rounds)
    return result


def _spec_decode_stats(original, reporter, *args, **kwargs):
    """SGLang's decode log line (``accept len``, ``accept rate``) and its acceptance
    gauges on ``/metrics`` divide counters fed once per request and iteration: a VERICACHE
    request that only drafted in an iteration adds -1 correct drafts and one "verify",
    and the rate's denominator assumes ``speculative_num_draft_tokens - 1`` drafts per
    verify. Before SGLang reads them, the counters are set from VERICACHE's own since the
    last log line: verifies, the tokens they committed, and accepted drafts scaled so
    that SGLang's rate is accepted / drafted. No seam exists for a worker's counts."""
    from sglang.srt.runtime_context import get_spec

    from sglang_vc import stats
    from sglang_vc.vericache.names import ALGORITHM

    if str(get_spec().speculative_algorithm or "").upper() != ALGORITHM:
        return original(reporter, *args, **kwargs)
    now = stats.snapshot().get("vericache", {})
    last = getattr(reporter, "_vc_spec_last", {})
    delta = {k: now.get(k, 0) - last.get(k, 0) for k in ("verify_rounds", "drafted", "accepted", "committed",
                                                          "full_kv_steps")}
    if delta["verify_rounds"]:
        per_round = max(int(get_spec().speculative_num_draft_tokens or 1) - 1, 1)
        reporter.spec_num_forward_ct = delta["verify_rounds"]
        reporter.spec_num_accept_tokens = delta["committed"]
        reporter.spec_num_correct_drafts = (delta["accepted"] * delta["verify_rounds"] * per_round
                                            / delta["drafted"] if delta["drafted"] else 0)
    else:  # no verify since the last line: one token per full-KV step, no drafts
        reporter.spec_num_forward_ct = max(delta["full_kv_steps"], 1)
        reporter.spec_num_accept_tokens = delta["full_kv_steps"]
        reporter.spec_num_correct_drafts = 0
    out = original(reporter, *args, **kwargs)
    if reporter.spec_num_forward_ct == 0:  # this call logged and reset them
        reporter._vc_spec_last = now
    return out


def _readmit_after_compression(*args, **kwargs):
    """SGLang stops trying to admit waiting requests once one did not fit
    (``running_batch.batch_is_full``), and clears the flag only when a running request
    leaves. Compression gives slots back without any request leaving: at the end of a
    prefill forward, the dropped (or quantized) prompt rows return to the pool, and the
    waiting requests may fit now. Without this, admission would keep counting running
    compressed requests at their full prompt size until one finishes."""
    from sglang_vc.kvruntime import current_runtime

    runtime = current_runtime()
    scheduler = args[0]
    if runtime is not None and runtime.take_returned_slots() and getattr(scheduler, "running_batch", None):
        scheduler.running_batch.batch_is_full = False
    return None


def _report_waiting_demand(result, *args, **kwargs):
    """After the scheduler chose its next batch: the prompt rows of the requests still
    waiting (not in that batch). VERICACHE's ``--vc-compress-when memory-binds``
    compresses a request at the end of its prefill only when the pool could not also
    hold them; the waiting queue has no seam of its own for a plugin to read."""
    from sglang_vc.kvruntime import current_runtime

    runtime = current_runtime()
    if runtime is not None and runtime.side.compress_gate is not None:  # nobody else reads it
        runtime.side.waiting.see(getattr(args[0], "waiting_queue", ()))
    return None


def _headroom_yields_to_decode(*args, **kwargs):
    """VERICACHE holds pool slots back for its verifies (the verify headroom). SGLang
    retracts a running request when the batch's next decode does not fit the pool (its
    admission does not count a speculative request's per-step reserve), and has no seam
    for a plugin's reservation to give way first: here the headroom gives the decode what
    it lacks, unless verifies starve (:mod:`sglang_vc.vericache.staging`). A retraction
    would prefill and compress a request again."""
    from sglang_vc.kvruntime import current_runtime

    runtime = current_runtime()
    headroom = runtime.side.held_back if runtime is not None else None
    batch = args[1] if len(args) > 1 else kwargs.get("batch")
    if headroom is None or not headroom.size or batch is None or batch.is_empty():
        return None
    if not batch.check_decode_mem():  # (it has evicted what cached prefixes could give)
        headroom.yield_to_decode(batch.new_tokens_required_next_decode() - headroom.allocator.available_size())
    return None


def _slots_ahead():
    """The running worker's per-request decode reserve (:mod:`sglang_vc.vericache.decode_slots`),
    or None where SGLang's uniform one applies."""
    from sglang_vc.kvruntime import current_runtime

    runtime = current_runtime()
    return runtime.side.slots_ahead if runtime is not None else None


def _decode_alloc_per_request(original, reqs, *, reserve: int, page_size: int):
    """SGLang's spec-v2 decode allocation tops every running request up to ``committed +
    2X`` slots, a reserve sized for a draft chain and the overlap scheduler; VERICACHE's
    staggered iteration writes at most one new position per request, and a request
    needs its outstanding drafts plus one (:mod:`sglang_vc.vericache.decode_slots`). With
    the uniform reserve, a pool that holds the requests as a plain server does makes SGLang
    retract one for slots no forward writes. The reserve is a constant of SGLang's with no
    per-request seam; other workers keep it."""
    ahead = _slots_ahead()
    if ahead is None:
        return original(reqs, reserve=reserve, page_size=page_size)
    from sglang_vc.vericache.decode_slots import decode_alloc_lens

    return decode_alloc_lens(reqs, ahead, page_size)


def _decode_need_per_request(original, batch, requests, page_size):
    """SGLang's retraction check asks for what its decode allocation takes
    (``_new_tokens_required_next_decode_spec_v2``); with VERICACHE's per-request reserve
    (the hook above) it must ask for the same, or it retracts for slots nobody takes --
    plus, while verifies starve for staging room, what the verify headroom lacks, so that
    SGLang retracts a request to free it (its own correct, slower path)."""
    ahead = _slots_ahead()
    if ahead is None:
        return original(batch, requests, page_size)
    from sglang_vc.kvruntime import current_runtime
    from sglang_vc.vericache.decode_slots import decode_alloc_lens

    headroom = current_runtime().side.held_back
    return decode_alloc_lens(requests, ahead, page_size)[2] + (headroom.starved_shortfall if headroom else 0)


def _switch_remote_requests_to_local(*args, **kwargs):
    """VERICACHE_REMOTE (path P2, and the fallback of a failed verify): a request whose
    prefix's full KV has arrived leaves the running batch by SGLang's own retraction and
    is requeued, to prefill what follows the prefix exactly. Its worker runs inside the
    forward; only between iterations is the running batch the scheduler's to change."""
    from sglang_vc.vericache.remote.worker import retract_switched

    retract_switched(args[0])
    return None


def _host_memory_budget_bytes(original, requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """SGLang keeps ``HICACHE_HOST_MEMORY_RESERVE_BYTES`` (10 GiB, sized for GPU
    servers) of RAM free before it allows a HiCache host pool, so on a 16-24 GB machine
    a host pool of a few hundred MB fails whenever other processes hold a few GB. On the
    CPU platform the model and the device KV pool are already in RAM when the host pool
    is sized, so the reserve is only headroom: 1 GiB (or 5% of the RAM if larger); the rest
    of SGLang's check (cgroup limits, ranks per host, the startup budget scope) is kept
    by calling the original with the reserve lowered for the call (AROUND hook: the
    constant has no seam of its own)."""
    import psutil
    import sglang.srt.mem_cache.pool_host.base as base

    saved = base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(saved, max(1 << 30, int(0.05 * psutil.virtual_memory().total)))
    try:
        return original(requested_bytes, auto_size=auto_size)
    finally:
        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = saved


def _row_headroom_for_chain_workers(result, *args, **kwargs):
    """SGLang widens each ``req_to_token`` row beyond the context by ``4 + X`` only, while
    a speculative decode round reserves ``2 * X`` slots past the committed length: the
    project's chain workers (VERICACHE, VERICACHE_REMOTE, SPECACHE: up to 2X - 1 drafts
    between verifies) would write past the row of a request within X tokens of the end of
    the context (an IndexError on the CPU, an out-of-bounds write on a GPU). SGLang widens
    the row to the reserve for its own page>1 and UNO paths only; no seam for ours."""
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
    from sglang.srt.runtime_context import get_spec

    from sglang_vc.speculative import PROJECT_ALGORITHMS

    algorithm = get_spec().speculative_algorithm
    if algorithm is not None and str(algorithm).upper() in PROJECT_ALGORITHMS:
        return max(result, get_alloc_reserve_per_decode())
    return None


def _view_rows_for_in_pool_drafts(original, configurator, *, max_num_reqs: int):
    """VERICACHE's in-pool drafts attend a view of their own rows written into a second
    ``req_to_token`` row per drafting request (:mod:`sglang_vc.vericache.view_rows`), so
    that SGLang's attention backends read it with their own kernels. SGLang sizes the table
    to ``max_running_requests`` rows exactly; the table gets that many rows more (up to
    ``view_rows.MAX_VIEW_ROWS``). ``max_running_requests`` itself is unchanged, so the
    extra rows never admit a request. No seam for a plugin."""
    from sglang.srt.runtime_context import get_spec

    from sglang_vc.vericache import view_rows

    algorithm = get_spec().speculative_algorithm
    if algorithm is not None and str(algorithm).upper() == "VERICACHE":
        extra = view_rows.extra_rows(max_num_reqs)
        logger.info("VERICACHE: req_to_token holds %d rows more than the %d running requests, for in-pool "
                    "drafts' views", extra, max_num_reqs)
        max_num_reqs += extra
    return original(configurator, max_num_reqs=max_num_reqs)


def _decode_graphs_for_vericache(original, model_runner):
    """VERICACHE's target forwards plain ``DECODE`` batches (full-KV iterations, in-pool
    drafts over view rows) that SGLang's decode graphs replay for a plain server, but
    SGLang 0.5.23 builds a speculative target's graph runner in ``TARGET_VERIFY`` mode
    only. ``_decode_cuda_graph_runner_cls`` is the model runner's seam for a specialised
    runner class (meant for ModelRunner subclasses, which a plugin cannot install), so it
    is wrapped here (:mod:`sglang_vc.vericache.decode_graphs`)."""
    from sglang_vc.vericache.decode_graphs import runner_cls_for

    return runner_cls_for(original, model_runner)


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, batch_size):
    """Pure-torch ``assign_req_to_token_pool_func``: write the freshly allocated slots
    ``out_cache_loc`` (concatenated per request) into ``req_to_token[row, start:end]``.
    Speculative decoding's per-round allocation (``alloc_for_spec_decode``) calls it; SGLang
    runs a Triton kernel there unless its in-tree CPU engine (with sgl-kernel) is active,
    and has no platform seam for the op (VERICACHE on the CPU platform needs it)."""
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    off = 0
    for row, start, end in zip(rows[:batch_size], starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += max(n, 0)


def _pace_storage_reads(result, *args, **kwargs):
    """SGLang's storage backend factory has no seam for wrapping the backend it creates
    (its own failure injector is wired in by environment variables): with
    ``--vc-storage-read-gbps`` the created backend's reads are paced (an emulated slow
    link, ``storage_link.py``)."""
    from sglang_vc.storage_link import pace_created_backend

    config = kwargs.get("storage_config") or next((a for a in args if hasattr(a, "extra_config")), None)
    return pace_created_backend(result, config) if config is not None else result


def _leave_stopping_to_the_launcher() -> None:
    """A supervisor stops a service by signalling its whole process group (systemd's
    control group, a terminal's Ctrl-C), not only the launcher. SGLang's scheduler and
    detokenizer die of that SIGTERM at once: the launcher's watchdog then reports a
    crash, raises SIGQUIT and sleeps 5 s for crash diagnostics, and the requests in
    flight lose their answers. In SGLang's child processes the two stop signals are
    ignored instead: the launcher gets them too, aborts what is in flight, shuts down and
    kills its children itself (a launcher killed outright still takes them along: SGLang
    sets their parent-death signal). Not a HookRegistry patch: a signal disposition of
    this process, set when SGLang loads the plugin in it."""
    import multiprocessing

    if multiprocessing.parent_process() is None:  # the launcher (or a process of its own)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def install() -> None:
    _leave_stopping_to_the_launcher()
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        _add_vc_counters,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.sampling.sampling_params.SamplingParams.verify",
        _check_sampling_params,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        _check_request,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request",
        _speccache_prompt,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        _speccache_responses,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.flush_cache",
        _speccache_flush,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.SignalHandler.sigterm_handler",
        _abort_in_flight_on_sigterm,
        HookType.AFTER,
    )
    HookRegistry.register("uvicorn.server.Server.handle_exit", _abort_in_flight_on_ctrl_c, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.Req.update_finish_state",
        _finish_check_of_new_tokens,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
        _no_output_without_new_tokens,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram",
        _correct_drafts_histogram,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics",
        _spec_fields_of_vericache,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats",
        _spec_decode_stats,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        _readmit_after_compression,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        _report_waiting_demand,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.update_running_batch",
        _headroom_yields_to_decode,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.allocation_sizing.page_aligned_decode_alloc_lens",
        _decode_alloc_per_request,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch._new_tokens_required_next_decode_spec_v2",
        _decode_need_per_request,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        _switch_remote_requests_to_local,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len",
        _row_headroom_for_chain_workers,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_req_to_token_pool",
        _view_rows_for_in_pool_drafts,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend",
        _pace_storage_reads,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls",
        _decode_graphs_for_vericache,
        HookType.AROUND,
    )
    from sglang_vc.kvruntime.graphs import GRAPH_GATE_TARGET, no_graph_for_compressed_batches

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch",
                          _overlap_only_where_nothing_drafts, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.process_batch_result",
                          _settle_before_processing, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._reqs_finishing_inflight",
                          _keep_requests_that_commit_nothing_yet, HookType.AROUND)
    HookRegistry.register(GRAPH_GATE_TARGET, no_graph_for_compressed_batches, HookType.AROUND)
    if _on_cpu_platform():
        _install_cpu_shims()


def _install_cpu_shims() -> None:
    HookRegistry.register(
        "sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__",
        _host_pool_unpinned,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.pool_host.base.host_memory_budget_bytes",
        _host_memory_budget_bytes,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
        assign_req_to_token_pool,
        HookType.REPLACE,
    )
    # The host pool module binds ``transfer_kv_direct`` only when sgl-kernel is there;
    # HookRegistry can replace a name but not define a missing one, so it is set here.
    import sglang.srt.mem_cache.pool_host.mha as host_mha

    if not hasattr(host_mha, "transfer_kv_direct"):
        host_mha.transfer_kv_direct = transfer_kv_direct
