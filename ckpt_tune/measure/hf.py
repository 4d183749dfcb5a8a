"""`--hf-config config.json`: a Hugging Face causal LM as a `Target`, with random weights.

Nothing is ever downloaded: the config file is read locally and the model is built with
`AutoModelForCausalLM.from_config`, which initialises weights randomly. The batch is random token ids
with `labels` = `input_ids`, so the model returns its own causal-LM loss (`loss_fn` is None).

Weights are built in float32 whatever the config's `torch_dtype` says: transformers 4.x ignores it in
`from_config` and 5.x honours it, and precision is the profiler's decision (bf16-mixed keeps fp32
master weights), not the config file's. With `--peft lora|qlora` the frozen base is bf16, as people load
it, and measure/peft_model.py adds the adapters (and, for QLoRA, the 4-bit layers).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_tune.errors import TargetError
from ckpt_tune.measure.loader import Target
from ckpt_tune.plan.finetune import PeftSpec

# --attn value -> transformers' attn_implementation
ATTN_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}
BATCH_SEED = 0  # fixed, so two runs (and the plan's verification run) see the same tokens


@dataclass(frozen=True, eq=False)
class HFBuild:
    """build_fn of an HF target: a fresh random-weight model per call (callable, so reports can read it)."""

    config: Any  # transformers.PretrainedConfig, use_cache already False
    attn_implementation: str
    config_dtype: str | None  # the file's torch_dtype/dtype, for reports only
    peft: PeftSpec | None = None  # LoRA / QLoRA on a frozen base (measure/peft_model.py); None: full fine-tuning

    def __call__(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        # from_config records the attention choice on the config it is given: keep ours pristine.
        config = copy.deepcopy(self.config)
        dtype = torch.float32 if self.peft is None else torch.bfloat16  # a peft base is loaded in bf16
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=self.attn_implementation, **{_dtype_kwarg(): dtype}
        )
        model.config.use_cache = False  # a KV cache is dead weight in training and breaks checkpointing
        if self.peft is not None:
            from ckpt_tune.measure.peft_model import apply_peft

            model = apply_peft(model, self.peft)
        return model.train()


@dataclass(frozen=True)
class HFBatch:
    """batch_fn of an HF target: {"input_ids", "labels"}, LongTensor[b, seq_len] from range(vocab_size)."""

    vocab_size: int
    seq_len: int
    seed: int = BATCH_SEED

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        input_ids = torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=gen)  # [b, T]
        # A copy, as a data collator makes one: labels are a tensor of their own in a real step.
        return {"input_ids": input_ids, "labels": input_ids.clone()}


def _dtype_kwarg() -> str:
    # transformers renamed torch_dtype to dtype in 4.56 and warns on the old name from then on.
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            hint="--hf-config takes a model's config.json",
        ) from exc
    except OSError as exc:
        raise TargetError(
            f"cannot read {path}: {exc.strerror}", hint="--hf-config takes a model's config.json"
        ) from exc
    if not isinstance(data, dict):
        raise TargetError(
            f"{path} holds a JSON {type(data).__name__}, not an object",
            hint="--hf-config takes a model's config.json",
        )
    return data


def load_hf_target(config_path: str | Path, seq_len: int = 512, attn: str = "sdpa", peft: PeftSpec | None = None) -> Target:
    """A Target that builds `AutoModelForCausalLM.from_config(<config_path>)` (with `peft`'s adapters)
    and feeds it random tokens."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as exc:
        raise TargetError(
            "--hf-config needs the transformers package, which is not importable here",
            hint="pip install 'ckpt-tune[hf]'",
        ) from exc

    if attn not in ATTN_IMPLEMENTATIONS:
        raise TargetError(f"unknown attention implementation {attn!r}", hint="use one of: sdpa, eager, flash")
    if attn == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise TargetError(
            "--attn flash needs the flash-attn package, which is not installed here",
            hint="use --attn sdpa (PyTorch's fused attention, also O(seq_len) memory on CUDA)",
        )

    path = Path(config_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    path = path.resolve()
    if not path.is_file():
        raise TargetError(f"config file not found: {path}", hint="--hf-config takes a model's config.json")
    data = _read_config(path)

    model_type = data.pop("model_type", None)
    if not model_type:
        raise TargetError(
            f"{path} has no model_type", hint='add e.g. "model_type": "llama" (see examples/configs/)'
        )
    if model_type not in CONFIG_MAPPING:
        raise TargetError(
            f"{path}: model_type {model_type!r} is unknown to transformers",
            hint="check the spelling, or upgrade transformers; remote code (auto_map) is never run",
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TargetError(
            f"{path}: model_type {model_type!r} has no causal-LM class (AutoModelForCausalLM)",
            hint="--hf-config builds decoder language models; wrap other models in a build() function",
        )
    # The dtype is dropped here, not passed on: weights are fp32 (see the module docstring).
    old_name, new_name = data.pop("torch_dtype", None), data.pop("dtype", None)
    config_dtype = new_name or old_name
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (TypeError, ValueError) as exc:
        raise TargetError(
            f"{path}: transformers rejected the config: {exc}", hint="compare with examples/configs/"
        ) from exc
    config.use_cache = False

    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise TargetError(
            f"{path} has no usable vocab_size (got {vocab_size!r})", hint='add e.g. "vocab_size": 32000'
        )
    max_positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise TargetError(
            f"--seq-len must be a positive integer, got {seq_len!r}", hint="e.g. --seq-len 2048"
        )
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise TargetError(
            f"--seq-len {seq_len} is longer than the model's {max_positions} positions ({path.name})",
            hint=f"use --seq-len {max_positions} or less, or raise max_position_embeddings in the config",
        )

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if peft is not None:
        from ckpt_tune.measure.peft_model import require

        require(peft)
    return Target(
        spec=f"hf:{config_path}",
        module_name="transformers",
        file_path=path,
        fn_name=f"{class_name}.from_config",
        build_fn=HFBuild(config, ATTN_IMPLEMENTATIONS[attn], config_dtype, peft),
        batch_fn=HFBatch(vocab_size, seq_len),
        loss_fn=None,
        batch_source=f"random token ids [batch, {seq_len}] from range({vocab_size}), labels = input_ids, seed {BATCH_SEED}",
        loss_source="the model's own .loss (causal-LM cross-entropy on labels)",
        is_hf=True,
    )


def hf_model_info(target: Target) -> dict[str, Any]:
    """The config's shape, for reports: model_type, num_layers, hidden_size, num_heads, vocab_size, seq_len, ..."""
    if not (target.is_hf and isinstance(target.build_fn, HFBuild) and isinstance(target.batch_fn, HFBatch)):
        raise ValueError(f"{target.spec} is not a Hugging Face target (made by load_hf_target)")
    config = target.build_fn.config
    num_heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or num_heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": config.vocab_size,
        "seq_len": target.batch_fn.seq_len,
        "max_positions": getattr(config, "max_position_embeddings", None),
        "attn_implementation": target.build_fn.attn_implementation,
        "config_dtype": target.build_fn.config_dtype,
        "peft": None if target.build_fn.peft is None else target.build_fn.peft.to_data(),
    }
