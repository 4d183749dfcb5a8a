"""A small U-Net for semantic segmentation (Ronneberger et al. 2015, "U-Net").

An encoder of conv-BN-ReLU stages that halve the resolution, a bottleneck, and a decoder that
doubles it back, each decoder stage concatenating the matching encoder output (the skip). A target
for `ckpt-tune`, e.g.

    ckpt-tune profile examples/unet.py:build --device cpu --batch-size 8

The skips are what makes U-Nets a test of a memory model: each encoder output stays alive from its
stage until the decoder stage that consumes it, across every block in between, whether or not
those blocks are checkpointed (docs/design.md §4, "tensors that cross blocks").
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    image_size: int = 64  # height and width of the square inputs; divisible by 2**depth
    in_channels: int = 3  # channels of the input images (RGB)
    num_classes: int = 4  # segmentation classes; the output is [B, num_classes, S, S] logits
    width: int = 16  # channels of the first encoder stage; each deeper stage doubles it
    depth: int = 3  # encoder (and decoder) stages; the bottleneck runs at S / 2**depth


class DoubleConv(nn.Module):
    """(3x3 conv, BatchNorm, ReLU) twice at the same resolution."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # [B, out_ch, H, W]


class Up(nn.Module):
    """2x transposed-conv upsampling, concatenation with the skip, then a DoubleConv."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, out_ch, 2, stride=2)
        self.conv = DoubleConv(2 * out_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)  # [B, out_ch, 2H, 2W]
        return self.conv(torch.cat([skip, x], dim=1))  # [B, out_ch, 2H, 2W]


class UNet(nn.Module):
    """`encoder[i]` runs at S / 2**i; `bottleneck` at S / 2**depth; `decoder[i]` undoes encoder[-1-i]."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        chans = [config.width * 2**i for i in range(config.depth + 1)]  # e.g. 16, 32, 64, 128
        self.encoder = nn.ModuleList(
            [
                DoubleConv(config.in_channels if i == 0 else chans[i - 1], chans[i])
                for i in range(config.depth)
            ]
        )
        self.bottleneck = DoubleConv(chans[-2], chans[-1])
        self.decoder = nn.ModuleList([Up(chans[i + 1], chans[i]) for i in reversed(range(config.depth))])
        self.head = nn.Conv2d(chans[0], config.num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.encoder:
            x = stage(x)  # [B, w * 2**i, S / 2**i, S / 2**i]
            skips.append(x)
            x = F.max_pool2d(x, 2)  # [B, w * 2**i, S / 2**(i+1), S / 2**(i+1)]
        x = self.bottleneck(x)  # [B, w * 2**depth, S / 2**depth, S / 2**depth]
        for stage, skip in zip(self.decoder, reversed(skips), strict=True):
            x = stage(x, skip)  # [B, channels of skip, size of skip]
        return self.head(x)  # [B, num_classes, S, S]


def _config(overrides: dict[str, object]) -> UNetConfig:
    known = {f.name for f in fields(UNetConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown UNetConfig field(s) {unknown}; known: {sorted(known)}")
    config = UNetConfig(**overrides)  # type: ignore[arg-type]
    if config.image_size % 2**config.depth:
        raise ValueError(f"image_size={config.image_size} is not divisible by 2**depth={2**config.depth}")
    return config


def build(**overrides: object) -> UNet:
    """The default U-Net; keyword arguments override `UNetConfig` fields, e.g. `build(depth=2)`.

    Weights come from a fixed seed in a private generator scope: two calls give the same model and
    the caller's random stream is left as it was.
    """
    config = _config(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return UNet(config)


def make_batch(batch_size: int, **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`(images, masks)`: float [batch_size, 3, 64, 64] from N(0, 1), long [batch_size, 64, 64] class ids.

    Pass the same overrides as to `build()` when they change the image size, channels or classes.
    """
    config = _config(overrides)
    g = torch.Generator().manual_seed(0)
    s = config.image_size
    images = torch.randn((batch_size, config.in_channels, s, s), generator=g)  # [B, C, S, S]
    masks = torch.randint(0, config.num_classes, (batch_size, s, s), generator=g)  # [B, S, S]
    return images, masks


def loss_fn(model: UNet, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-pixel cross-entropy of the class logits, averaged over all B*S*S pixels."""
    images, masks = batch
    return F.cross_entropy(model(images), masks)
