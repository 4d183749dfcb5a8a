"""timm convnext_atto (pretrained=False): stages of 2, 2, 6, 2 ConvNeXt blocks, drop_path 0.1, 32x32 images."""

from zoo_common import classify, images, import_timm, seeded

IMAGE = 32
DEPTHS = (2, 2, 6, 2)
BLOCKS = [f"stages.{s}.blocks.{i}" for s, n in enumerate(DEPTHS) for i in range(n)]


def build():
    timm = import_timm()

    return seeded(lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=10, drop_path_rate=0.1))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
