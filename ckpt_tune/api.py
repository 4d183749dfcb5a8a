"""The library behind every command: plain functions a user can call from Python.

    from ckpt_tune.api import Settings, profile, search
    prof = profile("examples/gpt.py:build", batch_size=8)
    outcome = search("examples/gpt.py:build", vram="600MiB")

The CLI parses arguments, calls these, and renders what they return (report.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from ckpt_tune import loader
from ckpt_tune.device import Budget, parse_budget, resolve_device
from ckpt_tune.emit import Plan
from ckpt_tune.errors import CkptTuneError, NoFitError, UserCodeError
from ckpt_tune.profiler import StepProfile, profile_model
from ckpt_tune.runner import StepRunner, StepSettings
from ckpt_tune.search import Searcher, SearchResult, find_blocks


@dataclass(frozen=True)
class Settings:
    """How the target is loaded and the iteration is run (the options shared by all commands)."""

    device: str | None = None  # None/"auto": cuda when available, else cpu
    precision: str = "fp32"
    optimizer: str = "adamw"
    batch_fn: str | None = None  # --batch-fn override, "file.py:fn"
    loss_fn: str | None = None  # --loss-fn override
    hf_config: str | None = None  # --hf-config config.json: build a Hugging Face causal LM from it
    seq_len: int = 512  # --seq-len for --hf-config
    attn: str = "sdpa"  # --attn for --hf-config


def load(target: str | None, settings: Settings) -> loader.Target:
    if settings.hf_config:
        from ckpt_tune.hf import load_hf_target

        return load_hf_target(settings.hf_config, seq_len=settings.seq_len, attn=settings.attn)
    if not target:
        raise CkptTuneError("no target given", "pass TARGET as path/to/file.py:fn or package.module:fn, or --hf-config")
    return loader.load_target(target, batch_fn=settings.batch_fn, loss_fn=settings.loss_fn)


@contextlib.contextmanager
def _user_errors(what: str) -> Iterator[None]:
    """Errors raised from inside the user's model during a step become one clear UserCodeError."""
    try:
        yield
    except CkptTuneError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise CkptTuneError(
            f"{what} ran out of memory: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            "use a smaller --batch-size, or profile a smaller configuration with --device meta",
        ) from e
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise UserCodeError(
            f"the training step raised {type(e).__name__}: {msg}",
            "run the step by hand to debug it, or rerun with --debug for the full traceback",
        ) from e


def _runner(target: loader.Target, settings: Settings) -> tuple[nn.Module, StepRunner, StepSettings]:
    device = resolve_device(settings.device)
    step = StepSettings(device=device, precision=settings.precision, optimizer=settings.optimizer)
    if device == "meta":  # fake tensors: nothing is allocated; the CUDA allocator's rounding is modelled
        from ckpt_tune import fake

        model = fake.build_fake_model(target)
        batch_fn = fake.fake_batch_fn(target, "cpu")
    else:
        model = loader.build_model(target)
        with _user_errors("moving the model"):
            model.to(device)

        def batch_fn(b):
            return loader.make_batch(target, b, device)

    runner = StepRunner(model, batch_fn, lambda m, batch: loader.compute_loss(target, m, batch), step)
    return model, runner, step


def profile(
    target: str | None,
    batch_size: int = 8,
    settings: Settings = Settings(),
    checkpoint: tuple[str, ...] = (),
    scaling: bool = True,
) -> StepProfile:
    """Profile one training iteration of the target at `batch_size`."""
    t = load(target, settings)
    model, runner, step = _runner(t, settings)
    with _user_errors("profiling"):
        return profile_model(
            model,
            runner.batch_fn,
            runner.loss_fn,
            batch_size=batch_size,
            settings=step,
            target=t.spec,
            scaling=scaling,
            checkpoint=checkpoint,
        )


@dataclass(frozen=True)
class SearchOutcome:
    plan: Plan
    result: SearchResult
    budget: Budget
    is_hf: bool
    target_batch: int | None = None
    world_size: int = 1  # > 1: every byte figure is per GPU of a sharded run
    shard: str = "none"


def search(
    target: str | None,
    vram: str,
    batch_size: int | None = None,
    target_batch: int | None = None,
    margin: str | None = None,
    settings: Settings = Settings(),
    progress: Callable[[str], None] | None = None,
    world_size: int = 1,
    shard: str = "none",
    segments: bool = True,
) -> SearchOutcome:
    """Largest batch (or the given one) that fits `vram`, with the cheapest verified checkpoint plan.

    `segments`: also consider runs of consecutive blocks under one checkpoint (ckpt_tune/segment.py)."""
    t = load(target, settings)
    device = resolve_device(settings.device)
    # --device meta sizes a CUDA step: hold back the CUDA context and margin as on a GPU
    budget = parse_budget(vram, "cuda" if device == "meta" else device, margin)
    _model, runner, step = _runner(t, settings)
    with _user_errors("searching"), runner:
        searcher = Searcher(runner, progress=progress, world_size=world_size, shard=shard, segments=segments)
        fixed = batch_size
        if target_batch is not None and batch_size is None:
            fixed = None
        res = searcher.search(budget.usable_bytes, batch_size=fixed)
        if target_batch is not None:
            res = _fit_target_batch(searcher, res, target_batch, budget.usable_bytes)
        b1, b2 = 1, 4
        sizes = sorted({b1, b2, max(1, res.batch_size // 2), res.batch_size, res.batch_size + 1})
        res.frontier = searcher.frontier(budget.usable_bytes, sizes, b1, b2, res.batch_size)
        res.frontier = [
            r if r.batch_size != res.batch_size else replace(r, plan=res.checkpoint, predicted_peak=res.predicted_peak, recompute_fraction=res.recompute_fraction)
            for r in res.frontier
        ]
    plan = Plan(
        target=t.spec,
        device=device,
        precision=step.precision,
        optimizer=step.optimizer,
        budget_bytes=budget.usable_bytes,
        batch_size=res.batch_size,
        grad_accum_steps=res.grad_accum_steps,
        checkpoint=res.checkpoint,
        predicted_peak_bytes=res.predicted_peak,
        predicted_recompute_fraction=res.recompute_fraction,
        verified_peak_bytes=res.verified_peak,
    )
    return SearchOutcome(plan, res, budget, t.is_hf, target_batch, searcher.world_size, searcher.shard)


def _fit_target_batch(searcher: Searcher, res: SearchResult, want: int, budget: int) -> SearchResult:
    """Turn a wanted effective batch into micro-batch × accumulation steps, micro-batch ≤ what fits."""
    if want <= res.batch_size:
        if want == res.batch_size:
            return res
        res = searcher.search(budget, batch_size=want)
        res.notes.append(f"effective batch {want} fits as one micro-batch")
        return res
    # from the second micro-batch on every gradient is live: the micro-batch that fits alone may not
    steps = -(-want // res.batch_size)
    while True:
        while want % steps:
            steps += 1
        micro = want // steps
        searcher.accum_steps = steps
        try:
            out = searcher.search(budget, batch_size=micro)
            break
        except NoFitError:
            if micro == 1:
                raise
            steps += 1
    out.grad_accum_steps = steps
    out.notes.append(f"effective batch {want} = micro-batch {micro} × {steps} accumulation steps")
    return out


def blocks(model: nn.Module) -> list[str]:
    """The checkpoint candidates search would consider for `model`."""
    return find_blocks(model)
