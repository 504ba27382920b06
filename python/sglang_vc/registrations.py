"""Registrations with SGLang's own registries (attention backends, speculative
algorithms, radix caches). Idempotent: SGLang loads plugins once per process."""

_done = False


def register_all() -> None:
    global _done
    if _done:
        return
    _done = True
