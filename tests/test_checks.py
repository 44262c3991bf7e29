"""Every numeric setting has a documented range both ways; a value outside
it -- too small, too large, a number too large for a float, NaN, an
infinity, a bool -- is a TierConfigError naming the key and the range, never
an OverflowError or an accepted absurdity (``lease_interval_s: 1e-6``)."""

import json

import pytest

from llmkv_fs.config import SETTINGS, TierConfigError, TierSettings

# key -> (smallest valid, largest valid, just below, just above)
NUMERIC = {
    "n_read_threads": (1, 512, 0, 513),
    "n_write_threads": (1, 512, 0, 513),
    "max_pending_store_blocks": (1, 1 << 24, 0, (1 << 24) + 1),
    "max_pending_store_bytes": (1, (1 << 63) - 1, 0, 1 << 63),
    "lookup_threads": (1, 256, 0, 257),
    "job_timeout_s": (0.1, 86400, 0.09, 86401),
    "max_usage_percent": (1, 100, 0.5, 100.5),
    "min_free_bytes": (0, (1 << 63) - 1, -1, 1 << 63),
    "lease_interval_s": (0.1, 3600, 1e-6, 3601),
    "failed_load_miss_s": (1, 3600, 0.5, 3601),
    "numa_node": (0, 1023, -1, 1024),
    "io_workers_nice": (0, 19, -1, 20),
}
HUGE = int("9" * 400)  # json.loads gives an int this large; float() of it overflows


def test_every_numeric_setting_is_covered():
    numeric = {
        s.key
        for s in SETTINGS
        if isinstance(s.default, (int, float)) and not isinstance(s.default, bool)
    }
    numeric -= {"file_mode", "dir_mode"}  # octal modes: tests/test_config.py
    # Declared as a string or null by default, numeric by their checks.
    assert numeric | {"numa_node", "max_pending_store_blocks"} == set(NUMERIC)


def refused(key, value) -> str:
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping({"root_dir": "/r", key: value})
    message = str(info.value)
    assert repr(key) in message
    return message


@pytest.mark.parametrize("key", sorted(NUMERIC))
def test_bounds_are_accepted(key):
    low, high, _, _ = NUMERIC[key]
    for value in (low, high):
        assert getattr(TierSettings.from_mapping({"root_dir": "/r", key: value}), key) == value


@pytest.mark.parametrize("key", sorted(NUMERIC))
@pytest.mark.parametrize(
    "case", ["too_small", "too_large", "overflow", "overflow_json", "nan", "inf", "-inf", "bool"]
)
def test_out_of_range_is_an_error_naming_key_and_range(key, case):
    _, _, below, above = NUMERIC[key]
    value = {
        "too_small": below,
        "too_large": above,
        "overflow": HUGE,
        "overflow_json": json.loads("1" + "0" * 400),
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": float("-inf"),
        "bool": True,
    }[case]
    message = refused(key, value)
    setting = next(s for s in SETTINGS if s.key == key)
    assert setting.valid and setting.valid in setting.doc
    if key != "min_free_bytes":  # sizes explain their spellings instead
        assert setting.valid in message, message
    assert len(message) < 600  # a 400-digit value is quoted short, not pasted


def test_an_integer_beyond_pythons_conversion_limit_is_still_named():
    message = refused("n_read_threads", 10**5000)
    assert "[1, 512]" in message


def test_numbers_written_as_strings_are_refused_except_sizes():
    refused("lease_interval_s", "30")
    assert TierSettings.from_mapping({"root_dir": "/r", "min_free_bytes": "1GiB"}).min_free_bytes
