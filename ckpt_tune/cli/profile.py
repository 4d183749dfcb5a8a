"""`ckpt-tune profile`: per-module activation memory and the whole-step breakdown."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpt_tune.cli import options
from ckpt_tune.cli.options import (
    Attn,
    BatchFn,
    BatchSize,
    Device,
    HfConfig,
    Json,
    LoraAlpha,
    LoraDropout,
    LoraR,
    LoraTargets,
    LossFn,
    Optim,
    Peft,
    Precision,
    SeqLen,
    TargetArg,
)


def profile(
    target: TargetArg = None,
    batch_size: BatchSize = 8,
    device: Device = None,
    precision: Precision = "fp32",
    optimizer: Optim = "adamw",
    batch_fn: BatchFn = None,
    loss_fn: LossFn = None,
    hf_config: HfConfig = None,
    seq_len: SeqLen = 512,
    attn: Attn = "sdpa",
    peft: Peft = None,
    lora_r: LoraR = 16,
    lora_alpha: LoraAlpha = 32,
    lora_dropout: LoraDropout = 0.05,
    lora_targets: LoraTargets = "all-linear",
    top: Annotated[int, typer.Option(help="rows in the module table")] = 15,
    depth: Annotated[int | None, typer.Option(help="show subtrees down to this depth instead of own bytes")] = None,
    as_json: Json = False,
    save: Annotated[Path | None, typer.Option("--save", help="write the profile as YAML")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="draw the step's memory over time and the largest modules to this .png or .svg (needs ckpt-tune[plot])")] = None,
) -> None:
    """Per-module activation memory and the whole-step breakdown of one training iteration."""
    from ckpt_tune.cli import render as report
    from ckpt_tune.measure import session

    if plot:  # a bad file name, or no matplotlib, is said before the step is recorded
        from ckpt_tune.cli import plot as figures

        figures.check_path(plot)
        figures.require_matplotlib()
    settings = options.settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn,
                                peft=options.peft_spec(peft, lora_r, lora_alpha, lora_dropout, lora_targets))
    with report.progress("profiling") as _:
        prof = session.profile(target, batch_size=batch_size, settings=settings)
    report.render_profile(prof, top=top, depth=depth)
    options.say_attention(hf_config, attn, seq_len)
    d = prof.to_dict()
    if save:
        import yaml

        save.write_text(yaml.safe_dump(d, sort_keys=False))
        report.err.print(f"profile written to {save}")
    if plot:
        figures.profile_figure(prof, plot, top=top)
        report.err.print(f"figure written to {plot}")
    if as_json:
        options.print_json(d)
