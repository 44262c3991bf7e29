"""Tier settings: TierSettings.from_mapping directly, and through vLLM 0.33's
real TieringOffloadingSpec.get_manager()."""

from __future__ import annotations

import dataclasses
import inspect
import os
import uuid

import pytest
from vllm.v1.kv_offload.base import Locality
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from llmkv_fs.config import SETTINGS, TierConfigError, TierSettings
from llmkv_fs.engine import EngineError
from tests.kits.tier_kit import Replica, offloading_config, ours

VALID_KEYS = sorted(s.key for s in SETTINGS)
DEFAULTS = {s.key: s.default for s in SETTINGS if not s.required}


def engine_id() -> str:
    return f"llmkvtest_{uuid.uuid4().hex[:12]}"


def shm_region(eid: str) -> str:
    return f"/dev/shm/vllm_offload_{eid}.mmap"


def valid_keys_part(message: str) -> str:
    assert "valid keys:" in message, message
    return message.split("valid keys:", 1)[1]


# -- TierSettings.from_mapping -------------------------------------------------------


def test_defaults_when_only_root_dir_given():
    settings = TierSettings.from_mapping({"root_dir": "/mnt/kv"})
    assert settings.root_dir == "/mnt/kv"
    assert len(DEFAULTS) == len(SETTINGS) - 1
    for key, default in DEFAULTS.items():
        assert getattr(settings, key) == default, key
    assert settings.as_dict() == {"root_dir": "/mnt/kv", **DEFAULTS}


def test_settings_table_documents_every_key():
    assert sorted(f.name for f in dataclasses.fields(TierSettings)) == VALID_KEYS
    assert [s.key for s in SETTINGS if s.required] == ["root_dir"]
    assert all(s.doc.strip() for s in SETTINGS)


def test_every_vllm_builtin_key_is_accepted():
    settings = TierSettings.from_mapping(
        {
            "root_dir": "/mnt/kv",
            "n_read_threads": 8,
            "n_write_threads": 3,
            "enable_kv_events": True,
            "locality": "REMOTE",
        }
    )
    assert (settings.n_read_threads, settings.n_write_threads) == (8, 3)
    assert settings.enable_kv_events is True
    assert settings.locality == "REMOTE"


def test_builtin_flags_match_vllms_fs_tier_signature():
    """The keys marked vllm_builtin are exactly the tier kwargs vLLM's own fs
    tier accepts, with the same defaults: a built-in config works unchanged."""
    params = inspect.signature(FileSystemTierManager.__init__).parameters
    framework = {"self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"}
    theirs = {name: p.default for name, p in params.items() if name not in framework}
    ours_builtin = {s.key: s.default for s in SETTINGS if s.vllm_builtin}
    assert set(ours_builtin) == set(theirs)
    for key, default in ours_builtin.items():
        if theirs[key] is not inspect.Parameter.empty:
            assert default == theirs[key], key


@pytest.mark.parametrize("bad", ["n_read_thread", "rootdir", "Durability"])
def test_unknown_key_names_it_and_lists_valid_keys(bad):
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping({"root_dir": "/mnt/kv", bad: 4})
    message = str(info.value)
    assert repr(bad) in message
    listed = valid_keys_part(message)
    for key in VALID_KEYS:
        assert key in listed, key
    assert bad not in [k.strip() for k in listed.split(",")]


def test_several_unknown_keys_are_all_named():
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping({"root_dir": "/mnt/kv", "foo": 1, "bar": 2})
    assert "'foo'" in str(info.value) and "'bar'" in str(info.value)


def test_unknown_key_is_reported_even_without_root_dir():
    with pytest.raises(TierConfigError, match="'n_read_thread'"):
        TierSettings.from_mapping({"n_read_thread": 4})


def test_missing_root_dir_is_named():
    with pytest.raises(TierConfigError, match="root_dir") as info:
        TierSettings.from_mapping({"n_read_threads": 4})
    assert "required" in str(info.value)


def test_tier_config_error_is_a_value_error():
    assert issubclass(TierConfigError, ValueError)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("n_read_threads", 0, "[1, 512]"),
        ("n_read_threads", True, "[1, 512]"),
        ("n_read_threads", "4", "[1, 512]"),
        ("n_read_threads", 4.0, "[1, 512]"),
        ("n_read_threads", 513, "[1, 512]"),
        ("n_write_threads", -1, "[1, 512]"),
        ("n_write_threads", False, "[1, 512]"),
        ("lookup_threads", 0, "integer"),
        ("max_pending_store_blocks", 0, "integer"),
        ("durability", "fast", "none, file, full"),
        ("durability", None, "none, file, full"),
        ("io_mode", "DIRECT", "auto, direct, buffered"),
        ("io_mode", "mmap", "auto, direct, buffered"),
        ("numa_node", -1, "auto"),
        ("numa_node", "x", "auto"),
        ("numa_node", True, "auto"),
        ("numa_node", 1.0, "auto"),
        ("locality", "moon", "LOCAL, REMOTE"),
        ("locality", 1, "LOCAL, REMOTE"),
        ("checksum", "yes", "true or false"),
        ("checksum", 1, "true or false"),
        ("enable_kv_events", "true", "true or false"),
        ("root_dir", "", "non-empty"),
        ("root_dir", "   ", "non-empty"),
        ("root_dir", 42, "non-empty"),
        ("root_dir", "/mnt/k\0v", "NUL"),
    ],
)
def test_bad_values_are_rejected_naming_key_value_and_expectation(key, value, expected):
    config = {"root_dir": "/mnt/kv", key: value}
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping(config)
    message = str(info.value)
    assert repr(key) in message
    assert repr(value) in message
    assert expected in message


@pytest.mark.parametrize("given", ["LOCAL", "REMOTE", None])
def test_locality_takes_exactly_what_vllm_takes(given):
    """vLLM does Locality(value): upper case only (tests/volume/test_pinned_root.py
    checks lowercase is refused by both tiers)."""
    assert TierSettings.from_mapping({"root_dir": "/r", "locality": given}).locality == given
    with pytest.raises(TierConfigError, match="locality"):
        TierSettings.from_mapping({"root_dir": "/r", "locality": "local"})


@pytest.mark.parametrize("given", ["local", "", "Remote", 1])
def test_bad_locality_error_carries_vllms_own_wording(given):
    """vLLM's built-in does Locality(value) and its tests (and operators'
    scripts) match ``Locality`` in the error; ours keeps naming the key and
    the valid values, and also carries Python's exact sentence."""
    with pytest.raises(ValueError) as builtin_error:
        Locality(given)
    with pytest.raises(TierConfigError) as ours_error:
        TierSettings.from_mapping({"root_dir": "/r", "locality": given})
    message = str(ours_error.value)
    assert str(builtin_error.value) in message  # e.g. "'local' is not a valid Locality"
    assert "'locality'" in message and "LOCAL, REMOTE" in message


@pytest.mark.parametrize(
    "given,stored",
    [
        ("auto", "auto"),
        ("off", "off"),
        (None, "off"),
        (0, 0),
        (3, 3),
    ],
)
def test_numa_node_accepted_values(given, stored):
    assert TierSettings.from_mapping({"root_dir": "/r", "numa_node": given}).numa_node == stored


@pytest.mark.parametrize(
    "key,value",
    [
        ("durability", "none"),
        ("durability", "file"),
        ("durability", "full"),
        ("io_mode", "auto"),
        ("io_mode", "direct"),
        ("io_mode", "buffered"),
        ("checksum", False),
        ("n_read_threads", 1),
        ("n_read_threads", 512),
        ("max_pending_store_blocks", 1 << 24),
        ("lookup_threads", 256),
    ],
)
def test_boundary_values_are_accepted(key, value):
    assert getattr(TierSettings.from_mapping({"root_dir": "/r", key: value}), key) == value


def test_settings_are_immutable():
    settings = TierSettings.from_mapping({"root_dir": "/r"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.n_read_threads = 3  # type: ignore[misc]


# -- through vLLM --------------------------------------------------------------------


def test_valid_config_maps_the_shm_region_and_applies_settings(disk_root):
    """Control for the leak checks below: the region path is the one vLLM uses."""
    eid = engine_id()
    replica = Replica(
        offloading_config(
            tiers=[ours(disk_root, durability="full", locality="REMOTE", n_read_threads=3)],
            engine_id=eid,
        )
    )
    try:
        assert os.path.exists(shm_region(eid))
        assert replica.tier.settings.durability == "full"
        assert replica.tier.settings.n_read_threads == 3
        assert replica.tier.settings.locality == "REMOTE"
        assert replica.tier.locality is not None and replica.tier.locality.value == "REMOTE"
    finally:
        replica.close()
    assert not os.path.exists(shm_region(eid))


def test_typo_key_fails_get_manager_with_valid_keys_and_no_shm_leak(disk_root):
    eid = engine_id()
    spec = TieringOffloadingSpec(
        offloading_config(tiers=[ours(disk_root, n_read_thread=4)], engine_id=eid)
    )
    with pytest.raises(Exception) as info:
        spec.get_manager()
    assert isinstance(info.value, TierConfigError)
    message = str(info.value)
    assert "'n_read_thread'" in message
    listed = valid_keys_part(message)
    assert "n_read_threads" in listed
    for key in VALID_KEYS:
        assert key in listed
    assert not os.path.exists(shm_region(eid))
    assert os.listdir(disk_root) == []  # nothing written before validation


def test_bad_value_fails_get_manager_before_touching_the_volume(disk_root):
    eid = engine_id()
    spec = TieringOffloadingSpec(
        offloading_config(tiers=[ours(disk_root, durability="fast")], engine_id=eid)
    )
    with pytest.raises(TierConfigError, match="none, file, full"):
        spec.get_manager()
    assert not os.path.exists(shm_region(eid))
    assert os.listdir(disk_root) == []


def test_root_dir_that_is_a_file_fails(tmp_path):
    path = tmp_path / "kvfile"
    path.write_bytes(b"not a directory")
    eid = engine_id()
    with pytest.raises(EngineError) as info:
        Replica(offloading_config(tiers=[ours(str(path))], engine_id=eid))
    message = str(info.value)
    assert str(path) in message
    assert "not a directory" in message
    assert path.read_bytes() == b"not a directory"
    assert not os.path.exists(shm_region(eid))


def test_configuration_doc_is_the_generated_table(capsys):
    """docs/configuration.md carries `llmkv-fs config-doc` verbatim."""
    from pathlib import Path

    from llmkv_fs.cli import main

    assert main(["config-doc"]) == 0
    table = capsys.readouterr().out
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert table in doc
