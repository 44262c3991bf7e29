"""What a file on the volume is (``llmkv_fs/ops/kinds.py``): from its name,
its lstat and where it lies; a symlink is SYMLINK whatever its name."""

from __future__ import annotations

import os

import pytest

from llmkv_fs.layout.names import CONFIG_FILENAME, temp_name
from llmkv_fs.ops.kinds import (
    BLOCK,
    CONFIG,
    CONFIG_AREA,
    LEASE,
    OTHER,
    QUARANTINED,
    RANK_AREA,
    SILLY_RENAMED,
    SYMLINK,
    TEMP,
    classify,
)

BLOCK_NAME = "0123456789abcdef.bin"
LEASE_NAME = "host~42~1700000000000000000.json"


@pytest.fixture
def entries(tmp_path):
    """lstat of a regular file, a FIFO and a symlink."""
    (tmp_path / "file").write_bytes(b"x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    return {name: os.lstat(tmp_path / name) for name in ("file", "fifo", "link")}


@pytest.mark.parametrize(
    ("name", "entry", "area", "where", "kind"),
    [
        (BLOCK_NAME, "file", RANK_AREA, {}, BLOCK),
        (BLOCK_NAME, "link", RANK_AREA, {}, SYMLINK),
        (BLOCK_NAME, "fifo", RANK_AREA, {}, OTHER),
        (BLOCK_NAME, "file", RANK_AREA, {"in_quarantine": True}, QUARANTINED),
        ("." + BLOCK_NAME, "file", RANK_AREA, {}, OTHER),
        (temp_name(BLOCK_NAME, "host", 42, "7"), "file", RANK_AREA, {}, TEMP),
        (".nfs0000000000abcdef00000001", "file", RANK_AREA, {}, SILLY_RENAMED),
        (CONFIG_FILENAME, "file", CONFIG_AREA, {}, CONFIG),
        (CONFIG_FILENAME, "link", CONFIG_AREA, {}, SYMLINK),
        (LEASE_NAME, "file", CONFIG_AREA, {"in_leases": True}, LEASE),
        (LEASE_NAME, "file", CONFIG_AREA, {}, OTHER),
        (BLOCK_NAME, "file", CONFIG_AREA, {}, OTHER),
    ],
)
def test_each_entry_gets_its_kind(entries, name, entry, area, where, kind):
    assert classify(name, entries[entry], area, **where) == kind
