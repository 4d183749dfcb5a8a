"""A Hugging Face `ViTForImageClassification` built from a small `ViTConfig`, with random weights.

Nothing is downloaded: the model comes from a config, so this runs offline. A target for `ckpt-tune`:

    ckpt-tune profile examples/vit.py:build --device cpu --batch-size 8

It needs the optional `transformers` dependency (`pip install 'ckpt-tune[hf]'`). Importing this file
works without it; `build()` says what to install.
"""

import torch
from torch import nn

# Small enough for a CPU step in well under a second; the names are ViTConfig's own.
NUM_HIDDEN_LAYERS = 6  # encoder blocks (`vit.encoder.layer.0` .. `vit.encoder.layer.5`)
HIDDEN_SIZE = 192  # width of the residual stream
NUM_ATTENTION_HEADS = 3  # attention heads per block
INTERMEDIATE_SIZE = 768  # the MLP's hidden width
IMAGE_SIZE = 224  # images are [B, 3, IMAGE_SIZE, IMAGE_SIZE]
PATCH_SIZE = 16  # (224 / 16)^2 = 196 patches, plus the class token
NUM_LABELS = 100  # classes; the logits are [B, NUM_LABELS]

_MISSING = "examples/vit.py needs transformers: pip install 'ckpt-tune[hf]'"


def build() -> nn.Module:
    """A randomly initialised ViT image classifier; the same weights on every call (seed 0).

    Raises RuntimeError with an install hint when `transformers` is not importable.
    """
    try:
        from transformers import ViTConfig, ViTForImageClassification
    except ImportError as exc:
        raise RuntimeError(_MISSING) from exc
    config = ViTConfig(
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_ATTENTION_HEADS,
        intermediate_size=INTERMEDIATE_SIZE,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_labels=NUM_LABELS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ViTForImageClassification(config)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    """`{"pixel_values": FloatTensor [B, 3, H, W], "labels": LongTensor [B]}`."""
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = torch.randint(0, NUM_LABELS, (batch_size,), generator=g)
    return {"pixel_values": pixels, "labels": labels}


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own cross-entropy (`output.loss`)."""
    return model(**batch).loss
