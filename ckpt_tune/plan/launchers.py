"""What each launcher can express of a plan, and its configuration text (`ckpt-tune search --emit`).

Three launchers read a configuration rather than the model's code: torchtitan (a job TOML),
DeepSpeed (a JSON config) and Hugging Face's `TrainingArguments` (keyword arguments). Each expresses
a few checkpoint layouts, always of whole blocks:

    torchtitan   [activation_checkpoint] mode "none" | "full" (every block) | "selective" with
                 selective_ac_option "N" (blocks N-1, 2N-1, …: its counter starts at 1) or "op" (every
                 block under its op rule, ckpt-tune's half-matmuls policy)
    hf-args      activation_checkpointing: every decoder layer (GradientCheckpointingLayer), or with
                 every_n_layers N the layers 0, N, 2N, … (where the installed transformers takes it)
    deepspeed    none: its activation checkpointing is called by the model's code, so the config cannot
                 choose modules; the plan runs as it is with ckpt_tune.apply on the model

`closest` maps a plan to the closest layout the launcher runs: the one that checkpoints every block
the plan touches (whole, in a segment, under a policy or through a sub-module) with the fewest
blocks, since a block left out gives its activations back; a plan whose every entry is an op policy
over every block maps to torchtitan's "op". Precision and sharding map to the launcher's nearest
(torchtitan has no fp16 and no ZeRO-1). `render` writes the text with, in comments, what the launcher
cannot express and the peak of the closest plan, which the caller measures (tune/launchers.py).

Pure: no torch, no device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.file import FULLY_SHARDED, Plan
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import known

LAUNCHERS = ("torchtitan", "deepspeed", "hf-args")
# the policy torchtitan's selective "op" rule is (plan/policy.py: every second matmul recomputed)
TORCHTITAN_OP_POLICY = "half-matmuls"
_ZERO_STAGE = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
_HF_PRECISION = {"bf16-mixed": {"bf16": True}, "fp16-mixed": {"fp16": True}}
_AUTOCAST_DTYPE = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
_SUBJECT = {"torchtitan": "torchtitan", "deepspeed": "DeepSpeed's config", "hf-args": "TrainingArguments"}


@dataclass(frozen=True)
class Layers:
    """The model's repeated blocks, as the launchers count them.

    Attributes:
        blocks: the innermost repeated blocks in execution order (tune/candidates.find_blocks):
            torchtitan's transformer blocks, DeepSpeed's nothing.
        hf_layers: transformers' `GradientCheckpointingLayer` modules in module order, what
            `activation_checkpointing` switches; None when the model is not a transformers model.
    """

    blocks: tuple[str, ...]
    hf_layers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class HfApi:
    """What the installed transformers' `TrainingArguments` takes: the switch's name
    (`activation_checkpointing`, or `gradient_checkpointing` before it was renamed) and whether its
    kwargs take `every_n_layers`."""

    switch: str = "activation_checkpointing"
    every_n_layers: bool = True


@dataclass(frozen=True)
class Expressed:
    """A plan as one launcher can run it.

    Attributes:
        launcher: one of LAUNCHERS.
        plan: the plan searched for.
        closest: the closest plan the launcher runs (its checkpoints, precision and sharding).
        layout: the closest checkpoint layout in words ("every 2nd block (2: blocks.1, blocks.3)").
        settings: the launcher's values, by section (torchtitan, DeepSpeed) or keyword (hf-args).
        cannot: what of the plan the launcher cannot express, one sentence each.
        how: what to do to run it, one sentence each.
    """

    launcher: str
    plan: Plan
    closest: Plan
    layout: str
    settings: dict[str, Any]
    cannot: tuple[str, ...]
    how: tuple[str, ...]

    @property
    def exact(self) -> bool:
        """Whether the closest plan is the plan itself (then its verified peak is the peak)."""
        same = {e.label for e in self.closest.checkpoint} == {e.label for e in self.plan.checkpoint}
        stage = _ZERO_STAGE[self.closest.shard] == _ZERO_STAGE[self.plan.shard]
        return same and stage and self.closest.precision == self.plan.precision


def runs_as(plan: Plan, launcher: str) -> tuple[str, str]:
    """(precision, shard) of the plan as `launcher` runs it: torchtitan has no fp16 (bf16 mixed, the
    same bytes per value) and no optimizer-only sharding (FSDP without resharding, which shards the
    gradients too); HF's FSDP has no ZeRO-1 either."""
    precision = "bf16-mixed" if launcher == "torchtitan" and plan.precision == "fp16-mixed" else plan.precision
    shard = "zero2" if launcher != "deepspeed" and plan.shard == "zero1" else plan.shard
    return precision, shard


def closest(plan: Plan, launcher: str, layers: Layers, hf: HfApi = HfApi()) -> Expressed:
    """The closest plan `launcher` (one of LAUNCHERS) runs, its settings, and what of `plan` it cannot
    express. Raises CkptTuneError for an unknown launcher."""
    launcher = known("launcher", launcher, LAUNCHERS, "--emit")
    precision, shard = runs_as(plan, launcher)
    cannot: list[str] = []
    if precision != plan.precision:
        cannot.append("fp16 mixed precision (mixed_precision_param is bfloat16 or float32): bf16 mixed, the same bytes per value")
    if shard != plan.shard:
        cannot.append("ZeRO-1 (optimizer state sharded alone): FSDP without resharding after forward (ZeRO-2), "
                      "which shards the gradients too")
    if launcher == "deepspeed":
        layout = _Layout(plan.checkpoint, "the plan's own checkpoints, applied with ckpt_tune.apply")
        if plan.checkpoint:
            cannot.append("which modules are checkpointed: DeepSpeed's activation checkpointing is called by the "
                          "model's code (deepspeed.checkpointing.checkpoint), so its config cannot choose modules")
    elif launcher == "torchtitan":
        layout, more = _whole_blocks(plan, layers.blocks, lambda i, n: (i + 1) % n == 0, True, "block")
        cannot += more
    elif layers.hf_layers is None:
        layout = _Layout()
        if plan.checkpoint:
            cannot.append(f"checkpointing: {hf.switch} calls the model's {hf.switch}_enable(), which only "
                          "transformers models have")
    else:
        every = (lambda i, n: i % n == 0) if hf.every_n_layers else None
        layout, more = _whole_blocks(plan, layers.hf_layers, every, False, "layer")
        cannot += more
    units = layers.blocks if shard != plan.shard and shard in FULLY_SHARDED else plan.shard_units
    near = replace(plan, checkpoint=layout.entries, precision=precision, shard=shard, shard_units=units)
    out = Expressed(launcher, plan, near, layout.words, _SETTINGS[launcher](near, layout, hf), tuple(cannot), ())
    return replace(out, how=tuple(_how(out)))


# -- the checkpoint layouts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """A layout a launcher switches: `every` 0 (none), 1 (every block), N (every Nth), or `op`."""

    entries: tuple[Entry, ...] = ()
    words: str = "no checkpointing"
    every: int = 0
    op: bool = False


def _whole_blocks(plan: Plan, blocks: tuple[str, ...], every, op: bool, noun: str) -> tuple[_Layout, list[str]]:
    """The closest layout over `blocks` for a launcher that checkpoints all of them, or those of
    `every(index, n)` for n ≥ 2 (None: not offered), or (`op`) all of them under its op rule; and what
    of the plan it cannot express."""
    if not plan.checkpoint:
        return _Layout(), []
    if not blocks:
        return _Layout(), [f"any checkpoint: the model has no repeated {noun}s to switch"]
    selective = [e for e in plan.checkpoint if e.policy is not None]
    if op and len(selective) == len(plan.checkpoint) and sorted(e.modules[0] for e in selective) == sorted(blocks):
        cannot = []
        policies = sorted({e.policy for e in selective} - {TORCHTITAN_OP_POLICY})
        if policies:
            cannot.append(f"the op polic{'ies' if len(policies) > 1 else 'y'} {', '.join(policies)}: its \"op\" rule "
                          f"keeps the matmul outputs but every second ({TORCHTITAN_OP_POLICY}) and the attention outputs")
        entries = tuple(Entry.selective(b, TORCHTITAN_OP_POLICY) for b in blocks)
        return _Layout(entries, f"every {noun} under its op rule (the {TORCHTITAN_OP_POLICY} policy)", 1, True), cannot
    cannot = _kinds(plan.checkpoint, blocks, noun)
    touched = {i for i, b in enumerate(blocks) for e in plan.checkpoint for m in e.modules if _covers(m, b)}
    if not touched:
        return _Layout(), cannot
    chosen, n = set(range(len(blocks))), 1
    for k in range(len(blocks), 1, -1) if every is not None else ():
        picked = {i for i in range(len(blocks)) if every(i, k)}
        if touched <= picked and len(picked) < len(chosen):
            chosen, n = picked, k
    if touched != chosen:
        names = [blocks[i] for i in sorted(touched)]
        pattern = f"every {noun} or every Nth" if every is not None else f"every {noun} only"
        cannot.append(f"checkpointing {_names(names)} ({len(names)} of {len(blocks)} {noun}s): it switches {pattern}")
    names = [blocks[i] for i in sorted(chosen)]
    which = f"every {noun}" if n == 1 else f"every {_ordinal(n)} {noun}"
    return _Layout(tuple(Entry((b,)) for b in names), f"{which} ({len(names)}: {_names(names)})", n), cannot


def _kinds(entries: tuple[Entry, ...], blocks: tuple[str, ...], noun: str) -> list[str]:
    """What of `entries` a launcher that checkpoints whole blocks one by one cannot express."""
    found: dict[str, list[str]] = {}
    for e in entries:
        if e.policy is not None:
            found.setdefault(f"op policies, checkpointed as their whole {noun}", []).append(e.label)
        elif e.is_segment:
            found.setdefault(f"segments (one checkpoint over a run of {noun}s), checkpointed {noun} by {noun}", []).append(e.label)
        elif e.modules[0] not in blocks:
            m = e.modules[0]
            kind = (f"sub-modules of a {noun}, checkpointed as their whole {noun}" if any(m.startswith(b + ".") for b in blocks)
                    else f"modules holding {noun}s, checkpointed {noun} by {noun}" if any(b.startswith(m + ".") for b in blocks)
                    else f"modules outside the {noun}s, left as they are")
            found.setdefault(kind, []).append(m)
    return [f"{kind}: {_names(names)}" for kind, names in found.items()]


def _covers(module: str, block: str) -> bool:
    """Whether checkpointing `module` acts on `block`: it is the block, inside it, or holds it."""
    return module == block or module.startswith(block + ".") or block.startswith(module + ".")


def _names(names: list[str], most: int = 6) -> str:
    if len(names) <= most:
        return ", ".join(names)
    return ", ".join([*names[: most - 2], "...", names[-1]])


def _ordinal(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# -- each launcher's settings -------------------------------------------------------------------------------


def _torchtitan(near: Plan, layout: _Layout, hf: HfApi) -> dict[str, Any]:
    training: dict[str, Any] = {
        "local_batch_size": near.batch_size,
        # torchtitan accumulates global / (local × data-parallel degree) micro-batches per step
        "global_batch_size": near.batch_size * near.grad_accum_steps * near.world_size,
    }
    if near.seq_len is not None:
        training["seq_len"] = near.seq_len
    training["dtype"] = "bfloat16" if near.precision == "bf16" else "float32"
    training["mixed_precision_param"] = "bfloat16" if near.precision == "bf16-mixed" else "float32"
    if layout.op:
        ac: dict[str, Any] = {"mode": "selective", "selective_ac_option": "op"}
    elif layout.every > 1:
        ac = {"mode": "selective", "selective_ac_option": str(layout.every)}
    else:
        ac = {"mode": "full" if layout.every else "none"}
    parallelism: dict[str, Any] = {"data_parallel_shard_degree": near.world_size}
    if near.world_size > 1:
        parallelism["fsdp_reshard_after_forward"] = "never" if near.shard == "zero2" else "always"
    return {"training": training, "activation_checkpoint": ac, "parallelism": parallelism}


def _deepspeed(near: Plan, layout: _Layout, hf: HfApi) -> dict[str, Any]:
    stage = _ZERO_STAGE[near.shard]
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": near.batch_size,
        "gradient_accumulation_steps": near.grad_accum_steps,
        "train_batch_size": near.batch_size * near.grad_accum_steps * near.world_size,
        "zero_optimization": {"stage": stage},
    }
    if near.precision in _AUTOCAST_DTYPE:  # autocast over fp32 weights: the step ckpt-tune ran
        out["torch_autocast"] = {"enabled": True, "dtype": _AUTOCAST_DTYPE[near.precision]}
    elif near.precision == "bf16":  # bf16 weights, gradients and optimizer states (ZeRO keeps them so)
        out["bf16"] = {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True} if stage else {})}
    # activations stay on the device, whole: what the measured step did
    out["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                       "contiguous_memory_optimization": False}
    return out


def _hf_args(near: Plan, layout: _Layout, hf: HfApi) -> dict[str, Any]:
    out: dict[str, Any] = {"per_device_train_batch_size": near.batch_size, "gradient_accumulation_steps": near.grad_accum_steps}
    if layout.every:
        out[hf.switch] = True
        # non-reentrant, as ckpt-tune's wrappers: the RNG state is preserved and kwargs reach the layer
        out[f"{hf.switch}_kwargs"] = {"use_reentrant": False, **({"every_n_layers": layout.every} if layout.every > 1 else {})}
    out.update(_HF_PRECISION.get(near.precision, {}))
    if near.shard in FULLY_SHARDED:
        out["fsdp"] = True
        out["fsdp_config"] = {"version": 2, "reshard_after_forward": near.shard != "zero2"}
    return out


_SETTINGS = {"torchtitan": _torchtitan, "deepspeed": _deepspeed, "hf-args": _hf_args}


def _how(e: Expressed) -> list[str]:
    """What to do to run the configuration (and the plan itself, where it differs)."""
    apply = "ckpt_tune.apply(model, plan) (or the patch snippet)"
    out = []
    if e.launcher == "deepspeed":
        if e.plan.checkpoint:
            out.append(f"checkpoint with {apply} before deepspeed.initialize; a transformers model's "
                       "activation_checkpointing_enable() checkpoints every decoder layer instead")
        if e.plan.world_size > 1:
            out.append("the per-rank peak was recorded under PyTorch's sharding engine (fully_shard or "
                       "ZeroRedundancyOptimizer); DeepSpeed's ZeRO adds its own buffers (reduce_bucket_size, "
                       "stage3_prefetch_bucket_size), not measured")
        if e.plan.precision == "bf16" and e.plan.shard == "none":
            out.append("DeepSpeed's bf16 without ZeRO keeps fp32 master weights in its optimizer: more bytes than "
                       "the bf16 step measured")
        return out
    if not e.exact and e.plan.checkpoint:
        where = ("set mode = \"none\" and call it in your parallelize function, before fully_shard"
                 if e.launcher == "torchtitan" else "leave the switch off and call it before Trainer(model=...)")
        out.append(f"to run the plan itself: {apply}; {where}")
    if e.launcher == "torchtitan":
        if e.plan.seq_len is None:
            out.append("seq_len: set it to your batches' length (the plan's batches came from the target's make_batch)")
        out.append("merge these sections into your job's TOML (--job.config_file)")
    else:
        if e.plan.precision == "bf16":
            out.append("bf16 weights: load the model with dtype=torch.bfloat16; TrainingArguments has no switch for it")
        if e.plan.shard == "zero1":
            out.append("ZeRO-1 itself: pass deepspeed= the file of `ckpt-tune search --emit deepspeed` instead of fsdp")
        out.append("TrainingArguments(output_dir=..., **kwargs)")
    return out


# -- the text ---------------------------------------------------------------------------------------------------


def comments(e: Expressed, peak_bytes: int, fake: bool = False) -> list[str]:
    """The notes the configuration carries: the plan, what the launcher cannot express, the closest
    layout and its peak (`peak_bytes`, measured by the caller; `fake`: under fake tensors)."""
    p = e.plan
    per = f", per rank of {p.world_size} ({p.shard})" if p.world_size > 1 else ""
    lines = [f"ckpt-tune search --emit {e.launcher}: {p.target}, micro-batch {p.batch_size}, {p.grad_accum_steps} "
             f"accumulation step(s){per}, {p.precision}"]
    lines += [f"{_SUBJECT[e.launcher]} cannot express {c}" for c in e.cannot]
    lines.append(f"{'the plan itself' if e.exact else 'closest it can express'}: {e.layout}")
    lines.append(peak_line(e, peak_bytes, fake))
    if not e.exact and p.verified_peak_bytes is not None:
        lines.append(f"the plan itself: {format_bytes(p.verified_peak_bytes)} verified")
    return lines + list(e.how)


def peak_line(e: Expressed, peak_bytes: int, fake: bool = False) -> str:
    """`measured peak: 1.2 MiB (1258291 bytes) at batch 8, …: fits the 2.0 MiB budget`."""
    p = e.plan
    if e.exact:
        how = "the plan itself, as the search verified it"
    else:
        how = "one recorded step of this layout" + (" under fake tensors" if fake else "")
    line = f"measured peak: {format_bytes(peak_bytes)} ({peak_bytes} bytes) at batch {p.batch_size}"
    line += (" per rank" if p.world_size > 1 else "") + f", {how}"
    if p.budget_bytes is None:
        return line
    if peak_bytes <= p.budget_bytes:
        return f"{line}: fits the {format_bytes(p.budget_bytes)} budget"
    return f"{line}: over the {format_bytes(p.budget_bytes)} budget by {format_bytes(peak_bytes - p.budget_bytes)}"


def render(e: Expressed, peak_bytes: int, fake: bool = False) -> str:
    """The configuration text: TOML (torchtitan), JSON (DeepSpeed) or a Python dict of keyword
    arguments (hf-args), with `comments` as comments (JSON: the `_comment` list, which DeepSpeed's
    config reader ignores; a note on stderr would not reach the file)."""
    notes = comments(e, peak_bytes, fake)
    if e.launcher == "deepspeed":
        return json.dumps({"_comment": notes, **e.settings}, indent=2) + "\n"
    head = [f"# {n}" for n in notes]
    if e.launcher == "torchtitan":
        body = []
        for section, values in e.settings.items():
            body += ["", f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
        return "\n".join(head + body) + "\n"
    return "\n".join([*head, "{", *(f"    {k!r}: {v!r}," for k, v in e.settings.items()), "}"]) + "\n"
