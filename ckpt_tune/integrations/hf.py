"""A ckpt-tune plan applied to a Hugging Face `transformers.Trainer`.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    apply_to_trainer(trainer, "plan.yaml")   # after building the Trainer, before train()
    trainer.train()

`apply_to_trainer` wraps the modules the plan names in `trainer.model` (`ckpt_tune.plan.apply.apply`;
a plan made on the base model also resolves inside a peft wrapper, `transformer.h.0` as
`base_model.model.transformer.h.0`), sets the run's micro-batch and accumulation to the plan's, turns
Hugging Face's own activation checkpointing off so that no module is checkpointed twice, and adds
`PlanGuard`, a callback that refuses to start a run whose settings are not the ones the plan was made
for (precision, tokens per sample, world size, batch). Importing this module imports transformers.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.plan.apply import HF_CHECKPOINTING, applied_names, apply
from ckpt_tune.plan.entry import member_names
from ckpt_tune.plan.file import Plan, load_plan
from ckpt_tune.vocab import PRECISIONS, SHARDS

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise CkptTuneError(
        "ckpt_tune.integrations.hf needs the transformers package, which is not importable here",
        hint="pip install 'ckpt-tune[hf]'",
    ) from exc

__all__ = ["PlanGuard", "apply_to_trainer", "first_batch", "run_precision"]

log = logging.getLogger(__name__)

# TrainingArguments flag -> the plan's precision (vocab.PRECISIONS) it trains in, fp32 weights kept
_MIXED = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}
# how a run trains in each precision
_PRECISION_ARGS = {
    "fp32": "TrainingArguments(bf16=False, fp16=False), float32 weights",
    "bf16-mixed": "TrainingArguments(bf16=True), float32 weights",
    "fp16-mixed": "TrainingArguments(fp16=True), float32 weights",
    "bf16": "the model's weights in torch.bfloat16",
}


def apply_to_trainer(trainer: Any, plan: Plan | str | Path | Mapping) -> tuple[str, ...]:
    """Apply a ckpt-tune plan to a `transformers.Trainer`, in place; call it before `trainer.train()`.

    Wraps the modules the plan names in `trainer.model` with non-reentrant checkpoint (names as
    `trainer.model.named_modules()` gives them, or, for a peft model, as its base model's do); sets
    `trainer.args.per_device_train_batch_size` and `gradient_accumulation_steps` to the plan's
    `batch_size` and `grad_accum_steps` (and the Trainer's own copy of the batch size); turns Hugging
    Face's activation checkpointing off (`args.activation_checkpointing` / `gradient_checkpointing`
    and the model's per-layer flags), saying so in a log warning; and adds a `PlanGuard` callback.

    Args:
        trainer: a `transformers.Trainer` built with `model=`.
        plan: a `Plan`, a plan file path, or a mapping with the plan file's keys.

    Returns:
        The names of the checkpointed modules, as `trainer.model.named_modules()` gives them.

    Raises:
        PlanError: the plan is unreadable or names modules the model lacks (nothing is changed then).
        CkptTuneError: `trainer` is not a Trainer, the Trainer builds its model in `train()`
            (`model_init`), or DeepSpeed already took its batch size from the arguments.
    """
    if not all(hasattr(trainer, a) for a in ("args", "add_callback", "callback_handler")):
        raise CkptTuneError(
            f"apply_to_trainer takes a transformers.Trainer, got {type(trainer).__name__}",
            hint="for a model of your own training loop, use ckpt_tune.apply(model, plan)",
        )
    plan = load_plan(plan)
    model = getattr(trainer, "model", None)
    if getattr(trainer, "model_init", None) is not None:
        raise CkptTuneError(
            "this Trainer was built with model_init, which builds a fresh model when train() starts: "
            "a plan applied now would be applied to a model that is thrown away",
            hint="build the model and pass Trainer(model=...), or call ckpt_tune.apply(model, plan) inside model_init",
        )
    if not isinstance(model, nn.Module):
        raise CkptTuneError(
            f"trainer.model is {type(model).__name__}, not a torch module",
            hint="call apply_to_trainer on a Trainer built with model=...",
        )
    args = trainer.args
    plan = _named_for(model, plan)
    if getattr(trainer, "is_deepspeed_enabled", False) and _batch_of(args) != (plan.batch_size, plan.grad_accum_steps):
        raise CkptTuneError(
            "DeepSpeed took its micro-batch and accumulation from TrainingArguments when they were built, "
            f"so the plan's (batch {plan.batch_size}, accumulation {plan.grad_accum_steps}) cannot be set now",
            hint=f"build TrainingArguments with per_device_train_batch_size={plan.batch_size}, "
            f"gradient_accumulation_steps={plan.grad_accum_steps}, then the Trainer",
        )
    saved = _hf_checkpointing_off(model, args)
    try:
        apply(model, plan)
    except CkptTuneError:
        _restore(saved, args)
        raise
    if saved.layers or saved.args:
        log.warning(
            "ckpt-tune: turned Hugging Face activation checkpointing off (%s) so that no module is checkpointed "
            "twice; the plan checkpoints %d module(s) instead",
            ", ".join([*(f"args.{k}" for k in saved.args), *([f"{len(saved.layers)} layer flags"] if saved.layers else [])]),
            len(member_names(plan.checkpoint)),
        )
    args.per_device_train_batch_size = plan.batch_size
    args.gradient_accumulation_steps = plan.grad_accum_steps
    # the Trainer copies the batch size when it is built (Trainer.__init__) and trains at that copy
    trainer._train_batch_size = args.train_batch_size
    for old in [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PlanGuard)]:
        trainer.remove_callback(old)
    names = tuple(member_names(plan.checkpoint))
    trainer.add_callback(PlanGuard(plan, [model.get_submodule(n) for n in names], _sharding_engine(trainer)))
    log.info(
        "ckpt-tune: %d module(s) checkpointed, micro-batch %d, accumulation %d",
        len(names),
        plan.batch_size,
        plan.grad_accum_steps,
    )
    return names


class PlanGuard(TrainerCallback):
    """Refuses to start training (`on_train_begin` raises `CkptTuneError`) when the run is not the one
    the plan was made for: another precision, longer samples than the plan's `seq_len`, another world
    size, a micro-batch or accumulation other than the plan's, or a model whose planned modules are no
    longer checkpointed. Added by `apply_to_trainer`."""

    def __init__(self, plan: Plan, modules: Sequence[nn.Module], engine: str | None = None) -> None:
        """`plan` with its names as the model has them; `modules` the planned modules of that model;
        `engine` "FSDP" or "DeepSpeed" when the Trainer shards the model, else None."""
        self.plan = plan
        self.modules = list(modules)
        self.engine = engine

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        error = self.check(args, model, first_batch(train_dataloader))
        if error is not None:
            raise error

    def check(self, args: Any, model: nn.Module | None, batch: Any) -> CkptTuneError | None:
        """The error naming every setting of the run (its `TrainingArguments`, the model being trained, a
        batch it trains on) that is not the plan's, with what to do; None when the run is the plan's."""
        plan = self.plan
        problems: list[str] = []  # what differs
        fixes: list[str] = []  # how to make the run the plan's
        flags: dict[str, Any] = {}  # or the `ckpt-tune search` options of a plan for this run
        replan = False  # whether a plan for this run is a way out (it is when flags are set)
        if model is not None:
            precision = run_precision(args, model)
            if precision != plan.precision:
                problems.append(f"precision {plan.precision}, and the run trains in {precision}")
                fixes.append(f"train in {plan.precision} ({_PRECISION_ARGS[plan.precision]})")
                if precision in PRECISIONS:
                    flags["precision"] = precision
            present = {id(m) for m in model.modules()}
            lost = [m for m in self.modules if id(m) not in present or "" not in applied_names(m)]
            if lost:
                problems.append(f"{len(lost)} of its {len(self.modules)} module(s) are not checkpointed in the model being trained")
                fixes.append("call apply_to_trainer after the last change to trainer.model, right before train()")
        world = int(getattr(args, "world_size", 1))
        # one device's plan holds for each rank of plain data parallelism, not for a sharded engine's
        if plan.world_size != world and (plan.world_size > 1 or self.engine is not None):
            what = f"{plan.world_size} rank(s)" + (f" ({plan.shard})" if plan.sharded else ", unsharded")
            problems.append(f"{what}, and the run has {world} rank(s)" + (f" under {self.engine}" if self.engine else ""))
            fixes.append(f"run it on {plan.world_size} rank(s)")
            replan = True
            if world > 1:
                flags.update(world_size=world, shard="|".join(s for s in SHARDS if s != "none"))
        if _batch_of(args) != (plan.batch_size, plan.grad_accum_steps):
            problems.append(
                f"micro-batch {plan.batch_size} × accumulation {plan.grad_accum_steps}, and the arguments now say "
                f"{args.per_device_train_batch_size} × {args.gradient_accumulation_steps}"
            )
            fixes.append("leave per_device_train_batch_size and gradient_accumulation_steps as apply_to_trainer set them")
            if args.per_device_train_batch_size != plan.batch_size:
                flags["batch_size"] = args.per_device_train_batch_size
        rows, tokens = _batch_shape(batch)
        if rows is not None and rows > plan.batch_size * max(1, int(getattr(args, "n_gpu", 1))):
            problems.append(f"micro-batch {plan.batch_size}, and the first batch has {rows} samples")
            flags["batch_size"] = rows
        if plan.seq_len is not None and tokens is not None and tokens > plan.seq_len:
            problems.append(f"{plan.seq_len} tokens per sample, and the first batch has {tokens}")
            fixes.append(f"truncate the samples to {plan.seq_len} tokens")
            flags["seq_len"] = tokens
        elif plan.seq_len is not None and batch is not None and tokens is None:
            log.info("ckpt-tune: the batches hold no input_ids, so their length is not compared with the plan's seq_len")
        if not problems:
            return None
        hint = "; ".join(fixes)
        if replan or flags or not fixes:
            command = f"make a plan for this run: {_search_command(plan, flags)}"
            hint = f"{hint}; or else {command}" if hint else command
        return CkptTuneError(f"the plan ({plan.target}) was made for another run: " + "; ".join(problems), hint)


def run_precision(args: Any, model: nn.Module) -> str:
    """The run's precision in the plan's words (vocab.PRECISIONS): "bf16" when most weights are
    bfloat16, else "bf16-mixed" / "fp16-mixed" for `args.bf16` / `args.fp16`, else "fp32" for float32
    weights; any other weight dtype is named as it is ("float16 weights")."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else torch.float32
    if dtype == torch.bfloat16:
        return "bf16"
    for flag, precision in _MIXED.items():
        if getattr(args, flag, False):
            return precision
    return "fp32" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} weights"


def first_batch(dataloader: Any) -> Any:
    """The first batch the Trainer's training dataloader yields, read from a fresh iterator of the
    dataloader accelerate wraps, with the global RNG put back afterwards (a random sampler draws its
    seed from it); None when there is none, or when the dataset is iterable (reading ahead from a
    stream could consume it)."""
    if dataloader is None:
        return None
    base = getattr(dataloader, "base_dataloader", dataloader)
    if isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset) or not hasattr(base, "__iter__"):
        log.info("ckpt-tune: the training data is an iterable dataset; its batches are not read ahead to check them")
        return None
    with torch.random.fork_rng(devices=[]):
        return next(iter(base), None)


def _batch_shape(batch: Any) -> tuple[int | None, int | None]:
    """(samples, tokens per sample) of a batch: from its `input_ids` when it has them, else samples only,
    from its first tensor; (None, None) when it holds no tensor."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return ids.shape[0], (ids.shape[-1] if ids.dim() >= 2 else None)
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    return (leaves[0].shape[0] if leaves else None), None


def _batch_of(args: Any) -> tuple[int, int]:
    return args.per_device_train_batch_size, args.gradient_accumulation_steps


def _search_command(plan: Plan, flags: Mapping[str, Any]) -> str:
    """`ckpt-tune search` for the plan's target with `flags` (option name -> value); an --hf-config
    target keeps its --seq-len unless `flags` changes it."""
    hf = plan.target.startswith("hf:")  # an --hf-config plan (measure/hf.py names its target so)
    target = f"--hf-config {plan.target[3:]}" if hf else plan.target
    if hf and plan.seq_len is not None:
        flags = {"seq_len": plan.seq_len, **flags}
    return " ".join([f"ckpt-tune search {target} --vram SIZE", *(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())])


def _sharding_engine(trainer: Any) -> str | None:
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    return None


def _named_for(model: nn.Module, plan: Plan) -> Plan:
    """The plan with each name the model lacks but its peft base model has given its full name in
    the model (`transformer.h.0` -> `base_model.model.transformer.h.0`); other names are left as they
    are, for `apply` to accept or refuse."""
    names = {n for n, _ in model.named_modules()}
    base = _peft_base(model)
    if base is None or all(n in names for n in member_names(plan.checkpoint)):
        return plan
    prefix = next(n for n, m in model.named_modules() if m is base)
    inner = {n for n, _ in base.named_modules()}

    def full(name: str) -> str:
        return f"{prefix}.{name}" if name not in names and name in inner else name

    entries = tuple(dataclasses.replace(e, modules=tuple(full(n) for n in e.modules)) for e in plan.checkpoint)
    return dataclasses.replace(plan, checkpoint=entries)


def _peft_base(model: nn.Module) -> nn.Module | None:
    """The model a peft wrapper holds (`PeftModel.get_base_model()`), or None for any other model.
    peft is only looked up if it was imported: a model cannot be a PeftModel otherwise."""
    peft = sys.modules.get("peft")
    wrappers = tuple(getattr(peft, n) for n in ("PeftModel", "PeftMixedModel") if hasattr(peft, n)) if peft else ()
    if not wrappers or not isinstance(model, wrappers):
        return None
    base = model.get_base_model()
    return base if base is not model and any(m is base for m in model.modules()) else None


@dataclasses.dataclass
class _Saved:
    """What `_hf_checkpointing_off` changed, for `_restore`."""

    layers: list[nn.Module]  # modules whose `gradient_checkpointing` flag was True
    args: dict[str, Any]  # TrainingArguments field -> its value before


def _hf_checkpointing_off(model: nn.Module, args: Any) -> _Saved:
    """Hugging Face activation checkpointing off: the Trainer's switch (it calls
    `activation_checkpointing_enable()` when `train()` starts) and the per-layer flags a model already
    enabled carries, set to False as `activation_checkpointing_disable()` sets them."""
    layers = [m for _name, m in HF_CHECKPOINTING.modules(model)]
    HF_CHECKPOINTING.switch(layers, False)
    saved = {k: getattr(args, k) for k in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, k, None)}
    for k in saved:
        setattr(args, k, False)
    return _Saved(layers, saved)


def _restore(saved: _Saved, args: Any) -> None:
    HF_CHECKPOINTING.switch(saved.layers, True)
    for k, v in saved.args.items():
        setattr(args, k, v)
