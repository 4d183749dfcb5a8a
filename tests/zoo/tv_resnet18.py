"""torchvision resnet18 (random weights, 10 classes, 64x64 images: 2x2 at the last stage, so BatchNorm trains at batch 1): BasicBlocks with BatchNorm, nested in stages."""

from zoo_common import classify, images, import_torchvision, seeded

IMAGE = 64
# innermost repeated blocks: the two BasicBlocks of each of the four stages
BLOCKS = [f"layer{s}.{i}" for s in (1, 2, 3, 4) for i in (0, 1)]


def build():
    import_torchvision()
    from torchvision.models import resnet18

    return seeded(lambda: resnet18(weights=None, num_classes=10))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
