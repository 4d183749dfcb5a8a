"""A Hugging Face model fine-tuned with LoRA or QLoRA, built the way people build it (plan/finetune.py).

LoRA: the base loaded in bf16 (`dtype=torch.bfloat16`), frozen, peft `LoraConfig` adapters on it.
QLoRA: what `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)` then
`prepare_model_for_kbit_training` give: every linear layer but the output head becomes a bitsandbytes
`Linear4bit` (transformers' quantizer keeps the head out), the rest of the base goes to fp32, every base
parameter is frozen, and the adapters are peft's own `lora.bnb.Linear4bit`.

`from_pretrained` with a quantization config is the only public way to that model and it needs weights;
there are none here (random weights, docs/design.md §3), so the swap transformers' quantizer does is done
by hand: the same classes, arguments and quantization call (`Params4bit._quantize`). Under `--device meta`
the weights are meta tensors and bitsandbytes' own meta kernels give the packed weight and quantization
state their real shapes (measure/quantized.py); nothing is quantized for real.
"""

from __future__ import annotations

import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.plan.finetune import PeftSpec

PEFT_HINT = "pip install 'ckpt-tune[peft]' (peft and bitsandbytes)"


def require(spec: PeftSpec) -> None:
    """Raise a clear error when peft, or bitsandbytes for QLoRA, is not importable."""
    import importlib.util

    missing = [m for m in ("peft", "bitsandbytes" if spec.quantized else None) if m and importlib.util.find_spec(m) is None]
    if missing:
        raise CkptTuneError(f"--peft {spec.method} needs {' and '.join(missing)}, not installed here", PEFT_HINT)


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers transformers' bitsandbytes quantizer converts: every `nn.Linear` (subclasses too) and
    GPT-2's `Conv1D`, but the output head and what is quantized already."""
    import bitsandbytes as bnb

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is there for --hf-config
        Conv1D = ()
    head = _output_head(model)
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.Linear, Conv1D)) and mod is not head and not isinstance(mod, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    ]


def quantize_linears(model: nn.Module) -> int:
    """Swap every linear layer but the output head for a bitsandbytes NF4 `Linear4bit` (double
    quantization, bf16 compute), as transformers' bitsandbytes quantizer does; returns how many. A
    `Conv1D` (weight stored [in, out]) is quantized transposed, as transformers loads it."""
    import bitsandbytes as bnb

    swaps = _linear_layers(model)
    for name, lin in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        weight = lin.weight.detach().to(torch.bfloat16)
        if not isinstance(lin, nn.Linear):  # Conv1D: [in, out]
            weight = weight.t().contiguous()
        out_features, in_features = weight.shape
        q = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=lin.bias is not None,
            compute_dtype=torch.bfloat16,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.uint8,
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8, module=q
        )
        q.weight._quantize(weight.device)  # meta stays meta (quantized.meta_quantization)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.detach().to(torch.bfloat16), requires_grad=False)
        setattr(parent, child, q)
    return len(swaps)


def apply_peft(model: nn.Module, spec: PeftSpec) -> nn.Module:
    """`model` (a transformers PreTrainedModel) as `spec` fine-tunes it: a peft model, base frozen."""
    require(spec)
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model.to(torch.bfloat16)  # the base as people load it: dtype=torch.bfloat16
    if spec.quantized:
        if quantize_linears(model) == 0:
            raise CkptTuneError("--peft qlora found no linear layer to quantize", "use --peft lora")
        model.is_loaded_in_4bit = True  # what from_pretrained sets; prepare_model_for_kbit_training reads it
        # our plan decides checkpointing: peft's own (every layer, reentrant) stays off
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # target_modules naming nothing in the model; settings a layer type refuses
        raise CkptTuneError(
            f"peft rejected the LoRA settings ({spec.describe()}): {str(exc).splitlines()[0]}",
            "--lora-targets takes module-name suffixes such as q_proj,v_proj, or all-linear; "
            "peft's adapters on fused MoE experts need --lora-dropout 0",
        ) from exc
    return peft_model.train()
