"""ckpt-tune's command line: parse → call the library → render → exit code. No arithmetic here.

Exit codes: 0 success; 1 error (bad target or input, user code raised); 2 usage; 3 the answer is "no"
(nothing fits the budget, or `check` found a regression).
"""

from __future__ import annotations

import os

# Before torch is imported: the profiler's C++ side warns about blocks allocated before recording
# started, which is expected here and says nothing to the user.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ckpt_tune.errors import CkptTuneError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Where the memory of a PyTorch training step goes, and how to make it fit.",
    pretty_exceptions_enable=False,
)

_state = {"debug": False}

TargetArg = Annotated[str | None, typer.Argument(help="path/to/file.py:fn or package.module:fn; fn() returns the model")]
Device = Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N | meta (default: cuda if available, else cpu)")]
Precision = Annotated[str, typer.Option(help="fp32 | bf16-mixed | fp16-mixed | bf16")]
Optim = Annotated[str, typer.Option("--optimizer", help="adamw | adam | sgd | sgd-momentum | none")]
BatchFn = Annotated[str | None, typer.Option("--batch-fn", help="make_batch override, file.py:fn")]
LossFn = Annotated[str | None, typer.Option("--loss-fn", help="loss_fn override, file.py:fn")]
HfConfig = Annotated[str | None, typer.Option("--hf-config", help="build a Hugging Face causal LM from this config.json")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="sequence length of the --hf-config batch")]
Attn = Annotated[str, typer.Option("--attn", help="attention kernel for --hf-config: sdpa | eager | flash")]
Json = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="micro-batch size")]
Margin = Annotated[str | None, typer.Option(help="held back from the budget: 5% or 512MiB (default 5% on cuda, 0 on cpu)")]


def _settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn):
    from ckpt_tune.api import Settings

    return Settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn)


def _say_attention(hf_config, attn: str, seq_len: int) -> None:
    """The attention kernel changes activation memory by O(T) vs O(T²) per head: say which was modelled."""
    if hf_config:
        from ckpt_tune import report

        if attn == "eager":
            what = "the eager path, which saves the T×T attention matrix per head"
        else:
            what = (f"{attn}: flash-style kernels save O(T) per head, but with attention dropout or an explicit "
                    "mask sdpa falls back to the math path (T×T); the numbers above are the kernel this device ran")
        report.err.print(f"attention at sequence {seq_len}: {what}")


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="show full tracebacks")] = False) -> None:
    _state["debug"] = debug


@app.command()
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
    top: Annotated[int, typer.Option(help="rows in the module table")] = 15,
    depth: Annotated[int | None, typer.Option(help="show subtrees down to this depth instead of own bytes")] = None,
    as_json: Json = False,
    save: Annotated[Path | None, typer.Option("--save", help="write the profile as YAML")] = None,
) -> None:
    """Per-module activation memory and the whole-step breakdown of one training iteration."""
    from ckpt_tune import api, report

    settings = _settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn)
    with report.progress("profiling") as _:
        prof = api.profile(target, batch_size=batch_size, settings=settings)
    report.render_profile(prof, top=top, depth=depth)
    _say_attention(hf_config, attn, seq_len)
    d = prof.to_dict()
    if save:
        import yaml

        save.write_text(yaml.safe_dump(d, sort_keys=False))
        report.err.print(f"profile written to {save}")
    if as_json:
        _print_json(d)


@app.command()
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
    world_size: Annotated[int, typer.Option("--world-size", min=1, help="GPUs of a sharded data-parallel run: plan per GPU")] = 1,
    shard: Annotated[str, typer.Option("--shard", help="none | zero1 | zero2 | zero3 | fsdp: what is divided by --world-size")] = "none",
    segments: Annotated[bool, typer.Option("--segments/--no-segments", help="also plan runs of consecutive blocks under one checkpoint (--no-segments: one checkpoint per module, e.g. for FSDP wrapped per block)")] = True,
    out: Annotated[Path | None, typer.Option("--out", help="write the plan YAML here")] = None,
    patch: Annotated[Path | None, typer.Option("--patch", help="write the patch snippet here")] = None,
    as_json: Json = False,
) -> None:
    """The largest batch that fits VRAM and the cheapest verified checkpoint plan that reaches it."""
    from ckpt_tune import api, report
    from ckpt_tune.emit import patch_snippet, plan_to_yaml, write_plan

    settings = _settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn)
    t0 = time.perf_counter()
    with report.progress("searching") as update:
        outcome = api.search(target, vram, batch_size=batch_size, target_batch=target_batch, margin=margin,
                             settings=settings, progress=update, world_size=world_size, shard=shard, segments=segments)
    elapsed = time.perf_counter() - t0
    plan_yaml = plan_to_yaml(outcome.plan)
    snippet = patch_snippet(outcome.plan, hf=outcome.is_hf)
    report.render_search(outcome, plan_yaml, snippet, elapsed)
    _say_attention(hf_config, attn, seq_len)
    if out:
        write_plan(outcome.plan, out)
        report.err.print(f"plan written to {out}")
    if patch:
        patch.write_text(snippet)
        report.err.print(f"patch written to {patch}")
    if as_json:
        from dataclasses import asdict

        res = outcome.result
        _print_json({
            "plan": asdict(outcome.plan),
            "budget": asdict(outcome.budget),
            "frontier": [asdict(r) for r in res.frontier],
            "baselines": {k: asdict(v) for k, v in res.baselines.items()},
            "candidates": list(res.units),
            "recorded_steps": res.probes,
            "elapsed_s": round(elapsed, 2),
            "notes": res.notes,
        })


from ckpt_tune import check_cli, diagnose_cli  # noqa: E402  (commands kept in their own modules)

check_cli.register(app)
diagnose_cli.register(app)


def main() -> None:
    """Entry point: click handles usage errors (exit 2); our error family becomes one line and its code."""
    try:
        app()
    except CkptTuneError as e:
        if _state["debug"]:
            raise
        from ckpt_tune import report

        report.error(e.message, e.hint)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
