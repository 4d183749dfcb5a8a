"""Models whose blocks nest, written the way torchvision and timm write theirs (tests/test_hierarchy.py).

- `NestedResNet`: residual blocks inside `nn.Sequential` stages inside `stages` (`stages.0.0`, …),
  BatchNorm throughout, a strided first block with a projection shortcut in every later stage.
- `ConvNeXtLike`: stages that downsample before their `blocks` list (code between blocks that is not
  a block), stochastic-depth rates from `torch.linspace(...).tolist()` in `__init__` as timm's and
  torchvision's ConvNeXt compute them, LayerNorm and an inverted-bottleneck MLP per block.
- `NestedUNet`: encoder and decoder stages of two conv blocks each, skip connections across.
- `RoutedMoE`: transformer-like layers whose MLP is a router over an `experts` list: the experts are
  repeated and have parameters, but they are not a chain (each sees its own tokens), so the layer
  stays the block.

Each module exposes `build`, `make_batch`, `loss_fn` through `TARGETS[name]`, plus the innermost
blocks a user means by "every block", written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class NestedResNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = [BasicBlock(cin, cout, 1 if i == 0 else 2)] + [BasicBlock(cout, cout) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop_path: float) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = (self.gamma * self.mlp(self.norm(y))).permute(0, 3, 1, 2)
        if self.training and self.drop_path > 0:  # stochastic depth, per sample
            keep = torch.rand(x.shape[0], 1, 1, 1, device=x.device) >= self.drop_path
            y = y * keep / (1 - self.drop_path)
        return x + y


class ConvNeXtStage(nn.Module):
    def __init__(self, cin: int, cout: int, depth: int, rates: list[float]) -> None:
        super().__init__()
        self.downsample = (
            nn.Sequential(LayerNorm2d(cin), nn.Conv2d(cin, cout, 2, 2)) if cin != cout else nn.Identity()
        )
        self.blocks = nn.Sequential(*(ConvNeXtBlock(cout, r) for r in rates))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXtLike(nn.Module):
    def __init__(self, dims=(8, 16, 32), depths=(2, 2, 2), drop_path_rate: float = 0.2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 2, 2), LayerNorm2d(dims[0]))
        # the rates are computed from a tensor, as timm and torchvision do
        rates = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        stages, cin, at = [], dims[0], 0
        for dim, depth in zip(dims, depths):
            stages.append(ConvNeXtStage(cin, dim, depth, rates[at : at + depth]))
            cin, at = dim, at + depth
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(cin)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean((2, 3))))


def _conv_block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = _conv_block(cin, cout)
        self.conv2 = _conv_block(cout, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class NestedUNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        w = width
        self.encoder = nn.ModuleList(
            [nn.Sequential(UNetBlock(3, w), UNetBlock(w, w)), nn.Sequential(UNetBlock(w, 2 * w), UNetBlock(2 * w, 2 * w))]
        )
        self.bottom = nn.Sequential(UNetBlock(2 * w, 4 * w), UNetBlock(4 * w, 4 * w))
        self.up = nn.ModuleList([nn.ConvTranspose2d(4 * w, 2 * w, 2, 2), nn.ConvTranspose2d(2 * w, w, 2, 2)])
        self.decoder = nn.ModuleList(
            [nn.Sequential(UNetBlock(4 * w, 2 * w), UNetBlock(2 * w, 2 * w)), nn.Sequential(UNetBlock(2 * w, w), UNetBlock(w, w))]
        )
        self.out = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, stage, skip in zip(self.up, self.decoder, reversed(skips)):
            x = stage(torch.cat([up(x), skip], 1))
        return self.out(x)


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d)
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class MoELayer(nn.Module):
    def __init__(self, d: int, n_experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x)
        flat = h.reshape(-1, h.shape[-1])
        top = self.router(flat).argmax(-1)  # top-1 routing
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            idx = (top == i).nonzero().squeeze(-1)
            out = out.index_add(0, idx, expert(flat[idx]))
        return x + out.reshape(x.shape)


class RoutedMoE(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(MoELayer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _images(size: int, classes: int):
    def make_batch(batch_size: int):
        g = _gen(1)
        return torch.randn(batch_size, 3, size, size, generator=g), torch.randint(0, classes, (batch_size,), generator=g)

    return make_batch


def _masks(size: int, classes: int):
    def make_batch(batch_size: int):
        g = _gen(1)
        return torch.randn(batch_size, 3, size, size, generator=g), torch.randint(0, classes, (batch_size, size, size), generator=g)

    return make_batch


def _tokens(vocab: int, seq: int):
    def make_batch(batch_size: int):
        ids = torch.randint(0, vocab, (batch_size, seq + 1), generator=_gen(1))
        return ids[:, :-1], ids[:, 1:]

    return make_batch


def _ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]) if logits.dim() == 3 else logits, y.reshape(-1) if logits.dim() == 3 else y)


@dataclass(frozen=True)
class Target:
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    innermost: tuple[str, ...]  # "every block", written out by hand


def _seeded(cls):
    def build():
        torch.manual_seed(0)
        return cls()

    return build


TARGETS = {
    "nested_resnet": Target(
        _seeded(NestedResNet), _images(16, 10), _ce, tuple(f"stages.{s}.{b}" for s in range(3) for b in range(2))
    ),
    "convnext_like": Target(
        _seeded(ConvNeXtLike), _images(32, 10), _ce, tuple(f"stages.{s}.blocks.{b}" for s in range(3) for b in range(2))
    ),
    "nested_unet": Target(
        _seeded(NestedUNet),
        _masks(16, 3),
        _ce,
        (*(f"encoder.{s}.{b}" for s in range(2) for b in range(2)), "bottom.0", "bottom.1",
         *(f"decoder.{s}.{b}" for s in range(2) for b in range(2))),
    ),
    "routed_moe": Target(_seeded(RoutedMoE), _tokens(64, 16), _ce, tuple(f"layers.{i}" for i in range(3))),
}
