"""Memory regression tests for a test suite, with `ckpt_tune.assert_peak_within`.

Each test measures one training iteration (zero_grad, batch, forward, loss, backward, optimizer step)
on the CPU and fails when its peak grew more than 5% past the baseline stored next to this file. The
failure message names the numbers: peak before and after, the limit, the modules that grew.

    pytest examples/ci/test_memory.py                                   # check
    CKPT_TUNE_UPDATE_BASELINES=1 pytest examples/ci/test_memory.py      # re-record on purpose

A test whose baseline file is missing records it and fails once ("commit it and rerun"), so a
baseline that was never committed cannot pass in CI.
"""

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ckpt_tune

HERE = Path(__file__).resolve().parent
BASELINES = HERE / "baselines"


def test_gpt_example_step_memory():
    # A target string, as on the command line: examples/gpt.py provides build, make_batch and loss_fn.
    target = f"{os.path.relpath(HERE.parent / 'gpt.py')}:build"
    ckpt_tune.assert_peak_within(target, BASELINES / "gpt.yaml", "5%", batch_size=8, device="cpu")


class MLP(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_mlp_step_memory():
    # A model object: say how to make a batch and (optionally) the loss.
    torch.manual_seed(0)
    ckpt_tune.assert_peak_within(
        MLP(),
        BASELINES / "mlp.yaml",
        "5%",
        make_batch=make_batch,
        loss_fn=loss_fn,
        batch_size=32,
        device="cpu",
        optimizer="adamw",
    )
