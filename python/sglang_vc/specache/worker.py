"""The SPECACHE speculative worker (SGLang spec-V2 schema, synchronous).

After a request's prefill (full KV; the runtime then quantizes its prompt with KIVI and
the host store keeps the quantized rows in full precision), each decode iteration runs
one forward for the whole batch:

* a request's first iteration is the **pre-decode** (algorithm 2): its last output token
  ``y`` at position ``L`` attends over the low-bit copy; its attention picks the first
  top-k rows per layer and KV head (prefetch started at once) and its output is the first
  speculative token. Nothing is committed;
* every later iteration (algorithm 3) forwards ``[y, s]`` at positions ``L, L+1`` as a
  ``TARGET_VERIFY`` chain: the output token ``y`` attends with last step's rows in full
  precision and its output is committed (sampled as SGLang's sampler would); the
  speculative token ``s`` picks the next rows and its output is the next ``s``. Its KV
  (slot ``L+1``) is overwritten by the next step's output token;
* a request without a payload (short prompt, host store full, ``vc_compressor: none``)
  decodes plainly in the same forward, one token per iteration.

After committing, the decode tail is quantized group by group (the host store receives
each group's full rows first). ``--specache-fetch nonspeculative`` (the comparison mode)
forwards the output token with no speculative token; in each layer it attends, fetches
its own top-k rows and attends again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.config import get_vc_config
from sglang_vc.kvruntime import get_runtime
from sglang_vc.spec_worker import ChainSpecWorker

from . import flags
from .host import HostKVStore, Prefetcher
from .names import META_INFO_KEY, STATS
from .requests import request_topk
from .step import Phase, ReqStep, StepPlan

logger = logging.getLogger(__name__)

WIDTH = 2  # tokens per request per step: the output token and the speculative token


@dataclass
class _ReqState:
    spec_token: Optional[int] = None  # None until the pre-decode ran
    steps: int = 0


class SpeCacheWorker(ChainSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        from sglang.srt.runtime_context import get_device

        super().__init__(target_worker, stride=WIDTH)
        self.server_args = server_args
        settings = get_vc_config(server_args).group(flags.GROUP)
        self.config = flags.config_of(settings)
        self.device = get_device().device
        self.host = HostKVStore(flags.host_kv_bytes(settings), pin=torch.device(self.device).type == "cuda")
        self.prefetcher = Prefetcher(self.host, self.device)
        self.states: dict[str, _ReqState] = {}
        self._runtime = None
        logger.info("SPECACHE: %s", self.config.describe())

    @property
    def runtime(self):
        if self._runtime is None:
            rt = self._runtime = get_runtime(self.model_runner)
            rt.full_kv_admit = self._admit
            rt.full_kv_sink = self._sink
            rt.full_kv_streamed = self._streamed
        return self._runtime

    # ------------------------------------------------------------------ host copy

    def _admit(self, rid: str, req_pool_idx: int, p: int, n: int) -> bool:
        ok = self.host.admit(rid, self.config.quantized_len(n) * self.runtime.bytes_per_slot)
        if not ok:
            stats.add(STATS, host_store_full=1)
        return ok

    def _sink(self, rid: str, req_pool_idx: int, layer_id: int, p: int, k, v) -> None:
        n_q = self.config.quantized_len(k.shape[0])
        if n_q:
            self.host.append(rid, layer_id, 0, k[:n_q], v[:n_q])

    def _streamed(self, rid: str, req_pool_idx: int, layer_id: int, start: int, k, v) -> None:
        self.host.append(rid, layer_id, start, k, v)

    # ------------------------------------------------------------------ entry point

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        runtime = self.runtime  # installs the host callbacks before the first prefill
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            result = self._step(batch)
        else:
            result = self.prefill_result(batch, pp_proxy_tensors)
        live = {r.rid for r in batch.reqs} | set(runtime.plans)
        self.host.retain(runtime.compressed_rids() & live)
        for rid in [r for r in self.states if r not in live]:
            del self.states[rid]
            self.prefetcher.forget(rid)
        return result

    @torch.inference_mode()
    def _step(self, batch):
        bs, dev = len(batch.reqs), batch.seq_lens.device
        committed = batch.seq_lens.to("cpu", torch.int64)
        rows = batch.req_pool_indices.to("cpu", torch.int64)
        req_to_token = self.req_to_token_pool.req_to_token
        t0 = torch.tensor([r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in batch.reqs])
        plan, entry_bits = [], []
        for i, req in enumerate(batch.reqs):
            entry = self.runtime.entry_for_row(int(rows[i]))
            entry_bits.append(entry.spec.bits if entry is not None else None)
            if entry is None or entry.payload is None or self.host.get(req.rid) is None:
                plan.append(ReqStep(req.rid, Phase.FULL))
                continue
            state = self.states.setdefault(req.rid, _ReqState())
            topk = request_topk(getattr(req.sampling_params, "custom_params", None), self.config.topk)
            speculating = self.config.speculative and topk > 0
            phase = Phase.PREDECODE if speculating and state.spec_token is None else Phase.DECODE
            plan.append(ReqStep(req.rid, phase, topk))
        step = StepPlan(self.config, self.host, self.prefetcher, plan)
        attn = self.model_runner.attn_backend
        # every request forwards two rows: [output token, speculative token]; a request
        # at its pre-decode, decoding from full KV, or in the non-speculative mode has no
        # speculative token and repeats its output token there (a causal mask makes row 0
        # independent of row 1, whose output is then unused)
        width = WIDTH
        positions = committed[:, None] + torch.arange(width)[None, :]
        slots = req_to_token[rows[:, None].to(req_to_token.device), positions.to(req_to_token.device)]
        spec = torch.tensor([s.spec_token if (s := self.states.get(p.rid)) is not None and p.phase is Phase.DECODE
                             and s.spec_token is not None else int(t0[i]) for i, p in enumerate(plan)])
        ids = torch.stack([t0, spec], 1)
        self.set_batch(batch, ForwardMode.TARGET_VERIFY, ids.flatten(), committed, slots.flatten(),
                       self.verify_input(ids, positions, committed, dev), batch.seq_lens.dtype, dev)
        try:
            attn.step = step
            res = self.target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            attn.step = None
        logits = res.logits_output.next_token_logits.view(bs, width, -1)
        first = self.penalize(logits[:, 0], batch.reqs, [()] * bs, range(bs), [0] * bs)
        out = self.targets(first[:, None], batch, positions[:, :1])[:, 0].to("cpu", torch.int64)
        guesses = logits.argmax(-1).to("cpu", torch.int64)  # [bs, width]

        accept_tokens = torch.zeros(bs, self.stride, dtype=torch.int64)
        accept_lens = torch.zeros(bs, dtype=torch.int64)
        n_pre = n_dec = n_full = 0
        for i, p in enumerate(plan):
            if p.phase is Phase.PREDECODE:
                self.states[p.rid].spec_token = int(guesses[i, 0])  # commits nothing
                n_pre += 1
                continue
            accept_tokens[i, 0] = out[i]
            accept_lens[i] = 1
            if p.phase is Phase.FULL:
                n_full += 1
                continue
            n_dec += 1
            state = self.states[p.rid]
            state.steps += 1
            if self.config.speculative:
                state.spec_token = int(guesses[i, 1])
            self.runtime.stream_tail(int(rows[i]), int(committed[i]) + 1)
            self._record(batch.reqs[i], state, p.topk, entry_bits[i])
        stats.add(STATS, iterations=1, steps=n_dec, predecode_steps=n_pre, full_kv_steps=n_full,
                  **step.counters.as_stats())
        return self.result(batch, accept_tokens, accept_lens)

    def _record(self, req, state: _ReqState, topk: int, bits: Optional[int]) -> None:
        """Per-request counters and settings, returned in the request's ``meta_info``."""
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [{**self.config.describe(), "steps": state.steps, "topk": topk,
                                               "kv_bits": bits}]
