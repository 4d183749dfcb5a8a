"""Models written the way other libraries write them, for the containment tests (tests/test_containment.py).

- `densenet`: torchvision's DenseNet pattern, each dense layer taking the list of all earlier feature maps,
  which its block (an `nn.ModuleDict`) appends to after the call; stem and first dense block frozen.
- `albert`: Hugging Face ALBERT, one encoder layer whose weights are shared, called six times.
- `gpt2`: Hugging Face GPT-2 from its config class with the library's defaults (`use_cache` on, dropout on).
- `aux_heads`: GoogLeNet's pattern, heads whose outputs the loss does not use (their graph is dropped
  after the forward, never backwarded).
- `looped`: a recurrent-depth model (HRM's pattern): its repeated blocks each run twice per step.
- `gpt2_checkpointed`: that GPT-2 with Hugging Face's own gradient checkpointing turned on by the user.
- `timm_checkpointed`: a timm ViT with timm's own gradient checkpointing turned on by the user
  (`set_grad_checkpointing(True)`: `checkpoint_seq` over its blocks).
- `resnet18`: torchvision's ResNet-18 on 64x64 images, whose step's peak is far from linear below a few
  samples (16 MB per sample between batches 1 and 4 on this CPU, 1.8 MB from 4 on).
- `routed`: top-1 routed experts picked by boolean masks (`x[top == i]`: shapes that depend on the data,
  which fake tensors cannot record).
- `wav2vec2`: Hugging Face's Wav2Vec2ForCTC, whose encoder reads its LayerDrop rate from the config at
  each call (`config.layerdrop`, here 0.5), with `audio_batch`.
- `self_checkpointed`: blocks with a custom autograd.Function, the first of which the model checkpoints
  itself (`torch.utils.checkpoint` around the block's call).
- `scripted`: blocks compiled with `torch.jit.script` (no hooks, no instance forward).
- `late_batch`: a model whose make_batch fails from batch 3 on (the user's error, at a batch the search
  reaches after its first step).
"""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, prev_features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(prev_features, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, n: int, cin: int, growth: int) -> None:
        super().__init__()
        for i in range(n):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1, bias=False), nn.BatchNorm2d(24), nn.ReLU())
        self.block1 = DenseBlock(4, 24, 8)
        self.trans1 = nn.Sequential(nn.BatchNorm2d(56), nn.Conv2d(56, 32, 1), nn.AvgPool2d(2))
        self.block2 = DenseBlock(4, 32, 8)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.trans1(self.block1(self.stem(x))))
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


def densenet() -> nn.Module:
    torch.manual_seed(0)
    model = DenseNet()
    for p in [*model.stem.parameters(), *model.block1.parameters()]:
        p.requires_grad_(False)
    return model


def densenet_batch(batch_size: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 16, 16, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def albert() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )
    return transformers.AlbertForMaskedLM(config)


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def tokens_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (batch_size, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


def gpt2_checkpointed() -> nn.Module:
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def timm_checkpointed() -> nn.Module:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=4, num_classes=10)
    model.set_grad_checkpointing(True)
    return model


def resnet18() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def images_64(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 64, 64, generator=torch.Generator().manual_seed(0)),)


class Routed(nn.Module):
    def __init__(self, d: int = 64, experts: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(d, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(0, 1)
        for gate, experts in zip(self.gates, self.experts, strict=True):
            top = gate(x).argmax(-1)
            out = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                out[top == i] = expert(x[top == i])
            x = x + out
        return x.square().mean()


def routed() -> nn.Module:
    torch.manual_seed(0)
    return Routed()


def routed_batch(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 32, 64, generator=torch.Generator().manual_seed(0)),)


def wav2vec2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32, 32),
        conv_stride=(5, 4, 4), conv_kernel=(10, 4, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.5,
    )
    return transformers.Wav2Vec2ForCTC(config)


def audio_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_values": torch.randn(batch_size, 4000, generator=g), "labels": torch.randint(1, 32, (batch_size, 8), generator=g)}


def images_batch(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def images_loss(model: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return model(*batch).square().mean()


class _Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class _MlpBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class _SwishBlock(_MlpBlock):
    def act(self, x: torch.Tensor) -> torch.Tensor:
        return _Swish.apply(x)


class _Blocks(nn.Module):
    def __init__(self, block, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Chain.forward(self, x)


class SelfCheckpointed(_Blocks):
    def __init__(self) -> None:
        super().__init__(_SwishBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if i == 0 else b(x)
        return x.square().mean()


def self_checkpointed() -> nn.Module:
    torch.manual_seed(0)
    return SelfCheckpointed()


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def late_batch() -> nn.Module:
    torch.manual_seed(0)
    return Chain()


def late_batch_make_batch(batch_size: int) -> torch.Tensor:
    if batch_size > 2:
        raise ValueError(f"this data loader yields at most 2 samples, not {batch_size}")
    return torch.randn(batch_size, 32)


make_batch = late_batch_make_batch


class AuxHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)
        self.aux = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x).relu()
        return self.head(h), self.aux(h)


def aux_heads() -> nn.Module:
    torch.manual_seed(0)
    return AuxHeads()


def aux_heads_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def aux_heads_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x)[0], y)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for layer in self.layers:
                h = h + layer(h)
        return h


class Looped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.core = Recurrent()
        self.mix = nn.Linear(64, 64)
        self.refine = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.core(self.embed(x))
        return self.head(h + self.refine(self.mix(h).relu())).square().mean()


def looped() -> nn.Module:
    torch.manual_seed(0)
    return Looped()


class SharedLoop(nn.Module):
    """One layer the model's own forward calls six times: no module runs once around the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.layer = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(6):
            h = h + self.layer(h)
        return self.head(h).square().mean()


def shared_loop() -> nn.Module:
    torch.manual_seed(0)
    return SharedLoop()


class LayerDropStack(nn.Module):
    """Hugging Face's LayerDrop: in training each layer is skipped with probability `layerdrop`."""

    def __init__(self) -> None:
        super().__init__()
        self.layerdrop = 0.5
        self.embed = nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = h + layer(h)
        return self.head(h).square().mean()


def layerdrop_stack() -> nn.Module:
    torch.manual_seed(0)
    return LayerDropStack()


class _RangeTracker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("x_min", torch.zeros(1))
        self.register_buffer("x_max", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.x_min = self.x_min * 0.9 + x.detach().min() * 0.1
            self.x_max = self.x_max * 0.9 + x.detach().max() * 0.1
        return x


class RangeTrackedBlocks(nn.Module):
    """The same with each tracker inside its block, so a checkpointed block recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), _RangeTracker(), nn.GELU(), nn.Linear(128, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).square().mean()


class _SharedInto(nn.Module):
    def __init__(self, encoding: nn.Module) -> None:
        super().__init__()
        self.encoding = encoding  # registered first on the model: a block's name for it is its second
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.encoding(h)
        return h + self.mlp(h)


class SharedIntoBlocks(nn.Module):
    """CoaT's layout: a module list of position encodings, one of them shared into every block, so the
    innermost blocks include a module that sits inside each of the others."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.encodings = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)])
        self.blocks = nn.ModuleList([_SharedInto(self.encodings[0]) for _ in range(4)])
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encodings[1](self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


def shared_into_blocks() -> nn.Module:
    torch.manual_seed(0)
    return SharedIntoBlocks()


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)])
        self.fuse = nn.Linear(64, 64)

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, branch in enumerate(self.branches):
            x[i] = branch(x[i])  # the argument changed in place, as timm's HRNet stages do
        return [self.fuse(x[0] + x[1]), x[1]]


class InPlaceLists(nn.Module):
    """Stages that take a list of branches and write each branch's output back into that list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.stages = nn.ModuleList([_Branches() for _ in range(3)])
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        xs = [h, h.tanh()]
        for stage in self.stages:
            xs = stage(xs)
        return self.head(xs[0] + xs[1]).square().mean()


def in_place_lists() -> nn.Module:
    torch.manual_seed(0)
    return InPlaceLists()


def range_tracked() -> nn.Module:
    torch.manual_seed(0)
    return RangeTrackedBlocks()


def looped_batch(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 32, generator=torch.Generator().manual_seed(0)),)


def wide_batch(batch_size: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 64, 32, generator=g),)


class Scripted(_Blocks):
    def __init__(self) -> None:
        super().__init__(lambda d: torch.jit.script(_MlpBlock(d)))


def scripted() -> nn.Module:
    torch.manual_seed(0)
    return Scripted()
