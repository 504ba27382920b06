"""Speculative algorithms that sglang-vc adds (VERICACHE, SPECACHE): their registration
with SGLang's registry, and their workers on the CPU platform."""

from __future__ import annotations

from typing import Callable

_WORKERS: dict[str, str] = {
    "VERICACHE": "sglang_vc.vericache.worker:VeriCacheWorker",
    "SPECACHE": "sglang_vc.specache.worker:SpeCacheWorker",
}


def supported_algorithms() -> set[str]:
    return set(_WORKERS)


def worker_cls_for(algorithm: str):
    import pkgutil

    path = _WORKERS.get(algorithm.upper())
    return pkgutil.resolve_name(path) if path else None


def register_algorithm(name: str, attention_backend: str, create_backend: Callable,
                       validate_server_args: Callable, handle_server_args: Callable) -> None:
    """Register algorithm ``name`` (synchronous, no overlap schedule) and the attention
    backend its worker forwards with, unless already registered. The worker class is
    imported only when SGLang builds it."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if attention_backend not in ATTENTION_BACKENDS:
        register_attention_backend(attention_backend)(create_backend)
    if attention_backend not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([attention_backend])
    if get_spec(name) is None:
        SpeculativeAlgorithm.register(
            name,
            supports_overlap=False,
            validate_server_args=validate_server_args,
            spec_class=_spec_class(name, handle_server_args),
        )(lambda server_args: worker_cls_for(name))


def _spec_class(name: str, handle: Callable):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class SpecAlgo(CustomSpecAlgo):
        def handle_server_args(self, server_args) -> None:
            handle(server_args)

        # Methods of SGLang's SpeculativeAlgorithm enum that CustomSpecAlgo lacks in
        # 0.5.23 but the scheduler calls on any algorithm.
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            from sglang.srt.platforms import current_platform

            if not current_platform.is_out_of_tree():
                return None
            return current_platform.get_speculative_worker_cls(algorithm=self.name)

        def create_worker(self, server_args):
            return self.get_platform_worker_cls() or super().create_worker(server_args)

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                              needs_confidence_relay: bool = False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                             needs_confidence_relay)

    SpecAlgo.__name__ = SpecAlgo.__qualname__ = f"{name.title()}SpecAlgo"
    return SpecAlgo
