"""torchvision mobilenet_v3_small (random weights, 10 classes, 64x64: 2x2 after the last stride, so BatchNorm trains at batch 1): inverted residuals with
squeeze-excitation, hardswish and BatchNorm, all in one `features` Sequential."""

from zoo_common import classify, images, import_torchvision, seeded

IMAGE = 64
# features.0 is the stem conv and features.12 the last 1x1 conv; 1..11 are the InvertedResidual blocks
BLOCKS = [f"features.{i}" for i in range(1, 12)]


def build():
    import_torchvision()
    from torchvision.models import mobilenet_v3_small

    return seeded(lambda: mobilenet_v3_small(weights=None, num_classes=10))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
