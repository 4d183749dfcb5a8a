"""ckpt-tune: where the memory of a PyTorch training step goes, and how to make it fit."""

from __future__ import annotations

__version__ = "0.1.0"
