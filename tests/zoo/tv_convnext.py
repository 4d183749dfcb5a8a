"""torchvision ConvNeXt with convnext_tiny's layout (stages of 3, 3, 9, 3 CNBlocks) at small widths,
stochastic depth 0.1 (random per sample, so the recompute must replay the random stream)."""

from zoo_common import classify, images, import_torchvision, seeded

IMAGE = 32
DEPTHS = (3, 3, 9, 3)
# features: [stem, stage, downsample, stage, downsample, stage, downsample, stage]; the CNBlocks inside each stage
BLOCKS = [f"features.{2 * s + 1}.{i}" for s, n in enumerate(DEPTHS) for i in range(n)]


def build():
    import_torchvision()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    widths = (16, 32, 64, 128)
    setting = [CNBlockConfig(w, widths[k + 1] if k < 3 else None, d) for k, (w, d) in enumerate(zip(widths, DEPTHS))]
    return seeded(lambda: ConvNeXt(setting, stochastic_depth_prob=0.1, num_classes=10))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
