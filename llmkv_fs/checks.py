"""The value checks tier settings are declared with (config.py): each
takes ``(key, value)``, returns the value in its settled type, or raises
``TierConfigError`` naming the key, the refused value and what is valid; and
each carries, as ``check.valid``, what it accepts in words (``accepts``),
which the docs show and the error quotes.

Numbers have ranges both ways: a value absurdly small (a lease interval of
1e-6 s makes an idle replica spin) is as much a mistake as one too large.

The command lines check their numbers with the same checks: ``option``
makes one an argparse ``type=``, so a refused value's message names the
option (argparse adds it) and quotes what is valid.

Pure functions: safe from any thread.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from llmkv_fs.units import UnitError, parse_size

__all__ = [
    "TierConfigError",
    "accepts",
    "boolean",
    "byte_size",
    "directory_path",
    "fail",
    "int_between",
    "io_workers_count",
    "key_files",
    "key_id_or_null",
    "locality",
    "numa_node",
    "number_between",
    "octal_mode",
    "one_of",
    "option",
    "or_auto",
    "percent",
    "seconds",
]


class TierConfigError(ValueError):
    """A secondary-tier config key is unknown or has a bad value."""


_SHOWN_MAX = 80  # characters of a refused value quoted in the error


def _shown(value: Any) -> str:
    """``repr(value)``, shortened: a 400-digit number is quoted, not pasted
    (and an int past Python's 4300-digit conversion limit cannot be)."""
    try:
        text = repr(value)
    except ValueError:
        return "an integer of thousands of digits"
    if len(text) > _SHOWN_MAX:
        return f"{text[: _SHOWN_MAX - 20]}... ({len(text)} characters)"
    return text


def fail(key: str, value: Any, expected: str, *, not_a: str = "") -> TierConfigError:
    """``not_a`` names the type vLLM's built-in converts the value to, so the
    message also carries Python's own wording for it (``'local' is not a
    valid Locality``), which scripts written against the built-in match."""
    refused = f"{_shown(value)} is not a valid {not_a}" if not_a else _shown(value)
    return TierConfigError(
        f"llmkv_fs: bad value for secondary tier key {key!r}: {refused} (expected {expected})"
    )


_Check = TypeVar("_Check", bound=Callable[..., Any])


def accepts(valid: str) -> Callable[[_Check], _Check]:
    """Attach the words for what a check accepts (``Setting.valid``)."""

    def attach(check: _Check) -> _Check:
        check.valid = valid  # type: ignore[attr-defined]
        return check

    return attach


def _is_number(value: Any) -> bool:
    # bool is an int subclass; "true" threads is a config mistake, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_between(low: int, high: int) -> Callable[[str, Any], int]:
    expected = f"an integer in [{low}, {high}]"

    @accepts(expected)
    def check(key: str, value: Any) -> int:
        if not _is_number(value) or isinstance(value, float) or not low <= value <= high:
            raise fail(key, value, expected)
        return int(value)

    return check


def or_null(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``check``, or null (None) for "not set"."""

    expected = f"null or {check.valid}"  # type: ignore[attr-defined]

    @accepts(expected)
    def either(key: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(key, value)
        except TierConfigError:
            raise fail(key, value, expected) from None

    return either


def or_auto(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``check``, or ``"auto"`` (returned as is: the caller decides)."""

    expected = f'"auto" or {check.valid}'  # type: ignore[attr-defined]

    @accepts(expected)
    def either(key: str, value: Any) -> Any:
        if value == "auto":
            return "auto"
        try:
            return check(key, value)
        except TierConfigError:
            raise fail(key, value, expected) from None

    return either


def option(
    check: Callable[[str, Any], Any], parse: Callable[[str], Any] = int
) -> Callable[[str], Any]:
    """``check`` as an argparse ``type=``: the option's text is ``parse``d
    (text that does not parse is checked as text: ``"auto"``), then
    checked; a refused value raises ArgumentTypeError quoting what is valid
    (argparse names the option)."""
    valid = check.valid  # type: ignore[attr-defined]

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = text
        try:
            return check("", value)
        except TierConfigError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {valid}") from None

    convert.__name__ = "value"  # argparse's fallback wording: "invalid value value"
    return convert


def _plain(number: float) -> str:
    """``1e+07`` as ``10,000,000``; any other number as ``:g`` writes it."""
    text = f"{number:g}"
    return f"{int(number):,}" if "e+" in text and float(number).is_integer() else text


def number_between(low: float, high: float, what: str) -> Callable[[str, Any], float]:
    """A float (or int) in [low, high]; NaN, infinities and bools refused."""
    expected = f"{what}, a number in [{_plain(low)}, {_plain(high)}]"

    @accepts(expected)
    def check(key: str, value: Any) -> float:
        # Compared before float(): an int too large for a float fails the
        # range instead of raising OverflowError; NaN fails every comparison.
        if not _is_number(value) or not low <= value <= high or not math.isfinite(value):
            raise fail(key, value, expected)
        return float(value)

    return check


@accepts("true or false")
def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise fail(key, value, "true or false")
    return value


def one_of(*choices: str | None) -> Callable[[str, Any], Any]:
    shown = ", ".join("null" if c is None else c for c in choices)

    @accepts(f"one of {shown}")
    def check(key: str, value: Any) -> Any:
        if value not in choices:
            raise fail(key, value, f"one of {shown}")
        return value

    return check


def octal_mode(required_bits: int, what: str) -> Callable[[str, Any], int]:
    # JSON has no octal literals; "0640" (a string) is what operators write.
    @accepts(f'an octal mode string such as "0640", within 0o7777, keeping {what}')
    def check(key: str, value: Any) -> int:
        if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3,4}", value.strip()):
            mode = int(value.strip(), 8)
        elif isinstance(value, int) and not isinstance(value, bool):
            mode = value
        else:
            raise fail(key, value, 'an octal mode string such as "0640"')
        if not 0 <= mode <= 0o7777:
            raise fail(key, value, "a mode within 0o7777")
        if mode & required_bits != required_bits:
            raise fail(key, value, f"a mode that keeps {what} ({required_bits:#o})")
        return mode

    return check


_SIZE_RANGE = "a size from 0 to 2^63 - 1 bytes"


@accepts(_SIZE_RANGE)
def byte_size(key: str, value: Any) -> int:
    if isinstance(value, (str, int, float)):
        try:
            return parse_size(value)
        except UnitError:
            pass
    raise fail(
        key,
        value,
        "a whole number of bytes from 0 to 2^63 - 1: an integer, or a string "
        'with a decimal or binary suffix such as "20GB" (20 * 10^9) or "20GiB" (20 * 2^30)',
    )


def byte_size_at_least(low: int) -> Callable[[str, Any], int]:
    """``byte_size``, and at least ``low`` bytes."""
    expected = f'a size of at least {low} bytes: an integer, or a string such as "2GiB"'

    @accepts(expected)
    def check(key: str, value: Any) -> int:
        try:
            size = byte_size(key, value)
        except TierConfigError:
            raise fail(key, value, expected) from None
        if size < low:
            raise fail(key, value, expected)
        return size

    return check


def seconds(low: float, high: float) -> Callable[[str, Any], float]:
    return number_between(low, high, "seconds")


percent = number_between(1, 100, "a percentage")


# -- the checks of one setting each (config.py) ------------------------------------------


@accepts("a non-empty directory path")
def directory_path(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(key, value, "a non-empty directory path")
    if "\0" in value:
        raise fail(key, value, "a path without NUL bytes")
    return value


@accepts("LOCAL, REMOTE or null")
def locality(key: str, value: Any) -> str | None:
    # Exactly what vLLM's Locality(value) takes: case-sensitive, unstripped.
    if value is None or value in ("LOCAL", "REMOTE"):
        return None if value is None else str(value)
    raise fail(key, value, "LOCAL, REMOTE (upper case, as vLLM requires) or null", not_a="Locality")


_MAX_NUMA_NODE = 1023  # Linux: MAX_NUMNODES is at most 1 << 10
_NUMA_EXPECTED = f'"auto", "off" or a NUMA node id (an integer in [0, {_MAX_NUMA_NODE}])'


@accepts(_NUMA_EXPECTED)
def numa_node(key: str, value: Any) -> str | int:
    if isinstance(value, str) and value in ("auto", "off"):
        return value
    if value is None:
        return "off"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_NUMA_NODE:
        return value
    raise fail(key, value, _NUMA_EXPECTED)


IO_WORKERS_MAX = 256
SEAL_KEYS_MAX = 64
_MAX_KEY_ID = (1 << 32) - 1  # a sealed trailer's u32 (layout/blockfile.py)
_KEY_FILES_EXPECTED = (
    f"null, or an object of at most {SEAL_KEYS_MAX} key ids (integers in [1, {_MAX_KEY_ID}]) "
    "to key file paths"
)


def key_id(key: str, value: Any) -> int:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    canonical = isinstance(text, str) and text.isdigit() and text == str(int(text))
    if canonical and 1 <= int(text) <= _MAX_KEY_ID:
        return int(text)
    raise fail(key, value, f"a key id: an integer in [1, {_MAX_KEY_ID}] (no leading zeros)")


@accepts(_KEY_FILES_EXPECTED)
def key_files(key: str, value: Any) -> tuple[tuple[int, str], ...] | None:
    # Only paths here: the keys are read at start-up (volume/keyfiles.py)
    # and never become part of the settings, their dict or their logs.
    if value is None:
        return None
    if not isinstance(value, dict) or not 1 <= len(value) <= SEAL_KEYS_MAX:
        raise fail(key, value, _KEY_FILES_EXPECTED)
    files: dict[int, str] = {}
    for given_id, path in value.items():
        number = key_id(key, given_id)
        if number in files:
            raise fail(key, value, f"{_KEY_FILES_EXPECTED}; key id {number} is given twice")
        if not isinstance(path, str) or not path.strip() or "\0" in path:
            raise fail(key, value, f"{_KEY_FILES_EXPECTED}; key id {number} has no usable path")
        files[number] = path
    return tuple(sorted(files.items()))


@accepts(f"null, or a key id of seal_key_files (an integer in [1, {_MAX_KEY_ID}])")
def key_id_or_null(key: str, value: Any) -> int | None:
    return None if value is None else key_id(key, value)


io_workers_count = or_auto(int_between(0, IO_WORKERS_MAX))
