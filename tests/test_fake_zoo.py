"""`--device meta` on models nobody here wrote: fake tensors vs the CPU allocator, within 1%.

Each case builds a small member of a family the project does not own (torchvision, timm, Hugging Face
transformers, peft, plain torch RNNs) and compares `fake_measured_peak` (FakeRecorder with the CPU
allocator's rules) with tests/harness.py `measured_peak` (the allocator's own events, read by
torch.profiler): docs/design.md §3. Batch 8, tiny widths so each case takes seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_fake import assert_fake_matches_allocator

BATCH = 8


def _torchvision():
    """torchvision through tests/torchvision_compat.py (PyPI's extension is linked against CUDA torch);
    timm and transformers import it too, so they go through here first."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed")
    importlib.import_module("tests.torchvision_compat")  # applies itself on import, before torchvision
    return importlib.import_module("torchvision")


def _logits_ce(model, batch):
    x, y = batch
    out = model(x)
    if out.dim() == 3:  # [B, T, V] language-model logits
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def _images(size: int, classes: int = 10):
    def make_batch(b: int):
        g = torch.Generator().manual_seed(0)
        return torch.randn(b, 3, size, size, generator=g), torch.randint(0, classes, (b,), generator=g)

    return make_batch


def _tokens(vocab: int, seq: int):
    def make_batch(b: int):
        x = torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(0))
        return x, x.clone()

    return make_batch


def _hf_tokens(vocab: int, seq: int, labels: tuple[int, ...] | None = None):
    def make_batch(b: int):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, vocab, (b, seq), generator=g)
        y = x.clone() if labels is None else torch.randint(0, labels[0], (b, *labels[1:]), generator=g)
        return {"input_ids": x, "labels": y}

    return make_batch


def _hf_loss(model, batch):
    return model(**batch).loss


# --- plain torch -------------------------------------------------------------------------------


class RNNLM(nn.Module):
    """A stacked LSTM/GRU language model: dropout between layers and around the RNN, tied embeddings."""

    def __init__(self, kind: str, vocab: int = 200, d: int = 64, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = getattr(nn, kind)(d, d, num_layers=layers, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.drop(self.rnn(self.drop(self.emb(x)))[0]))


class NestedUNet(nn.Module):
    """A U-Net whose encoder and decoder stages nest (each stage holds the next), with max-pooling,
    bilinear upsampling and concatenated skips."""

    def __init__(self, ch: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inner = NestedUNet(ch * 2, depth - 1) if depth > 1 else None
        cin = 3 if ch == 8 else ch // 2
        self.enc = nn.Sequential(nn.Conv2d(cin, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(ch * 3 if self.inner else ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU())

    def forward(self, x):
        e = self.enc(x)
        if self.inner is None:
            return self.dec(e)
        d = self.inner(F.max_pool2d(e, 2))
        return self.dec(torch.cat([e, F.interpolate(d, scale_factor=2, mode="bilinear")], dim=1))


class SegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unet = NestedUNet()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.unet(x))


def _seg_batch(b: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 4, (b, 32, 32), generator=g)


def _seg_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _example_unet():
    from ckpt_tune.measure import loader
    from tests.test_fake import EXAMPLES

    target = loader.load_target(f"{EXAMPLES / 'unet.py'}:build")
    cfg = {"image_size": 32, "width": 8, "depth": 3}
    return (lambda: target.build_fn(**cfg)), (lambda b: target.batch_fn(b, **cfg)), target.loss_fn


# --- torchvision and timm ----------------------------------------------------------------------


def _tv(name: str, size: int = 32, **kw):
    models = _torchvision().models
    return (lambda: getattr(models, name)(num_classes=10, **kw)), _images(size), _logits_ce


def _tv_vit():
    _torchvision()
    from torchvision.models.vision_transformer import VisionTransformer

    kw = {"image_size": 32, "patch_size": 8, "num_layers": 2, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128}
    return (lambda: VisionTransformer(**kw, num_classes=10)), _images(32), _logits_ce


def _tv_swin():
    _torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    kw = {"patch_size": [4, 4], "embed_dim": 24, "depths": [2, 2], "num_heads": [2, 4], "window_size": [4, 4]}
    return (lambda: SwinTransformer(**kw, stochastic_depth_prob=0.2, num_classes=10)), _images(32), _logits_ce


def _timm(name: str, **kw):
    _torchvision()
    timm = pytest.importorskip("timm")
    return (lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw)), _images(32), _logits_ce


# --- transformers and peft ---------------------------------------------------------------------

V, T = 128, 16
_DECODER = {
    "vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def _transformers():
    if importlib.util.find_spec("torchvision") is not None:
        _torchvision()
    return pytest.importorskip("transformers")


def _hf(kind: str):
    tr = _transformers()
    if kind == "bert":
        cfg = tr.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, num_labels=3,
        )  # fmt: skip
        return (lambda: tr.BertForSequenceClassification(cfg)), _hf_tokens(V, T, labels=(3,)), _hf_loss
    if kind == "t5":
        cfg = tr.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0
        )  # fmt: skip
        return (lambda: tr.T5ForConditionalGeneration(cfg)), _hf_tokens(V, T, labels=(V, 8)), _hf_loss
    if kind == "llama":
        return (lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**_DECODER))), _hf_tokens(V, T), _hf_loss
    if kind == "mistral":
        return (lambda: tr.MistralForCausalLM(tr.MistralConfig(**_DECODER, sliding_window=8))), _hf_tokens(V, T), _hf_loss
    if kind == "mixtral":
        cfg = tr.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
        return (lambda: tr.MixtralForCausalLM(cfg)), _hf_tokens(V, T), _hf_loss
    if kind == "gpt_neox":
        cfg = tr.GPTNeoXConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64,
        )  # fmt: skip
        return (lambda: tr.GPTNeoXForCausalLM(cfg)), _hf_tokens(V, T), _hf_loss
    assert kind == "lora"
    peft = pytest.importorskip("peft")

    def build():
        base = tr.LlamaForCausalLM(tr.LlamaConfig(**_DECODER))
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))

    return build, _hf_tokens(V, T), _hf_loss


CASES = {
    "lstm_lm": lambda: ((lambda: RNNLM("LSTM")), _tokens(200, 16), _logits_ce),
    "gru_lm": lambda: ((lambda: RNNLM("GRU")), _tokens(200, 16), _logits_ce),
    "unet_example": _example_unet,
    "unet_nested": lambda: (SegNet, _seg_batch, _seg_loss),
    "tv_resnet18": lambda: _tv("resnet18"),
    "tv_mobilenet_v3_small": lambda: _tv("mobilenet_v3_small"),
    "tv_efficientnet_b0": lambda: _tv("efficientnet_b0"),
    "tv_convnext_tiny": lambda: _tv("convnext_tiny"),
    "tv_vit": _tv_vit,
    "tv_swin": _tv_swin,
    "timm_resnet18": lambda: _timm("resnet18"),
    "timm_vit": lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, drop_path_rate=0.1),
    "timm_convnext": lambda: _timm("convnext_atto", drop_path_rate=0.1),
    "hf_bert": lambda: _hf("bert"),
    "hf_t5": lambda: _hf("t5"),
    "hf_llama": lambda: _hf("llama"),
    "hf_mistral": lambda: _hf("mistral"),
    "hf_mixtral": lambda: _hf("mixtral"),
    "hf_gpt_neox": lambda: _hf("gpt_neox"),
    "peft_lora_llama": lambda: _hf("lora"),
}
SLOW = {"tv_efficientnet_b0"}  # 10-25 s on 2 cores
# the conformance zoo (tests/zoo, check 2) runs these same models against the CPU allocator in `make
# test`: here they run with `make test-heavy` only, to keep `make test` within its time
IN_THE_ZOO = {
    "lstm_lm", "gru_lm", "tv_resnet18", "tv_mobilenet_v3_small", "tv_convnext_tiny", "tv_vit", "tv_swin", "timm_vit",
    "timm_convnext", "hf_bert", "hf_t5", "hf_llama", "hf_mistral", "hf_mixtral", "hf_gpt_neox", "peft_lora_llama",
}


def _marks(case: str):
    if case in IN_THE_ZOO:
        return [pytest.mark.slow, pytest.mark.heavy]
    return [pytest.mark.slow] if case in SLOW else []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in CASES])
def test_fake_peak_matches_cpu_allocator_on_unseen_models(case):
    build, make_batch, loss_fn = CASES[case]()
    assert_fake_matches_allocator(case, build, make_batch, loss_fn, BATCH)


def test_stochastic_depth_rates_computed_in_the_constructor_build():
    """ConvNeXt, Swin and ViT read `torch.linspace(0, rate, n).tolist()` in __init__: real, exact."""
    from torch._subclasses.fake_tensor import FakeTensor

    from ckpt_tune.measure import fake_inputs, loader

    class Stochastic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rates = torch.linspace(0, 0.1, 4).tolist()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in self.rates)
            for b in self.blocks:
                nn.init.trunc_normal_(b.weight, std=0.02)  # rejection sampling: data-dependent

    target = loader.Target(
        spec="t", module_name="t", file_path=None, fn_name="build", build_fn=Stochastic,
        batch_fn=lambda b: torch.zeros(b, 8), loss_fn=None, batch_source="t", loss_source="t",
    )  # fmt: skip
    model = fake_inputs.build_fake_model(target)
    assert model.rates == pytest.approx([0, 0.1 / 3, 0.2 / 3, 0.1])
    assert all(isinstance(t, FakeTensor) and t.device.type == "cpu" for t in model.parameters())


def test_rnn_flat_weights_follow_the_fake_parameters():
    from ckpt_tune.measure import fake_inputs, loader

    target = loader.Target(
        spec="t", module_name="t", file_path=None, fn_name="build", build_fn=lambda: RNNLM("LSTM"),
        batch_fn=lambda b: torch.zeros(b, 4, dtype=torch.long), loss_fn=None, batch_source="t", loss_source="t",
    )  # fmt: skip
    model = fake_inputs.build_fake_model(target)
    assert model.head.weight is model.emb.weight
    assert [id(w) for w in model.rnn._flat_weights] == [id(getattr(model.rnn, n)) for n in model.rnn._flat_weights_names]
