from torch import nn


def build():
    return nn.Linear(4, 4)
