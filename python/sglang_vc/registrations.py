"""Registrations with SGLang's own registries (attention backends, speculative
algorithms, radix caches) and of the mechanisms' flag groups with the launcher's config.
Idempotent: SGLang loads plugins once per process."""

_done = False


def register_flag_groups() -> None:
    """Each mechanism's ``flags`` module registers its flag family when imported."""
    from sglang_vc import storage_link as _storage_link  # noqa: F401
    from sglang_vc.evicpress import flags as _evicpress_flags  # noqa: F401
    from sglang_vc.specache import flags as _specache_flags  # noqa: F401
    from sglang_vc.speccache import flags as _speccache_flags  # noqa: F401
    from sglang_vc.vericache import flags as _vericache_flags  # noqa: F401


def register_all() -> None:
    global _done
    if _done:
        return
    _done = True
    register_flag_groups()
    from sglang_vc import kvruntime

    kvruntime.register()  # attention backend "vc_torch", radix cache "vc"

    from sglang_vc.vericache import worker_spec

    worker_spec.register()  # speculative algorithm "VERICACHE", attention backend "vc_verify"

    from sglang_vc.vericache.remote import spec as remote_spec

    remote_spec.register()  # speculative algorithm "VERICACHE_REMOTE" (SGLang's attention backend)

    from sglang_vc.specache import worker_spec as specache_spec

    specache_spec.register()  # speculative algorithm "SPECACHE", attention backend "specache"

    from sglang_vc import speccache

    speccache.register()  # attention backend "vc_speccache", radix cache "speccache"

    from sglang.srt.mem_cache.registry import register_radix_cache_backend

    register_radix_cache_backend("evicpress", _evicpress_factory)  # EvicPress tiers


def _evicpress_factory(ctx):
    from sglang_vc.evicpress.radix import evicpress_factory

    return evicpress_factory(ctx)
