"""One function per case, reached through the `fn`, --batch-fn and --loss-fn parts of a target."""

from dataclasses import dataclass

import torch
from torch import nn


class DictModel(nn.Module):
    """forward(**batch) -> {"loss": ..., "logits": ...}, like a Hugging Face model given labels."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x, y=None):
        logits = self.proj(x)
        loss = None if y is None else (logits - y).pow(2).mean()
        return {"loss": loss, "logits": logits}


class TupleModel(nn.Module):
    """forward(*batch) -> (float, float, int) tensors: the default rule sums the floating ones."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x, scale):
        h = self.proj(x)
        return h, h * scale, torch.zeros(2, dtype=torch.long)


@dataclass
class Output:
    hidden: torch.Tensor
    extra: dict


class DataclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x):
        h = self.proj(x)
        return Output(hidden=h, extra={"aux": [2 * h]})


class ScalarModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def forward(self, x):
        return self.proj(x).mean()


class IntModel(nn.Module):
    def forward(self, x):
        return x.long()


class BadForward(nn.Module):
    def forward(self, x):
        raise ValueError("shapes do not line up")


def build_dict():
    return DictModel()


def build_tuple():
    return TupleModel()


def build_dataclass():
    return DataclassModel()


def build_scalar():
    return ScalarModel()


def build_int_output():
    return IntModel()


def build_bad_forward():
    return BadForward()


def build_raises():
    config = {"n_layer": 2}
    return nn.Linear(config["d_model"], 4)


def build_returns_pair():
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


build_not_callable = 42


def make_batch(batch_size):
    return torch.ones(batch_size, 4)


def batch_dict(batch_size):
    return {"x": torch.ones(batch_size, 4), "y": torch.zeros(batch_size, 3)}


def batch_tuple(batch_size):
    return (torch.ones(batch_size, 4), torch.tensor(2.0))


def batch_nested(batch_size):
    return {"inputs": [torch.ones(batch_size, 4), (torch.zeros(batch_size),)], "meta": "keep me"}


def batch_raises(batch_size):
    if batch_size > 2:
        raise RuntimeError(f"only have 2 samples, asked for {batch_size}")
    return torch.ones(batch_size, 4)


def batch_none(batch_size):
    return None


def batch_no_tensor(batch_size):
    return [1.0] * batch_size


def loss_raises(model, batch):
    raise KeyError("labels")


def loss_not_scalar(model, batch):
    return model(batch)


def loss_not_tensor(model, batch):
    return 1.5


def loss_detached(model, batch):
    return model(batch).sum().detach()


def loss_sum(model, batch):
    return model(batch).sum()
