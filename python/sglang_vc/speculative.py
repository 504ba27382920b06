"""Speculative algorithms that sglang-vc adds, and their workers on the CPU platform."""

_WORKERS: dict[str, str] = {
    "VERICACHE": "sglang_vc.vericache.worker:VeriCacheWorker",
}


def supported_algorithms() -> set[str]:
    return set(_WORKERS)


def worker_cls_for(algorithm: str):
    import pkgutil

    path = _WORKERS.get(algorithm.upper())
    return pkgutil.resolve_name(path) if path else None
