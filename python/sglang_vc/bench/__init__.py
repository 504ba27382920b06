"""Benchmarks: python -m sglang_vc.bench.NAME ... --json OUT."""


def default_device() -> str:
    """The device a serving benchmark's servers run on when ``--device`` is not given:
    the GPU where torch sees one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
