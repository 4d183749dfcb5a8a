"""Let torchvision's pure-Python models import beside the CPU build of torch (the test environment).

torchvision 0.28.0 on PyPI (the release built for torch 2.13) ships a C extension linked against the
CUDA build of torch (`libc10_cuda.so`). Beside the CPU build its extension does not load, and then
`import torchvision` stops in `torchvision._meta_registrations`, which registers fake kernels for the
extension's detection ops ("operator torchvision::nms does not exist"). transformers and timm import
torchvision when it is installed, so every Hugging Face model would fail to import too.

The models the conformance zoo uses (ResNet, MobileNet, EfficientNet, ConvNeXt, ViT, Swin) are pure
Python and call none of those ops. So, only when the extension cannot load, the two registration
modules are skipped. With a matching build (a CUDA torch, or torchvision built for this torch)
nothing changes.

`python tests/torchvision_compat.py` (run by `make setup`) installs this as a start-up hook of the
virtual environment: a `.pth` file that adds an import finder, which acts when `torchvision` is
first imported and costs nothing otherwise. Importing this module applies it to the running process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
import types
from pathlib import Path

HOOK = "_ckpt_tune_torchvision_compat"


def _extension_loads(locations) -> bool:
    import torch

    libs = [p for loc in locations for p in Path(loc).glob("_C*.so")]
    if not libs:
        return True  # a build without the extension imports as it is
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError:
        return False
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """On the first `import torchvision`: skip its op registrations when its extension cannot load."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations and not _extension_loads(spec.submodule_search_locations):
            for mod in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
                sys.modules.setdefault(mod, types.ModuleType(mod))
        return spec


def apply() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def install() -> Path:
    """Write the start-up hook into this interpreter's site-packages; returns the .pth file."""
    site = Path(sysconfig.get_paths()["purelib"])
    (site / f"{HOOK}.py").write_text(Path(__file__).read_text())
    pth = site / f"{HOOK}.pth"
    pth.write_text(f"import {HOOK}; {HOOK}.apply()\n")
    return pth


if __name__ == "__main__":
    print(f"installed {install()}")
else:
    apply()
