"""torchvision VisionTransformer (the ViT-B/16 class) at a small size: 32x32 images, 8x8 patches,
hidden 64, 4 layers, dropout 0.1."""

from zoo_common import classify, images, import_torchvision, seeded

IMAGE = 32
LAYERS = 4
BLOCKS = [f"encoder.layers.encoder_layer_{i}" for i in range(LAYERS)]


def build():
    import_torchvision()
    from torchvision.models.vision_transformer import VisionTransformer

    return seeded(lambda: VisionTransformer(image_size=IMAGE, patch_size=8, num_layers=LAYERS, num_heads=4,
                                            hidden_dim=64, mlp_dim=128, dropout=0.1, attention_dropout=0.1,
                                            num_classes=10))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
