"""Helpers shared by the zoo's target files: deterministic builds and batches, no downloads."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    """factory() with the global generator seeded to 0; the caller's random stream is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = factory()
    model.train()
    return model


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def images(batch_size: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen()
    return torch.randn(batch_size, 3, size, size, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def tokens(batch_size: int, seq_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """input_ids and labels (the same ids, separate storage), for causal LMs that shift internally."""
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen())
    return {"input_ids": ids, "labels": ids.clone()}


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(**batch).loss


def quiet_transformers():
    import_torchvision()  # transformers imports torchvision where it is installed (image utilities)
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers



def import_torchvision():
    """torchvision beside the CPU torch. PyPI's 0.28.0 extension is linked against CUDA torch; `make setup`
    installs tests/torchvision_compat.py as a start-up hook that skips its op registrations then. Where the
    hook is not installed, the module is loaded from its file and applied here (the CLI puts only
    tests/zoo on sys.path, so `tests` may not be importable)."""
    if "torchvision" not in sys.modules and "_ckpt_tune_torchvision_compat" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "torchvision_compat.py"
        spec = importlib.util.spec_from_file_location("_zoo_torchvision_compat", path)
        compat = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compat)
        if hasattr(compat, "apply"):
            compat.apply()
    import torchvision

    return torchvision


def import_timm():
    import_torchvision()  # timm imports torchvision
    import timm

    return timm
