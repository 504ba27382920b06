"""Interpreter start-up shim, loaded by ``sglang_vc_startup.pth`` in the project's venv.

The PyPI torchvision wheel is a CUDA build; with the CPU torch it dies on import with
``operator torchvision::nms does not exist``. transformers and sglang both import it, so a
plain ``from transformers import AutoTokenizer`` fails in any process of this environment.
Defining the two operator schemas before torchvision loads fixes it. It has to happen at
start-up (users tokenize and run reference models in their own processes), but lazily: a
meta-path finder acts only when torchvision is first imported, so pip and other tools in
the venv do not pay for importing torch.
"""

import sys


class _TorchvisionSchemaFinder:
    """Defines ``torchvision::nms``/``qnms`` right before torchvision is imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        _define_schemas()
        return None  # let the regular finders import torchvision


def _define_schemas() -> None:
    import torch

    if torch.version.cuda or torch.version.hip:
        return  # a GPU torch build: torchvision's own extension registers the ops
    global _torchvision_lib  # keep the Library alive: dropping it unregisters the ops
    _torchvision_lib = torch.library.Library("torchvision", "FRAGMENT")
    _torchvision_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def install() -> None:
    if "torchvision" not in sys.modules and not any(
        isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _TorchvisionSchemaFinder())


install()
