"""Project configuration, found the way ruff and pytest find theirs: the defaults of the command options.

Where: from the current directory upward to the filesystem root, the first directory holding either
`ckpt-tune.toml` (top-level keys) or a `pyproject.toml` with a `[tool.ckpt-tune]` table. When both are
in one directory `ckpt-tune.toml` wins; a `pyproject.toml` without the table is skipped and the search
goes on upward. `CKPT_TUNE_NO_CONFIG=1` (or `ckpt-tune --no-config`) turns it off; `ckpt-tune --config
FILE` reads one file and searches nothing.

What: the keys in `KEYS` (kebab-case as TOML writes them; snake_case is accepted too). A top-level key
is the default of that option in every command that has it; a per-command table (`[tool.ckpt-tune.search]`,
or `[search]` in ckpt-tune.toml) sets it for that command only and wins over the top level. A flag on the
command line wins over both. Two exceptions keep the commands' meaning: a top-level `batch-size` is not
given to `search`, where it would fix the micro-batch instead of searching for the largest one (put it in
`[tool.ckpt-tune.search]` for that); and `target` and `hf-config` exclude each other (the CLI drops a
configured `hf-config` when TARGET is given on the command line).

Relative paths (`target`/`batch-fn`/`loss-fn` in their path/file.py:fn form, `hf-config`, `baseline`) are
read relative to the directory of the file that sets them; `package.module:fn` is left alone.

Pure: reads TOML and returns plain dicts; no torch, no typer. Errors are `ConfigError` (exit 1) and
name the file, the table and the key.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.vocab import OPTIMIZERS, PRECISIONS

CONFIG_FILE = "ckpt-tune.toml"
PYPROJECT = "pyproject.toml"
TOOL = "ckpt-tune"
ENV_DISABLE = "CKPT_TUNE_NO_CONFIG"

ATTNS = ("sdpa", "eager", "flash")
SPEC_FORMS = "path/to/file.py:fn or package.module:fn"

# kebab-case key -> kind of value (see _value)
KEYS: dict[str, str] = {
    "target": "spec",
    "batch-fn": "spec",
    "loss-fn": "spec",
    "precision": "precision",
    "optimizer": "optimizer",
    "device": "device",
    "batch-size": "count",
    "hf-config": "path",
    "seq-len": "count",
    "attn": "attn",
    "baseline": "path",
    "vram": "size",
    "margin": "margin",
}

# (command, option) pairs a top-level key does not reach: `search --batch-size` fixes the micro-batch
# instead of searching for the largest, and the command line has no way to unset it again.
TOP_LEVEL_SKIP = {("search", "batch_size")}

_DEVICE_RE = re.compile(r"\s*(auto|cpu|meta|cuda(:\d+)?)\s*", re.IGNORECASE)
_FALSE = ("", "0", "false", "no", "off")


class ConfigError(CkptTuneError):
    """The configuration file is unreadable, or holds an unknown key or a bad value. Exit code 1."""


@dataclass(frozen=True)
class Config:
    """A configuration file read and checked: the defaults of each command's options.

    Attributes:
        path: the file read.
        table: "[tool.ckpt-tune]" for a pyproject.toml, "" for a ckpt-tune.toml.
        defaults: command -> {option name (snake_case, as the command's parameter): value}, the
            `default_map` click takes; only options the command has.
        origins: (command, option) -> (the kebab-case key, e.g. "vram", and the table that set
            it, e.g. "/p/pyproject.toml [tool.ckpt-tune.search]").
    """

    path: Path
    table: str
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    origins: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.path} {self.table}" if self.table else str(self.path)


def disabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """True when CKPT_TUNE_NO_CONFIG is set to anything but "", 0, false, no or off."""
    value = (os.environ if environ is None else environ).get(ENV_DISABLE)
    return value is not None and value.strip().lower() not in _FALSE


def find(start: Path) -> tuple[Path, dict[str, Any], str] | None:
    """(file, its ckpt-tune table, "[tool.ckpt-tune]" or "") for the first configured directory at or
    above `start`, or None."""
    for directory in (start, *start.parents):
        candidate = directory / CONFIG_FILE
        if candidate.is_file():
            return candidate, _parse(candidate), ""
        candidate = directory / PYPROJECT
        if candidate.is_file():
            table = _pyproject_table(candidate)
            if table is not None:
                return candidate, table, f"[tool.{TOOL}]"
    return None


def read(path: Path) -> tuple[Path, dict[str, Any], str]:
    """The file given with --config: a pyproject.toml (its [tool.ckpt-tune] table) or any other TOML."""
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", hint="--config takes a ckpt-tune.toml or a pyproject.toml")
    if path.name == PYPROJECT:
        table = _pyproject_table(path)
        if table is None:
            raise ConfigError(f"{path} has no [tool.{TOOL}] table", hint=f"add [tool.{TOOL}] with e.g. target = \"model.py:build\"")
        return path, table, f"[tool.{TOOL}]"
    return path, _parse(path), ""


def load(
    start: Path,
    params: Mapping[str, Collection[str]],
    explicit: Path | None = None,
) -> Config | None:
    """The configuration for a run in `start` (or the file `explicit`), checked against `params`
    (command -> its option names), or None when there is none."""
    found = read(explicit) if explicit is not None else find(start)
    if found is None:
        return None
    return build(*found, params=params)


def build(path: Path, table: dict[str, Any], label: str, params: Mapping[str, Collection[str]]) -> Config:
    """Check one ckpt-tune table and turn it into each command's defaults."""
    base = path.parent
    where = _at(path, label)
    shared: dict[str, Any] = {}
    per_command: dict[str, dict[str, Any]] = {}
    seen: dict[str, str] = {}
    for raw, value in table.items():
        if raw in params:  # a per-command table
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{where}: {raw} must be a table of options for `ckpt-tune {raw}`, got {_show(value)}",
                    hint=f"write it as [{_sub(label, raw)[1:-1]}] with keys such as device = \"cuda\"",
                )
            per_command[raw] = _table(value, _at(path, _sub(label, raw)), base, params[raw], raw)
            continue
        key = _key(raw, where, seen, commands=params)
        shared[key] = _value(key, value, where, base)
    _exclusive(shared, where)

    defaults: dict[str, dict[str, Any]] = {}
    origins: dict[tuple[str, str], tuple[str, str]] = {}
    for command, options in params.items():
        out: dict[str, Any] = {}
        own = per_command.get(command, {})
        for key, value in shared.items():
            opt = key.replace("-", "_")
            if opt in options and (command, opt) not in TOP_LEVEL_SKIP:
                out[opt] = value
                origins[(command, opt)] = (key, where)
        if "target" in own:
            out.pop("hf_config", None)
        if "hf-config" in own:
            out.pop("target", None)
        for key, value in own.items():
            opt = key.replace("-", "_")
            out[opt] = value
            origins[(command, opt)] = (key, _at(path, _sub(label, command)))
        if out:
            defaults[command] = out
    return Config(path, label, defaults, origins)


# --- reading ------------------------------------------------------------------------------------------


def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return None
    return tomllib


def _parse(path: Path) -> dict[str, Any]:
    toml = _toml()
    if toml is None:
        raise ConfigError(
            f"cannot read {path}: Python < 3.11 needs the tomli package to read TOML",
            hint=f"pip install tomli, or set {ENV_DISABLE}=1 to ignore configuration files",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from e
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise ConfigError(
            f"{path} is not valid TOML: {e}",
            hint=f"fix the file, or set {ENV_DISABLE}=1 to ignore configuration files",
        ) from e


def _pyproject_table(path: Path) -> dict[str, Any] | None:
    """pyproject.toml's [tool.ckpt-tune] table, or None when it has none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if TOOL not in text:  # cannot hold the table: not even parsed, so an unrelated broken file is no error
        return None
    tool = _parse(path).get("tool")
    if not isinstance(tool, dict) or TOOL not in tool:
        return None
    table = tool[TOOL]
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: tool.{TOOL} must be a table, got {_show(table)}", hint=f"write [tool.{TOOL}] and keys below it")
    return table


# --- checking -----------------------------------------------------------------------------------------


def _at(path: Path, label: str) -> str:
    return f"{path} {label}" if label else str(path)


def _sub(label: str, command: str) -> str:
    """The label of a per-command table: "[tool.ckpt-tune.search]" or "[search]"."""
    return f"{label[:-1]}.{command}]" if label else f"[{command}]"


def _table(table: dict[str, Any], where: str, base: Path, options: Collection[str], command: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for raw, value in table.items():
        key = _key(raw, where, seen)
        if key.replace("-", "_") not in options:
            has = [k for k in KEYS if k.replace("-", "_") in options]
            raise ConfigError(
                f"{where}: {key}: `ckpt-tune {command}` has no --{key} option",
                hint=f"keys for {command}: {', '.join(has)}",
            )
        out[key] = _value(key, value, where, base)
    _exclusive(out, where)
    return out


def _key(raw: str, where: str, seen: dict[str, str], commands: Collection[str] = ()) -> str:
    key = raw.replace("_", "-")
    if key not in KEYS:
        choices = [*KEYS, *commands]
        close = difflib.get_close_matches(key, choices, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(KEYS)}"
        if commands and not close:
            hint += f"; per-command tables: {', '.join(commands)}"
        raise ConfigError(f"{where}: unknown key {raw!r}", hint=hint)
    if key in seen:
        raise ConfigError(f"{where}: {key} is set twice (as {seen[key]!r} and {raw!r})", hint="keep one of them")
    seen[key] = raw
    return key


def _exclusive(table: Mapping[str, Any], where: str) -> None:
    if "target" in table and "hf-config" in table:
        raise ConfigError(
            f"{where}: target and hf-config are both set; a run builds one model",
            hint="keep one of them (a per-command table may set the other)",
        )


def _show(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", dict: "a table", list: "an array"}
    return f"{value!r} ({kind.get(type(value), type(value).__name__)})"


def _value(key: str, value: Any, where: str, base: Path) -> Any:
    """The value as the option takes it, or a ConfigError naming `where` and `key`."""
    kind = KEYS[key]

    def bad(expected: str, hint: str) -> ConfigError:
        return ConfigError(f"{where}: {key} must be {expected}, got {_show(value)}", hint=hint)

    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("a positive integer", f"write e.g. {key} = 8 (a number, no quotes)")
        return value
    if kind == "size":
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return str(value)
        if not isinstance(value, str) or not value.strip():
            raise bad("a memory size", f'write e.g. {key} = "24GB", "24000MiB", a byte count, or "auto"')
        return value.strip()
    if kind == "margin":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value.strip():
            raise bad("a percentage, fraction or size", f'write e.g. {key} = "5%", 0.05 or "512MiB"')
        return value.strip()
    if not isinstance(value, str) or not value.strip():
        raise bad("a non-empty string", f'write e.g. {key} = "{_EXAMPLES[kind]}"')
    value = value.strip()
    if kind in _CHOICES:
        choices = _CHOICES[kind]
        if value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            raise ConfigError(
                f"{where}: {key} = {value!r} is not one of {', '.join(choices)}",
                hint=f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(choices)}",
            )
        return value
    if kind == "device":
        if not _DEVICE_RE.fullmatch(value):
            raise ConfigError(f"{where}: device = {value!r} is not a device", hint="use auto, cpu, cuda, cuda:N or meta")
        return value
    if kind == "spec":
        return _spec(key, value, where, base)
    return _relative(value, base)  # path


_CHOICES = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "attn": ATTNS}
_EXAMPLES = {
    "spec": "model.py:build",
    "path": "path/to/file",
    "device": "cuda",
    "precision": "bf16-mixed",
    "optimizer": "adamw",
    "attn": "sdpa",
}


def _spec(key: str, value: str, where: str, base: Path) -> str:
    """`file.py:fn` relative to `base`; `package.module:fn` as given."""
    left, colon, fn = value.rpartition(":")  # rpartition keeps a Windows drive letter in `left`
    if not colon or not left or not fn.isidentifier():
        raise ConfigError(f"{where}: {key} = {value!r} is not {SPEC_FORMS}", hint=f'write e.g. {key} = "model.py:build"')
    if left.endswith(".py") or "/" in left or os.sep in left:
        left = _relative(left, base)
    return f"{left}:{fn}"


def _relative(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else Path(os.path.normpath(base / path)))
