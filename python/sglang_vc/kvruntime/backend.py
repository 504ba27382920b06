"""Attention backend ``vc_torch``: SGLang's own attention backend for full KV, plus the
compression of a request's KV right after its prefill and attention over compressed KV
afterwards.

Forwards in which no request reads compressed rows run the backend SGLang itself picks
for the platform and model (FlashInfer, FA3 or Triton on CUDA; ``torch_native``, this
class's base, on the CPU), decode CUDA graphs included. Batches with compressed requests
run a per-request loop over :func:`.kernels.attend` (the SDPA call of ``torch_native``).
On CUDA (``sgl_kernel_ext``'s Triton kernels) a decode batch with compressed requests is
one attention launch per layer over every request's live pool rows, read through index
lists built on the device once per forward, plus the packed payload of each quantized
request dequantized inside its own kernel and merged by log-sum-exp
(:meth:`VCTorchAttnBackend._forward_decode_batched`).
Compression happens inside the prefill forward, layer by layer, after the layer's
attention: the prefill itself (and so the first output token) always sees the full KV.
"""

from __future__ import annotations

import dataclasses
import logging

import sgl_kernel_ext as ext
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_vc import stats

from . import decode_index, graphs, kernels
from .decode_index import DecodeIndex
from .runtime import get_runtime, host_rows

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ExtendLists:
    """An extend forward's per-request sizes on the host, read once for all layers (the
    CPU extend below would otherwise read them from the device in every layer)."""

    seq_lens: torch.Tensor  # the forward batch's tensor these lists describe
    rows: list[int]
    kv_lens: list[int]
    q_lens: list[int]
    prefixes: list[int]


def full_kv_backend_name(server_args, model_config, use_mla_backend: bool) -> str:
    """The SGLang attention backend that runs full-KV attention: the one
    ``--vc-full-kv-attention-backend`` names, else SGLang's platform default for the model
    (its own ``get_default_attn_backend``: FA3, FlashInfer or Triton on CUDA as the GPU
    and model allow, ``torch_native`` on the CPU). SGLang's per-model overrides (e.g.
    Qwen3-VL, Llama 4, GPT-OSS) apply only when ``--attention-backend`` is unset, which
    the project sets: name their backend with the flag."""
    from sglang.srt.arg_groups.model_override_base import get_default_attn_backend

    from sglang_vc.config import get_vc_config

    chosen = get_vc_config(server_args).vc_full_kv_attention_backend
    return chosen or get_default_attn_backend(server_args, use_mla_backend, model_config)


class VCTorchAttnBackend(TorchNativeAttnBackend):
    """See the module docstring. Forwards in which no request reads compressed rows run
    ``self.full_kv`` -- the SGLang backend of :func:`full_kv_backend_name` -- unchanged
    (SGLang's ``torch_native`` is this class's own base), decode CUDA graphs included:
    the graph protocol is the full-KV backend's, and SGLang's can-run gate skips the
    graphs for a batch that holds a compressed request (:meth:`holds_compressed`)."""

    decode_index: "DecodeIndex | None" = None  # this decode forward's index lists (Triton path)
    extend_lists: "ExtendLists | None" = None  # this extend forward's sizes on the host
    delegated: bool = False  # this forward runs the full-KV backend

    def __init__(self, model_runner):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        if getattr(pool, "is_quantized_kv_cache", False) or getattr(pool, "store_dtype", None) != getattr(pool, "dtype", None):
            raise ValueError("vc_torch: lossy serving needs an unquantized KV cache (no --kv-cache-dtype)")
        if self.use_sliding_window_kv_pool:
            raise ValueError("vc_torch: sliding-window (hybrid SWA) models are not supported")
        self.runtime = get_runtime(model_runner)
        self.translator = getattr(model_runner, "kv_index_translator", None)  # SGLang's KV-read plans
        self.full_kv_name = full_kv_backend_name(model_runner.server_args, model_runner.model_config,
                                                 model_runner.use_mla_backend)
        self.full_kv = self._make_full_kv_backend(model_runner, self.full_kv_name)
        if self.full_kv is not None:
            # what SGLang reads off the model runner's backend about the one doing the work
            self.attn_backend_list = [self.full_kv]
            for name in ("extend_dummy_seqs_capped_by_req_pool", "extend_attention_block_m"):
                if hasattr(self.full_kv, name):
                    setattr(self, name, getattr(self.full_kv, name))
        logger.info("sglang-vc: full-KV attention runs SGLang's %s backend; requests reading compressed "
                    "rows run the project's", self.full_kv_name)

    @staticmethod
    def _make_full_kv_backend(model_runner, name: str):
        """SGLang's backend ``name`` from its registry (None for ``torch_native``: this
        class is one)."""
        if name == "torch_native":
            return None
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        return ATTENTION_BACKENDS[name](model_runner)

    # ------------------------------------------------------------------ CUDA graphs

    def holds_compressed(self, forward_batch) -> bool:
        """Whether a request of this batch reads compressed rows (then it runs eagerly:
        SGLang's can-run gate asks, see :func:`.graphs.no_graph_for_compressed_batches`). From
        the host-side request ids, no device read."""
        compressed = self.runtime.compressed_rids()
        if not compressed:
            return False
        if forward_batch.rids is None:
            return True  # cannot tell: eager is always correct
        return not compressed.isdisjoint(forward_batch.rids)

    def _graph_backend(self):
        if self.full_kv is None:
            raise ValueError(f"{self.full_kv_name}: SGLang's torch_native backend does not capture CUDA "
                             "graphs; name another --vc-full-kv-attention-backend or pass "
                             "--cuda-graph-backend-decode disabled")
        return self.full_kv

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        backend = self._graph_backend()
        if not graphs.graph_gate_in_place():
            # without the gate a compressed batch would replay full-KV graphs over its
            # null slots: wrong output, so no graphs at all
            raise RuntimeError("decode CUDA graphs under vc_torch need sglang-vc's can-run gate on "
                               "DecodeCudaGraphRunner.can_run_graph, which is not applied (see "
                               "HookRegistry's log); pass --cuda-graph-backend-decode disabled")
        backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self._graph_backend().get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """A graph's capture or replay (eager forwards go through
        :meth:`init_forward_metadata`): only batches without compressed requests get
        here, and they are the full-KV backend's."""
        self.runtime.no_forward()
        self.decode_index = None
        self.delegated = True
        self._graph_backend().init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        self._graph_backend().init_forward_metadata_in_graph(forward_batch)

    def on_after_cuda_graph_warmup(self):
        self._graph_backend().on_after_cuda_graph_warmup()

    # ``shared_read_ends`` stays SGLang's conservative default, not the full-KV
    # backend's: a prefill's compression and the per-request attention read
    # ``req_to_token`` after the full-KV backend's own reads end.

    # ------------------------------------------------------------------ metadata

    def delegates(self, forward_batch, batch) -> bool:
        """Whether this forward's attention is SGLang's full-KV backend's: no request in
        it reads compressed rows. ``TARGET_VERIFY`` forwards are the speculative workers'
        own (their chains read staged or prefetched rows)."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or batch.any_compressed:
            return False
        return not (mode.is_extend() and self.extend_per_request())

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        batch = self.runtime.begin_forward(forward_batch)
        self.delegated = self.full_kv is not None and self.delegates(forward_batch, batch)
        if self.delegated:
            self.full_kv.init_forward_metadata(forward_batch)
            stats.add("attention", full_kv_backend_forwards=1)
        self.decode_index, self.own_decode = None, None
        if forward_batch.forward_mode.is_decode() and batch.any_compressed:
            stats.add("attention", project_attention_forwards=1)  # a request reads compressed rows
        if (forward_batch.forward_mode.is_decode() and batch.any_compressed and not batch.online
                and ext.backend_for(forward_batch.seq_lens) is ext.Backend.TRITON):
            own = [i for i, e in enumerate(batch.entries) if e is not None and self._decodes_own(e)]
            self.own_decode = self._build_own_decode(forward_batch, batch, own) if own else None
            if not own or self.own_decode is not None:
                self.decode_index = self._build_decode_index(forward_batch, batch, own)

    def _build_decode_index(self, forward_batch, batch, own: list[int]) -> DecodeIndex:
        """Every request's live pool rows and payloads (:func:`.decode_index.build`); the
        requests ``own`` decode their own way (:meth:`_own_decode_layer`), payloads included."""
        entries = batch.entries
        if own:
            entries = [None if i in own else e for i, e in enumerate(entries)]
        # the lengths as the host knows them (SGLang keeps them): no sync
        lens = forward_batch.seq_lens_cpu.tolist() if forward_batch.seq_lens_cpu is not None else None
        return decode_index.build(self.runtime, self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                  forward_batch.seq_lens, lens, [0 if e is None else e.row_start for e in batch.entries],
                                  entries)

    def _decodes_own(self, entry) -> bool:
        """Whether a subclass decodes this compressed request its own way
        (:meth:`_attend_compressed`; on the Triton path :meth:`_build_own_decode`)."""
        return False

    own_decode = None  # this decode forward's own-way requests, batched (Triton path)

    def _build_own_decode(self, forward_batch, batch, own: list[int]):
        """Per-forward state to decode requests ``own`` (indices in the batch) together in
        each layer (:meth:`_own_decode_layer`), or None: the batch takes the per-request
        loop."""
        return None

    def _own_decode_layer(self, q_, layer, out) -> None:
        """Write the own-way requests' attention of this layer into ``out [B, Hq, Dv]``."""
        raise NotImplementedError

    def _after_layer(self, layer) -> None:
        if layer.layer_id == self.runtime.last_layer:
            self.runtime.end_forward()

    # ------------------------------------------------------------------ extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        batch = self.runtime.batch
        per_request = batch is not None and (batch.any_compressed or self.extend_per_request())
        if self.delegated:
            o = self.full_kv.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        elif not per_request or layer.is_cross_attention:
            o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        else:
            o = self._forward_per_request(q, k, v, layer, forward_batch, save_kv_cache, extend=True)
        if batch is not None and batch.pending:
            self.runtime.compress_layer(layer.layer_id, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim))
        if batch is not None:
            self._after_layer(layer)
        return o

    # ------------------------------------------------------------------ decode

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        batch = self.runtime.batch
        if self.delegated:
            o = self.full_kv.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        elif batch is None or not batch.any_compressed or layer.is_cross_attention:
            o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        elif self.decode_index is not None:
            o = self._forward_decode_batched(q, k, v, layer, forward_batch, save_kv_cache)
        else:
            q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
            o = self._forward_per_request(q, k, v, layer, forward_batch, save_kv_cache, extend=False)
        if batch is not None:
            self._after_layer(layer)
        return o

    def _forward_decode_batched(self, q, k, v, layer, forward_batch, save_kv_cache):
        """One decode layer of the whole batch on the Triton path: one paged attention
        launch over the index lists of :meth:`_build_decode_index`, then each quantized
        request's payload attended from its packed codes and merged into its row. Equal to
        the per-request loop (the same rows, the same payload)."""
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.paged_decode(q_, layer, self.decode_index)
        if self.own_decode is not None:
            self._own_decode_layer(q_, layer, out)
        return out.to(q.dtype).reshape(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def paged_decode(self, q_, layer, idx: DecodeIndex):
        """One query per request over its live pool rows and payload (:func:`.decode_index.attend`)."""
        lid = layer.layer_id
        return decode_index.attend(q_, self.token_to_kv_pool.get_key_buffer(lid),
                                   self.token_to_kv_pool.get_value_buffer(lid), idx, lid, layer.scaling)

    # ------------------------------------------------------------------ per request

    def _forward_per_request(self, q, k, v, layer, forward_batch, save_kv_cache, *, extend: bool):
        if layer.qk_head_dim != layer.v_head_dim:
            o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        else:
            o = torch.empty_like(q)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        batch = self.runtime.batch
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        seq_lens = seq_lens.tolist()
        pool_idx = host_rows(forward_batch)
        q_lens = forward_batch.extend_seq_lens_cpu if extend else [1] * len(seq_lens)
        start = 0
        for i, seq_len in enumerate(seq_lens):
            t = q_lens[i]
            q_r = q_[start : start + t]
            entry = batch.entries[i]
            onl = batch.online.get(i)
            if entry is None:
                slots = req_to_token[pool_idx[i], :seq_len].to(torch.int64)
                k_r, v_r = kernels.gather_kv(k_buf, v_buf, slots)
                num_prefix, positions = 0, torch.arange(seq_len, device=slots.device)
            elif not extend and onl is None and (out := self._attend_compressed(q_r, entry, layer, seq_len)) is not None:
                o_[start : start + t] = out
                start += t
                continue
            else:
                k_r, v_r, num_prefix, positions = self.runtime.request_kv(entry, layer.layer_id, seq_len, onl)
            o_[start : start + t] = kernels.attend(
                q_r, k_r, v_r, num_prefix=num_prefix, key_positions=positions,
                q_start=seq_len - t, scale=layer.scaling, enable_gqa=gqa,
                q_positions=self.query_positions(i) if extend else None,
            )
            if onl is not None:
                self.runtime.online_update(layer.layer_id, onl, q_r, k_r, v_r)
            start += t
        return o

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                 scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                 sliding_window_size=None):
        """SGLang's ``torch_native`` extend (this class's base, the CPU's full-KV backend)
        pads each request's queries to its whole length, prefix included, and runs causal
        SDPA over all of them: ``O(L^2)`` per request however few tokens it adds (a verify
        window, a prefill chunk over a cached prefix). Here only the added queries attend,
        the causal mask shifted by the prefix: the same output. Masks other than a plain
        causal one (sliding window, cross or encoder attention) stay SGLang's."""
        if (encoder_lens is not None or is_cross_attn or not causal
                or (sliding_window_size is not None and sliding_window_size > -1)):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        lists = self.extend_lists
        if lists is None or lists.seq_lens is not seq_lens:
            lists = ExtendLists(seq_lens, req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
                                extend_prefix_lens.tolist())
        start = 0
        for row, kv_len, t, prefix in zip(lists.rows, lists.kv_lens, lists.q_lens, lists.prefixes):
            k, v = kernels.gather_kv(k_cache, v_cache, req_to_token[row, :kv_len].to(torch.int64))
            output[start : start + t] = kernels.attend_sdpa(
                query[start : start + t], k, v, num_prefix=0, key_positions=torch.arange(kv_len, device=k.device),
                q_start=prefix, scale=scaling, enable_gqa=enable_gqa, last_position=kv_len - 1)
            start += t
        return output

    def extend_per_request(self) -> bool:
        """Whether this extend forward must run the per-request loop although no request
        in it is compressed (a subclass whose queries are not the row's last tokens)."""
        return False

    def query_positions(self, i: int):
        """Positions of request ``i``'s extend queries when they are not its row's last
        ``t`` tokens (None: they are)."""
        return None

    def _attend_compressed(self, q, entry, layer, seq_len: int):
        """The decode attention of one compressed request (``q [1, Hq, D]`` at position
        ``seq_len - 1``) on the Triton path, or None for the runtime's torch path (gather
        its compressed rows, dequantize its payload, then attend). Subclasses may attend
        their own way."""
        if ext.backend_for(q) is not ext.Backend.TRITON:
            return None
        lid = layer.layer_id
        slots, positions = kernels.live_rows(self.req_to_token_pool.req_to_token[entry.req_pool_idx],
                                             entry.row_start, seq_len)
        return kernels.attend_pool(q, self.token_to_kv_pool.get_key_buffer(lid),
                                   self.token_to_kv_pool.get_value_buffer(lid), slots, positions,
                                   q_start=seq_len - 1, scale=layer.scaling,
                                   payload=self.runtime.packed_payload(entry, lid))
