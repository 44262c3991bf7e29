"""Durations and sizes on gc's command line, and how the report prints them.

Durations: a number with an optional suffix ``s``, ``m``, ``h``, ``d`` (``30s``,
``10m``, ``1.5h``, ``7d``; a bare number is seconds). Sizes: bytes, or a
number with a Kubernetes-style suffix: ``K M G T P`` are powers of 1000,
``Ki Mi Gi Ti Pi`` powers of 1024 (a trailing ``B`` is accepted:
``500GB``, ``2GiB``).
"""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["duration", "fmt_bytes", "fmt_duration", "percent_or_off", "size"]

_DURATION_RE = re.compile(r"^\s*(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[smhd]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE_RE = re.compile(r"^\s*(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>(?:[KMGTP]i?)?)B?\s*$", re.I)


def duration(text: str) -> float:
    match = _DURATION_RE.match(text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (examples: 90, 30s, 10m, 2h, 7d)")
    return float(match["n"]) * _DURATION_UNITS[match["unit"]]


def size(text: str) -> int:
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 1000000, 500G, 2Ti, 800MiB)")
    unit = match["unit"]
    if not unit:
        factor = 1
    else:
        power = "KMGTP".index(unit[0].upper()) + 1
        factor = (1024 if unit.lower().endswith("i") else 1000) ** power
    return int(float(match["n"]) * factor)


def percent_or_off(text: str) -> float | None:
    if text.strip().lower() in ("off", "none", "no"):
        return None
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage or 'off'") from None
    if not 0 <= value <= 100 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 100")
    return value


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float) -> str:
    """600 -> "10m", 661 -> "11m", 5400 -> "1.5h", 2341662 -> "27.1d"."""
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds / width:.1f}".rstrip("0").rstrip(".") + unit
    return f"{seconds:.0f}s"
