"""The one YAML codec of the package: plan files and baseline files are written and read through it.

Files are written line by line, so each value can carry a comment for the people who read them
(`line`), with scalars as `yaml.safe_dump` writes them (so names like "0" or "true" come back as
strings). They are read with `yaml.safe_load` only, and `Fields` checks each field, naming the file
and the field in every error, with a hint.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ckpt_tune.errors import CkptTuneError

COMMENT_COLUMN = 38  # comments start in this column (1-based) when the value leaves room


def scalar(value: Any) -> str:
    """One YAML scalar (or flow collection) as safe_dump writes it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def flow_name(name: str) -> str:
    """A name inside a YAML flow list: plain when it reads back as itself, else double-quoted."""
    plain = re.fullmatch(r"[A-Za-z_][\w.\-]*", name) is not None and yaml.safe_load(name) == name
    return name if plain else json.dumps(name)


def line(
    key: str, value: str, comment: str | None = None, indent: int = 0, column: int = COMMENT_COLUMN
) -> str:
    """`key: value  # comment`. `value` is YAML text already (see `scalar`); "" opens a nested block.

    The space before "#" is what makes it a comment: "12# x" would read back as the string "12# x".
    `column`: where comments start, for a file whose layout was fixed before this module (baselines).
    """
    text = f"{' ' * indent}{key}: {value}" if value else f"{' ' * indent}{key}:"
    return f"{text.ljust(column - 1)} # {comment}" if comment else text


def parse(text: str, where: str, error: type[CkptTuneError], hint: str | None = None) -> Any:
    """`yaml.safe_load(text)`, or `error` naming the file (`where`), the line and column, and the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise error(f"{where} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}", hint=hint) from exc


def read(
    path: str | Path,
    where: str,
    error: type[CkptTuneError],
    hint: str | None = None,
    invalid_hint: str | None = None,
) -> Any:
    """The parsed YAML of a file, or `error` saying why it cannot be read (with `hint`) or parsed
    (with `invalid_hint`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {where}: {exc.strerror or exc}", hint=hint) from exc
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not text: {exc.reason}") from exc
    return parse(text, where, error, invalid_hint)


def write(path: str | Path, text: str, what: str, error: type[CkptTuneError], mkdir: bool = False) -> Path:
    """Write `text` to `path`; an OSError becomes `error` naming the file."""
    path = Path(path)
    try:
        if mkdir and path.parent != Path():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    return path


def kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


class Fields:
    """Checks of one file's fields; every error names the file (`where`) and the field, with a hint."""

    def __init__(self, where: str, error: type[CkptTuneError], fix: str, noun: str = "field") -> None:
        self.where, self.error, self.fix, self.noun = where, error, fix, noun

    def fail(self, key: str, problem: str, hint: str | None = None) -> CkptTuneError:
        return self.error(f"{self.where}: field '{key}' {problem}", hint=hint or self.fix)

    def keys(self, data: Any, allowed: Sequence[str], optional: Sequence[str] = (), prefix: str = "") -> dict:
        """`data` as a mapping with only `allowed` keys, each present unless `optional`."""
        if not isinstance(data, dict):
            raise self.fail(prefix.rstrip(".") or "(file)", f"must be a mapping, got {kind(data)}")
        for k in data:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                raise self.fail(
                    prefix + str(k),
                    f"is not a {self.noun}",
                    f"did you mean {close[0]!r}?" if close else f"{self.noun}s are: {', '.join(allowed)}",
                )
        for k in allowed:
            if k not in data and k not in optional:
                raise self.fail(prefix + k, "is missing")
        return data

    def integer(self, value: Any, key: str, minimum: int | None = 0, nullable: bool = False) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            hint = "write a plain integer number of bytes, e.g. 25769803776" if key.endswith("_bytes") else None
            raise self.fail(key, f"must be an integer{' or null' if nullable else ''}, got {kind(value)} {value!r}", hint)
        if minimum is not None and value < minimum:
            hint = "sizes cannot be negative" if minimum == 0 else f"use {minimum} or more"
            raise self.fail(key, f"must be >= {minimum}, got {value}", hint)
        return value

    def flag(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {kind(value)} {value!r}")
        return value

    def number(self, value: Any, key: str, hint: str | None = None) -> float:
        """A finite number >= 0."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number, got {value!r}", hint)
        if not math.isfinite(value) or value < 0:
            raise self.fail(key, f"must be finite and >= 0, got {value}", hint)
        return float(value)

    def text(self, value: Any, key: str, choices: Sequence[str] | None = None, hint: str | None = None) -> str:
        if not isinstance(value, str) or not value.strip():
            quote = "quote it in the YAML file, e.g. '2.4.0'" if isinstance(value, (int, float)) else None
            raise self.fail(key, f"must be a non-empty string, got {kind(value)} {value!r}", quote or hint)
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            raise self.fail(
                key,
                f"is {value!r}, not one of {', '.join(choices)}",
                f"did you mean {close[0]!r}?" if close else "use one of the values listed",
            )
        return value
