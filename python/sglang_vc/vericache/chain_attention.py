"""Attention backend ``vc_chain``: ``vc_torch`` (SGLang's ``torch_native`` backend,
attending only an extend's new queries) plus chain ``TARGET_VERIFY`` forwards, for
``VERICACHE_REMOTE``'s lossless tiering on the CPU.

A tiering verify forwards each request's tokens after its exact prefix as one chain
(:meth:`~sglang_vc.spec_worker.ChainSpecWorker.ragged_verify_input`). A chain's mask is
causal, so the forward is an ordinary causal extend (prefix = ``seq_lens``, extend = the
request's verify tokens), which is what this backend runs it as. SGLang's
``torch_native`` backend has no ``TARGET_VERIFY`` of its own (it reads the extend
lengths a verify batch does not carry); on a GPU the server keeps SGLang's backend
(FlashInfer runs ``TARGET_VERIFY`` itself).
"""

from __future__ import annotations

import copy

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang_vc.kvruntime.backend import VCTorchAttnBackend


def verify_lens(spec_info, bs: int) -> list[int]:
    """Tokens each request forwards in this verify: SGLang's ragged layout, or the
    uniform draft width."""
    layout = getattr(spec_info, "ragged_verify_layout", None)
    if layout is not None and layout.verify_lens_cpu is not None:
        return list(layout.verify_lens_cpu)
    return [spec_info.draft_token_num] * bs


def extend_view(forward_batch):
    """A chain ``TARGET_VERIFY`` forward batch as an ordinary causal extend (a shallow
    copy: prefix = committed tokens, extend = the forwarded window)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dev = forward_batch.seq_lens.device
    seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens.cpu()
    pre = [int(s) for s in seq_lens.tolist()]
    lens = verify_lens(forward_batch.spec_info, len(pre))
    view = copy.copy(forward_batch)
    view.forward_mode = ForwardMode.EXTEND
    view.spec_info = None
    view.seq_lens_cpu = torch.tensor([a + b for a, b in zip(pre, lens)], dtype=torch.int64)
    view.seq_lens = to_device(view.seq_lens_cpu.to(forward_batch.seq_lens.dtype), dev)
    view.extend_prefix_lens_cpu, view.extend_seq_lens_cpu = pre, lens
    view.extend_prefix_lens = to_device(torch.tensor(pre, dtype=torch.int32), dev)
    view.extend_seq_lens = to_device(torch.tensor(lens, dtype=torch.int32), dev)
    return view


class ChainVerifyAttnBackend(VCTorchAttnBackend):
    _view = None  # this forward's extend view (a TARGET_VERIFY forward only)

    def init_forward_metadata(self, forward_batch):
        self._view = extend_view(forward_batch) if forward_batch.forward_mode.is_target_verify() else None
        super().init_forward_metadata(self._view or forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if forward_batch.forward_mode.is_target_verify():
            forward_batch = self._view
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


def create(model_runner):
    return ChainVerifyAttnBackend(model_runner)
