"""A complete target: build, make_batch, no loss_fn (the default rule sums the output)."""

import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def make_batch(batch_size):
    return torch.ones(batch_size, 4)


def helper_not_a_target():
    return None
