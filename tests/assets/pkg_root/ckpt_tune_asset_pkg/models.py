"""The `package.module:fn` form: ckpt_tune_asset_pkg.models:build."""

import torch
from torch import nn


def build():
    return nn.Linear(4, 2)


def make_batch(batch_size):
    return (torch.ones(batch_size, 4),)


def loss_fn(model, batch):
    return model(*batch).mean()
