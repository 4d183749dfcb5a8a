"""The plan file: a Plan written as YAML for people and read back, every field validated.

Pure: no device, no model execution. The YAML layout is the user contract of docs/design.md §2;
`check` and `ckpt_tune.apply` read it back, so every field is validated on load with the field named in
the error. Text goes through the package's one YAML codec (yamlio.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ckpt_tune import yamlio
from ckpt_tune.errors import PlanError
from ckpt_tune.plan.entry import Action, Entry, entries_of, member_names, to_data
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import DEVICES, OPTIMIZERS, PRECISIONS

PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    target: str  # "path/to/file.py:fn" or "package.module:fn" that builds the model
    device: str  # "cpu" | "cuda" | "meta" (meta: predicted under fake tensors, never run on a device)
    precision: str  # one of PRECISIONS
    optimizer: str  # one of OPTIMIZERS; its state is part of the peak
    budget_bytes: int | None  # the budget searched against; None when the plan was not searched for one
    batch_size: int  # micro-batch per step
    grad_accum_steps: int  # micro-batches per optimizer step
    checkpoint: tuple[Entry, ...]  # what to checkpoint: modules, or runs of blocks (plan/entry.py)
    predicted_peak_bytes: int  # memory model's peak for one iteration with this plan
    predicted_recompute_fraction: float  # extra step time, as a fraction of the step without checkpointing
    verified_peak_bytes: int | None = None  # measured by running the plan; None if not verified
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        # entries may be given in their data form ("blocks.0", ["blocks.1", "blocks.2"]): keep the type
        object.__setattr__(self, "checkpoint", entries_of(self.checkpoint))

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields as the plan file holds them (entries in their data form): JSON output."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["checkpoint"] = to_data(self.checkpoint)
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
    "checkpoint",
    "predicted_peak_bytes",
    "predicted_recompute_fraction",
    "verified_peak_bytes",
)
_OPTIONAL_KEYS = ("verified_peak_bytes",)
_FIX = "plan files are written by `ckpt-tune search --out`"
_ENTRY_COMMENT = {
    Action.CHECKPOINT: "one segment: one checkpoint over these blocks",
    Action.SELECTIVE: "checkpointed under an op policy",
}


def entry_yaml(entry: Entry) -> str:
    """One item of the `checkpoint` list: `  - name`, a flow list for a run of blocks, or a flow
    mapping `{module: name, policy: p}` for a module under an op policy."""
    if entry.action is Action.SELECTIVE:
        item = f"  - {{module: {yamlio.flow_name(entry.modules[0])}, policy: {entry.policy}}}"
        return f"{item.ljust(yamlio.COMMENT_COLUMN - 1)} # {_ENTRY_COMMENT[entry.action]}"
    if not entry.is_segment:
        return f"  - {yamlio.scalar(entry.modules[0])}"
    item = f"  - [{', '.join(yamlio.flow_name(n) for n in entry.modules)}]"
    return f"{item.ljust(yamlio.COMMENT_COLUMN - 1)} # {_ENTRY_COMMENT[entry.action]}"


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
    return "\n".join(lines) + "\n"


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
        checkpoint=_checkpoint_entries(data["checkpoint"], f),
        predicted_peak_bytes=f.integer(data["predicted_peak_bytes"], "predicted_peak_bytes", 0),
        predicted_recompute_fraction=f.number(
            data["predicted_recompute_fraction"], "predicted_recompute_fraction", "e.g. 0.11 for 11%"
        ),
        verified_peak_bytes=f.integer(data["verified_peak_bytes"], "verified_peak_bytes", 0, nullable=True)
        if "verified_peak_bytes" in data
        else None,
        version=PLAN_VERSION,
    )


def _checkpoint_entries(value: Any, f: yamlio.Fields) -> tuple[Entry, ...]:
    """The `checkpoint` list: module names, segments as lists of two or more names, and modules under
    an op policy as `{module: name, policy: p}`."""
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

