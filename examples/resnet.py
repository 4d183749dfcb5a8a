"""A ResNet-18-style image classifier (He et al. 2016, "Deep Residual Learning"), narrowed for CPU.

Four stages `layer1..layer4`, each an `nn.Sequential` of two residual `BasicBlock`s with BatchNorm,
as in torchvision's `resnet18`, but a quarter as wide (16-32-64-128 channels) and with a 3x3 stem
without max-pooling, the usual variant for small images. A target for `ckpt-tune`, e.g.

    ckpt-tune profile examples/resnet.py:build --device cpu --batch-size 32

BatchNorm makes this the example where a checkpointing plan must take care with running statistics:
recomputing a block in backward updates them a second time (docs/design.md §5).
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    image_size: int = 64  # height and width of the square input images
    in_channels: int = 3  # channels of the input images (RGB)
    num_classes: int = 10  # number of output classes
    width: int = 16  # channels of the stem and layer1; each later stage doubles it
    blocks_per_stage: int = 2  # BasicBlocks in each of layer1..layer4 (ResNet-18 has 2)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and a residual connection; a 1x1 conv-BN projects the shortcut
    when the stride or the channel count changes."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # [B, out_ch, H/stride, W/stride]
        out = self.bn2(self.conv2(out))  # [B, out_ch, H/stride, W/stride]
        return F.relu(out + self.downsample(x))  # [B, out_ch, H/stride, W/stride]


class ResNet(nn.Module):
    """Stem, layer1..layer4 (stride 1, 2, 2, 2), global average pool, linear classifier."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.conv1 = nn.Conv2d(config.in_channels, w, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.layer1 = self._stage(w, w, stride=1)
        self.layer2 = self._stage(w, 2 * w, stride=2)
        self.layer3 = self._stage(2 * w, 4 * w, stride=2)
        self.layer4 = self._stage(4 * w, 8 * w, stride=2)
        self.fc = nn.Linear(8 * w, config.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _stage(self, in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(in_ch, out_ch, stride)]
        blocks += [BasicBlock(out_ch, out_ch) for _ in range(self.config.blocks_per_stage - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))  # [B, w, S, S]
        x = self.layer1(x)  # [B, w, S, S]
        x = self.layer2(x)  # [B, 2w, S/2, S/2]
        x = self.layer3(x)  # [B, 4w, S/4, S/4]
        x = self.layer4(x)  # [B, 8w, S/8, S/8]
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # [B, 8w]
        return self.fc(x)  # [B, num_classes]


def _config(overrides: dict[str, object]) -> ResNetConfig:
    known = {f.name for f in fields(ResNetConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown ResNetConfig field(s) {unknown}; known: {sorted(known)}")
    return ResNetConfig(**overrides)  # type: ignore[arg-type]


def build(**overrides: object) -> ResNet:
    """The default ResNet; keyword arguments override `ResNetConfig` fields, e.g. `build(width=8)`.

    Weights come from a fixed seed in a private generator scope: two calls give the same model and
    the caller's random stream is left as it was.
    """
    config = _config(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ResNet(config)


def make_batch(batch_size: int, **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`(images, labels)`: float [batch_size, 3, 64, 64] from N(0, 1) and long [batch_size] labels.

    Pass the same overrides as to `build()` when they change the image size, channels or classes.
    """
    config = _config(overrides)
    g = torch.Generator().manual_seed(0)
    shape = (batch_size, config.in_channels, config.image_size, config.image_size)
    images = torch.randn(shape, generator=g)  # [B, C, S, S]
    labels = torch.randint(0, config.num_classes, (batch_size,), generator=g)  # [B]
    return images, labels


def loss_fn(model: ResNet, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the class logits."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)
