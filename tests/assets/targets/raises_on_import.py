from torch import nn

LAYERS = {"small": 2}
DEPTH = LAYERS["large"]


def build():
    return nn.Linear(4, 4)
