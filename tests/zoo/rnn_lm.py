"""Plain-torch stacked LSTM and GRU language models: one single-layer RNN per block, dropout between
layers, input embedding tied to the output projection."""

import torch
import torch.nn.functional as F
from torch import nn
from zoo_common import gen, seeded

SEQ, VOCAB, DIM, LAYERS = 32, 500, 64, 3
BLOCKS = [f"layers.{i}" for i in range(LAYERS)]


class RNNLayer(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], p: float) -> None:
        super().__init__()
        self.rnn = cell(DIM, DIM, batch_first=True)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.rnn(x)[0])


class RNNLM(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], p: float = 0.2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList(RNNLayer(cell, p) for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.drop(self.emb(x))
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build_lstm():
    return seeded(lambda: RNNLM(nn.LSTM))


def build_gru():
    return seeded(lambda: RNNLM(nn.GRU))


def make_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen())
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
