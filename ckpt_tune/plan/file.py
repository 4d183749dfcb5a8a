"""The plan file: a Plan written as YAML for people and read back, every field validated.

Pure: no device, no model execution. The YAML layout is the user contract of docs/design.md §2;
`check` and `ckpt_tune.apply` read it back, so every field is validated on load with the field named in
the error. Text goes through the package's one YAML codec (yamlio.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from ckpt_tune import yamlio
from ckpt_tune.errors import PlanError
from ckpt_tune.plan import finetune
from ckpt_tune.plan.entry import Entry, entries_of, member_names, to_data
from ckpt_tune.plan.finetune import PeftSpec
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import DEVICES, OPTIMIZERS, PRECISIONS, SHARDINGS, SHARDS, RunSpec

PLAN_VERSION = 1
# the stages that call fully_shard on the plan's shard units (zero1 shards the optimizer only)
FULLY_SHARDED = ("zero2", "zero3", "fsdp")

ShardUnit = str | tuple[str, ...]  # a module name, or names sharded together as one group


@dataclass(frozen=True, kw_only=True)
class Plan(RunSpec):
    """A plan file's contents. Its header is a RunSpec: the device ("cpu", "cuda" or "meta": predicted
    under fake tensors, never run on a device), precision, optimizer (its state is part of the peak),
    micro-batch per step, and the sharded run (world_size, shard; docs/design.md §6) the budget and every
    peak below are per rank of."""

    fixed_batch: ClassVar[bool] = True

    target: str  # "path/to/file.py:fn" or "package.module:fn" that builds the model
    budget_bytes: int | None  # the budget searched against; None when the plan was not searched for one
    grad_accum_steps: int  # micro-batches per optimizer step
    checkpoint: tuple[Entry, ...]  # what to checkpoint: modules, or runs of blocks (plan/entry.py)
    predicted_peak_bytes: int  # memory model's peak for one iteration with this plan
    predicted_recompute_fraction: float  # extra step time, as a fraction of the step without checkpointing
    verified_peak_bytes: int | None = None  # measured by running the plan; None if not verified
    # the plan's predicted peak before it was first run (None: not run), and whether predicted_peak_bytes
    # was solved again on terms learned from that run (segments whose terms were estimated, then measured)
    first_predicted_peak_bytes: int | None = None
    predicted_from_run: bool = False
    version: int = PLAN_VERSION
    # A sharded run's units and figures; a plan file without these keys (and world_size, shard) means
    # one device.
    shard_units: tuple[ShardUnit, ...] = ()  # fully_shard each, in this order, then the root (zero2/3, fsdp)
    sharding: str = "none"  # how the per-rank figures were obtained: one of SHARDINGS
    # tokens per sample of the batches the plan was made for (--hf-config's --seq-len); None: the
    # target's own make_batch made them
    seq_len: int | None = None
    # LoRA / QLoRA the plan was measured with (--peft, plan/finetune.py); None: every parameter trains
    peft: PeftSpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # entries may be given in their data form ("blocks.0", ["blocks.1", "blocks.2"]): keep the type
        object.__setattr__(self, "checkpoint", entries_of(self.checkpoint))
        units = tuple(u if isinstance(u, str) else tuple(u) for u in self.shard_units)
        object.__setattr__(self, "shard_units", units)

    @property
    def sharded(self) -> bool:
        """Whether the plan is for a run over several ranks (the file then holds the sharding keys)."""
        return (self.world_size, self.shard, self.shard_units, self.sharding) != (1, "none", (), "none")

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields as the plan file holds them (entries in their data form): JSON output."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["checkpoint"] = to_data(self.checkpoint)
        d["shard_units"] = [u if isinstance(u, str) else list(u) for u in self.shard_units]
        return d


# Key order of the file (docs/design.md §2).
KEYS = (
    "version",
    "target",
    "device",
    "precision",
    "optimizer",
    "budget_bytes",
    "batch_size",
    "grad_accum_steps",
    "seq_len",
    "peft",
    "world_size",
    "shard",
    "sharding",
    "shard_units",
    "checkpoint",
    "predicted_peak_bytes",
    "predicted_recompute_fraction",
    "verified_peak_bytes",
    "first_predicted_peak_bytes",
    "predicted_from_run",
)
_SHARD_KEYS = ("world_size", "shard", "sharding", "shard_units")  # written for a sharded plan only
_OPTIONAL_KEYS = ("seq_len", "peft", "verified_peak_bytes", "first_predicted_peak_bytes", "predicted_from_run", *_SHARD_KEYS)
_FIX = "plan files are written by `ckpt-tune search --out`"
_STAGE_COMMENT = {
    "zero1": "optimizer state sharded; the model stays whole (ZeroRedundancyOptimizer)",
    "zero2": "fully_shard, reshard_after_forward=False: gradients and optimizer state sharded",
    "zero3": "fully_shard, reshard_after_forward=True: parameters too",
    "fsdp": "fully_shard, reshard_after_forward=True: parameters too",
}
_SHARDING_COMMENT = {
    "measured": "rank 0 recorded under the real engine, fake process group",
    "arithmetic": "one device's step divided by the ranks",
}
def entry_yaml(entry: Entry) -> str:
    """One item of the `checkpoint` list: its data form (plan/kinds/) in YAML flow style (`  - name`,
    a flow list for a run of blocks, a flow mapping for a module under an op policy or offloaded),
    with its kind's comment."""
    data = entry.to_data()
    if isinstance(data, str):
        item = f"  - {yamlio.scalar(data)}"
    elif isinstance(data, list):
        item = f"  - [{', '.join(yamlio.flow_name(n) for n in data)}]"
    else:
        item = "  - {" + ", ".join(f"{k}: {yamlio.flow_name(v)}" for k, v in data.items()) + "}"
    comment = entry.kind.comment
    return f"{item.ljust(yamlio.COMMENT_COLUMN - 1)} # {comment}" if comment else item


def plan_to_yaml(plan: Plan) -> str:
    """The plan file text: keys in the order of docs/design.md §2, bytes as plain ints, comments for people."""
    s, line = yamlio.scalar, yamlio.line
    budget = None if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    lines = [
        "# ckpt-tune plan: apply with ckpt_tune.apply(model, <this file>) or paste the patch snippet",
        line("version", s(plan.version)),
        line("target", s(plan.target)),
        line("device", s(plan.device)),
        line("precision", s(plan.precision)),
        line("optimizer", s(plan.optimizer)),
        line("budget_bytes", s(plan.budget_bytes), budget),
        line("batch_size", s(plan.batch_size), "micro-batch per step"),
        line("grad_accum_steps", s(plan.grad_accum_steps)),
    ]
    if plan.seq_len is not None:
        lines.append(line("seq_len", s(plan.seq_len), "tokens per sample of the batches planned for"))
    if plan.peft is not None:
        lines.append(line("peft", s(plan.peft.to_data()), "adapters on a frozen base" + (", 4-bit NF4" if plan.peft.quantized else ", bf16")))
    if plan.sharded:
        lines += _shard_lines(plan)
    if plan.checkpoint:
        lines.append(line("checkpoint", "", "names from model.named_modules(), wrapped with non-reentrant checkpoint"))
        lines += [entry_yaml(e) for e in plan.checkpoint]
    else:
        lines.append(line("checkpoint", "[]", "nothing checkpointed"))
    lines.append(line("predicted_peak_bytes", s(plan.predicted_peak_bytes), format_bytes(plan.predicted_peak_bytes)))
    lines.append(
        line(
            "predicted_recompute_fraction",
            s(round(float(plan.predicted_recompute_fraction), 4)),
            "extra step time, as a fraction of the step without checkpointing",
        )
    )
    if plan.verified_peak_bytes is not None:
        lines.append(
            line(
                "verified_peak_bytes",
                s(plan.verified_peak_bytes),
                f"{format_bytes(plan.verified_peak_bytes)}, measured by running the plan",
            )
        )
    if plan.first_predicted_peak_bytes is not None:
        lines.append(
            line(
                "first_predicted_peak_bytes",
                s(plan.first_predicted_peak_bytes),
                f"{format_bytes(plan.first_predicted_peak_bytes)}, predicted before the plan was first run",
            )
        )
    if plan.predicted_from_run:
        lines.append(line("predicted_from_run", "true", "predicted_peak_bytes was solved again on terms learned from that run"))
    return "\n".join(lines) + "\n"


def _shard_lines(plan: Plan) -> list[str]:
    """world_size, shard, sharding and shard_units: the lines of a sharded plan."""
    s, line = yamlio.scalar, yamlio.line
    lines = [
        line("world_size", s(plan.world_size), "ranks; the budget and the peaks are per rank"),
        line("shard", s(plan.shard), _STAGE_COMMENT.get(plan.shard)),
        line("sharding", s(plan.sharding), _SHARDING_COMMENT.get(plan.sharding)),
    ]
    if not plan.shard_units:
        empty = "only the root is sharded" if plan.shard in FULLY_SHARDED else "no module is sharded"
        return [*lines, line("shard_units", "[]", empty)]
    lines.append(line("shard_units", "", "fully_shard each, in this order, then the root"))
    for u in plan.shard_units:
        if isinstance(u, str):
            lines.append(f"  - {s(u)}")
        else:
            item = f"  - [{', '.join(yamlio.flow_name(n) for n in u)}]"
            lines.append(f"{item.ljust(yamlio.COMMENT_COLUMN - 1)} # one unit: sharded together")
    return lines


def write_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan file; returns the path written."""
    return yamlio.write(path, plan_to_yaml(plan), "plan file", PlanError)


def load_plan(source: str | Path | dict | Plan) -> Plan:
    """A validated Plan from a plan file path, a mapping with the file's keys, or a Plan.

    Every field is checked; a bad one raises PlanError naming the field and what it should be.
    """
    if isinstance(source, Plan):
        return _from_mapping(source.to_dict(), "plan")
    if isinstance(source, dict):
        return _from_mapping(source, "plan")
    if not isinstance(source, (str, Path)):
        raise PlanError(
            f"a plan is a file path, a mapping or a Plan, got {type(source).__name__}",
            hint="pass the path of the YAML file written by `ckpt-tune search --out`",
        )
    where = f"plan file {Path(source)}"
    data = yamlio.read(source, where, PlanError, hint="write one with `ckpt-tune search TARGET --vram SIZE --out plan.yaml`")
    if not isinstance(data, dict):
        raise PlanError(
            f"{where} must hold a mapping of plan fields, found {yamlio.kind(data)}",
            hint="a plan file starts with `version: 1` and `target: ...` (see `ckpt-tune search --out`)",
        )
    return _from_mapping(data, where)


def _from_mapping(data: dict, where: str) -> Plan:
    f = yamlio.Fields(where, PlanError, _FIX, noun="plan field")
    f.keys(data, KEYS, _OPTIONAL_KEYS)
    version = data["version"]
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise f.fail(
            "version",
            f"is {version!r}; this ckpt-tune reads version {PLAN_VERSION}",
            "regenerate the plan with this version of ckpt-tune",
        )
    return Plan(
        target=f.text(data["target"], "target", hint="e.g. examples/gpt.py:build"),
        device=f.text(data["device"], "device", DEVICES),
        precision=f.text(data["precision"], "precision", PRECISIONS),
        optimizer=f.text(data["optimizer"], "optimizer", OPTIMIZERS),
        budget_bytes=f.integer(data["budget_bytes"], "budget_bytes", 1, nullable=True),
        batch_size=f.integer(data["batch_size"], "batch_size", 1),
        grad_accum_steps=f.integer(data["grad_accum_steps"], "grad_accum_steps", 1),
        seq_len=f.integer(data["seq_len"], "seq_len", 1, nullable=True) if "seq_len" in data else None,
        peft=finetune.from_data(data["peft"]) if data.get("peft") is not None else None,
        checkpoint=_checkpoint_entries(data["checkpoint"], f),
        predicted_peak_bytes=f.integer(data["predicted_peak_bytes"], "predicted_peak_bytes", 0),
        predicted_recompute_fraction=f.number(
            data["predicted_recompute_fraction"], "predicted_recompute_fraction", "e.g. 0.11 for 11%"
        ),
        verified_peak_bytes=f.integer(data["verified_peak_bytes"], "verified_peak_bytes", 0, nullable=True)
        if "verified_peak_bytes" in data
        else None,
        first_predicted_peak_bytes=f.integer(data["first_predicted_peak_bytes"], "first_predicted_peak_bytes", 0, nullable=True)
        if "first_predicted_peak_bytes" in data
        else None,
        predicted_from_run=f.flag(data.get("predicted_from_run", False), "predicted_from_run"),
        version=PLAN_VERSION,
        **_sharding(data, f),
    )


def _sharding(data: dict, f: yamlio.Fields) -> dict[str, Any]:
    """world_size, shard, sharding and shard_units, checked alone and together; absent: one device."""
    world_size = f.integer(data.get("world_size", 1), "world_size", 1)
    shard = f.text(data.get("shard", "none"), "shard", SHARDS)
    sharding = f.text(data.get("sharding", "none"), "sharding", SHARDINGS)
    units = _shard_units(data.get("shard_units"), f)
    if world_size == 1 and shard != "none":
        raise f.fail("shard", f"is {shard!r} but world_size is 1", "set world_size to the number of ranks, or shard: none")
    if world_size > 1 and shard == "none":
        raise f.fail(
            "shard",
            f"is 'none' but world_size is {world_size}: a plan for several ranks names its sharding stage",
            f"use one of {', '.join(s for s in SHARDS if s != 'none')} (plain data parallelism: a plan for world_size 1)",
        )
    if world_size == 1 and sharding != "none":
        raise f.fail("sharding", f"is {sharding!r} but world_size is 1", "use none: the figures are one device's")
    if world_size > 1 and sharding == "none":
        raise f.fail(
            "sharding",
            f"is 'none' but world_size is {world_size}: say how the per-rank figures were obtained",
            "measured (recorded under the engine) or arithmetic (one device's step divided)",
        )
    if units and shard not in FULLY_SHARDED:
        raise f.fail(
            "shard_units",
            f"lists modules but shard is {shard!r}: only {', '.join(FULLY_SHARDED)} call fully_shard",
            "leave it empty: shard_units: []",
        )
    for entry in entries_of(data.get("checkpoint") or ()):
        if not entry.is_segment:
            continue
        for u in units:
            group = {u} if isinstance(u, str) else set(u)
            if group & set(entry.modules) and not set(entry.modules) <= group:
                raise f.fail(
                    "shard_units",
                    f"shards {sorted(group & set(entry.modules))[0]!r} of the segment {entry.label} apart from the rest "
                    "of it: a segment's recompute runs its blocks' forwards without FSDP's hooks",
                    f"list the segment's blocks as one unit: - [{', '.join(entry.modules)}]",
                )
    return {"world_size": world_size, "shard": shard, "sharding": sharding, "shard_units": units}


def _shard_units(value: Any, f: yamlio.Fields) -> tuple[ShardUnit, ...]:
    """The `shard_units` list: module names, and lists of names sharded together as one unit."""
    if value is None:
        return ()
    group_ok = lambda u: isinstance(u, (list, tuple)) and len(u) >= 1 and all(isinstance(n, str) for n in u)  # noqa: E731
    if not isinstance(value, (list, tuple)) or not all(isinstance(u, str) or group_ok(u) for u in value):
        raise f.fail(
            "shard_units",
            f"must be a list of module names (strings), got {value!r}",
            "one name from model.named_modules() per line: `  - blocks.0`; modules sharded together as one "
            "unit are a list: `  - [blocks.2, blocks.3]`",
        )
    units = tuple(u if isinstance(u, str) else (u[0] if len(u) == 1 else tuple(u)) for u in value)
    names = [n for u in units for n in ((u,) if isinstance(u, str) else u)]
    if "" in names:
        raise f.fail("shard_units", "names the root module ''", "leave the root out: it is sharded last, on its own")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise f.fail("shard_units", f"lists {dupes[0]!r} more than once", "list each module once")
    for i, outer in enumerate(names):
        inner = next((n for n in names[i + 1 :] if n.startswith(outer + ".")), None)
        if inner is not None:
            raise f.fail(
                "shard_units",
                f"lists {outer!r} before {inner!r}, which is inside it",
                "list inner modules first: fully_shard goes from the leaves to the root",
            )
    return units


def _checkpoint_entries(value: Any, f: yamlio.Fields) -> tuple[Entry, ...]:
    """The `checkpoint` list: module names, segments as lists of two or more names, modules under an op
    policy as `{module: name, policy: p}` and modules offloaded as `{module: name, action: offload}`."""
    if value is None:
        return ()
    segment_ok = lambda e: isinstance(e, (list, tuple)) and len(e) >= 2 and all(isinstance(n, str) for n in e)  # noqa: E731
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, (str, Entry, dict)) or segment_ok(e) for e in value):
        raise f.fail(
            "checkpoint",
            f"must be a list of module names (strings), got {value!r}",
            "list names from model.named_modules(), one per line: `  - blocks.0`; "
            "a segment (one checkpoint over consecutive blocks) is a list of two or more: `  - [blocks.2, blocks.3]`",
        )
    try:
        entries = tuple(Entry.of(e) for e in value)
    except PlanError as e:
        raise f.fail("checkpoint", e.message, e.hint) from None
    names = member_names(entries)
    if "" in names:
        raise f.fail("checkpoint", "names the root module ''", "checkpoint submodules, e.g. blocks.0, not the whole model")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise f.fail("checkpoint", f"lists {dupes[0]!r} more than once", "list each module once")
    return entries

