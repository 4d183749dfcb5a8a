"""A training script whose body runs when imported."""

import sys

from torch import nn


def build():
    return nn.Linear(4, 4)


sys.exit("usage: train.py --epochs N")
