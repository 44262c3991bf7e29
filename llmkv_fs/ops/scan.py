"""Reading a cache volume's tree: digests, their rank directories, and every
file under them. Shared by gc, stats and verify; reads through ``volume`` and ``layout`` only
(no vLLM, no engine), safe to run against a volume that live tiers are writing.

The root is sorted out here (``list_root``); the directories below it are
listed by ``walk`` (``ops/walker.py``: a pool of threads, every directory
opened relative to its parent, never through a symlink); what each file is
comes from ``ops/kinds.py``. An entry that cannot be read is recorded and
skipped (``ops/problems.py``), never the end of a pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import stat

from llmkv_fs.checks import int_between, option, or_auto
from llmkv_fs.layout.names import (
    config_path,
    is_trash_name,
    parse_digest_dir_name,
    parse_rank_dir_name,
)
from llmkv_fs.layout.names import lease_dir as lease_dir_path
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.fsinfo import filesystem_type
from llmkv_fs.volume.leases import Lease, LeaseDir, read_lease_dir
from llmkv_fs.volume.run_config import read_run_config, run_config_proves

__all__ = [
    "Digest",
    "RootListing",
    "add_threads_argument",
    "default_threads",
    "is_network_fs",
    "list_root",
    "threads_for",
]

MAX_THREADS = 256  # the walker's pool never grows past this
_LOCAL_READERS = 8


@dataclasses.dataclass
class Digest:
    """One run config on the volume: ``<root>/<name>/`` (config.json,
    leases/) plus its ``<name>_r<rank>`` siblings. Either part may be
    missing (a crashed start, a half-finished gc)."""

    root: str
    name: str
    model: str
    digest: str
    has_config_dir: bool
    rank_dirs: dict[int, str]

    @property
    def config_dir(self) -> str:
        return f"{self.root}/{self.name}"

    def read_config(self) -> dict | None:
        """config.json's object, or None (missing, not a regular file --
        never followed, never blocked on --, not JSON, not an object)."""
        return self.config_status()[0]

    def config_status(self) -> tuple[dict | None, str]:
        """(config.json's object or None, why not)."""
        if not self.has_config_dir:
            return None, "no config directory"
        return read_run_config(config_path(self.config_dir))

    def config_proves_ours(self) -> tuple[bool, str]:
        """Whether config.json hashes to this directory's digest (then it is
        a cache digest beyond doubt), and if not, why not."""
        config, why = self.config_status()
        if config is None:
            return False, why
        if not run_config_proves(config, self.digest):
            return False, f"config.json does not hash to {self.digest}"
        return True, ""

    def lease_dir(self) -> LeaseDir:
        """Valid leases and bad files at lease names. Raises OSError when
        ``leases/`` cannot be read -- a symlink there (ELOOP: never followed,
        the leases it leads to are no one's to count) or not a directory
        (ENOTDIR) included --, so that no caller takes "unreadable" for
        "no live lease"."""
        if not self.has_config_dir:
            return LeaseDir([], [])
        path = lease_dir_path(self.config_dir)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return LeaseDir([], [])  # vLLM's built-in tier writes none
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "a symlink, not followed", path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        return read_lease_dir(self.config_dir)

    def leases(self) -> list[Lease]:
        return self.lease_dir().leases


@dataclasses.dataclass(frozen=True)
class RootListing:
    """The root directory, sorted out: digests, gc's own trash, symlinks
    (never followed), anything else (left alone) and the entries that could
    not be looked at (skipped)."""

    digests: list[Digest]
    trash: list[str]
    symlinks: list[str]
    other: list[str]
    problems: Problems = dataclasses.field(default_factory=Problems)


# Filesystems where a metadata operation is a network round trip (or a FUSE
# hop): there, concurrent listing pays off. On local ones (ext4, xfs, tmpfs,
# ...) a thread pool only adds GIL hand-offs (figures in docs/gc.md).
_NETWORK_FS = (
    "nfs",
    "nfs4",
    "ceph",
    "lustre",
    "glusterfs",
    "cifs",
    "smb3",
    "smbfs",
    "gpfs",
    "beegfs",
    "9p",
    "afs",
    "gfs2",
    "ocfs2",
    "panfs",
    "pvfs2",
    "orangefs",
    "wekafs",
    "virtiofs",
)


def is_network_fs(fstype: str) -> bool:
    return fstype in _NETWORK_FS or fstype.startswith("fuse")


def default_threads(path: str, reads: bool = False) -> int:
    """16 listings in flight on a network (or FUSE) filesystem, 1 on a local
    one (each listing hands the GIL over, and a cached one is a
    microsecond: docs/gc.md, Speed); a tool that ``reads`` every file
    (verify) 8 there, whose reads and checksums run outside the GIL
    (docs/operations.md)."""
    if is_network_fs(filesystem_type(path)):
        return 16
    return _LOCAL_READERS if reads else 1


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``, the same option of every volume tool (gc, stats,
    verify, doctor): how many directories are listed, and files read, at
    once on each root. Its value is ``threads_for``'s ``given``."""
    parser.add_argument(
        "--threads",
        type=option(or_auto(int_between(1, MAX_THREADS))),
        default="auto",
        metavar="N",
        help=f"directories listed (and files read) at once on each root, 1 to {MAX_THREADS}; "
        "default auto: 16 on a network or FUSE filesystem (NFS, CephFS, Lustre, "
        f"GlusterFS); on a local one 1, or {_LOCAL_READERS} for verify, which reads every file",
    )


def threads_for(root: str, given: int | str | None, reads: bool = False) -> int:
    """The threads a tool uses on ``root``: ``given`` (a count), or for
    ``"auto"`` and None ``default_threads(root, reads)``."""
    if given is None or given == "auto":
        return default_threads(root, reads)
    return int(given)


def list_root(root: str) -> RootListing:
    """Sort out ``root``'s entries. Symlinks are collected, never followed.
    Raises OSError only when ``root`` itself cannot be listed."""
    found: dict[str, Digest] = {}
    trash, symlinks, other = [], [], []
    problems = Problems()
    with os.scandir(root) as it:
        entries = list(it)
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_link = not is_dir and entry.is_symlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.add(exc, entry.path, "stat")
            continue
        if is_link:
            symlinks.append(entry.path)
            continue
        if not is_dir:
            other.append(entry.path)
            continue
        if is_trash_name(entry.name):
            trash.append(entry.path)
            continue
        rank = parse_rank_dir_name(entry.name)
        base_name = rank.digest_dir_name if rank else entry.name
        parsed = parse_digest_dir_name(base_name)
        if parsed is None:
            other.append(entry.path)
            continue
        digest = found.setdefault(
            base_name, Digest(root, base_name, parsed.model, parsed.digest, False, {})
        )
        if rank:
            digest.rank_dirs[rank.rank] = entry.path
        else:
            digest.has_config_dir = True
    return RootListing(
        [found[name] for name in sorted(found)],
        sorted(trash),
        sorted(symlinks),
        sorted(other),
        problems,
    )
