"""Out-of-tree SGLang platform for machines without CUDA.

SGLang discovers it through the ``sglang.srt.platforms`` entry point: ``activate`` runs at
``import sglang`` and returns the platform class path when this machine has no CUDA device,
or None so that SGLang keeps its own CUDA platform on a GPU machine.
"""


def activate():
    import torch

    if torch.cuda.is_available():
        return None
    return "sglang_vc.platform.cpu.TorchCpuPlatform"
