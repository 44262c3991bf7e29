"""Sealed blocks through vLLM 0.33's real TieringOffloadingManager, in both
I/O modes: a sealed tier round-trips byte-exact while vLLM's built-in tier
on the same volume finds none of its blocks; a forgery with a valid xxh3
trailer reaches the GPU path unsealed (the hole) and not sealed; every bad
key file stops the tier at start-up with an error naming the setting and
never the key."""

from __future__ import annotations

import logging
import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.checks import TierConfigError
from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.layout.blockfile import Corruption
from tests.kits.seal_kit import forge_plain, key_file, sealed_trailer
from tests.kits.tier_kit import builtin, make_keys, ours, payload_for, read_primary, start
from tests.kits.volume_kit import block_files

pytestmark = pytest.mark.usefixtures("io_mode")

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture
def secrets(tmp_path):
    directory = tmp_path / "secrets"
    directory.mkdir()
    return directory


def sealed_tier(root: str, *paths: str, **extra):
    files = {str(i): path for i, path in enumerate(paths, start=1)}
    return ours(root, seal_key_files=files, **extra)


def test_sealed_tier_round_trips_and_the_builtin_never_sees_its_blocks(
    tmp_path, replicas, secrets, caplog
):
    root = str(tmp_path / "v")
    path = key_file(secrets)
    with open(path) as f:
        secret_text = f.read().strip()
    caplog.set_level(logging.DEBUG)
    writer = start(replicas, sealed_tier(root, path))
    keys = make_keys(4)
    writer.store(keys)
    files = block_files(root)
    assert len(files) == 4
    for file in files:
        sealed_trailer(file)
    reader = start(replicas, sealed_tier(root, path))
    ctx = reader.new_request()
    final, _ = reader.find(keys, ctx)
    assert final == dict.fromkeys(keys, HIT)
    for key in keys:
        assert read_primary(reader, key, ctx) == payload_for(key, reader.row_bytes)
    assert secret_text not in caplog.text
    plain = start(replicas, builtin(root))
    assert plain.find(keys)[0] == dict.fromkeys(keys, MISS)


def _forge_first(replica, root: str, key: bytes, sealed: bool) -> None:
    (path,) = block_files(root)
    if sealed:
        sealed_trailer(path)
    forge_plain(path, key, b"\x66" * replica.row_bytes)


def test_forged_block_with_valid_xxh3_trailer_is_served_when_unsealed(tmp_path, replicas):
    root = str(tmp_path / "v")
    key = make_keys(1)[0]
    writer = start(replicas, ours(root))
    writer.store([key])
    _forge_first(writer, root, key, sealed=False)
    victim = start(replicas, ours(root))
    ctx = victim.new_request()
    assert victim.find([key], ctx)[0] == {key: HIT}
    assert read_primary(victim, key, ctx) == b"\x66" * victim.row_bytes  # the hole


def test_forged_block_with_valid_xxh3_trailer_is_refused_when_sealed(tmp_path, replicas, secrets):
    root = str(tmp_path / "v")
    path = key_file(secrets)
    key = make_keys(1)[0]
    writer = start(replicas, sealed_tier(root, path))
    writer.store([key])
    _forge_first(writer, root, key, sealed=True)
    victim = start(replicas, sealed_tier(root, path))
    victim.find([key])
    victim.settle()
    counters = victim.tier.engine.counters
    assert counters[Direction.LOAD, Failure.CORRUPT] == 1
    assert counters[Corruption.BAD_VERSION] == 1
    assert victim.find([key])[0] == {key: MISS}


def _write(path: str, data: bytes, mode: int = 0o400) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


BAD_KEYS = {
    "missing": (lambda d: {"1": str(d / "nope")}, None, "cannot be read"),
    "a-directory": (lambda d: {"1": str(d)}, None, "not a regular file"),
    "world-readable": (lambda d: {"1": key_file(d, mode=0o644)}, None, "readable by everyone"),
    "too-short": (
        lambda d: {"1": _write(str(d / "k"), os.urandom(16).hex().encode())},
        None,
        "too short (16 bytes)",
    ),
    "too-long": (
        lambda d: {"1": _write(str(d / "k"), os.urandom(48).hex().encode())},
        None,
        "too long",
    ),
    "malformed": (
        lambda d: {"1": _write(str(d / "k"), b"not a key, not base64!\n")},
        None,
        "neither hex nor base64",
    ),
    "empty": (lambda d: {"1": _write(str(d / "k"), b"")}, None, "too short (0 bytes)"),
    "duplicate-ids": (
        lambda d: {1: key_file(d, "a"), "1": key_file(d, "b")},
        None,
        "key id 1 is given twice",
    ),
    "write-key-not-among-them": (
        lambda d: {"1": key_file(d, "a"), "2": key_file(d, "b")},
        3,
        "seal_write_key_id 3 is not among",
    ),
    "several-without-write-key": (
        lambda d: {"1": key_file(d, "a"), "2": key_file(d, "b")},
        None,
        "seal_write_key_id is required",
    ),
    "bad-id": (lambda d: {"01": key_file(d)}, None, "a key id"),
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_bad_key_files_stop_the_tier_at_start_up(tmp_path, replicas, secrets, case):
    files, write_id, why = BAD_KEYS[case]
    config = ours(str(tmp_path / "v"), seal_key_files=files(secrets))
    if write_id is not None:
        config["seal_write_key_id"] = write_id
    with pytest.raises(TierConfigError) as raised:
        start(replicas, config)
    message = str(raised.value)
    assert why in message
    assert "seal_key_files" in message or "seal_write_key_id" in message
    for name in os.listdir(secrets):
        if os.path.isfile(secrets / name):
            with open(secrets / name, "rb") as f:
                content = f.read().strip()
            assert not content or content.decode(errors="replace") not in message
    assert not os.path.exists(tmp_path / "v"), "nothing is created on the volume"


def test_sealing_refuses_trailerless_blocks(tmp_path, replicas, secrets):
    config = sealed_tier(str(tmp_path / "v"), key_file(secrets), accept_trailerless=True)
    with pytest.raises(TierConfigError, match="seal_key_files and accept_trailerless"):
        start(replicas, config)


@pytest.mark.parametrize("case", ["a retired key id", "another key under our id"])
def test_a_store_writes_over_blocks_this_replica_cannot_open(tmp_path, replicas, secrets, case):
    """A key dropped from seal_key_files (rotation's last step), or a file
    sealed with another key under one of our ids (planted): a foreign_key
    miss, left in place for whoever holds that key -- and the store that
    recomputes the block writes its own over it (``replaced``), so no
    prefix stays uncached until gc evicts it."""
    root = str(tmp_path / "v")
    old = key_file(secrets, "old")
    new = key_file(secrets, "new")
    new_keys = {"2": new} if case == "a retired key id" else {"1": new}
    keys = make_keys(3, seed=case)
    start(replicas, ours(root, seal_key_files={"1": old})).store(keys)

    rotated = start(replicas, ours(root, seal_key_files=new_keys))
    assert rotated.find(keys)[0] == dict.fromkeys(keys, MISS)
    rotated.settle()
    counters = rotated.tier.engine.counters
    assert counters[Direction.LOAD, Failure.FOREIGN_KEY] >= 1
    rotated.store(keys)  # recomputed: in its CPU tier, and cascaded to ours
    assert counters[Outcome.REPLACED] == len(keys)
    assert counters[Outcome.PRESENT] == 0

    reader = start(replicas, ours(root, seal_key_files=new_keys))
    ctx = reader.new_request()
    assert reader.find(keys, ctx)[0] == dict.fromkeys(keys, HIT)
    for key in keys:
        assert read_primary(reader, key, ctx) == payload_for(key, reader.row_bytes)
    assert len(block_files(root)) == len(keys)
