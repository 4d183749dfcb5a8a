"""ckpt-tune: where the memory of a PyTorch training step goes, and how to make it fit."""

from __future__ import annotations

__version__ = "0.1.0"

# Public names loaded on first use, so `import ckpt_tune` does not import torch: name -> module.
_LAZY = {"assert_peak_within": "ckpt_tune.check"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt_tune' has no attribute {name!r}")
