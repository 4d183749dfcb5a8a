"""torchvision SwinTransformer (swin_t's class) at a small size: 64x64 images, embed 24, depths 2, 2, 4, 2,
window 4, stochastic depth 0.1; shifted windows with attention masks, patch merging between stages."""

from zoo_common import classify, images, import_torchvision, seeded

IMAGE = 64
DEPTHS = (2, 2, 4, 2)
# features: [patch embed, stage, merge, stage, merge, stage, merge, stage]; the Swin blocks inside each stage
BLOCKS = [f"features.{2 * s + 1}.{i}" for s, n in enumerate(DEPTHS) for i in range(n)]


def build():
    import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    return seeded(lambda: SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=list(DEPTHS), num_heads=[2, 4, 8, 8],
                                          window_size=[4, 4], stochastic_depth_prob=0.1, num_classes=10))


def make_batch(batch_size):
    return images(batch_size, IMAGE)


loss_fn = classify
