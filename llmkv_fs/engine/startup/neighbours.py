"""At start-up, one log line per other deployment of our model on a root:
blocks of the same model under another run-config digest are blocks this
replica will never read (another block size, dtype, KV layout, parallelism
or sealing), and the operator should hear it from the tier, not find it
in a dashboard's hit ratio.

Bounded and read-only: it lists the root once (at most ``_MAX_ENTRIES``
entries), and for at most ``_MAX_OTHERS`` other digests of our model reads
their config.json and leases and one entry of each rank directory -- never
a block walk. A digest directory, leases directory or rank directory that
is a symlink is skipped, never followed. The line names the digest, its
live replicas and the differing fields (layout/run_diff.py); never a key,
a key check or anything of a prompt. Nothing here raises: a root it cannot
read costs the line, with a debug record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time

from llmkv_fs.layout.names import (
    config_path,
    lease_dir,
    parse_digest_dir_name,
    rank_dir_name,
    safe_model_component,
)
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.run_diff import Difference, differences
from llmkv_fs.volume.leases import read_lease_dir
from llmkv_fs.volume.run_config import read_run_config

__all__ = ["OtherDeployment", "log_other_deployments", "other_deployments"]

logger = logging.getLogger("vllm.llmkv_fs.engine")

_MAX_ENTRIES = 10_000  # root entries looked at
_MAX_OTHERS = 16  # other digests of our model read (and logged)


@dataclasses.dataclass(frozen=True)
class OtherDeployment:
    name: str  # <model>_<digest>
    live_replicas: int
    holds_blocks: bool
    differences: list[Difference]


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _holds_blocks(rank_dir: str) -> bool:
    try:
        fd = os.open(rank_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with os.scandir(fd) as entries:
            return any(not e.name.startswith(".") for e in entries)
    except OSError:
        return False
    finally:
        os.close(fd)


def _live(digest_dir: str, now: float) -> int:
    if not _is_dir(lease_dir(digest_dir)):  # missing, or a symlink: not followed
        return 0
    return sum(lease.is_live(now) for lease in read_lease_dir(digest_dir).leases)


def other_deployments(layout: CacheLayout) -> list[OtherDeployment]:
    """The other digests of ``layout``'s model on its root (see the module
    doc for the bounds). Raises OSError when the root cannot be listed."""
    ours = layout.run_config
    model = safe_model_component(str(ours.get("model_name", "")))
    root = layout.root_dir
    names: list[str] = []
    with os.scandir(root) as entries:
        for count, entry in enumerate(entries):
            if count >= _MAX_ENTRIES or len(names) >= _MAX_OTHERS:
                break
            parsed = parse_digest_dir_name(entry.name)
            if parsed is None or parsed.model != model or entry.name == layout.digest_dir_name:
                continue
            if entry.is_dir(follow_symlinks=False):
                names.append(entry.name)
    found = []
    now = time.time()
    for name in sorted(names):
        digest_dir = f"{root}/{name}"
        config, _why = read_run_config(config_path(digest_dir))
        if config is None:
            continue  # not a deployment we can compare (doctor reports it)
        found.append(
            OtherDeployment(
                name,
                _live(digest_dir, now),
                _holds_blocks(rank_dir_name(digest_dir, 0)),
                differences(ours, config),
            )
        )
    return found


def log_other_deployments(layout: CacheLayout) -> None:
    """One INFO line per other deployment of our model on the root."""
    try:
        others = other_deployments(layout)
    except (OSError, ValueError) as exc:
        logger.debug("llmkv_fs: other deployments on %s not listed: %s", layout.root_dir, exc)
        return
    for other in others:
        fields = ", ".join(f"{d.field} {d.ours} vs {d.theirs}" for d in other.differences)
        logger.info(
            "llmkv_fs: %s also holds model %s under another digest, %s (%s, %d live "
            "replica(s)), which this replica never reads: %s (ours vs theirs). "
            "llmkv-fs doctor %s says what each difference means and its fix",
            layout.root_dir,
            layout.run_config.get("model_name"),
            other.name,
            "holds blocks" if other.holds_blocks else "no blocks",
            other.live_replicas,
            fields or "the same run config under another name",
            layout.root_dir,
        )
