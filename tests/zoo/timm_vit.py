"""timm vit_tiny_patch16_224 at a small size (pretrained=False): 32x32 images, 4x4 patches, 4 blocks,
drop_rate and drop_path_rate 0.1."""

from zoo_common import classify, images, import_timm, seeded

IMAGE = 32
DEPTH = 4
BLOCKS = [f"blocks.{i}" for i in range(DEPTH)]


def build():
    timm = import_timm()

    return seeded(lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=4,
                                            depth=DEPTH, num_classes=10, drop_rate=0.1, drop_path_rate=0.1))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
