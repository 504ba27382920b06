"""The base of sglang-vc's speculative workers (VERICACHE, SPECACHE): SGLang's spec-V2
worker schema, run synchronously on the target model alone.

Both algorithms forward the target model over a batch of SGLang's own requests several
tokens at a time (``TARGET_VERIFY`` forwards with a causal chain mask, or ``DECODE``
forwards of a sub-batch) and commit what they choose; this class holds the SGLang
plumbing they share: pointing a schedule batch at one forward, the chain verify input,
the sampler's choice of a token from logits, sub-batches, and the prefill result.
"""

from __future__ import annotations

import copy
import itertools
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vc.grammar_masks import apply_grammars
from sglang_vc.overlap import RelayInput, on
from sglang_vc.penalties import apply_penalties, has_penalties, penalty_rows


def chain_mask(starts: list[int], lens: list[int], dev) -> torch.Tensor:
    """SGLang's flattened verify mask for chains: request ``i``'s ``[lens[i], starts[i] +
    lens[i]]`` block, row ``r`` seeing the prefix and chain tokens ``0 .. r``. Built on
    ``dev`` by a few element-wise kernels (sizes known on the host, so nothing is read back),
    not as per-request host tensors copied over every iteration."""
    width = [s + n for s, n in zip(starts, lens)]
    sizes = [n * wd for n, wd in zip(lens, width)]
    total = sum(sizes)
    if total == 0:
        return torch.zeros(0, dtype=torch.bool, device=dev)
    per_req = to_device(torch.tensor([[s, wd, off] for s, wd, off in
                                      zip(starts, width, itertools.accumulate([0, *sizes[:-1]]))], dtype=torch.int64), dev)
    req = torch.repeat_interleave(torch.arange(len(sizes), device=dev),
                                  torch.tensor(sizes).to(dev, non_blocking=True), output_size=total)
    start, wd, off = per_req[req].unbind(1)
    local = torch.arange(total, device=dev) - off
    return local % wd <= start + local // wd


def committed_lens(batch) -> torch.Tensor:
    """Each request's committed length, int64 on the host: SGLang's ScheduleBatch keeps
    them there (``seq_lens_cpu``, updated with ``seq_lens`` after every round), so no
    device read; the device tensor is read only where the host copy is missing."""
    if batch.seq_lens_cpu is not None:
        return batch.seq_lens_cpu.to(torch.int64)
    return batch.seq_lens.to("cpu", torch.int64)


class ChainSpecWorker(BaseSpecWorker):
    """``stride``: the tokens per request SGLang's output path reserves per iteration."""

    def __init__(self, target_worker, stride: int):
        super().__init__()
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.stride = stride

    @property
    def draft_worker(self):
        return None  # the drafter (if any) is the target model itself

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        pass

    def prefill_result(self, batch, pp_proxy_tensors=None, override=None):
        """A prefill (extend) forward: the target model's own, one token committed per
        request, reported in the spec-V2 schema. ``override(tokens) -> tokens`` replaces
        the sampled tokens (a verifier's, for requests whose prefix KV is lossy)."""
        from sglang.srt.managers.utils import GenerationBatchResult

        res = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
        predict = res.next_token_ids if override is None else override(res.next_token_ids)
        bs = len(batch.reqs)
        accept_tokens = torch.zeros(bs, self.stride, dtype=torch.int32, device=predict.device)
        if bs:
            accept_tokens[:, 0] = predict
        accept_lens = torch.ones(bs, dtype=torch.int32, device=predict.device)
        return GenerationBatchResult(
            logits_output=res.logits_output,
            next_token_ids=predict,
            can_run_cuda_graph=res.can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=batch.seq_lens,
            next_draft_input=self.draft_input(batch.seq_lens.clone(), accept_tokens.flatten(), accept_lens),
            speculative_num_draft_tokens=self.stride,
            speculative_output_stride=self.stride,
        )

    def result(self, batch, accept_tokens: torch.Tensor, accept_lens: torch.Tensor, logits_output=None,
               can_run_cuda_graph: bool = False):
        """The spec-V2 result of a decode iteration: ``accept_tokens [bs, stride]`` and
        ``accept_lens [bs]`` (int64, on the host or the device) committed after each
        request's ``seq_lens``;
        ``can_run_cuda_graph``: its forward replayed a graph (SGLang's decode log says so)."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        dev = batch.seq_lens.device
        committed = committed_lens(batch)
        # (accept_lens on the host, or on the device where the accept rule ran there)
        new_seq_lens = (on(committed, dev) + on(accept_lens, dev)).to(batch.seq_lens.dtype)
        tokens = on(accept_tokens.to(torch.int32), dev).flatten()
        lens = on(accept_lens.to(torch.int32), dev)
        logits_output = logits_output or LogitsProcessorOutput(next_token_logits=None)
        if batch.return_logprob and logits_output.next_token_logprobs is None:
            # nothing committed that asked for logprobs (a failed iteration: every request
            # ends): SGLang's output path reads the field whenever the batch asks
            logits_output.next_token_logprobs = torch.zeros(accept_tokens.shape, dtype=torch.float32)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=tokens,
            can_run_cuda_graph=can_run_cuda_graph,
            accept_lens=lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=self.draft_input(new_seq_lens, tokens, lens),
            speculative_num_draft_tokens=self.stride,
            speculative_output_stride=self.stride,
        )

    def draft_input(self, new_seq_lens, accept_tokens, accept_lens):
        # SGLang's chain/tree verify input carries the per-request accept state between
        # rounds (filter/merge on batch changes); the workers keep nothing else there
        # (under the overlap scheduler, the last tokens it relays: :mod:`sglang_vc.overlap`)
        return RelayInput(draft_token_num=self.stride, new_seq_lens=new_seq_lens,
                          accept_tokens=accept_tokens, accept_lens=accept_lens)

    def sub_batch(self, batch, indices: list[int]):
        """The requests ``indices`` of the batch, as a batch of their own, in batch order
        (SGLang's ``filter_batch`` on a shallow copy; the sampling info is copied, not
        shared).

        ``indices`` must be strictly increasing: ``filter_batch`` returns the batch
        unchanged when asked to keep as many requests as it has, so a whole-batch
        permutation would silently come back in batch order, each request then forwarded
        with another's token, position and slot. Callers order their rows by batch index."""
        indices = list(indices)
        if any(a >= b for a, b in zip(indices, indices[1:])) or (indices and not 0 <= indices[0] <= indices[-1] < len(batch.reqs)):
            raise ValueError(f"sub_batch indices must be strictly increasing batch indices, got {indices}")
        sub = copy.copy(batch)
        sub.sampling_info = copy.copy(batch.sampling_info)
        if sub.sampling_info is not None:
            # the workers apply penalties from each request's output ids
            # (:meth:`penalize`), not from SGLang's penalizer state, which filter_batch
            # would otherwise filter in place under the batch it belongs to
            sub.sampling_info.penalizer_orchestrator = _NoPenalties()
        sub.spec_info = None
        sub.filter_batch(keep_indices=indices)
        return sub

    forwards: int = 0  # model forwards run by forward_sub (the trace reports them per iteration)
    replayed: bool = False  # whether forward_sub's last forward replayed a CUDA graph

    def forward_sub(self, sub, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info, *,
                    rows: Optional[list[int]] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One model forward of ``sub``. ``rows``: the ``req_to_token`` row each request reads
        (its own by default; VERICACHE's in-pool drafters read a view row); ``positions``:
        the tokens' true positions where SGLang would derive other ones from ``seq_lens``
        (a ``DECODE`` forward over a view row, whose ``seq_len`` is the view's length)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        self.forwards += 1
        self.set_batch(sub, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info,
                        sub.seq_lens.dtype, sub.seq_lens.device)
        rows_cpu = torch.tensor(rows if rows is not None else [r.kv.req_pool_idx for r in sub.reqs], dtype=torch.int64)
        if rows is not None:
            sub.req_pool_indices = to_device(rows_cpu.to(sub.req_pool_indices.dtype), sub.req_pool_indices.device)
        # the forward batch built here as SGLang's worker builds it from a schedule batch,
        # with the host copy of its rows that SGLang keeps for extends only: the project's
        # attention reads the rows from it (``kvruntime.runtime.host_rows``), no device read
        self.target_worker.set_hicache_consumer(getattr(sub, "hicache_consumer_index", -1))
        forward_batch = ForwardBatch.init_new(sub, self.model_runner, return_hidden_states_before_norm=False)
        forward_batch.req_pool_indices_cpu = rows_cpu
        if positions is not None:
            forward_batch.positions = to_device(positions.to(forward_batch.positions.dtype),
                                                forward_batch.positions.device)
        res = self.target_worker.forward_batch_generation(None, forward_batch=forward_batch, is_verify=True)
        self.replayed = bool(res.can_run_cuda_graph)
        return res.logits_output.next_token_logits

    def set_batch(self, batch, mode, input_ids, seq_lens_cpu, out_cache_loc, spec_info, seq_dtype, dev):
        """Point the (isolated) schedule batch at one forward of the round."""
        batch.forward_mode = mode
        batch.input_ids = to_device(input_ids.to(torch.int64), dev)
        batch.seq_lens = to_device(seq_lens_cpu.to(seq_dtype), dev)
        batch.seq_lens_cpu = seq_lens_cpu.to(torch.int64)
        batch.seq_lens_sum = int(seq_lens_cpu.sum())
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.out_cache_loc = to_device(out_cache_loc.to(torch.int64), dev)
        batch.spec_info = spec_info

    def verify_input(self, verify_ids, positions, committed, dev, mask: bool = True):
        """A ``TARGET_VERIFY`` input in which every request verifies ``W`` tokens.
        ``mask=False``: no dense mask (as :meth:`ragged_verify_input`'s)."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        bs, w = verify_ids.shape
        # A causal chain (NGRAM's tree with topk=1): query k sees the committed prefix and
        # verify tokens 0..k. Flattened per request as [W, L + W], as SGLang's verify
        # attention backends read it (the vc_verify backend builds the same mask itself).
        mask = chain_mask(committed.tolist(), [w] * bs, dev) if mask else torch.zeros(0, dtype=torch.bool, device=dev)
        spec_info = NgramVerifyInput(
            draft_token=on(verify_ids.flatten(), dev),  # (host tensors: non-blocking copies)
            custom_mask=mask,
            positions=on(positions.flatten(), dev),
            retrieve_index=torch.arange(bs * w, device=dev).view(bs, w),
            retrieve_next_token=None,
            retrieve_next_sibling=None,
            draft_token_num=w,
        )
        spec_info.capture_hidden_mode = CaptureHiddenMode.NULL
        return spec_info

    def ragged_verify_input(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int],
                            lens: list[int], dev, mask: bool = True):
        """A ``TARGET_VERIFY`` input whose requests verify different numbers of tokens
        (SGLang's ragged verify layout): request ``i`` forwards ``lens[i]`` tokens at
        positions ``starts[i] ..``, each seeing its committed prefix and the tokens before
        it in its own chain. One token (``lens[i] == 1``) is a plain decode step.
        ``mask=False``: no dense mask (a backend that runs the forward as a causal extend,
        like ``vc_verify``, never reads it; it is ``O(tokens x context)`` per iteration)."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput
        from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

        lens_t = torch.tensor(lens, dtype=torch.int32)
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = lens_t.cumsum(0)
        total = int(indptr[-1])
        spec_info = NgramVerifyInput(
            draft_token=to_device(ids, dev),
            # (an empty one when unread: SGLang's input takes its device from it)
            custom_mask=chain_mask(starts, lens, dev) if mask else torch.zeros(0, dtype=torch.bool, device=dev),
            positions=to_device(positions, dev),
            retrieve_index=torch.arange(total, device=dev).view(1, total),
            retrieve_next_token=None,
            retrieve_next_sibling=None,
            draft_token_num=max(lens),
        )
        spec_info.num_tokens_per_req = spec_info.num_tokens_for_logprob_per_req = 1  # ragged
        spec_info.ragged_verify_layout = RaggedVerifyLayout(
            verify_lens=to_device(lens_t, dev), graph_num_tokens=total, extend_start_loc=to_device(indptr[:-1], dev),
            qo_indptr_device=to_device(indptr, dev), verify_lens_cpu=list(lens), total_verify_tokens=total)
        spec_info.capture_hidden_mode = CaptureHiddenMode.NULL
        return spec_info

    @staticmethod
    def constrained(reqs) -> bool:
        """Whether any request has a penalty, ``min_new_tokens`` or a live grammar: the
        callers of :meth:`penalize` build its per-row inputs only then."""
        return any(has_penalties(req.sampling_params) or getattr(req, "grammar", None) is not None
                   for req in reqs)

    @staticmethod
    def penalize(logits: torch.Tensor, reqs, runs, row_req, row_drafts, last_tokens=None,
                 masked_rows=None) -> torch.Tensor:
        """``logits`` with what SGLang's sampler applies before ``logit_bias``, at each
        row's own position: each request's penalties and ``min_new_tokens``
        (:mod:`sglang_vc.penalties`), then, given ``last_tokens`` (each request's last
        committed token), its grammar's vocabulary mask (:mod:`sglang_vc.grammar_masks`).
        Row ``j`` is request ``row_req[j]``'s, after ``row_drafts[j]`` of the tokens
        ``runs[i]`` it drafted past its committed output; ``masked_rows`` (all by default)
        are the rows the grammar masks. Unchanged when no request has a penalty or a
        grammar."""
        logits = apply_penalties(logits, penalty_rows(reqs, runs, row_req, row_drafts, logits.shape[-1],
                                                      logits.device))
        if last_tokens is not None:
            logits = apply_grammars(logits, reqs, last_tokens, runs, row_req, row_drafts, masked_rows)
        return logits

    @staticmethod
    def committed_logprobs(batch, logits: torch.Tensor, first_row: list, accept_tokens: torch.Tensor,
                           accept_lens: torch.Tensor):
        """SGLang's logprob outputs (``return_logprob``, ``top_logprobs_num``,
        ``token_ids_logprob``) for the tokens an iteration commits, from the full-KV
        logits that chose them: committed token ``j`` of request ``i`` came from row
        ``first_row[i] + j`` of ``logits`` (penalties and ``logit_bias`` applied, as
        SGLang's sampler computes logprobs); ``first_row[i]`` is None where it committed
        nothing. Laid out as SGLang's chain-verify workers lay them out
        (``compute_spec_logprobs``, ``accept_tokens [bs, stride]``)."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.layers.logprob_processor import compute_spec_logprobs

        bs, stride = accept_tokens.shape
        first = torch.tensor([0 if r is None else r for r in first_row], dtype=torch.int64)
        last = (accept_lens.to(torch.int64) - 1).clamp(min=0)
        rows = first[:, None] + torch.minimum(torch.arange(stride)[None, :], last[:, None])
        out = LogitsProcessorOutput(next_token_logits=logits[to_device(rows.flatten(), logits.device)])
        compute_spec_logprobs(batch, out, on(accept_tokens.flatten(), logits.device), chain_stride=stride)
        return out

    def targets(self, logits: torch.Tensor, batch, positions: torch.Tensor) -> torch.Tensor:
        """The verifier's token at each of the W positions ``[bs, W]`` of every request
        (:meth:`targets_flat` on a uniform layout)."""
        bs, w, vocab = logits.shape
        rows = torch.arange(bs).repeat_interleave(w)
        return self.targets_flat(logits.reshape(bs * w, vocab), batch, rows, positions.reshape(-1)).view(bs, w)

    def targets_flat(self, logits: torch.Tensor, batch, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The verifier's token at each logits row ``[N]`` (row ``j`` belongs to request
        ``rows[j]`` of ``batch``, at ``positions[j]``), chosen from the full-KV logits as
        SGLang's sampler chooses in full-KV decoding: ``logit_bias`` added; argmax for
        greedy requests; otherwise softmax at the request's temperature, then SGLang's own
        top-k / top-p / min-p sampling, seeded per request and position under
        deterministic inference. Penalties and grammar masks are applied before
        (:meth:`penalize`)."""
        from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

        vocab = logits.shape[-1]
        info = batch.sampling_info
        logits = logits.float()
        rows = to_device(rows, logits.device)
        if info is not None and info.logit_bias is not None:
            logits = logits + info.logit_bias[:, :vocab].to(logits.device)[rows]
        if info is None or info.is_all_greedy:
            return logits.argmax(-1)

        def per_row(t):  # [bs] -> [N]
            return t.view(-1)[rows.to(t.device)]

        probs = torch.softmax(logits / per_row(info.temperatures.float())[:, None], dim=-1)
        seed = info.sampling_seed
        ids = top_k_top_p_min_p_sampling_from_probs_torch(
            probs,
            per_row(info.top_ks),
            per_row(info.top_ps.float()),
            per_row(info.min_ps.float()),
            bool(info.need_min_p_sampling),
            None if seed is None else per_row(seed),
            on(positions.reshape(-1), probs.device),
        ).to(torch.int64)
        # greedy requests of a mixed batch (SGLang gives them top_k = 1): exact argmax
        greedy = per_row(info.top_ks <= 1).to(ids.device)
        return torch.where(greedy, logits.argmax(-1), ids)


class _NoPenalties:
    is_required = False

    def filter(self, keep_indices) -> None:
        pass
