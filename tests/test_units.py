"""Sizes and durations: one parser, the same number wherever a size is
written (the tier's min_free_bytes, gc's --max-bytes), and one formatter each
for the reports."""

from __future__ import annotations

import math

import pytest

from llmkv_fs.cli import build_parser
from llmkv_fs.config import TierConfigError, TierSettings
from llmkv_fs.units import (
    MAX_SIZE,
    UnitError,
    format_bytes,
    format_duration,
    parse_duration,
    parse_percent_or_off,
    parse_size,
)

GB, GiB = 10**9, 1 << 30

SIZES = [
    # plain bytes
    ("0", 0),
    ("1000", 1000),
    ("4096B", 4096),
    (" 17 ", 17),
    # decimal, the Kubernetes way: k M G T P, with or without B
    ("1k", 1000),
    ("1K", 1000),
    ("1kB", 1000),
    ("1KB", 1000),
    ("1.5k", 1500),
    ("500M", 500 * 10**6),
    ("500MB", 500 * 10**6),
    ("20G", 20 * GB),
    ("20GB", 20 * GB),
    ("20 GB", 20 * GB),
    ("20g", 20 * GB),
    ("1.5GB", 1_500_000_000),
    ("3T", 3 * 10**12),
    ("3TB", 3 * 10**12),
    ("2P", 2 * 10**15),
    # binary: Ki Mi Gi Ti Pi, with or without B
    ("1Ki", 1024),
    ("1KiB", 1024),
    ("0.5KiB", 512),
    ("800Mi", 800 << 20),
    ("800MiB", 800 << 20),
    ("20Gi", 20 * GiB),
    ("20GiB", 20 * GiB),
    ("20 GiB", 20 * GiB),
    ("20gib", 20 * GiB),
    ("1.5GiB", 3 << 29),
    ("2Ti", 2 << 40),
    ("2TiB", 2 << 40),
    ("1PiB", 1 << 50),
    (".5Ki", 512),
    ("5.Ki", 5120),
]


@pytest.mark.parametrize("text, n", SIZES)
def test_sizes_decimal_and_binary(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text, n",
    [s for s in SIZES if s[0] in ("1000", "1.5k", "20G", "20GB", "20GiB", "2Ti", "800MiB")],
)
def test_a_size_is_the_same_number_in_the_tier_config_and_on_gcs_command_line(text, n):
    from_config = TierSettings.from_mapping({"root_dir": "/r", "min_free_bytes": text})
    from_gc = build_parser().parse_args(["gc", "/r", "--max-bytes", text])
    assert from_config.min_free_bytes == from_gc.max_bytes == n


def test_20g_is_decimal_and_20gib_binary():
    assert parse_size("20G") == parse_size("20GB") == 20_000_000_000
    assert parse_size("20GiB") == parse_size("20Gi") == 21_474_836_480


@pytest.mark.parametrize("value, n", [(0, 0), (123, 123), (MAX_SIZE, MAX_SIZE), (2e10, 20 * GB)])
def test_sizes_given_as_numbers(value, n):
    assert parse_size(value) == n
    assert (
        TierSettings.from_mapping({"root_dir": "/r", "min_free_bytes": value}).min_free_bytes == n
    )


@pytest.mark.parametrize(
    "value, why",
    [
        ("lots", "is not a size"),
        ("", "is not a size"),
        ("20X", "is not a size"),
        ("20iB", "is not a size"),
        ("GB", "is not a size"),
        ("1e9", "is not a size"),
        ("nan", "is not a size"),
        ("inf", "is not a size"),
        ("0x10", "is not a size"),
        ("1_000", "is not a size"),
        ("20GBB", "is not a size"),
        ("-1", "negative"),
        ("-20GiB", "negative"),
        (-1, "negative"),
        (-0.5, "whole number"),
        ("1.5", "whole number"),
        ("0.1KiB", "whole number"),
        (1.5, "whole number"),
        (math.nan, "whole number"),
        (math.inf, "whole number"),
        (True, "is not a size"),
        ("9" * 41, "over 40 characters"),
        ("9" * 19, "largest size"),
        ("8EiB", "is not a size"),
        ("10000PB", "largest size"),
        (MAX_SIZE + 1, "largest size"),
    ],
)
def test_bad_sizes_say_why(value, why):
    with pytest.raises(UnitError, match=why):
        parse_size(value)


@pytest.mark.parametrize(
    "value", ["lots", "1.5", "-20GiB", "9" * 100, -1, 1.5, True, None, [20], "20 G B"]
)
def test_bad_size_in_the_tier_config_names_the_key_and_what_is_valid(value):
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping({"root_dir": "/r", "min_free_bytes": value})
    message = str(info.value)
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:60]}... (102 characters)"
    assert "'min_free_bytes'" in message and shown in message
    assert '"20GB" (20 * 10^9)' in message and '"20GiB" (20 * 2^30)' in message


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--max-bytes", "lots", "'lots' is not a size"),
        ("--max-bytes", "1.5", "'1.5' is not a whole number of bytes"),
        ("--max-bytes", "-5G", "'-5G' is negative"),
        ("--min-age", "7 weeks", "'7 weeks' is not a duration"),
        ("--protect", "-1m", "is not a duration"),
        ("--watch", "9" * 50, "is not a duration"),
        ("--tmp-age", "1000000d", "longer than 100 years"),
        ("--high", "120", "not between 0 and 100"),
        ("--high", "nan", "not between 0 and 100"),
        ("--low", "half", "not a percentage or 'off'"),
    ],
)
def test_bad_gc_arguments_are_argparse_errors_naming_the_option(capsys, option, value, message):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["gc", "/r", f"{option}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"llmkv-fs gc: error: argument {option}: " in err and message in err


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90),
        ("30s", 30),
        ("10m", 600),
        ("1.5h", 5400),
        ("7d", 604800),
        ("0", 0),
        (" 2H ", 7200),
        (".5m", 30),
        ("10 m", 600),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "7 weeks", "1e3", "-5s", "5ms", "nan", "inf"])
def test_bad_durations(text):
    with pytest.raises(UnitError, match="is not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text, value",
    [("85", 85.0), ("85%", 85.0), ("0", 0.0), ("100", 100.0), ("off", None), ("None", None)],
)
def test_percent_or_off(text, value):
    assert parse_percent_or_off(text) == value


@pytest.mark.parametrize(
    "n, text",
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (20 * GiB, "20.0 GiB"),
        (20 * GB, "18.6 GiB"),
        (3 << 40, "3.0 TiB"),
        (5 << 50, "5120.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (None, "-"),
        (0, "0s"),
        (45, "45s"),
        (-3, "0s"),
        (60, "1m"),
        (600, "10m"),
        (661, "11m"),
        (5400, "1.5h"),
        (86400, "1d"),
        (2341662, "27.1d"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_formatted_durations_parse_back():
    for seconds in (45, 600, 5400, 7 * 86400):
        assert parse_duration(format_duration(seconds)) == seconds


def test_unit_errors_are_value_errors():
    assert issubclass(UnitError, ValueError)
