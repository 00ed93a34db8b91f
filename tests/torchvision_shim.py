"""Let ``import torchvision`` succeed on a CPU-only torch when the installed wheel is a CUDA build.

The package registry's ``torchvision==0.28.*`` wheel is built against CUDA: its compiled
ops library (``torchvision/_C.so``: ``nms``, ``roi_align``, ...) needs ``libc10_cuda.so``
and does not load against the CPU wheel of torch 2.13. torchvision then still imports its
Python code, but registering fake kernels for ``torchvision::nms`` and ``::qnms`` fails
("operator torchvision::nms does not exist"), which breaks ``import torchvision`` and every
package that imports it (transformers, timm, torchmetrics, laplace-torch).

The model classes used here (torchvision's resnet, mobilenet, efficientnet, convnext,
VisionTransformer, swin) need none of the compiled ops. When, and only when, the compiled
library does not load, the two schemas are declared without kernels, so that the import
succeeds and a call of a compiled op still fails loudly. A working CPU build is untouched.
"""

import importlib.util
import os

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # the torch.library fragment, kept alive while the process runs


def install() -> bool:
    """Declare the schemas if torchvision is installed and its compiled ops do not load;
    returns whether it did."""
    global _LIBRARY
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _LIBRARY is not None:
        return False
    folder = list(spec.submodule_search_locations or [])[0]
    compiled = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
    try:
        for path in compiled:
            torch.ops.load_library(path)
        return False
    except OSError:
        pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 - declared once per process
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)
    return True
