"""Byte counts and percentages as people read and write them.

Bytes are `int` everywhere in the package and are formatted only for display, in binary units: device
memory is sized in powers of two, and a "24 GB" card holds about 24 GiB (docs/design.md §2).
"""

from __future__ import annotations

import math

from ckpt_tune.errors import BudgetError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """`n` bytes in binary units: "100 B", "12.0 KiB", "512.0 MiB", "1.50 GiB", "-3.0 MiB".

    KiB and MiB get one decimal, GiB and above two: a GPU budget is read in GiB, where a tenth is
    100 MiB, too coarse to tell two plans apart.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_bytes takes an int number of bytes, got {type(n).__name__}")
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} B"
    exp = 1
    while exp < len(_UNITS) - 1 and n >= 1024 ** (exp + 1):
        exp += 1
    digits = 2 if exp >= 3 else 1
    value = round(n / 1024**exp, digits)
    # 1023.96 MiB would print as "1024.0 MiB": move up a unit instead.
    if value >= 1024 and exp < len(_UNITS) - 1:
        exp += 1
        digits = 2 if exp >= 3 else 1
        value = round(n / 1024**exp, digits)
    return f"{sign}{value:.{digits}f} {_UNITS[exp]}"


def parse_percent(text: str | float | int) -> float:
    """A fraction from "10%", "2.5 %" or a bare fraction "0.1" / 0.1. Returns 0.1 for all of "10%", "0.1".

    A bare number above 1 is refused: "10" could mean 10% or 1000%, and guessing would silently turn
    a 10% margin into a 1000% one. Percentages may exceed 100% ("150%" -> 1.5).
    """
    original = text
    if isinstance(text, bool):
        raise BudgetError(f"not a percentage: {original!r}", hint="write e.g. 10% or 0.1")
    if isinstance(text, (int, float)):
        value, has_percent = float(text), False
    else:
        s = str(text).strip()
        has_percent = s.endswith("%")
        if has_percent:
            s = s[:-1].strip()
        try:
            value = float(s)
        except ValueError:
            raise BudgetError(f"not a percentage: {original!r}", hint="write e.g. 10% or 0.1") from None
    if not math.isfinite(value) or value < 0:
        raise BudgetError(
            f"a percentage must be a finite number >= 0, got {original!r}", hint="write e.g. 10% or 0.1"
        )
    if has_percent:
        return value / 100.0
    if value > 1:
        raise BudgetError(
            f"ambiguous percentage {original!r}: a bare number is read as a fraction and must be <= 1",
            hint=f"write {value:g}% for {value:g} percent, or {value / 100:g} as a fraction",
        )
    return value


def format_percent(fraction: float, digits: int = 1, signed: bool = False) -> str:
    """A fraction for people: 0.125 -> "12.5%"; `signed` -> "+12.5%"; `digits=None`-like exactness with
    `digits=-1`: as the user wrote it, up to 4 significant digits (0.05 -> "5%", 0.125 -> "12.5%")."""
    if digits < 0:
        return f"{'+' if signed and fraction > 0 else ''}{100 * fraction:.4g}%"
    return f"{fraction:+.{digits}%}" if signed else f"{fraction:.{digits}%}"
