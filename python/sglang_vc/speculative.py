"""Speculative algorithms that sglang-vc adds (VERICACHE, SPECACHE): their registration
with SGLang's registry, and their workers on the CPU platform."""

from __future__ import annotations

from typing import Callable, Optional

_WORKERS: dict[str, str] = {
    "VERICACHE": "sglang_vc.vericache.worker:VeriCacheWorker",
    "SPECACHE": "sglang_vc.specache.worker:SpeCacheWorker",
    "VERICACHE_REMOTE": "sglang_vc.vericache.remote.worker:RemoteVerifyWorker",
}


def supported_algorithms() -> set[str]:
    return set(_WORKERS)


def worker_cls_for(algorithm: str):
    import pkgutil

    path = _WORKERS.get(algorithm.upper())
    return pkgutil.resolve_name(path) if path else None


PROJECT_ALGORITHMS: set[str] = set()  # the names registered below


def register_algorithm(name: str, attention_backend: Optional[str], create_backend: Optional[Callable],
                       validate_server_args: Callable, handle_server_args: Callable,
                       supports_overlap: bool = False, grammar_overlap: bool = False) -> None:
    """Register algorithm ``name`` and the attention backend its worker forwards with
    (None: SGLang's own), unless already registered. ``supports_overlap``: its worker
    keeps SGLang's overlap contract (publishes each forward's lengths, relays its last
    tokens through the future map). ``grammar_overlap``: its worker advances the grammars
    itself with the scheduler's grammar barrier (SGLang then leaves grammar batches
    overlapped). The worker class is imported only when SGLang builds it."""
    PROJECT_ALGORITHMS.add(name.upper())
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if attention_backend is not None and attention_backend not in ATTENTION_BACKENDS:
        register_attention_backend(attention_backend)(create_backend)
    if attention_backend is not None and attention_backend not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([attention_backend])
    if get_spec(name) is None:
        SpeculativeAlgorithm.register(
            name,
            supports_overlap=supports_overlap,
            validate_server_args=validate_server_args,
            spec_class=_spec_class(name, handle_server_args, grammar_overlap),
        )(lambda server_args: worker_cls_for(name))


def config_error(name: str, message: str):
    """The usage error of algorithm ``name``'s flags (the launcher exits 2 with it)."""
    from sglang_vc.config import ConfigError

    return ConfigError(f"--speculative-algorithm {name}: {message}")


def check_raw_flags(server_args, attention_backend: str) -> Optional[str]:
    """What the user's own flags contradict in what a project algorithm needs (its
    attention backend, the ``vc`` radix cache, page size 1, one chain); None if nothing."""
    raw = getattr(server_args, "_raw_input", None) or {}
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = raw.get(field)
        if value not in (None, attention_backend):
            return f"forwards with the {attention_backend} attention backend; got {field}={value}"
    if raw.get("radix_cache_backend") not in (None, "vc"):
        return "needs --radix-cache-backend vc"
    if raw.get("page_size") not in (None, 1):
        return "needs --page-size 1"
    if (raw.get("speculative_eagle_topk") or 1) != 1:
        return "forwards a single chain: --speculative-eagle-topk must be 1"
    return None


def resolve_flags(server_args, attention_backend: str, overlap: bool = False) -> None:
    """The SGLang flags every project algorithm runs with: no mixed chunks, one chain,
    its attention backend over the ``vc`` radix cache, page size 1 (compressed rows are
    token slots), and a synchronous worker (no overlap schedule) unless ``overlap``
    (the algorithm's worker keeps SGLang's overlap contract). Turning off what was on
    is a warning users see (:mod:`sglang_vc.notices`)."""
    from sglang_vc.notices import switched_off

    algorithm = f"--speculative-algorithm {server_args.speculative_algorithm}"
    if not overlap and not server_args.disable_overlap_schedule:
        switched_off("the overlap scheduler", algorithm,
                     "its worker runs each decode iteration's forwards synchronously and commits "
                     "tokens the next iteration's plan depends on")
    if server_args.enable_mixed_chunk:
        switched_off("mixed chunks (--enable-mixed-chunk)", algorithm,
                     "its decode iterations are draft and verify forwards of their own, not mixable "
                     "with a prefill chunk")
    server_args.speculative_eagle_topk = 1
    if not overlap:
        server_args.disable_overlap_schedule = True
    server_args.enable_mixed_chunk = False
    server_args.attention_backend = attention_backend
    server_args.radix_cache_backend = "vc"
    server_args.page_size = 1


def _spec_class(name: str, handle: Callable, grammar_overlap: bool):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class SpecAlgo(CustomSpecAlgo):
        def handle_server_args(self, server_args) -> None:
            handle(server_args)

        def supports_grammar_overlap(self) -> bool:
            return grammar_overlap

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
