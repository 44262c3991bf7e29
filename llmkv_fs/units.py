"""Sizes and durations: one parser and one formatter for each, the same
everywhere (the tier's ``min_free_bytes``, gc's ``--max-bytes`` and ages, the
stats, verify and gc reports). Standard library only; any room may import it.

Sizes follow the Kubernetes convention, so one spelling means one number in
every place that takes a size:

- a plain whole number is bytes (``1000000``; a trailing ``B`` is allowed);
- ``k`` ``M`` ``G`` ``T`` ``P``, with or without ``B`` (``kB``, ``MB``, ``GB``,
  ``TB``, ``PB``), are powers of 1000: ``20GB`` and ``20G`` are 20 * 10^9;
- ``Ki`` ``Mi`` ``Gi`` ``Ti`` ``Pi``, with or without ``B`` (``KiB``, ``MiB``,
  ``GiB``, ``TiB``, ``PiB``), are powers of 1024: ``20GiB`` is 20 * 2^30.

Suffix letters are case-insensitive and a space may precede them. A fraction is
accepted when it comes to whole bytes (``1.5GB``, ``0.5KiB``), refused when it
does not (``1.5``, ``0.1KiB``).

Durations: a number with an optional suffix ``s``, ``m``, ``h``, ``d`` (``30s``,
``10m``, ``1.5h``, ``7d``; a bare number is seconds).

Parse errors are ``UnitError``: a ``ValueError`` whose message names the text
and what is valid, and an ``argparse.ArgumentTypeError``, so the parsers serve
directly as argparse ``type=`` functions and argparse prints that message.
"""

from __future__ import annotations

import argparse
import math
import re
from fractions import Fraction

__all__ = [
    "MAX_DURATION_S",
    "MAX_SIZE",
    "UnitError",
    "format_bytes",
    "format_duration",
    "parse_duration",
    "parse_percent_or_off",
    "parse_size",
]

MAX_SIZE = (1 << 63) - 1  # the largest file offset (off_t) there is
MAX_DURATION_S = 100 * 365 * 86400  # below threading.TIMEOUT_MAX, far above any sane age
_MAX_TEXT = 40  # longer is a typo or an attack, not a size

_NUMBER = r"(?P<n>\d+(?:\.\d*)?|\.\d+)\s*"  # no sign, exponent, nan or inf
_SIZE_RE = re.compile(_NUMBER + r"(?P<unit>(?:[kmgtp]i?)?)b?", re.IGNORECASE)
_DURATION_RE = re.compile(_NUMBER + r"(?P<unit>[smhd]?)", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE_EXAMPLES = "examples: 1000000, 500GB (500 * 10^9), 2TiB (2 * 2^40), 800MiB"


class UnitError(ValueError, argparse.ArgumentTypeError):
    """A size, duration or percentage that does not parse; the message says
    what was given and what is valid."""


def parse_size(value: str | float) -> int:
    """Bytes from ``"20GB"`` (20 * 10^9), ``"20GiB"`` (20 * 2^30), ``"1.5k"``
    or a whole number; see the module docstring for every spelling."""
    if isinstance(value, bool):
        raise UnitError(f"{value!r} is not a size ({_SIZE_EXAMPLES})")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise UnitError(f"{value!r} is not a whole number of bytes")
        return _in_range(value, int(value))
    if len(value) > _MAX_TEXT:
        raise UnitError(f"{value[:_MAX_TEXT]!r}... is not a size (over {_MAX_TEXT} characters)")
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        if value.strip().startswith("-"):
            raise UnitError(f"{value!r} is negative: a size is 0 bytes or more")
        raise UnitError(f"{value!r} is not a size ({_SIZE_EXAMPLES})")
    unit = match["unit"].lower()
    factor = 1
    if unit:
        factor = (1024 if unit.endswith("i") else 1000) ** ("kmgtp".index(unit[0]) + 1)
    exact = Fraction(match["n"]) * factor
    if exact.denominator != 1:
        raise UnitError(f"{value!r} is not a whole number of bytes ({float(exact):g})")
    return _in_range(value, int(exact))


def _in_range(given: object, n: int) -> int:
    if n < 0:
        raise UnitError(f"{given!r} is negative: a size is 0 bytes or more")
    if n > MAX_SIZE:
        raise UnitError(f"{given!r} is more than the largest size, 2^63 - 1 bytes")
    return n


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"30s"``, ``"10m"``, ``"1.5h"`` or ``"7d"``."""
    match = _DURATION_RE.fullmatch(text.strip()) if len(text) <= _MAX_TEXT else None
    if match is None:
        raise UnitError(f"{text[:_MAX_TEXT]!r} is not a duration (examples: 90, 30s, 10m, 2h, 7d)")
    seconds = float(match["n"]) * _DURATION_UNITS[match["unit"].lower()]
    if seconds > MAX_DURATION_S:
        raise UnitError(f"{text!r} is longer than 100 years")
    return seconds


def parse_percent_or_off(text: str) -> float | None:
    """A percentage in [0, 100] (``"85"``, ``"85%"``), or None for ``"off"``."""
    if text.strip().lower() in ("off", "none", "no"):
        return None
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise UnitError(f"{text!r} is not a percentage or 'off'") from None
    if not 0 <= value <= 100:  # NaN fails this too
        raise UnitError(f"{text!r} is not between 0 and 100")
    return value


def format_bytes(n: float | None) -> str:
    """512 -> "512 B", 1536 -> "1.5 KiB", 3 * 2^40 -> "3.0 TiB"; None -> "-"."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_duration(seconds: float | None) -> str:
    """45 -> "45s", 600 -> "10m", 661 -> "11m", 5400 -> "1.5h", 2341662 ->
    "27.1d"; None -> "-"; a negative age (clock skew between hosts) -> "0s"."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds / width:.1f}".rstrip("0").rstrip(".") + unit
    return f"{seconds:.0f}s"
