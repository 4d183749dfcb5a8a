"""The plan as files: YAML out and back in (validated), and a patch snippet that needs only torch.

Pure: no device, no model execution. The YAML layout is the user contract of DESIGN.md §2; `check` and
`ckpt_tune.apply` read it back, so every field is validated on load with the field named in the error.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from ckpt_tune.errors import CkptTuneError, PlanError
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import DEVICES, OPTIMIZERS, PRECISIONS

PLAN_VERSION = 1

# An entry of a plan's `checkpoint` list: a module name, or a segment: the names of two or more
# consecutive blocks checkpointed as one region (ckpt_tune/segment.py).
Entry = str | tuple[str, ...]


def is_entry(e: Any, min_segment: int = 2) -> bool:
    """A module name, or a segment: a list or tuple of at least `min_segment` names."""
    return isinstance(e, str) or (
        isinstance(e, (list, tuple)) and len(e) >= min_segment and all(isinstance(n, str) for n in e)
    )


def member_names(entries) -> list[str]:
    """Every module name of a checkpoint list, segments flattened, in order."""
    return [n for e in entries for n in ((e,) if isinstance(e, str) else e)]


def entry_label(entry: Entry) -> str:
    """`blocks.0`, or `blocks.2..blocks.4` for a segment."""
    return entry if isinstance(entry, str) else f"{entry[0]}..{entry[-1]}"


@dataclass(frozen=True)
class Plan:
    target: str  # "path/to/file.py:fn" or "package.module:fn" that builds the model
    device: str  # "cpu" | "cuda" | "meta" (meta: predicted under fake tensors, never run on a device)
    precision: str  # one of PRECISIONS
    optimizer: str  # one of OPTIMIZERS; its state is part of the peak
    budget_bytes: int | None  # the budget searched against; None when the plan was not searched for one
    batch_size: int  # micro-batch per step
    grad_accum_steps: int  # micro-batches per optimizer step
    checkpoint: tuple[Entry, ...]  # names from model.named_modules() (segments: tuples of names)
    predicted_peak_bytes: int  # memory model's peak for one iteration with this plan
    predicted_recompute_fraction: float  # extra step time, as a fraction of the step without checkpointing
    verified_peak_bytes: int | None = None  # measured by running the plan; None if not verified
    version: int = PLAN_VERSION


# Key order of the file (DESIGN.md §2) and the comment printed after each value.
_KEY_ORDER = (
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
_COMMENT_COLUMN = 38


def _scalar(value: Any) -> str:
    """One YAML scalar as safe_dump writes it, so names like "0" or "true" come back as strings."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _flow_scalar(name: str) -> str:
    """A name inside a YAML flow list: plain when it reads back as itself, else double-quoted."""
    plain = re.fullmatch(r"[A-Za-z_][\w.\-]*", name) is not None and yaml.safe_load(name) == name
    return name if plain else json.dumps(name)


def _line(key: str, value: str, comment: str | None = None) -> str:
    line = f"{key}: {value}" if value else f"{key}:"
    return f"{line.ljust(_COMMENT_COLUMN - 1)} # {comment}" if comment else line


def plan_to_yaml(plan: Plan) -> str:
    """The plan file text: keys in the order of DESIGN.md §2, bytes as plain ints, comments for people."""
    budget = None if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    lines = [
        "# ckpt-tune plan: apply with ckpt_tune.apply(model, <this file>) or paste the patch snippet",
        _line("version", _scalar(plan.version)),
        _line("target", _scalar(plan.target)),
        _line("device", _scalar(plan.device)),
        _line("precision", _scalar(plan.precision)),
        _line("optimizer", _scalar(plan.optimizer)),
        _line("budget_bytes", _scalar(plan.budget_bytes), budget),
        _line("batch_size", _scalar(plan.batch_size), "micro-batch per step"),
        _line("grad_accum_steps", _scalar(plan.grad_accum_steps)),
    ]
    ckpt_comment = "names from model.named_modules(), wrapped with non-reentrant checkpoint"
    if plan.checkpoint:
        lines.append(_line("checkpoint", "", ckpt_comment))
        for entry in plan.checkpoint:
            if isinstance(entry, str):
                lines.append(f"  - {_scalar(entry)}")
            else:
                item = f"  - [{', '.join(_flow_scalar(n) for n in entry)}]"
                lines.append(f"{item.ljust(_COMMENT_COLUMN - 1)} # one segment: one checkpoint over these blocks")
    else:
        lines.append(_line("checkpoint", "[]", "nothing checkpointed"))
    lines.append(
        _line(
            "predicted_peak_bytes",
            _scalar(plan.predicted_peak_bytes),
            format_bytes(plan.predicted_peak_bytes),
        )
    )
    lines.append(
        _line(
            "predicted_recompute_fraction",
            _scalar(round(float(plan.predicted_recompute_fraction), 4)),
            "extra step time, as a fraction of the step without checkpointing",
        )
    )
    if plan.verified_peak_bytes is not None:
        lines.append(
            _line(
                "verified_peak_bytes",
                _scalar(plan.verified_peak_bytes),
                f"{format_bytes(plan.verified_peak_bytes)}, measured by running the plan",
            )
        )
    return "\n".join(lines) + "\n"


def write_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan file; returns the path written."""
    path = Path(path)
    try:
        path.write_text(plan_to_yaml(plan), encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot write plan file {path}: {exc.strerror or exc}") from exc
    return path


def parse_yaml(text: str, where: str, error: type[CkptTuneError], hint: str | None = None) -> Any:
    """`yaml.safe_load(text)`, or `error` naming the file (`where`), the line and column, and the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise error(f"{where} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}", hint=hint) from exc


def load_plan(source: str | Path | dict | Plan) -> Plan:
    """A validated Plan from a plan file path, a mapping with the file's keys, or a Plan.

    Every field is checked; a bad one raises PlanError naming the field and what it should be.
    """
    if isinstance(source, Plan):
        return _from_mapping(asdict(source), "plan")
    if isinstance(source, dict):
        return _from_mapping(source, "plan")
    if not isinstance(source, (str, Path)):
        raise PlanError(
            f"a plan is a file path, a mapping or a Plan, got {type(source).__name__}",
            hint="pass the path of the YAML file written by `ckpt-tune search --out`",
        )
    path = Path(source)
    where = f"plan file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(
            f"cannot read {where}: {exc.strerror or exc}",
            hint="write one with `ckpt-tune search TARGET --vram SIZE --out plan.yaml`",
        ) from exc
    except UnicodeDecodeError as exc:
        raise PlanError(f"{where} is not text: {exc.reason}") from exc
    data = parse_yaml(text, where, PlanError)
    if not isinstance(data, dict):
        raise PlanError(
            f"{where} must hold a mapping of plan fields, found {type(data).__name__ if data is not None else 'nothing'}",
            hint="a plan file starts with `version: 1` and `target: ...` (see `ckpt-tune search --out`)",
        )
    return _from_mapping(data, where)


def _field_error(where: str, key: str, problem: str, hint: str) -> PlanError:
    return PlanError(f"{where}: field '{key}' {problem}", hint=hint)


def _int(data: dict, key: str, where: str, minimum: int, nullable: bool = False) -> int | None:
    value = data[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        hint = "a plain integer number of bytes, e.g. 25769803776" if key.endswith("_bytes") else "an integer"
        raise _field_error(
            where, key, f"must be an integer{' or null' if nullable else ''}, got {value!r}", f"write {hint}"
        )
    if value < minimum:
        raise _field_error(
            where,
            key,
            f"must be >= {minimum}, got {value}",
            "sizes cannot be negative" if minimum == 0 else f"use {minimum} or more",
        )
    return value


def _choice(data: dict, key: str, where: str, choices: tuple[str, ...]) -> str:
    value = data[key]
    if value not in choices or not isinstance(value, str):
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise _field_error(
            where,
            key,
            f"is {value!r}, not one of {', '.join(choices)}",
            f"did you mean {close[0]!r}?" if close else "use one of the values listed",
        )
    return value


def _from_mapping(data: dict, where: str) -> Plan:
    unknown = [k for k in data if k not in _KEY_ORDER]
    if unknown:
        key = str(unknown[0])
        close = difflib.get_close_matches(key, _KEY_ORDER, n=1)
        raise _field_error(
            where,
            key,
            "is not a plan field",
            f"did you mean {close[0]!r}?" if close else f"plan fields are: {', '.join(_KEY_ORDER)}",
        )
    for key in _KEY_ORDER:
        if key not in data and key not in _OPTIONAL_KEYS:
            raise _field_error(where, key, "is missing", "plan files are written by `ckpt-tune search --out`")

    version = data["version"]
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise _field_error(
            where,
            "version",
            f"is {version!r}; this ckpt-tune reads version {PLAN_VERSION}",
            "regenerate the plan with this version of ckpt-tune",
        )
    target = data["target"]
    if not isinstance(target, str) or not target.strip():
        raise _field_error(
            where, "target", f"must be a non-empty string, got {target!r}", "e.g. examples/gpt.py:build"
        )

    fraction = data["predicted_recompute_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise _field_error(
            where, "predicted_recompute_fraction", f"must be a number, got {fraction!r}", "e.g. 0.11 for 11%"
        )
    if not math.isfinite(fraction) or fraction < 0:
        raise _field_error(
            where,
            "predicted_recompute_fraction",
            f"must be finite and >= 0, got {fraction}",
            "e.g. 0.11 for 11%",
        )

    entries = _checkpoint_entries(data["checkpoint"], where)
    return Plan(
        target=target,
        device=_choice(data, "device", where, DEVICES),
        precision=_choice(data, "precision", where, PRECISIONS),
        optimizer=_choice(data, "optimizer", where, OPTIMIZERS),
        budget_bytes=_int(data, "budget_bytes", where, 1, nullable=True),
        batch_size=_int(data, "batch_size", where, 1),
        grad_accum_steps=_int(data, "grad_accum_steps", where, 1),
        checkpoint=entries,
        predicted_peak_bytes=_int(data, "predicted_peak_bytes", where, 0),
        predicted_recompute_fraction=float(fraction),
        verified_peak_bytes=_int(data, "verified_peak_bytes", where, 0, nullable=True)
        if "verified_peak_bytes" in data
        else None,
        version=PLAN_VERSION,
    )


def _checkpoint_entries(value: Any, where: str) -> tuple[Entry, ...]:
    """The `checkpoint` list: module names, and segments as lists of two or more names."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(is_entry(e) for e in value):
        raise _field_error(
            where,
            "checkpoint",
            f"must be a list of module names (strings), got {value!r}",
            "list names from model.named_modules(), one per line: `  - blocks.0`; "
            "a segment (one checkpoint over consecutive blocks) is a list of two or more: `  - [blocks.2, blocks.3]`",
        )
    entries = tuple(e if isinstance(e, str) else tuple(e) for e in value)
    names = member_names(entries)
    if "" in names:
        raise _field_error(
            where,
            "checkpoint",
            "names the root module ''",
            "checkpoint submodules, e.g. blocks.0, not the whole model",
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _field_error(where, "checkpoint", f"lists {dupes[0]!r} more than once", "list each module once")
    return entries
