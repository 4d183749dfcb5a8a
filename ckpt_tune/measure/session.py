"""One session with the user's training step: settings, the loaded target, the runner that records it.

Every command starts here: `load` resolves the target (a file/module function or an --hf-config),
`build_runner` builds the model on the device (or under fake tensors for `--device meta`) and the
`StepRunner` that measures its iterations, and `user_errors` turns an exception raised inside the
user's code into one clear error. `profile` is the library call behind `ckpt-tune profile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError, LimitationError, UserCodeError
from ckpt_tune.measure import loader, user_code
from ckpt_tune.measure.device import resolve_device
from ckpt_tune.measure.host import HostGuard
from ckpt_tune.measure.loader import HOST_OOM, MISSING_KERNEL
from ckpt_tune.measure.profiler import StepProfile, profile_model
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.plan.finetune import PeftSpec
from ckpt_tune.vocab import RunSpec

_PACKAGE = Path(__file__).resolve().parents[1]  # ckpt_tune/


@dataclass(frozen=True, kw_only=True)
class Settings(RunSpec):
    """How the target is loaded and the iteration is run (the options shared by all commands): a
    `RunSpec` whose device may be None or "auto", and the target's loading options.

    `batch_size`, `world_size` and `shard` are the run's when a command is not given its own."""

    unresolved_device: ClassVar[bool] = True

    device: str | None = None  # None/"auto": cuda when available, else cpu
    batch_fn: str | None = None  # --batch-fn override, "file.py:fn"
    loss_fn: str | None = None  # --loss-fn override
    hf_config: str | None = None  # --hf-config config.json: build a Hugging Face causal LM from it
    seq_len: int = 512  # --seq-len for --hf-config
    attn: str = "sdpa"  # --attn for --hf-config
    peft: PeftSpec | None = None  # --peft lora|qlora (and --lora-*) for --hf-config


PROFILE_BATCH = 8  # the micro-batch profile, check and diagnose measure at when none is given


def run_of(
    settings: Settings,
    batch_size: int | None,
    world_size: int | None,
    shard: str | None,
    default_batch: int | None = PROFILE_BATCH,
) -> tuple[int | None, int | None, str | None]:
    """The batch size and sharded run a command works at: its own arguments, else the settings', else
    `default_batch` (None: the command finds the batch). The sharded run is the settings' only when the
    command was given neither `world_size` nor `shard`."""
    if world_size is None and shard is None and settings.world_size > 1:
        world_size, shard = settings.world_size, settings.shard
    batch = next((b for b in (batch_size, settings.batch_size) if b is not None), default_batch)
    return batch, world_size, shard


def load(target: str | loader.Target | None, settings: Settings) -> loader.Target:
    """The target a command works on: a `loader.Target` as it is (a framework integration's own build,
    batch and loss functions), else the --hf-config model, else the target string resolved.

    Raises:
        CkptTuneError: no target at all, or a `loader.Target` given with settings that name another
            one (`hf_config`, `batch_fn`, `loss_fn`).
        TargetError: the target string cannot be resolved (loader.load_target).
    """
    if isinstance(target, loader.Target):
        named = [k for k in ("hf_config", "batch_fn", "loss_fn") if getattr(settings, k)]
        if named:
            raise CkptTuneError(
                f"a loaded target comes with its own functions; the settings also name {', '.join(named)}",
                "leave hf_config, batch_fn and loss_fn unset in Settings when passing a loader.Target",
            )
        return target
    if settings.hf_config:
        from ckpt_tune.measure.hf import load_hf_target

        return load_hf_target(settings.hf_config, seq_len=settings.seq_len, attn=settings.attn, peft=settings.peft)
    if settings.peft is not None:
        raise CkptTuneError(
            "--peft applies to --hf-config models",
            "build your own target with peft (and bitsandbytes) in its build function; it is measured as it is",
        )
    if not target:
        raise CkptTuneError(
            "no target given",
            "pass TARGET as path/to/file.py:fn or package.module:fn, or --hf-config; "
            'or set `target = "..."` under [tool.ckpt-tune] in pyproject.toml',
        )
    return loader.load_target(target, batch_fn=settings.batch_fn, loss_fn=settings.loss_fn)


@contextlib.contextmanager
def user_errors(what: str) -> Iterator[None]:
    """Errors raised from inside the user's model during a step become one clear UserCodeError;
    running out of memory, or a CPU without a kernel the step needs, is said as what it is."""
    try:
        yield
    except CkptTuneError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise CkptTuneError(
            f"{what} ran out of memory: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            "use a smaller --batch-size, or profile a smaller configuration with --device meta",
        ) from e
    except RuntimeError as e:
        if HOST_OOM in str(e):
            raise CkptTuneError(
                f"{what} ran out of host memory: {str(e).splitlines()[0]}",
                "this machine's RAM cannot hold the step at that batch: use --device meta to size it under "
                "fake tensors, or a smaller --batch-size",
            ) from e
        if MISSING_KERNEL in str(e):
            raise CkptTuneError(
                f"this CPU cannot run the step at this precision: oneDNN has no kernel for one of its ops "
                f"({str(e).splitlines()[0][:100]})",
                "use --precision fp32 on this machine, or --device meta to size the step without running it",
            ) from e
        raise UserCodeError(
            f"the training step raised RuntimeError: {str(e).splitlines()[0] if str(e) else ''}",
            "run the step by hand to debug it, or rerun with --debug for the full traceback",
        ) from e
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        ours = _raised_in_ckpt_tune(e)
        if ours is not None:
            raise LimitationError(
                f"ckpt-tune failed while {what}, in its own code, not in your step: {type(e).__name__}: {msg} ({ours})",
                "this is ckpt-tune's bug: rerun with --debug for the traceback and report it",
            ) from e
        raise UserCodeError(
            f"the training step raised {type(e).__name__}: {msg}",
            "run the step by hand to debug it, or rerun with --debug for the full traceback",
        ) from e


def _raised_in_ckpt_tune(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame when it is ckpt-tune's own code (the error is then ours, not
    the step's: docs/design.md §10), else None."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    if _PACKAGE not in path.parents:
        return None
    return f"{path.relative_to(_PACKAGE.parent)}:{tb.tb_lineno}"


def build_runner(
    target: loader.Target,
    settings: Settings,
    world_size: int = 1,
    shard: str = "none",
    units_of: Callable[[nn.Module], Sequence[str]] | None = None,
) -> tuple[nn.Module, StepRunner, StepSettings]:
    """The model and the runner that records its step. With `world_size` > 1 the runner records rank 0 of
    a sharded run under PyTorch's own engine (measure/sharded.py; `sharded_engine` says where it can),
    with shard units `units_of(model)` (None: sharded.default_units)."""
    device = resolve_device(settings.device)
    step = StepSettings(
        device=device, precision=settings.precision, optimizer=settings.optimizer, world_size=world_size, shard=shard
    )
    if device == "meta":  # fake tensors: nothing is allocated; the CUDA allocator's rounding is modelled
        from ckpt_tune.measure import fake_inputs

        model = fake_inputs.build_fake_model(target)
        batch_fn = fake_inputs.fake_batch_fn(target, "cpu")
    else:
        model = user_code.build_model(target)
        with user_errors("moving the model"):
            model.to(device)

        def batch_fn(b):
            return user_code.make_batch(target, b, device)

    def loss_fn(m, batch):
        return user_code.compute_loss(target, m, batch)

    if sharded_engine(device, world_size):
        from ckpt_tune.measure.sharded import ShardedRunner

        units = None if units_of is None else tuple(units_of(model))
        runner = ShardedRunner(model, batch_fn, loss_fn, step, world_size=world_size, shard=shard, units=units)
        if device == "cpu":  # one fake process group per process: a larger step is refused, not faked
            runner = HostGuard(runner, lambda: _too_large_sharded(world_size, shard))
        return model, runner, step
    runner = StepRunner(model, batch_fn, loss_fn, step)
    if device == "cpu":  # a step this machine cannot hold is recorded under fake tensors (measure/host.py)
        runner = HostGuard(runner, lambda: fake_twin(target, step))
    return model, runner, step


def fake_twin(target: loader.Target, step: StepSettings) -> StepRunner:
    """A runner of the target's step under fake tensors with the allocator rules of `step`'s device
    (measure/fake.py: the CPU's, or CUDA's as `--device meta` sizes them): the same bytes as the real
    step, nothing allocated."""
    from ckpt_tune.measure import fake_inputs

    fake_step = replace(step, device="meta", fake_target=torch.device(step.device).type)

    def loss_fn(m, batch):
        return user_code.compute_loss(target, m, batch)

    return StepRunner(fake_inputs.build_fake_model(target), fake_inputs.fake_batch_fn(target, "cpu"), loss_fn, fake_step)


def sharded_engine(device: str, world_size: int) -> bool:
    """Whether a step of `world_size` > 1 is recorded under the real sharding engine (a fake process
    group on this CPU or under fake tensors); on a CUDA device it is divided by arithmetic (tune/sharding.py)."""
    return world_size > 1 and device in ("cpu", "meta")


def _too_large_sharded(world_size: int, shard: str) -> StepRunner:
    raise CkptTuneError(
        f"this {shard} step over {world_size} ranks needs more RAM than this machine can give it: the model is "
        "built whole before it is sharded",
        "use --device meta: the sharded step is then recorded under fake tensors, which allocate nothing",
    )


def profile(
    target: str | None,
    batch_size: int | None = None,
    settings: Settings = Settings(),
    checkpoint: tuple[str, ...] = (),
    scaling: bool = True,
    world_size: int | None = None,
    shard: str | None = None,
    units_of: Callable[[nn.Module], Sequence[str]] | None = None,
) -> StepProfile:
    """Profile one training iteration of the target at `batch_size`; with `world_size` > 1, rank 0's
    under the sharding engine where `sharded_engine` says it runs (build_runner). Arguments left None
    are the settings' (`run_of`); the batch then defaults to PROFILE_BATCH, the run to one device."""
    batch_size, world_size, shard = run_of(settings, batch_size, world_size, shard)
    world_size, shard = world_size or 1, shard or "none"
    t = load(target, settings)
    model, runner, step = build_runner(t, settings, world_size, shard, units_of)
    with user_errors("profiling"):
        prof = profile_model(
            model,
            runner.batch_fn,
            runner.loss_fn,
            batch_size=batch_size,
            settings=step,
            target=t.spec,
            scaling=scaling,
            checkpoint=checkpoint,
            runner=runner,
        )
    if isinstance(runner, HostGuard) and runner.fake_batches:
        prof = replace(prof, measured_by="; ".join(["fake tensors with the CPU allocator's rules", *runner.notes]))
    return prof
