"""What a file on a cache volume is, from its name, its lstat and where it
lies: the kinds every volume tool sorts entries into. A symlink is always
SYMLINK, wherever it is and whatever its name: no tool ever follows one."""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

from llmkv_fs.layout.names import (
    CONFIG_FILENAME,
    is_block_name,
    is_lease_name,
    is_silly_rename_name,
    is_temp_name,
)

__all__ = [
    "BLOCK",
    "CONFIG",
    "CONFIG_AREA",
    "LEASE",
    "OTHER",
    "QUARANTINED",
    "RANK_AREA",
    "SILLY_RENAMED",
    "SYMLINK",
    "TEMP",
    "FileEntry",
    "classify",
]

BLOCK, TEMP, QUARANTINED, OTHER = "block", "temp", "quarantined", "other"
CONFIG, LEASE, SYMLINK = "config", "lease", "symlink"
# An NFS client's ``.nfs<hex>`` file (layout/names.py): an unlinked file some
# client still has open. Never removed, never block data, never a sign of use.
SILLY_RENAMED = "silly_renamed"
# Which kind of top directory a walk started from.
RANK_AREA, CONFIG_AREA = "rank", "config"


class FileEntry(NamedTuple):
    """One non-directory entry and its lstat. (A tuple: a scan makes one per
    file, millions of them.)"""

    path: str
    kind: str  # one of the kinds above
    st: os.stat_result


def classify(
    name: str, st: os.stat_result, area: str, in_quarantine: bool = False, in_leases: bool = False
) -> str:
    """The kind of a non-directory entry, from its name, its lstat and where
    it lies (``area``: under a rank or a config directory)."""
    if stat.S_ISLNK(st.st_mode):
        return SYMLINK
    if is_silly_rename_name(name):
        return SILLY_RENAMED
    if is_temp_name(name):
        return TEMP
    if not stat.S_ISREG(st.st_mode):
        return OTHER
    if area == RANK_AREA:
        if in_quarantine:
            return QUARANTINED
        return BLOCK if is_block_name(name) else OTHER
    if in_leases and is_lease_name(name):
        return LEASE
    if not in_leases and name == CONFIG_FILENAME:
        return CONFIG
    return OTHER
