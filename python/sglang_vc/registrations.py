"""Registrations with SGLang's own registries (attention backends, speculative
algorithms, radix caches). Idempotent: SGLang loads plugins once per process."""

_done = False


def register_all() -> None:
    global _done
    if _done:
        return
    _done = True
    from sglang_vc import lossy

    lossy.register()  # attention backend "vc_torch", radix cache "vc"

    from sglang_vc.vericache import worker_spec

    worker_spec.register()  # speculative algorithm "VERICACHE", attention backend "vc_verify"

    from sglang.srt.mem_cache.registry import register_radix_cache_backend

    register_radix_cache_backend("evicpress", _evicpress_factory)  # EvicPress tiers


def _evicpress_factory(ctx):
    from sglang_vc.evicpress.radix import evicpress_factory

    return evicpress_factory(ctx)
