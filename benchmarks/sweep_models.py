"""The sweep's models: every architecture of four libraries, each built small from its own classes with random
weights (nothing is downloaded), with a seeded batch and the loss a user would write.

- transformers: every class of the causal-LM, masked-LM, seq2seq, image-classification and speech-seq2seq
  auto mappings, from its config class with one generic tiny configuration (`tiny_config`: 2 layers, width
  64, FFN 128, 4 heads, 2 KV heads, vocabulary 1000, 64×64 images in 8×8 patches, ... wherever the config
  class has such a field; sub-configs likewise). Library defaults otherwise: dropout as configured,
  `use_cache` as the config has it, train mode.
- torchvision: every model of `list_models(module=torchvision.models)` (classification) and of
  `module=torchvision.models.segmentation`, weights=None, 10 classes (5 for segmentation), 64×64 images
  where the model takes them (ViT and MaxViT are told the size), else its usual size.
- timm: one small model per family, a family being the letters of a name's first `_`-separated word
  (`resnet18d` and `resnet50` are both `resnet`); the smallest by parameter count (`timm_families`),
  pretrained=False, 10 classes, 64×64 where the model takes `img_size`, else its default input size.
- diffusers: UNet2DModel, UNet2DConditionModel, DiTTransformer2DModel, AutoencoderKL, tiny configs, a
  denoising MSE loss.

An architecture is a `ckpt-tune` target through this file: the environment variable `CKPT_TUNE_SWEEP_ARCH`
(`library:name` or `library:name#variant`) selects it, and `build`, `make_batch` and `loss_fn` below are what
a user would pass:

    CKPT_TUNE_SWEEP_ARCH=transformers:LlamaForCausalLM ckpt-tune profile benchmarks/sweep_models.py:build --device cpu

A variant is an alternative input size or configuration (`recipe(arch, variant)`): the first that builds and
runs a plain training step (`first_working_variant`) is the one checked. Models over `MAX_PARAMS` are not
built.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
ENV = "CKPT_TUNE_SWEEP_ARCH"
LIBRARIES = ("transformers", "torchvision", "timm", "diffusers")
MAX_PARAMS = 12_000_000  # larger models are not swept: at a budget where their batch is small in activations, AdamW's
# temporaries (the size of the parameters) leave room for a batch in the hundreds, minutes a step on 2 cores
SEQ, TARGET_SEQ, VOCAB = 16, 16, 1000  # labels as long as the ids: audio LMs in the seq2seq mapping align them
IMAGE, CLASSES, SEG_CLASSES = 64, 10, 5
AUDIO_SAMPLES = 4096  # raw audio (`input_values`) for speech models that take it
HF_DEPTHS = (2, 4, 8)  # variants: hybrids with one attention layer in 4 (or 8) have none at depth 2
DOES_NOT_BUILD = "does not build with a generic tiny config"


@dataclass(frozen=True)
class Arch:
    library: str
    name: str  # the model class (transformers, diffusers) or the model name (torchvision, timm)
    kind: str  # causal-lm, masked-lm, seq2seq, image-classification, speech-seq2seq, classification, ...
    detail: str = ""  # transformers: the model_type; timm: the family

    @property
    def key(self) -> str:
        return f"{self.library}:{self.name}"


@dataclass
class Recipe:
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    describe: str = ""
    params_on_meta: Callable[[], int] | None = None  # a cheap parameter count, before anything is allocated
    notes: list[str] = field(default_factory=list)


def quiet() -> None:
    """Third-party warnings and log lines are not what the sweep looks at."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    with contextlib.suppress(ImportError):
        import diffusers

        diffusers.utils.logging.set_verbosity_error()


def seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    """factory() with the global generator seeded to 0; the caller's random stream is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = factory()
    model.train()
    return model


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_count(factory: Callable[[], nn.Module]) -> Callable[[], int]:
    def count() -> int:
        with torch.device("meta"):
            return n_params(factory())

    return count


# -- transformers ----------------------------------------------------------------------------------------
HF_MAPPINGS = {  # kind -> auto mapping; an architecture in several is checked once, as the first kind here
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

DEPTH = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "num_encoder_layers",
         "encoder_layers", "decoder_layers")
# field -> tiny value, set wherever a config class has the field as an int (or, for the `NONE_OK` ones, None)
TINY: dict[str, int] = {
    # depth (2, or the variant's: hybrids with one attention layer in 4 or 8 need more)
    **dict.fromkeys(DEPTH, 2),
    # width
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
                     "dim", "projection_dim"), 64),
    **dict.fromkeys(("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
                     "ffn_hidden_size", "hidden_dim"), 128),
    # attention
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "v_head_dim"), 16),
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 32, "rotary_dim": 8,
    # mixture of experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2, "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 64),
    # vocabulary and positions
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "seq_length"), 128),
    "max_source_positions": 32, "max_target_positions": 64,
    # images and audio
    "image_size": IMAGE, "patch_size": 8, "num_channels": 3,
    **dict.fromkeys(("num_mel_bins", "input_feat_per_channel", "feature_size"), 16),
}
NONE_OK = {"head_dim", "num_key_value_heads", "q_lora_rank", "num_experts_per_tok"}
LISTS: dict[str, Callable[[int], int]] = {  # list field -> its i-th tiny entry
    "depths": lambda i: 1,
    "block_sizes": lambda i: 1,
    "hidden_sizes": lambda i: 16 * 2**i,
    "embed_dims": lambda i: 16 * 2**i,
    "num_heads": lambda i: 2 ** min(i, 3),
    "num_attention_heads": lambda i: 2 ** min(i, 3),
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tiny_kwargs(default: Any, kind: str, layers: int = 2, top: bool = True) -> dict[str, Any]:
    """Keyword arguments that make `type(default)` tiny: the `TINY` fields it has (depth `layers`), tiny
    lists, small special-token ids, and the same for each sub-config."""
    from transformers import PretrainedConfig

    kw: dict[str, Any] = {}
    fields = default.to_dict()
    for name, value in TINY.items():
        if name in fields and (_is_int(fields[name]) or (fields[name] is None and name in NONE_OK)):
            kw[name] = layers if name in DEPTH else value
    if "head_dim" in kw and "qk_rope_head_dim" in kw:  # multi-head latent attention: rotary part = head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    for name, entry in LISTS.items():
        value = fields.get(name)
        if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
            kw[name] = [entry(i) for i in range(len(value))]
    for name, small in TOKEN_IDS.items():
        value = fields.get(name, "absent")
        if _is_int(value) and value >= VOCAB:
            kw[name] = small
        elif value in (None, "absent") and top and kind.endswith("seq2seq") and name in ("pad_token_id", "decoder_start_token_id"):
            kw[name] = 0  # labels are shifted right into decoder inputs from these
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig):
            sub = value.to_dict()
            layers = next((sub[k] for k in ("num_hidden_layers", "num_layers") if _is_int(sub.get(k))), None)
            # per-layer lists (layer_types, ...) are derived again from the new depth
            sub = {k: v for k, v in sub.items() if not (isinstance(v, list) and layers and len(v) == layers)}
            kw[name] = {**sub, **tiny_kwargs(value, kind, layers, top=False)}
    if top and kind == "image-classification":
        kw["num_labels"] = CLASSES
    return kw


def tiny_config(config_class: type, kind: str, layers: int = 2) -> Any:
    default = config_class()
    return config_class(**tiny_kwargs(default, kind, layers))


def transformers_archs() -> list[Arch]:
    from transformers.models.auto import modeling_auto

    found: dict[str, tuple[str, list[str]]] = {}  # class -> (kind, model types listing it)
    for kind, mapping in HF_MAPPINGS.items():
        for model_type, classes in getattr(modeling_auto, mapping).items():
            for cls in classes if isinstance(classes, (tuple, list)) else (classes,):
                found.setdefault(cls, (kind, []))[1].append(model_type)

    def own_type(cls: str, types: list[str]) -> str:  # LlamaForCausalLM: "llama", not "exaone"
        flat = cls.lower()
        return next((t for t in types if flat.startswith(t.replace("_", "").replace("-", ""))), types[0])

    out = [Arch("transformers", cls, kind, own_type(cls, types)) for cls, (kind, types) in found.items()]
    return sorted(out, key=lambda a: (list(HF_MAPPINGS).index(a.kind), a.name))


def _hf_recipe(arch: Arch, variant: int) -> Recipe:
    import transformers

    cls = getattr(transformers, arch.name)
    layers = HF_DEPTHS[variant]
    config = tiny_config(cls.config_class, arch.kind, layers)
    describe = f"tiny config, {layers} layers"

    def build() -> nn.Module:  # a copy of the config each time: a model may write to its config
        return seeded(lambda: cls(copy.deepcopy(config)))

    vocab = min(VOCAB, getattr(config, "vocab_size", None) or VOCAB)
    kind = arch.kind

    if kind == "image-classification":
        size = getattr(config, "image_size", IMAGE)
        size = size if _is_int(size) else IMAGE
        channels = getattr(config, "num_channels", 3) or 3

        def make_batch(b: int) -> dict[str, torch.Tensor]:
            g = gen()
            return {"pixel_values": torch.randn(b, channels, size, size, generator=g),
                    "labels": torch.randint(0, CLASSES, (b,), generator=g)}

        def loss_fn(model: nn.Module, batch) -> torch.Tensor:
            logits = model(pixel_values=batch["pixel_values"]).logits
            return F.cross_entropy(logits, batch["labels"])

        return Recipe(build, make_batch, loss_fn, f"{describe}, {size}×{size} images",
                      meta_count(lambda: cls(config)))

    if kind == "speech-seq2seq":
        key = cls.main_input_name if cls.main_input_name in ("input_features", "input_values") else "input_features"
        feats = _speech_shape(config) if key == "input_features" else (AUDIO_SAMPLES,)

        def make_batch(b: int) -> dict[str, torch.Tensor]:
            g = gen()
            return {key: torch.randn(b, *feats, generator=g),
                    "labels": torch.randint(4, vocab, (b, TARGET_SEQ), generator=g)}

    elif kind == "seq2seq":

        def make_batch(b: int) -> dict[str, torch.Tensor]:
            g = gen()
            return {"input_ids": torch.randint(4, vocab, (b, SEQ), generator=g),
                    "labels": torch.randint(4, vocab, (b, TARGET_SEQ), generator=g)}

    else:  # causal and masked LMs: the labels are the ids (separate storage)

        def make_batch(b: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(4, vocab, (b, SEQ), generator=gen())
            return {"input_ids": ids, "labels": ids.clone()}

    return Recipe(build, make_batch, hf_loss, describe, meta_count(lambda: cls(config)))


def _speech_shape(config: Any) -> tuple[int, int]:
    """(channels, frames) or (frames, features) of `input_features` for a speech config."""
    if _is_int(getattr(config, "num_mel_bins", None)):
        frames = 2 * config.max_source_positions if _is_int(getattr(config, "max_source_positions", None)) else 64
        return (config.num_mel_bins, frames)
    if _is_int(getattr(config, "input_feat_per_channel", None)):
        return (64, config.input_feat_per_channel * (getattr(config, "input_channels", 1) or 1))
    if _is_int(getattr(config, "feature_size", None)):
        return (64, config.feature_size)
    return (64, 16)


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    out = model(**batch)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"][:, : logits.shape[1]].reshape(-1))


# -- torchvision -------------------------------------------------------------------------------------------
def torchvision_archs() -> list[Arch]:
    import torchvision

    cls = torchvision.models.list_models(module=torchvision.models)
    seg = torchvision.models.list_models(module=torchvision.models.segmentation)
    return [Arch("torchvision", n, "classification") for n in cls] + [Arch("torchvision", n, "segmentation") for n in seg]


def _tv_kwargs(name: str, size: int) -> dict[str, Any]:
    if name.startswith("vit_") and size != 224:
        return {"image_size": size}
    if name.startswith("maxvit") and size != 224:
        return {"input_size": (size, size)}
    return {}


def _torchvision_recipe(arch: Arch, variant: int) -> Recipe:
    import torchvision

    name = arch.name
    if variant == 0:
        size = 56 if name.startswith("vit_") and "_14" in name else IMAGE
    else:
        size = 299 if name.startswith("inception") else 224
    segment = arch.kind == "segmentation"
    kw = {"weights": None, "num_classes": SEG_CLASSES if segment else CLASSES, **_tv_kwargs(name, size)}
    if segment:
        kw["weights_backbone"] = None

    def factory() -> nn.Module:
        return torchvision.models.get_model(name, **kw)

    def make_batch(b: int):
        g = gen()
        x = torch.randn(b, 3, size, size, generator=g)
        y = torch.randint(0, SEG_CLASSES, (b, size, size), generator=g) if segment else torch.randint(0, CLASSES, (b,), generator=g)
        return x, y

    return Recipe(lambda: seeded(factory), make_batch, segmentation_loss if segment else classify,
                  f"{size}×{size} images", meta_count(factory))


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if not isinstance(out, torch.Tensor):  # GoogLeNet and Inception in train mode: (logits, aux...)
        out = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(out, y)


def segmentation_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x)["out"], y)


# -- timm ------------------------------------------------------------------------------------------------
def timm_family(name: str) -> str:
    first = name.split("_")[0]
    m = re.match(r"[a-z]+", first)
    return m.group(0) if m else first


# The smallest model per family of timm 1.0.31 (`python benchmarks/sweep_models.py --timm-families` computes
# it again: every model built under fake tensors, parameters counted, ties to the first name)
TIMM_VERSION = "1.0.31"
TIMM_SMALLEST: dict[str, str] = {
    "aimv": "aimv2_large_patch14_224", "bat": "bat_resnext26ts", "beit": "beit_base_patch16_224",
    "beitv": "beitv2_base_patch16_224", "botnet": "botnet26t_256", "caformer": "caformer_s18",
    "cait": "cait_xxs24_224", "coat": "coat_tiny", "coatnet": "coatnet_pico_rw_224",
    "coatnext": "coatnext_nano_rw_224", "convformer": "convformer_s18", "convit": "convit_tiny",
    "convmixer": "convmixer_768_32", "convnext": "convnext_zepto_rms", "convnextv": "convnextv2_atto",
    "cpubone": "cpubone_nano", "crossvit": "crossvit_tiny_240", "cs": "cs3darknet_focus_s",
    "csatv": "csatv2", "cspdarknet": "cspdarknet53", "cspnext": "cspnext_tiny", "cspresnet": "cspresnet50",
    "cspresnext": "cspresnext50", "darknet": "darknet17", "darknetaa": "darknetaa53", "davit": "davit_tiny",
    "deepseek": "deepseek_vit_412m", "deit": "deit_tiny_patch16_224", "densenet": "densenet121",
    "densenetblur": "densenetblur121d", "dla": "dla46x_c", "dm": "dm_nfnet_f0", "dpn": "dpn48b",
    "eca": "eca_resnext26ts", "ecaresnet": "ecaresnet26t", "ecaresnetlight": "ecaresnetlight",
    "ecaresnext": "ecaresnext26t_32x4d", "edgenext": "edgenext_xx_small",
    "efficientformer": "efficientformer_l1", "efficientformerv": "efficientformerv2_s0",
    "efficientnet": "efficientnet_lite0", "efficientnetv": "efficientnetv2_rw_t",
    "efficientvim": "efficientvim_m1", "efficientvit": "efficientvit_b0", "ese": "ese_vovnet19b_slim_dw",
    "eva": "eva02_tiny_patch14_224", "fasternet": "fasternet_t0", "fastvit": "fastvit_t8",
    "fbnetc": "fbnetc_100", "fbnetv": "fbnetv3_b", "flexivit": "flexivit_small",
    "focalnet": "focalnet_tiny_srf", "gc": "gc_efficientnetv2_rw_t", "gcresnet": "gcresnet33ts",
    "gcresnext": "gcresnext26ts", "gcvit": "gcvit_xxtiny", "gemma": "gemma4_vit_167m_enc",
    "gernet": "gernet_s", "ghostnet": "ghostnet_050", "ghostnetv": "ghostnetv3_050",
    "gmixer": "gmixer_12_224", "gmlp": "gmlp_ti16_224", "halo": "halo2botnet50ts_256",
    "halonet": "halonet_h1", "haloregnetz": "haloregnetz_b", "hardcorenas": "hardcorenas_b",
    "hgnet": "hgnet_tiny", "hgnetv": "hgnetv2_b0", "hiera": "hiera_tiny_224", "hieradet": "hieradet_small",
    "hrnet": "hrnet_w18_small", "iformer": "iformer_t", "inception": "inception_next_atto",
    "lambda": "lambda_resnet26t", "lamhalobotnet": "lamhalobotnet50ts_256", "lcnet": "lcnet_035",
    "lcnetv": "lcnetv2_small", "legacy": "legacy_seresnet18", "levit": "levit_128s",
    "lowformer": "lowformer_b0", "mambaout": "mambaout_femto", "maxvit": "maxvit_pico_rw_256",
    "maxxvit": "maxxvit_rmlp_nano_rw_256", "maxxvitv": "maxxvitv2_nano_rw_256", "mixer": "mixer_s16_224",
    "mixnet": "mixnet_s", "mnasnet": "mnasnet_small", "mobilenet": "mobilenet_edgetpu_100",
    "mobilenetv": "mobilenetv2_035", "mobileone": "mobileone_s1", "mobilevit": "mobilevit_xxs",
    "mobilevitv": "mobilevitv2_050", "mvitv": "mvitv2_tiny",
    "naflexvit": "naflexvit_base_patch16_parfac_gap", "nasnetalarge": "nasnetalarge", "nest": "nest_tiny",
    "nextvit": "nextvit_small", "nf": "nf_regnet_b0", "nfnet": "nfnet_l0", "pit": "pit_ti_224",
    "pnasnet": "pnasnet5large", "poolformer": "poolformer_s12", "poolformerv": "poolformerv2_s12",
    "pvt": "pvt_v2_b0", "qwen": "qwen3_vit_88m", "rdnet": "rdnet_tiny", "regnetv": "regnetv_040",
    "regnetx": "regnetx_002", "regnety": "regnety_002", "regnetz": "regnetz_005",
    "repghostnet": "repghostnet_050", "repvgg": "repvgg_a0", "repvit": "repvit_m1", "res": "res2next50",
    "resmlp": "resmlp_12_224", "resnest": "resnest14d", "resnet": "resnet10t", "resnetaa": "resnetaa34d",
    "resnetblur": "resnetblur18", "resnetrs": "resnetrs50", "resnetv": "resnetv2_18",
    "resnext": "resnext26ts", "rexnet": "rexnet_100", "rexnetr": "rexnetr_100", "sam": "sam2_hiera_tiny",
    "samvit": "samvit_base_patch16_224", "sebotnet": "sebotnet33ts_256", "sedarknet": "sedarknet21",
    "sehalonet": "sehalonet33ts", "selecsls": "selecsls42", "semnasnet": "semnasnet_050",
    "senet": "senet154", "sequencer": "sequencer2d_s", "seresnet": "seresnet18",
    "seresnetaa": "seresnetaa50d", "seresnext": "seresnext26ts", "seresnextaa": "seresnextaa101d_32x8d",
    "shvit": "shvit_s1", "skresnet": "skresnet18", "skresnext": "skresnext50_32x4d",
    "spnasnet": "spnasnet_100", "starnet": "starnet_s050", "swiftformer": "swiftformer_xs",
    "swin": "swin_tiny_patch4_window7_224", "swinv": "swinv2_cr_tiny_224", "test": "test_efficientnet",
    "tf": "tf_mobilenetv3_small_075", "tiny": "tiny_vit_5m_224", "tinynet": "tinynet_e",
    "tnt": "tnt_s_legacy_patch16_224", "tresnet": "tresnet_m", "twins": "twins_svt_small", "vgg": "vgg11",
    "visformer": "visformer_tiny", "vit": "vit_tiny_patch16_dinov3_qkvb", "vitamin": "vitamin_small_224",
    "volo": "volo_d1_224", "vovnet": "vovnet39a", "wide": "wide_resnet50_2", "xception": "xception41p",
    "xcit": "xcit_nano_12_p8_224",
}


def timm_families(live: bool = False) -> dict[str, str]:
    """family -> its smallest model (by parameter count with 10 classes, built on the meta device)."""
    import timm

    if TIMM_SMALLEST and timm.__version__ == TIMM_VERSION and not live:
        return dict(TIMM_SMALLEST)
    best: dict[str, tuple[int, str]] = {}
    for name in timm.list_models():
        try:
            with torch.device("meta"):
                count = n_params(timm.create_model(name, pretrained=False, num_classes=CLASSES))
        except Exception:  # (one that cannot build on meta is not a candidate)
            continue
        fam = timm_family(name)
        if fam not in best or count < best[fam][0]:
            best[fam] = (count, name)
    return {fam: name for fam, (_, name) in sorted(best.items())}


def timm_archs() -> list[Arch]:
    return [Arch("timm", name, "classification", fam) for fam, name in timm_families().items()]


def _timm_create(name: str, size: int | None) -> nn.Module:
    import timm

    kw: dict[str, Any] = {"pretrained": False, "num_classes": CLASSES}
    if size is not None:
        kw["img_size"] = size
    return timm.create_model(name, **kw)


def _timm_recipe(arch: Arch, variant: int) -> Recipe:
    import timm

    name = arch.name
    if variant == 0:
        size, told = IMAGE, IMAGE  # 64×64, the model told so (ViT-like models take `img_size`)
    elif variant == 1:
        size, told = IMAGE, None  # 64×64 into a model that takes any size
    else:
        cfg = timm.get_pretrained_cfg(name)
        size = (cfg.input_size[-1] if cfg is not None else 224) or 224
        told = None

    def factory() -> nn.Module:
        return _timm_create(name, told)

    def make_batch(b: int):
        g = gen()
        return torch.randn(b, 3, size, size, generator=g), torch.randint(0, CLASSES, (b,), generator=g)

    return Recipe(lambda: seeded(factory), make_batch, classify, f"{size}×{size} images", meta_count(factory))


# -- diffusers -------------------------------------------------------------------------------------------
DIFFUSERS = ("UNet2DModel", "UNet2DConditionModel", "DiTTransformer2DModel", "AutoencoderKL")


def diffusers_archs() -> list[Arch]:
    kinds = {"UNet2DModel": "unet", "UNet2DConditionModel": "unet", "DiTTransformer2DModel": "dit", "AutoencoderKL": "vae"}
    return [Arch("diffusers", n, kinds[n]) for n in DIFFUSERS]


def _diffusers_recipe(arch: Arch, variant: int) -> Recipe:
    import diffusers

    name = arch.name
    if name == "UNet2DModel":
        cfg = dict(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                   down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                   norm_num_groups=8, attention_head_dim=8)
        shape, cond = (3, 16, 16), None
    elif name == "UNet2DConditionModel":
        cfg = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
                   down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                   cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)
        shape, cond = (4, 8, 8), (4, 16)
    elif name == "DiTTransformer2DModel":
        cfg = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2, sample_size=8,
                   patch_size=2, norm_num_groups=8, num_embeds_ada_norm=CLASSES)
        shape, cond = (4, 8, 8), None
    else:  # AutoencoderKL
        cfg = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                   up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32),
                   latent_channels=4, norm_num_groups=8, sample_size=16)
        shape, cond = (3, 16, 16), None
    cls = getattr(diffusers, name)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        g = gen()
        clean = torch.randn(b, *shape, generator=g)
        noise = torch.randn(b, *shape, generator=g)
        batch = {"noisy": clean + noise, "clean": clean, "noise": noise,
                 "timestep": torch.randint(0, 1000, (b,), generator=g)}
        if cond is not None:
            batch["encoder_hidden_states"] = torch.randn(b, *cond, generator=g)
        if name == "DiTTransformer2DModel":
            batch["class_labels"] = torch.randint(0, CLASSES, (b,), generator=g)
        return batch

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        if name == "AutoencoderKL":  # denoising reconstruction
            return F.mse_loss(model(batch["noisy"]).sample, batch["clean"])
        if name == "DiTTransformer2DModel":
            out = model(batch["noisy"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
        elif name == "UNet2DConditionModel":
            out = model(batch["noisy"], batch["timestep"], encoder_hidden_states=batch["encoder_hidden_states"]).sample
        else:
            out = model(batch["noisy"], batch["timestep"]).sample
        return F.mse_loss(out[:, : shape[0]], batch["noise"])  # predict the noise

    def factory() -> nn.Module:
        return cls(**cfg)

    return Recipe(lambda: seeded(factory), make_batch, loss_fn, "tiny config", meta_count(factory))


# -- all of them -----------------------------------------------------------------------------------------
ENUMERATORS = {"transformers": transformers_archs, "torchvision": torchvision_archs, "timm": timm_archs,
               "diffusers": diffusers_archs}
VARIANTS = {"transformers": len(HF_DEPTHS), "torchvision": 2, "timm": 3, "diffusers": 1}
RECIPES = {"transformers": _hf_recipe, "torchvision": _torchvision_recipe, "timm": _timm_recipe,
           "diffusers": _diffusers_recipe}


def all_archs(only: str | None = None) -> list[Arch]:
    _import_torchvision()
    return [a for lib in LIBRARIES if only in (None, lib) for a in ENUMERATORS[lib]()]


def find(key: str) -> Arch:
    """The architecture `library:name` (looked up in its library's enumeration)."""
    library, _, name = key.partition(":")
    for a in all_archs(library):
        if a.name == name:
            return a
    raise KeyError(key)


def recipe(arch: Arch, variant: int = 0) -> Recipe:
    _import_torchvision()
    return RECIPES[arch.library](arch, variant)


def first_working_variant(arch: Arch, run_step: Callable[[Recipe], None]) -> tuple[int, Recipe, list[str]]:
    """(variant, recipe, why the earlier ones failed) of the first variant that builds, is at most
    MAX_PARAMS, and runs `run_step(recipe)`; raises RuntimeError(DOES_NOT_BUILD: reasons) when none does."""
    reasons = []
    for v in range(VARIANTS[arch.library]):
        try:
            r = recipe(arch, v)
            count = 0
            if r.params_on_meta is not None:
                with contextlib.suppress(Exception):  # some models cannot be built on meta: counted when built
                    count = r.params_on_meta()
                if count > MAX_PARAMS:
                    raise TooLarge(f"{count / 1e6:.0f}M parameters > {MAX_PARAMS / 1e6:.0f}M")
            run_step(r)
            return v, r, reasons
        except TooLarge as e:
            reasons.append(f"#{v} ({r.describe}): too large: {e}")
            break  # another input size does not change the parameter count
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            reasons.append(f"#{v}: {type(e).__name__}: {msg}")
    raise RuntimeError(f"{DOES_NOT_BUILD}: " + " | ".join(reasons))


class TooLarge(Exception):
    pass


def _import_torchvision() -> None:
    """torchvision beside the CPU torch (tests/torchvision_compat.py; see tests/zoo/zoo_common.py)."""
    if "torchvision" in sys.modules:
        return
    path = ROOT / "tests" / "zoo" / "zoo_common.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sweep_zoo_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with contextlib.suppress(ImportError):
        mod.import_torchvision()


# -- the target: what `CKPT_TUNE_SWEEP_ARCH` selects --------------------------------------------------------
_CURRENT: dict[str, tuple[Arch, Recipe]] = {}


def selection(key: str, variant: int = 0) -> str:
    return f"{key}#{variant}"


def current() -> Recipe:
    value = os.environ.get(ENV)
    if not value:
        raise RuntimeError(f"set {ENV}=library:name[#variant] to choose the architecture")
    if value not in _CURRENT:
        quiet()
        key, _, variant = value.partition("#")
        arch = find(key)
        _CURRENT[value] = (arch, recipe(arch, int(variant or 0)))
    return _CURRENT[value][1]


def build() -> nn.Module:
    return current().build()


def make_batch(batch_size: int):
    return current().make_batch(batch_size)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    return current().loss_fn(model, batch)


if __name__ == "__main__":
    if sys.argv[1:] == ["--timm-families"]:
        quiet()
        _import_torchvision()
        print(json.dumps(timm_families(live=True), indent=1))
    else:
        print("\n".join(f"{a.key}\t{a.kind}\t{a.detail}" for a in all_archs(sys.argv[1] if sys.argv[1:] else None)))
