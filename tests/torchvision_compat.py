"""Import torchvision's models beside the CPU build of torch.

torchvision 0.28.0 on PyPI (the release built for torch 2.13) ships a C extension linked against the
CUDA build of torch (`libc10_cuda.so`). Beside the CPU build its extension does not load, and then
`import torchvision` stops in `torchvision._meta_registrations`, which registers fake kernels for the
extension's detection ops (`operator torchvision::nms does not exist`). The models the conformance
zoo uses (ResNet, MobileNet, EfficientNet, ConvNeXt, ViT, Swin) are pure Python and call none of those
ops, so when the extension is missing the two registration modules are skipped. With a matching build
(a CUDA torch, or a torchvision built from source) nothing is changed.

Import this module before torchvision: `from tests.torchvision_compat import torchvision`.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch


def _extension_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    from pathlib import Path

    libs = [p for loc in spec.submodule_search_locations for p in Path(loc).glob("_C*.so")]
    if not libs:
        return False
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError:
        return False
    return True


if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None and not _extension_loads():
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))

import torchvision  # noqa: E402

__all__ = ["torchvision"]
