"""Exact simulation of a lossy (compressed) KV cache inside HF transformers, pure torch.

Used by the fidelity lab (``python -m sglang_vc.bench.fidelity``); no SGLang server.

How the lossy cache is simulated
--------------------------------
The model runs with the attention implementation ``"vc_lossy"`` registered here in
transformers' ``AttentionInterface`` (and ``eager_mask`` in ``AttentionMaskInterface``).
It is transformers' *eager* attention, op for op, plus one extra step: when a
:class:`Controller` is attached to the model and a :class:`LossyKV` is active, the
attention logits of kv head ``h`` at cache positions that ``h`` does not keep are set to
``-inf`` (per layer and per kv head, on top of the causal mask; the q heads of a GQA group
share their kv head's mask). Softmax over the kept positions only is exactly attention
over the compacted cache of a token-dropping method: the kept keys keep their RoPE
positions, new tokens continue at the original positions. With nothing hidden the masked
fill is a no-op, so keep ratio 1.0 is bit-identical to plain eager attention (tested).

* Token dropping: after the prompt's prefill with full KV, the compressor's
  ``kept_positions`` of each layer become that layer's per-head visibility over the
  prompt; generated tokens are always visible (except for online methods, below).
* Quantization: the cached prompt K/V are replaced by the compressor's dequantized values
  (``decompress``; its full-precision residual window stays exact). Generated tokens stay
  full precision (KIVI would quantize them in groups once its residual overflows).
* Online methods (``mode == "online"``, H2O): after every layer's attention during decode,
  the compressor's ``update`` is called with the step's queries and the key rows the
  queries attended to (kept rows + new rows, with their absolute positions, H2O's keyword
  API ``positions=``/``req_ids=``); the positions it evicts are hidden from then on.

Queries for the methods that need them are captured inside the attention function (post
RoPE, exactly what attention multiplies with the keys) while :meth:`Session.prefill`
runs with ``capture=True``; the new keys of those tokens are captured too (KVzip's
``recon_keys``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

ATTN_IMPL = "vc_lossy"

_registered = False


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``[B, Hkv, L, D]`` -> ``[B, Hkv * n_rep, L, D]``, q head i reads kv head i // n_rep
    (transformers' ``repeat_kv``)."""
    b, h, n, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def lossy_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """transformers' eager attention + the active per-layer, per-kv-head visibility mask.

    ``query [B, Hq, q, D]`` and ``key``/``value [B, Hkv, L, D]`` (the whole cache after
    this step's update), all post-RoPE.
    """
    ctl: Controller | None = getattr(module, "_vc_controller", None)
    if ctl is not None and ctl.specache is not None:  # SpeCache's attention (bench.specache_hf)
        return ctl.specache.attend(module.layer_idx, query, key, value, scaling), None
    if ctl is not None and ctl.fuse is not None:  # SpecCache's fused prefill (bench.speccache_hf)
        return ctl.fuse.attend(module.layer_idx, query, key, value, scaling, module.num_key_value_groups), None
    groups = module.num_key_value_groups
    if ctl is not None and ctl.capturing:
        ctl._capture(module.layer_idx, query, key)
    key_states = _repeat_kv(key, groups)
    value_states = _repeat_kv(value, groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    if ctl is not None and ctl.lossy is not None:
        vis = ctl.lossy.visible[module.layer_idx]
        if vis is not None:
            n = min(vis.shape[1], attn_weights.shape[-1])
            hide = ~vis[:, :n].repeat_interleave(groups, dim=0)  # [Hq, n]
            attn_weights[..., :n].masked_fill_(hide[None, :, None, :], float("-inf"))
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    if ctl is not None and ctl.lossy is not None and ctl.lossy.online:
        ctl.lossy.after_attention(module.layer_idx, query, key)
    return attn_output, attn_weights


def register() -> None:
    """Register ``"vc_lossy"`` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPL, lossy_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPL, eager_mask)
    _registered = True


def load_model(model_dir: str, dtype: torch.dtype | str = torch.float32):
    """An HF causal LM in eval mode running the ``vc_lossy`` attention."""
    from transformers import AutoModelForCausalLM

    register()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    model.set_attn_implementation(ATTN_IMPL)
    return model.eval()


# ----------------------------------------------------------------------------- lossy KV


@dataclass
class LossyKV:
    """What a compressor did to one request's cache, for every layer.

    ``visible[l]``: bool ``[Hkv, n]``, which of the first ``n`` cache positions kv head ``h``
    still attends to (positions ``>= n`` are visible); ``None`` = all visible.
    ``k_prompt[l]`` / ``v_prompt[l]``: ``[1, Hkv, T, D]`` replacing the cached prompt K/V
    (quantization), or ``None``. ``compressor`` / ``req_id``: the online compressor whose
    ``update`` runs after each layer's attention (``None`` for offline methods).
    """

    visible: list[Tensor | None]
    k_prompt: list[Tensor | None]
    v_prompt: list[Tensor | None]
    compressor: Any = None
    req_id: Any = None
    updates: int = field(default=0)

    @property
    def online(self) -> bool:
        return self.compressor is not None

    @classmethod
    def identity(cls, num_layers: int) -> "LossyKV":
        return cls([None] * num_layers, [None] * num_layers, [None] * num_layers)

    def snapshot(self) -> "LossyKV":
        """An independent copy (the online compressor's state included)."""
        return LossyKV(
            [None if v is None else v.clone() for v in self.visible],
            self.k_prompt,  # never modified
            self.v_prompt,
            copy.deepcopy(self.compressor),
            self.req_id,
            self.updates,
        )

    def after_attention(self, layer_idx: int, query: Tensor, key: Tensor) -> None:
        """Online step: feed this layer's new queries to the compressor, hide its evictions."""
        q_len, total = query.shape[2], key.shape[2]
        keys = key[0]  # [Hkv, L, D]
        h = keys.shape[0]
        vis = self.visible[layer_idx]
        prev = total - q_len
        if vis is None:
            vis = torch.ones(h, prev, dtype=torch.bool, device=key.device)
        if vis.shape[1] < total:  # the new tokens are visible
            vis = torch.cat([vis, vis.new_ones(h, total - vis.shape[1])], dim=1)
        kept_old = vis[:, :prev]
        counts = kept_old.sum(dim=1)
        if int(counts.min()) != int(counts.max()):
            raise RuntimeError(f"online compressor: heads of layer {layer_idx} keep different counts {counts.tolist()}")
        old_pos = kept_old.nonzero()[:, 1].view(h, -1)  # ascending per head
        new_pos = torch.arange(prev, total, device=key.device).expand(h, q_len)
        pos = torch.cat([old_pos, new_pos], dim=1)  # [H, m]
        rows = keys.gather(1, pos.unsqueeze(-1).expand(-1, -1, keys.shape[-1])).transpose(0, 1)  # [m, H, D]
        q = query[0].transpose(0, 1)  # [q_len, Hq, D]
        drops = self.compressor.update(
            layer_idx, q, [rows], None, req_offsets=[0, q_len], req_ids=[self.req_id], positions=[pos]
        )[0]
        if drops.numel():
            vis = vis.clone()
            vis.scatter_(1, drops.to(torch.long), False)
        self.visible[layer_idx] = vis
        self.updates += 1


# ----------------------------------------------------------------------------- session


class Controller:
    """Attached to every attention module of a model (``module._vc_controller``).

    ``lossy``: the active :class:`LossyKV` (``None``: plain attention); ``specache``: a
SpeCache simulation that replaces the attention while it decodes; ``fuse``: SpecCache's
    selective-recompute prefill, likewise.
    ``capturing``: while True, each layer's queries and new keys are recorded.
    """

    def __init__(self, model):
        self.lossy: LossyKV | None = None
        self.specache = None  # a bench.specache_hf.SpeCacheSim while one decodes
        self.fuse = None  # a bench.speccache_hf.FusedPrefill while one prefills
        self.capturing = False
        self._q: list[list[Tensor]] = []
        self._k: list[list[Tensor]] = []
        self.attn_modules = []
        for mod in model.modules():
            if hasattr(mod, "layer_idx") and hasattr(mod, "num_key_value_groups") and hasattr(mod, "q_proj"):
                mod._vc_controller = self
                self.attn_modules.append(mod)
        if not self.attn_modules:
            raise ValueError("no attention modules with layer_idx/num_key_value_groups found in the model")
        self.num_layers = len(self.attn_modules)
        self._q = [[] for _ in range(self.num_layers)]
        self._k = [[] for _ in range(self.num_layers)]

    def _capture(self, layer_idx: int, query: Tensor, key: Tensor) -> None:
        q_len = query.shape[2]
        self._q[layer_idx].append(query[0].transpose(0, 1).clone())  # [q, Hq, D]
        self._k[layer_idx].append(key[0, :, key.shape[2] - q_len :].transpose(0, 1).clone())  # [q, Hkv, D]

    def take_captured(self) -> tuple[list[Tensor], list[Tensor]]:
        qs = [torch.cat(x) if x else None for x in self._q]
        ks = [torch.cat(x) if x else None for x in self._k]
        self._q = [[] for _ in range(self.num_layers)]
        self._k = [[] for _ in range(self.num_layers)]
        return qs, ks

    def detach(self) -> None:
        for mod in self.attn_modules:
            if getattr(mod, "_vc_controller", None) is self:
                del mod._vc_controller


def cache_kv(cache) -> list[tuple[Tensor, Tensor]]:
    """Per layer ``(keys, values)`` ``[1, Hkv, L, D]`` of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def build_cache(base: Sequence[tuple[Tensor, Tensor]], length: int, lossy: LossyKV | None = None):
    """A fresh ``DynamicCache`` holding the first ``length`` positions of ``base`` (copied,
    ``base`` is never modified), with the prompt K/V replaced where ``lossy`` says so."""
    from transformers import DynamicCache

    data = []
    for li, (k, v) in enumerate(base):
        if k.shape[2] < length:
            raise ValueError(f"build_cache: base layer {li} has {k.shape[2]} positions, {length} requested")
        k, v = k[:, :, :length], v[:, :, :length]
        if lossy is not None and lossy.k_prompt[li] is not None:
            t = lossy.k_prompt[li].shape[2]
            k = torch.cat([lossy.k_prompt[li], k[:, :, t:]], dim=2)
            v = torch.cat([lossy.v_prompt[li], v[:, :, t:]], dim=2)
        data.append((k, v))
    return DynamicCache(data)


class Session:
    """A model with a :class:`Controller`: prefill (optionally capturing queries) and
    one-token decode steps on a cache, under a chosen :class:`LossyKV`."""

    def __init__(self, model, prefill_chunk: int = 512):
        if model.config._attn_implementation != ATTN_IMPL:
            register()
            model.set_attn_implementation(ATTN_IMPL)
        self.model = model
        self.ctl = Controller(model)
        self.prefill_chunk = prefill_chunk
        cfg = model.config
        self.num_layers = self.ctl.num_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_q_heads = cfg.num_attention_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", None)

    def activate(self, lossy: LossyKV | None) -> None:
        self.ctl.lossy = lossy

    @torch.no_grad()
    def prefill(self, ids: Sequence[int], cache=None, capture: bool = False):
        """Run ``ids`` (in chunks) on ``cache`` (a new one if ``None``) with the active lossy
        state. Returns ``(cache, last_logits float32 [V], queries, new_keys)``; the last two
        are per-layer ``[len(ids), H, D]`` tensors when ``capture`` else ``None``."""
        from transformers import DynamicCache

        if cache is None:
            cache = DynamicCache(config=self.model.config)
        ids = list(ids)
        self.ctl.capturing = capture
        try:
            logits = None
            for s in range(0, len(ids), self.prefill_chunk):
                chunk = torch.tensor([ids[s : s + self.prefill_chunk]])
                out = self.model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits = out.logits[0, -1].float()
        finally:
            self.ctl.capturing = False
        qs, ks = self.ctl.take_captured() if capture else (None, None)
        return cache, logits, qs, ks

    @torch.no_grad()
    def forward(self, cache, tokens: Sequence[int]) -> Tensor:
        """Run ``tokens`` in one forward on ``cache`` (appended in place); the logits of
        every position, float32 ``[len(tokens), V]`` (row i predicts the token after i)."""
        out = self.model(input_ids=torch.tensor([[int(t) for t in tokens]]), past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    @torch.no_grad()
    def step(self, cache, token: int) -> Tensor:
        """Decode one token on ``cache`` (appended in place); next-token logits float32 [V]."""
        out = self.model(input_ids=torch.tensor([[int(token)]]), past_key_values=cache, use_cache=True)
        return out.logits[0, -1].float()


# ----------------------------------------------------------------------------- compression


@dataclass
class PromptCapture:
    """What the prefill (and, for KVzip, the reconstruction pass) recorded, per layer."""

    k: list[Tensor]  # [T, Hkv, D] post-RoPE prompt keys
    v: list[Tensor]
    queries: list[Tensor] | None = None  # [T, Hq, D] prompt queries
    recon_queries: list[Tensor] | None = None  # [T_r, Hq, D]
    recon_keys: list[Tensor] | None = None  # [T_r, Hkv, D]


def compress_prompt(comp, ratio_or_bits, cap: PromptCapture, *, snapkv_window: int = 32,
                    req_id: Any = None) -> tuple[LossyKV, dict]:
    """Compress every layer of the prompt with ``comp``; returns the lossy state and stats
    (kept fraction for token dropping, stored bits per element for quantization)."""
    n_layers = len(cap.k)
    lossy = LossyKV.identity(n_layers)
    need = getattr(comp, "needs_queries", None)
    kept_frac, bpe = [], []
    for li in range(n_layers):
        k, v = cap.k[li], cap.v[li]
        t = k.shape[0]
        kwargs: dict[str, Any] = {}
        if need is None:
            queries = None
        elif need == "observation_window":
            if cap.queries is None:
                raise ValueError(f"{comp.name}: prompt queries were not captured")
            w = max(1, min(snapkv_window, t - 1))
            queries = cap.queries[li][-w:]
        elif need == "prefill":
            if cap.queries is None:
                raise ValueError(f"{comp.name}: prompt queries were not captured")
            queries = cap.queries[li]
        elif need == "reconstruction":
            if cap.recon_queries is None:
                raise ValueError(f"{comp.name}: reconstruction queries were not captured")
            queries = cap.recon_queries[li]
            if "recon_keys" in getattr(comp, "extra_inputs", ()):
                kwargs["recon_keys"] = cap.recon_keys[li]
        else:
            raise ValueError(f"{comp.name}: unsupported needs_queries={need!r}")
        ckv = comp.compress(li, k, v, ratio_or_bits, queries=queries, req_id=req_id, **kwargs)
        if ckv.scenario == "token_dropping":
            vis = torch.zeros(k.shape[1], t, dtype=torch.bool, device=k.device)
            vis.scatter_(1, ckv.kept_positions.to(torch.long), True)
            lossy.visible[li] = vis
            kept_frac.append(ckv.n_keep / t)
            bpe.append(ckv.bits_per_element(include_positions=False))
        else:
            kd, vd, _pos = comp.decompress(ckv)
            lossy.k_prompt[li] = kd.transpose(0, 1).unsqueeze(0).contiguous()
            lossy.v_prompt[li] = vd.transpose(0, 1).unsqueeze(0).contiguous()
            kept_frac.append(1.0)
            bpe.append(ckv.bits_per_element())
    if getattr(comp, "mode", "offline") == "online":
        lossy.compressor = comp
        lossy.req_id = req_id
    stats = {
        "kept_fraction": sum(kept_frac) / len(kept_frac),
        "stored_bits_per_element": sum(bpe) / len(bpe),
    }
    return lossy, stats
