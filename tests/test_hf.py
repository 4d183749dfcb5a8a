"""hf.py: Hugging Face causal LMs from a local config.json, random weights, no download."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tune.errors import TargetError
from ckpt_tune.measure.hf import hf_model_info, load_hf_target
from ckpt_tune.measure.loader import load_target
from ckpt_tune.measure.user_code import build_model, compute_loss, make_batch

pytestmark = pytest.mark.hf

CONFIGS = Path(__file__).parent.parent / "examples" / "configs"
TINY = CONFIGS / "gpt2-tiny.json"


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def llama_params(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> int:
    """Llama/Mistral parameter count: untied embedding and lm_head, no biases, two RMSNorms per layer."""
    head_dim = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q, o: H×H; k, v: H×(kv·d)
    mlp = 3 * hidden * inter  # gate, up, down
    return 2 * vocab * hidden + layers * (attn + mlp + 2 * hidden) + hidden


# name -> (published parameter count, the same from the formula with the config's shapes)
PUBLISHED = {
    "llama-2-7b": (6_738_415_616, llama_params(32000, 4096, 11008, 32, 32, 32)),
    "llama-2-13b": (13_015_864_320, llama_params(32000, 5120, 13824, 40, 40, 40)),
    "llama-2-70b": (68_976_648_192, llama_params(32000, 8192, 28672, 80, 64, 8)),
    "llama-3-8b": (8_030_261_248, llama_params(128256, 4096, 14336, 32, 32, 8)),
    "mistral-7b": (7_241_732_096, llama_params(32000, 4096, 14336, 32, 32, 8)),
}


def test_tiny_gpt2_builds_with_random_weights(transformers):
    target = load_hf_target(TINY, seq_len=32)
    assert target.is_hf
    assert target.spec == f"hf:{TINY}"
    assert target.loss_fn is None
    model = build_model(target)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.training
    assert model.config.use_cache is False
    assert next(model.parameters()).dtype == torch.float32
    d, vocab, pos, layers = 64, 1000, 256, 2
    per_layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    # lm_head is tied to wte, so it adds nothing: 180,480
    assert sum(p.numel() for p in model.parameters()) == vocab * d + pos * d + layers * per_layer + 2 * d
    # two builds are two models, not one shared object
    assert build_model(target) is not model


def test_tiny_gpt2_batch_is_fixed_random_tokens(transformers):
    target = load_hf_target(TINY, seq_len=32)
    batch = make_batch(target, 3)
    assert sorted(batch) == ["input_ids", "labels"]
    assert batch["input_ids"].shape == (3, 32)
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].min() >= 0
    assert batch["input_ids"].max() < 1000
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    assert torch.equal(make_batch(target, 3)["input_ids"], batch["input_ids"])


def test_tiny_gpt2_loss_is_a_trainable_scalar(transformers):
    target = load_hf_target(TINY, seq_len=32, attn="eager")
    model = build_model(target)
    loss = compute_loss(target, model, make_batch(target, 2))
    assert loss.shape == ()
    assert loss.requires_grad
    # random init predicts nearly uniformly over 1000 tokens: cross-entropy ≈ ln(1000) = 6.91
    assert abs(loss.item() - math.log(1000)) < 0.5
    loss.backward()
    assert model.transformer.wte.weight.grad is not None


def test_model_info_reads_the_config(transformers):
    info = hf_model_info(load_hf_target(CONFIGS / "llama-2-70b.json", seq_len=4096))
    assert info["model_type"] == "llama"
    assert (info["num_layers"], info["hidden_size"], info["num_heads"], info["num_kv_heads"]) == (
        80,
        8192,
        64,
        8,
    )
    assert (info["vocab_size"], info["seq_len"], info["max_positions"]) == (32000, 4096, 4096)
    assert info["config_dtype"] == "float16"
    tiny = hf_model_info(load_hf_target(TINY, seq_len=16))
    # GPT-2 names them n_layer / n_embd / n_head; the config maps the common names onto them
    assert (tiny["num_layers"], tiny["hidden_size"], tiny["num_heads"], tiny["vocab_size"]) == (
        2,
        64,
        4,
        1000,
    )
    with pytest.raises(ValueError, match="not a Hugging Face target"):
        hf_model_info(load_target(f"{Path(__file__).parent / 'assets' / 'targets' / 'good.py'}:build"))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_have_published_sizes(transformers, name):
    path = CONFIGS / f"{name}.json"
    published, formula = PUBLISHED[name]
    assert formula == published
    config = transformers.AutoConfig.from_pretrained(str(path))
    assert config.model_type == json.loads(path.read_text())["model_type"]
    target = load_hf_target(path, seq_len=2048)
    # meta tensors have shapes and no storage: a 70B model costs no RAM here
    with torch.device("meta"):
        model = build_model(target)
    assert sum(p.numel() for p in model.parameters()) == published
    assert next(model.parameters()).dtype == torch.float32  # not the file's fp16/bf16


def test_config_directory_is_accepted(transformers, tmp_path):
    (tmp_path / "config.json").write_text(TINY.read_text())
    assert load_hf_target(tmp_path, seq_len=8).file_path == (tmp_path / "config.json").resolve()


def test_seq_len_longer_than_positions(transformers):
    with pytest.raises(TargetError, match="--seq-len 512 is longer than the model's 256 positions") as info:
        load_hf_target(TINY)
    assert "--seq-len 256" in info.value.hint


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"vocab_size": 10}', "has no model_type"),
        ('{"model_type": "llama-9000"}', "model_type 'llama-9000' is unknown to transformers"),
        ('{"model_type": "t5"}', "model_type 't5' has no causal-LM class"),
    ],
)
def test_bad_config_files_name_the_file(transformers, tmp_path, text, message):
    path = tmp_path / "my-config.json"
    path.write_text(text)
    with pytest.raises(TargetError) as info:
        load_hf_target(path, seq_len=8)
    assert str(path.resolve()) in info.value.message
    assert message in info.value.message


def test_missing_config_file(transformers, tmp_path):
    with pytest.raises(TargetError, match=f"config file not found: {tmp_path.resolve()}"):
        load_hf_target(tmp_path / "nope.json")


def test_attention_choices(transformers):
    with pytest.raises(TargetError, match="unknown attention implementation 'fast'"):
        load_hf_target(TINY, seq_len=8, attn="fast")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(TargetError, match="needs the flash-attn package") as info:
            load_hf_target(TINY, seq_len=8, attn="flash")
        assert "--attn sdpa" in info.value.hint
    assert hf_model_info(load_hf_target(TINY, seq_len=8, attn="eager"))["attn_implementation"] == "eager"


def test_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(TargetError, match="needs the transformers package") as info:
        load_hf_target(TINY)
    assert info.value.hint == "pip install 'ckpt-tune[hf]'"
