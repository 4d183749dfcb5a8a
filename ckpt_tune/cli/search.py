"""`ckpt-tune search`: the largest batch that fits, the cheapest verified plan, its YAML and patch."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from ckpt_tune.cli import options
from ckpt_tune.cli.options import (
    Attn,
    BatchFn,
    Device,
    HfConfig,
    Json,
    LoraAlpha,
    LoraDropout,
    LoraR,
    LoraTargets,
    LossFn,
    Margin,
    Optim,
    Peft,
    Precision,
    SeqLen,
    TargetArg,
)
from ckpt_tune.plan.kinds import candidates_help


def search(
    target: TargetArg = None,
    vram: Annotated[str, typer.Option(help="budget: 24GB (read as GiB), 24GiB, 24000MiB, bytes, or auto")] = "auto",
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", min=1, help="fix the micro-batch; find the cheapest plan")] = None,
    target_batch: Annotated[int | None, typer.Option("--target-batch", min=1, help="wanted effective batch: micro-batch × accumulation")] = None,
    device: Device = None,
    precision: Precision = "fp32",
    optimizer: Optim = "adamw",
    margin: Margin = None,
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
    world_size: Annotated[int, typer.Option("--world-size", min=1, help="GPUs of a sharded data-parallel run: plan per GPU")] = 1,
    shard: Annotated[str, typer.Option("--shard", help="none | zero1 | zero2 | zero3 | fsdp: what is divided by --world-size")] = "none",
    segments: Annotated[bool, typer.Option("--segments/--no-segments", help="also plan runs of consecutive blocks under one checkpoint (--no-segments: one checkpoint per module, e.g. for FSDP wrapped per block)")] = True,
    candidates: Annotated[str, typer.Option("--candidates", help=candidates_help())] = "all",
    host_link: Annotated[float, typer.Option("--host-link", min=0.001, help="GB/s of the host link offload's transfers are priced at (modelled): PCIe 4.0 x16 by default")] = 25.0,
    out: Annotated[Path | None, typer.Option("--out", help="write the plan YAML here")] = None,
    patch: Annotated[Path | None, typer.Option("--patch", help="write the patch snippet here")] = None,
    emit: Annotated[str | None, typer.Option("--emit", help="torchtitan | deepspeed | hf-args: the closest configuration that launcher understands (TOML, JSON, TrainingArguments kwargs), what it cannot express and its measured peak; on stdout, or in --emit-out")] = None,
    emit_out: Annotated[Path | None, typer.Option("--emit-out", help="write the --emit configuration here")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="draw the frontier, the baselines and the plan to this .png or .svg (needs ckpt-tune[plot])")] = None,
    as_json: Json = False,
) -> None:
    """The largest batch that fits VRAM and the cheapest verified checkpoint plan that reaches it."""
    from ckpt_tune.cli import render as report
    from ckpt_tune.plan.file import plan_to_yaml, write_plan
    from ckpt_tune.plan.kinds import parse_candidates
    from ckpt_tune.plan.patch import patch_snippet
    from ckpt_tune.tune import search as search_api

    settings = options.settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn,
                                peft=options.peft_spec(peft, lora_r, lora_alpha, lora_dropout, lora_targets))
    kinds = parse_candidates(candidates)
    launcher = _launcher(emit, emit_out, as_json)
    if plot:  # a bad file name, or no matplotlib, is said before the search runs
        from ckpt_tune.cli import plot as figures

        figures.check_path(plot)
        figures.require_matplotlib()
    t0 = time.perf_counter()
    with report.progress("searching") as update:
        outcome = search_api.search(target, vram, batch_size=batch_size, target_batch=target_batch, margin=margin,
                             settings=settings, progress=update, world_size=world_size, shard=shard, segments=segments,
                                    candidates=kinds, host_link=host_link * 1e9)
    elapsed = time.perf_counter() - t0
    plan_yaml = plan_to_yaml(outcome.plan)
    snippet = patch_snippet(outcome.plan, hf=outcome.is_hf)
    report.render_search(outcome, plan_yaml, patch_snippet(outcome.plan, hf=outcome.is_hf, embed=False), elapsed)
    options.say_attention(hf_config, attn, seq_len)
    # measured before any file is written: a failing step leaves the user's files as they were
    emitted = _emit(outcome.plan, launcher, target, settings) if launcher else None
    if out:
        write_plan(outcome.plan, out)
        report.err.print(f"plan written to {out}")
    if patch:
        patch.write_text(snippet)
        report.err.print(f"patch written to {patch}")
    if emitted:
        _write_emitted(emitted, emit_out)
    if plot:
        figures.search_figure(outcome, plot)
        report.err.print(f"figure written to {plot}")
    if as_json:
        res = outcome.result
        options.print_json({
            "plan": outcome.plan.to_dict(),
            "budget": asdict(outcome.budget),
            "frontier": [r.to_dict() for r in res.frontier],
            "baselines": {k: v.to_dict() for k, v in res.baselines.items()},
            "candidates": list(res.units),
            "recorded_steps": res.probes,
            # probes under fake tensors (--device cpu): of the recorded steps, the real ones; the real steps
            # that timed the step; the largest real recorded peak (null where every step was real)
            "real_recorded_steps": res.real_steps,
            "timed_steps": res.timed_steps,
            "largest_real_peak_bytes": res.largest_real_peak,
            "extended_terms": res.extended_terms,
            "stage_seconds": res.stage_seconds,
            "elapsed_s": round(elapsed, 2),
            "notes": res.notes,
            **({"emit": emitted.to_dict()} if emitted else {}),
        })


def _launcher(emit: str | None, emit_out: Path | None, as_json: bool) -> str | None:
    """The --emit launcher, checked with --emit-out and --json before the search runs."""
    from ckpt_tune.errors import CkptTuneError
    from ckpt_tune.plan.launchers import LAUNCHERS
    from ckpt_tune.vocab import known

    if emit is None:
        if emit_out is not None:
            raise CkptTuneError("--emit-out names a file but no --emit launcher", f"add --emit {' | '.join(LAUNCHERS)}")
        return None
    if as_json and emit_out is None:
        raise CkptTuneError(
            "--emit without --emit-out prints the configuration on stdout, where --json prints its result",
            "write the configuration to a file with --emit-out FILE, or leave out --json",
        )
    return known("launcher", emit, LAUNCHERS, "--emit")


def _emit(plan, launcher: str, target, settings):
    """The launcher's configuration for the plan, the closest layout's peak measured; its summary on stderr."""
    from ckpt_tune.cli import render as report
    from ckpt_tune.tune.launchers import emit

    with report.progress(f"the closest {launcher} configuration") as update:
        emitted = emit(plan, launcher, target, settings, progress=update)
    report.err.print(emitted.summary, markup=False)
    return emitted


def _write_emitted(emitted, emit_out: Path | None) -> None:
    """The configuration in `emit_out`, or on stdout."""
    import sys

    from ckpt_tune.cli import render as report
    from ckpt_tune.errors import CkptTuneError
    from ckpt_tune.yamlio import write

    if emit_out is None:
        sys.stdout.write(emitted.text)
        return
    what = f"{emitted.expressed.launcher} configuration"
    write(emit_out, emitted.text, what, CkptTuneError)
    report.err.print(f"{what} written to {emit_out}", markup=False)
