"""The options every command shares, named once: typer annotations, the settings they build, JSON out."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

# Nothing here imports torch: `ckpt-tune --help` stays fast. Settings and rendering load on use.

TargetArg = Annotated[str | None, typer.Argument(help="path/to/file.py:fn or package.module:fn; fn() returns the model")]
Device = Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N | meta (default: cuda if available, else cpu)")]
Precision = Annotated[str, typer.Option(help="fp32 | bf16-mixed | fp16-mixed | bf16")]
Optim = Annotated[str, typer.Option("--optimizer", help="adamw | adam | adamw-8bit | paged-adamw-8bit | sgd | sgd-momentum | none")]
BatchFn = Annotated[str | None, typer.Option("--batch-fn", help="make_batch override, file.py:fn")]
LossFn = Annotated[str | None, typer.Option("--loss-fn", help="loss_fn override, file.py:fn")]
HfConfig = Annotated[str | None, typer.Option("--hf-config", help="build a Hugging Face causal LM from this config.json")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="sequence length of the --hf-config batch")]
Attn = Annotated[str, typer.Option("--attn", help="attention kernel for --hf-config: sdpa | eager | flash")]
Peft = Annotated[str | None, typer.Option("--peft", help="lora | qlora: fine-tune the --hf-config model with peft LoRA adapters on a frozen bf16 base, or on a 4-bit NF4 base (bitsandbytes)")]
LoraR = Annotated[int, typer.Option("--lora-r", help="LoRA rank, with --peft")]
LoraAlpha = Annotated[int, typer.Option("--lora-alpha", help="LoRA alpha, with --peft")]
LoraDropout = Annotated[float, typer.Option("--lora-dropout", help="LoRA dropout, with --peft")]
LoraTargets = Annotated[str, typer.Option("--lora-targets", help="modules that get adapters, comma-separated name suffixes (q_proj,v_proj), or all-linear: every linear layer but the output head")]
Json = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="micro-batch size")]
Margin = Annotated[str | None, typer.Option(help="held back from the budget: 5% or 512MiB (default 5% on cuda, 0 on cpu)")]


def peft_spec(peft: str | None, r: int, alpha: int, dropout: float, targets: str):
    """--peft and its --lora-* options as a PeftSpec (None without --peft)."""
    from ckpt_tune.plan.finetune import PeftSpec, parse_targets

    if peft is None:
        return None
    return PeftSpec(peft, r, alpha, dropout, parse_targets(targets))


def settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn, peft=None):
    """The Settings of measure/session.py from the shared options (`peft`: a PeftSpec, or None)."""
    from ckpt_tune.measure.session import Settings

    return Settings(
        device=device, precision=precision, optimizer=optimizer, batch_fn=batch_fn, loss_fn=loss_fn,
        hf_config=hf_config, seq_len=seq_len, attn=attn, peft=peft,
    )


def say_attention(hf_config, attn: str, seq_len: int) -> None:
    """The attention kernel changes activation memory by O(T) vs O(T²) per head: say which was modelled."""
    if hf_config:
        from ckpt_tune.cli import render

        if attn == "eager":
            what = "the eager path, which saves the T×T attention matrix per head"
        else:
            what = (f"{attn}: flash-style kernels save O(T) per head, but with attention dropout or an explicit "
                    "mask sdpa falls back to the math path (T×T); the numbers above are the kernel this device ran")
        render.err.print(f"attention at sequence {seq_len}: {what}")


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
