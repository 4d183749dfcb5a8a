"""What a check records and reports: the data types, and the baseline file in and out.

A baseline (YAML, `write_baseline` / `load_baseline`) holds the peak, the breakdown at the peak, the
whole-step static parts and each module's activation bytes, with the settings it was measured under.
A baseline of a sharded run (`world_size` > 1, `shard`) holds rank 0's figures, recorded under the real
engine with a fake process group (measure/sharded.py); a file without those keys is one device.
The file goes through the package's YAML codec (yamlio.py): written line by line with a comment on
each number for people, read with `yaml.safe_load`, every field checked with the file and the field
named in the error. No torch here.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ckpt_tune import yamlio
from ckpt_tune.errors import BaselineError, PlanError, RegressionError
from ckpt_tune.plan import finetune
from ckpt_tune.plan.entry import Entry, plain
from ckpt_tune.plan.finetune import PeftSpec
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import DEVICES, OPTIMIZERS, PARTS, PRECISIONS, SHARDS, Parts, RunSpec, device_kind

if TYPE_CHECKING:
    from ckpt_tune.measure.profiler import StepProfile

BASELINE_VERSION = 1
BREAKDOWN_KEYS = PARTS
# Baseline files put their comments two columns right of plan files' (yamlio.COMMENT_COLUMN): the
# layout predates the shared codec, and committed baselines should not change when re-recorded.
COMMENT_COLUMN = 40


@dataclass(frozen=True, kw_only=True)
class CheckSettings(RunSpec):
    """What a baseline was measured under (a RunSpec: the device is compared by kind, so cuda:0 matches
    cuda:1; with world_size > 1 every figure is rank 0's, recorded under the engine); a check under
    other settings would compare apples and pears."""

    fixed_batch: ClassVar[bool] = True

    checkpoint: tuple[str, ...] = ()  # modules checkpointed by the --plan; () without one
    seq_len: int | None = None  # --hf-config targets only: the sequence length of the batch
    attn: str | None = None  # --hf-config targets only: the attention kernel
    peft: PeftSpec | None = None  # --hf-config targets only: LoRA / QLoRA (--peft), None: every parameter trains


@dataclass(frozen=True)
class Baseline:
    target: str  # the target string it was measured from (informational: a rename is no failure)
    settings: CheckSettings
    peak_bytes: int  # largest live bytes of the iteration (CUDA: max_memory_allocated)
    reserved_bytes: int | None  # CUDA: max_memory_reserved; None elsewhere
    breakdown: Parts  # what was live at the peak moment (a mapping of the five parts is read as Parts)
    param_bytes: int  # whole-step static parts
    grad_bytes: int
    optimizer_bytes: int
    activation_total_bytes: int  # everything saved for backward
    unattributed_activation_bytes: int  # saved outside every module (loss, loss_fn)
    modules: dict[str, int]  # module name -> own activation bytes; modules saving nothing omitted
    torch_version: str
    measured_by: str
    created: str  # ISO 8601, UTC
    version: int = BASELINE_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.breakdown, Parts):
            object.__setattr__(self, "breakdown", Parts(**self.breakdown))


@dataclass(frozen=True)
class DiffRow:
    name: str  # module name, or a part such as "param_bytes" / "breakdown.other"
    kind: str  # "grew" | "shrank" | "same" | "new" (not in the baseline) | "removed" (gone from the model)
    before: int | None  # None: not in the baseline
    after: int | None  # None: not in the model any more
    delta: int
    fraction: float | None  # delta / before; None when before is absent or 0


@dataclass(frozen=True)
class SettingDiff:
    name: str
    baseline: Any
    current: Any


@dataclass(frozen=True)
class CheckResult:
    status: str  # "pass" | "improved" | "regressed" | "settings-differ" | "written"
    target: str
    settings: CheckSettings  # what was measured (or asked for, when nothing was measured)
    tolerance: float
    reserved_tolerance: float
    baseline_peak_bytes: int | None  # None: there was no baseline
    peak_bytes: int | None  # None: not measured (settings differ)
    limit_bytes: int | None  # the largest peak that passes
    baseline_reserved_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_limit_bytes: int | None = None
    settings_diff: tuple[SettingDiff, ...] = ()
    parts: tuple[DiffRow, ...] = ()  # static parts, unattributed activations, breakdown at the peak
    modules: tuple[DiffRow, ...] = ()  # modules whose bytes changed, largest growth first
    reasons: tuple[str, ...] = ()  # why it regressed
    warnings: tuple[str, ...] = ()
    baseline_path: str | None = None
    baseline_created: str | None = None
    recorded: Baseline | None = None  # the baseline this run wrote ("written")

    @property
    def delta_bytes(self) -> int | None:
        if self.peak_bytes is None or self.baseline_peak_bytes is None:
            return None
        return self.peak_bytes - self.baseline_peak_bytes

    @property
    def exit_code(self) -> int:
        return {"regressed": RegressionError.exit_code, "settings-differ": BaselineError.exit_code}.get(
            self.status, 0
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["delta_bytes"] = self.delta_bytes
        d["exit_code"] = self.exit_code
        return d


# --- from a profile --------------------------------------------------------------------------------


def settings_of(
    profile: StepProfile,
    checkpoint: Sequence[str] = (),
    seq_len: int | None = None,
    attn: str | None = None,
    world_size: int = 1,
    shard: str = "none",
    peft: PeftSpec | None = None,
) -> CheckSettings:
    """The settings of a profiled step (`world_size`/`shard`: the sharded run whose rank 0 it is)."""
    return CheckSettings(
        batch_size=profile.batch_size,
        precision=profile.precision,
        optimizer=profile.optimizer,
        device=profile.device,
        checkpoint=tuple(checkpoint),
        seq_len=seq_len,
        attn=attn,
        world_size=world_size,
        shard=shard,
        peft=peft,
    )


def baseline_from_profile(profile: StepProfile, settings: CheckSettings | None = None) -> Baseline:
    """The baseline record of a profiled step (`settings` adds what the profile does not carry: the plan)."""
    return Baseline(
        target=profile.target,
        settings=settings or settings_of(profile),
        peak_bytes=profile.peak_bytes,
        reserved_bytes=profile.cuda_reserved_bytes,
        breakdown=profile.breakdown,
        param_bytes=profile.param_bytes,
        grad_bytes=profile.grad_bytes,
        optimizer_bytes=profile.optimizer_bytes,
        activation_total_bytes=profile.activation_total_bytes,
        unattributed_activation_bytes=profile.unattributed_activation_bytes,
        modules={m.name: m.activation_bytes for m in profile.modules if m.activation_bytes},
        torch_version=str(profile.torch_version),  # torch.__version__ is a str subclass YAML cannot write
        measured_by=profile.measured_by,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


# --- the file out ----------------------------------------------------------------------------------


def _field(key: str, value: Any, comment: str | None = None, indent: int = 0) -> str:
    """One line of a baseline file: `key: value  # comment`, both as YAML scalars; `...` opens a block."""
    if value is ...:
        return yamlio.line(key, "", comment, indent, column=COMMENT_COLUMN)
    return yamlio.line(yamlio.scalar(key), yamlio.scalar(value), comment, indent, column=COMMENT_COLUMN)


def _peft(value: Any, f: yamlio.Fields) -> PeftSpec | None:
    if value is None:
        return None
    try:
        return finetune.from_data(value)
    except PlanError as e:
        raise f.fail("settings.peft", e.message.removeprefix("peft: ")) from e


def baseline_to_yaml(b: Baseline) -> str:
    s = b.settings
    lines = [
        "# ckpt-tune memory baseline. `ckpt-tune check TARGET --baseline <this file>` fails when the",
        "# training step's peak grows past it; record a new one on purpose with --update and commit it.",
        _field("version", b.version),
        _field("target", b.target),
        _field("created", b.created),
        _field("torch_version", b.torch_version),
        _field("measured_by", b.measured_by),
        _field("settings", ..., "the check measures under these; others fail with exit 1"),
        _field("batch_size", s.batch_size, indent=2),
        _field("precision", s.precision, indent=2),
        _field("optimizer", s.optimizer, indent=2),
        _field("device", s.device, indent=2),
        _field(
            "checkpoint",
            [e if isinstance(e, str) else list(e) for e in s.checkpoint],
            "modules checkpointed by the --plan",
            indent=2,
        ),
    ]
    if s.seq_len is not None or s.attn is not None:
        lines += [_field("seq_len", s.seq_len, indent=2), _field("attn", s.attn, indent=2)]
    if s.peft is not None:
        lines.append(_field("peft", s.peft.to_data(), "LoRA / QLoRA (--peft)", indent=2))
    if s.world_size > 1:  # written for a sharded run only: a one-device file is as it always was
        lines += [
            _field("world_size", s.world_size, "ranks; every figure below is rank 0's", indent=2),
            _field("shard", s.shard, "recorded under the real engine, a fake process group", indent=2),
        ]
    lines += [
        _field("peak_bytes", b.peak_bytes, format_bytes(b.peak_bytes)),
        _field(
            "reserved_bytes",
            b.reserved_bytes,
            "CUDA caching allocator reserve"
            + (f": {format_bytes(b.reserved_bytes)}" if b.reserved_bytes is not None else ""),
        ),
        _field("breakdown", ..., "live at the peak moment; adds up to peak_bytes"),
        *(_field(p.value, n, format_bytes(n), indent=2) for p, n in b.breakdown.items()),
        _field("param_bytes", b.param_bytes, "whole step: " + format_bytes(b.param_bytes)),
        _field("grad_bytes", b.grad_bytes, format_bytes(b.grad_bytes)),
        _field("optimizer_bytes", b.optimizer_bytes, format_bytes(b.optimizer_bytes)),
        _field(
            "activation_total_bytes",
            b.activation_total_bytes,
            "saved for backward: " + format_bytes(b.activation_total_bytes),
        ),
        _field(
            "unattributed_activation_bytes",
            b.unattributed_activation_bytes,
            "saved outside every module: " + format_bytes(b.unattributed_activation_bytes),
        ),
    ]
    if b.modules:
        lines.append(_field("modules", ..., "bytes each module's own ops save for backward; 0 omitted"))
        lines += [_field(name, n, format_bytes(n), indent=2) for name, n in b.modules.items()]
    else:
        lines.append(_field("modules", {}))
    return "\n".join(lines) + "\n"


def write_baseline(baseline: Baseline, path: str | Path) -> Path:
    return yamlio.write(path, baseline_to_yaml(baseline), "baseline file", BaselineError, mkdir=True)


# --- the file in -----------------------------------------------------------------------------------

_TOP_KEYS = tuple(f.name for f in fields(Baseline))
# the settings in the file's order, which is also the order a settings diff lists them in
SETTING_KEYS = ("batch_size", "precision", "optimizer", "device", "checkpoint", "seq_len", "attn", "world_size", "shard", "peft")
_OPTIONAL_SETTINGS = ("checkpoint", "seq_len", "attn", "world_size", "shard", "peft")
_FIX = "baseline files are written by `ckpt-tune check`: fix the field, or record a new one with --update"
_RESTORE = "restore it from version control, or record a new one with --update"


def _is_entry(value: Any) -> bool:
    """A module name, or a segment: a list of two or more names (plan/entry.py)."""
    try:
        Entry.of(value)
    except PlanError:
        return False
    return True


def load_baseline(path: str | Path) -> Baseline:
    """A validated Baseline from its YAML file. Any problem raises BaselineError naming the file and field."""
    path = Path(path)
    where = f"baseline file {path}"
    if not path.exists():
        raise BaselineError(f"{where} not found", hint=f"record one with `ckpt-tune check TARGET --baseline {path}`")
    data = yamlio.read(path, where, BaselineError, invalid_hint=_RESTORE)
    if not isinstance(data, dict):
        raise BaselineError(
            f"{where} must hold a mapping of baseline fields, found {yamlio.kind(data)}", hint=_RESTORE
        )
    f = yamlio.Fields(where, BaselineError, _FIX, noun="baseline field")
    f.keys(data, _TOP_KEYS, ("reserved_bytes",))
    if isinstance(data["version"], bool) or data["version"] != BASELINE_VERSION:
        raise f.fail(
            "version",
            f"is {data['version']!r}; this ckpt-tune reads version {BASELINE_VERSION}",
            "record a new baseline with --update",
        )
    s = f.keys(data["settings"], SETTING_KEYS, _OPTIONAL_SETTINGS, "settings.")
    ckpt = s.get("checkpoint") or []
    if not isinstance(ckpt, list) or not all(_is_entry(n) for n in ckpt):
        raise f.fail(
            "settings.checkpoint",
            f"must be a list of module names (a segment: a list of two or more), got {ckpt!r}",
        )
    device = f.text(s["device"], "settings.device")
    if device_kind(device) not in DEVICES:
        raise f.fail("settings.device", f"is {device!r}, not cpu, cuda, cuda:N or meta")
    world_size = f.integer(s.get("world_size", 1), "settings.world_size", 1)
    shard = f.text(s.get("shard", "none"), "settings.shard", SHARDS)
    if (world_size > 1) != (shard != "none"):
        raise f.fail(
            "settings.shard",
            f"is {shard!r} at world_size {world_size}: a sharded run (world_size > 1) names its stage "
            f"({', '.join(x for x in SHARDS if x != 'none')}), one device has none",
        )
    settings = CheckSettings(
        batch_size=f.integer(s["batch_size"], "settings.batch_size", 1),
        precision=f.text(s["precision"], "settings.precision", PRECISIONS),
        optimizer=f.text(s["optimizer"], "settings.optimizer", OPTIMIZERS),
        device=device,
        checkpoint=plain(ckpt),
        seq_len=f.integer(s.get("seq_len"), "settings.seq_len", 1, nullable=True),
        attn=None if s.get("attn") is None else f.text(s["attn"], "settings.attn"),
        world_size=world_size,
        shard=shard,
        peft=_peft(s.get("peft"), f),
    )
    bd = f.keys(data["breakdown"], BREAKDOWN_KEYS, (), "breakdown.")
    # "other" is what is left of the peak after the named parts, and may dip below zero.
    breakdown = Parts(**{k: f.integer(bd[k], f"breakdown.{k}", None if k == "other" else 0) for k in BREAKDOWN_KEYS})
    mods = data["modules"] or {}
    if not isinstance(mods, dict):
        raise f.fail("modules", f"must be a mapping of module name to bytes, got {yamlio.kind(mods)}")
    modules = {}
    for name, n in mods.items():
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            raise f.fail("modules", f"has a key {name!r} that is not a module name")
        modules[str(name)] = f.integer(n, f"modules.{name}")
    created = data["created"]
    if isinstance(created, (datetime.date, datetime.datetime)):  # YAML reads an unquoted timestamp as one
        created = created.isoformat()
    return Baseline(
        target=f.text(data["target"], "target"),
        settings=settings,
        peak_bytes=f.integer(data["peak_bytes"], "peak_bytes", 1),
        reserved_bytes=f.integer(data.get("reserved_bytes"), "reserved_bytes", 0, nullable=True),
        breakdown=breakdown,
        param_bytes=f.integer(data["param_bytes"], "param_bytes"),
        grad_bytes=f.integer(data["grad_bytes"], "grad_bytes"),
        optimizer_bytes=f.integer(data["optimizer_bytes"], "optimizer_bytes"),
        activation_total_bytes=f.integer(data["activation_total_bytes"], "activation_total_bytes"),
        unattributed_activation_bytes=f.integer(
            data["unattributed_activation_bytes"], "unattributed_activation_bytes"
        ),
        modules=modules,
        torch_version=f.text(data["torch_version"], "torch_version"),
        measured_by=f.text(data["measured_by"], "measured_by"),
        created=f.text(created, "created"),
    )
