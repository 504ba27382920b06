"""Benchmarks: python -m sglang_vc.bench.NAME ... --json OUT."""


def add_device_argument(parser) -> None:
    """``--device`` of a serving benchmark: where its servers run, by default the GPU where
    torch sees one, else the CPU."""
    import torch

    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"),
                        help="where the servers run (default: cuda where torch sees a GPU, else cpu)")
