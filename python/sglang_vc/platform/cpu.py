"""A pure-torch CPU platform: every op SGLang needs runs as plain torch on the CPU.

SGLang's in-tree CPU engine needs a CPU build of sgl-kernel that PyPI does not carry, so
this platform is out-of-tree (``PlatformEnum.OOT``): SGLang then routes every fused op to
its ``forward_native`` torch path (dispatch key ``native``) and never assumes CUDA.
"""

import functools
import logging

import psutil

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger(__name__)

# Share of the available RAM given to the KV pool when the user does not size it.
KV_POOL_RAM_FRACTION = 0.05
MIN_KV_POOL_TOKENS = 4096


class TorchCpuPlatform(CpuDeviceMixin, SRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()  # no triton, no graphs, no sgl-kernel transfers

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def apply_server_args_defaults(self, server_args) -> None:
        # SGLang's scheduler polls its sockets in a busy loop when idle; on a CPU host that
        # steals a core from the model (and from every other process) for nothing.
        server_args.sleep_on_idle = True
        if server_args.max_total_tokens is None:
            # SGLang sizes the pool from "device memory" = all RAM (about 9 GB on 24 GiB);
            # on a shared host a small fixed share of what is free is the sane default.
            server_args.max_total_tokens = _kv_pool_tokens_from_free_ram(server_args)

    def get_kv_pool_cls(self, *, kind):
        # Speculative decoding builds the pool with enable_kv_cache_copy, whose warmup
        # launches a Triton kernel; on CPU the pool moves KV with SGLang's torch move.
        return _torch_mha_pool_cls() if kind == "mha" else None

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        from sglang_vc.speculative import supported_algorithms

        return algorithm.upper() in supported_algorithms()

    def get_speculative_worker_cls(self, algorithm: str):
        from sglang_vc.speculative import worker_cls_for

        return worker_cls_for(algorithm)


@functools.cache
def _torch_mha_pool_cls():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class TorchMHATokenToKVPool(MHATokenToKVPool):
        """SGLang's MHA pool whose KV moves (speculative decoding) use the native torch
        path instead of the Triton tiled copy."""

        def _init_kv_copy_and_warmup(self):
            self._kv_copy_config = None
            self.use_native_move_kv_cache = True

    return TorchMHATokenToKVPool


def _kv_pool_tokens_from_free_ram(server_args) -> int:
    try:
        from sglang.srt.utils.hf_transformers_utils import get_config

        config = get_config(
            server_args.model_path, trust_remote_code=server_args.trust_remote_code
        )
        text = getattr(config, "text_config", config)
        head_dim = getattr(text, "head_dim", None) or (
            text.hidden_size // text.num_attention_heads
        )
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        bytes_per_elem = 2 if server_args.dtype in ("bfloat16", "float16", "half") else 4
        per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * bytes_per_elem
    except Exception as exc:  # unknown config layout: fall back to a modest pool
        logger.warning("Could not size the KV pool from the model config (%s)", exc)
        return 16384
    budget = psutil.virtual_memory().available * KV_POOL_RAM_FRACTION
    context = getattr(text, "max_position_embeddings", 8192) or 8192
    tokens = int(budget // per_token)
    return max(MIN_KV_POOL_TOKENS, min(tokens, 4 * context))
