"""QLoRA on your own model: the GPT of examples/gpt.py with a 4-bit NF4 base and LoRA adapters.

What the bitsandbytes and peft documentation teach, on a model that is not a Hugging Face one: every
Linear layer of the transformer blocks becomes a bitsandbytes `Linear4bit` (NF4, double quantization,
bf16 compute), the base is frozen, and peft adds LoRA adapters to the attention and MLP projections.
bitsandbytes' 4-bit layers run on the CPU, so a target for ckpt-tune on any machine:

    ckpt-tune profile examples/qlora_gpt.py:build --device cpu --precision bf16-mixed --batch-size 8
    ckpt-tune search  examples/qlora_gpt.py:build --device cpu --precision bf16-mixed --vram 48MiB

Needs `pip install bitsandbytes peft`. make_batch and loss_fn are examples/gpt.py's.
"""

import sys
from pathlib import Path

import bitsandbytes as bnb
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import build as build_gpt
from gpt import loss_fn, make_batch  # noqa: F401  (ckpt-tune finds them in this module)

LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]  # the blocks' projections


def _to_4bit(linear: nn.Linear) -> bnb.nn.Linear4bit:
    """linear's weights quantized to NF4, as `BitsAndBytesConfig(load_in_4bit=True, ...)` does on load."""
    q = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.bfloat16,
        compress_statistics=True,  # double quantization
        quant_type="nf4",
    )
    q.weight = bnb.nn.Params4bit(
        linear.weight.data.to(torch.bfloat16), requires_grad=False, compress_statistics=True, quant_type="nf4"
    )
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.to(torch.bfloat16), requires_grad=False)
    return q.to("cpu")  # moving a Params4bit to a device quantizes it


def build(n_layer: int = 4, n_embd: int = 256, r: int = 8):
    model = build_gpt(n_layer=n_layer, n_embd=n_embd, n_head=4, dropout=0.0)
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, _to_4bit(child))
    model.requires_grad_(False)  # the base is frozen; peft's adapters are what trains
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, target_modules=LORA_TARGETS)
    return get_peft_model(model, config)
