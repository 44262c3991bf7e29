"""A real shared filesystem on one machine: a one-brick GlusterFS volume on
loopback, mounted twice through FUSE (two independent clients, like two vLLM
replicas on two nodes sharing one volume) -- its bring-up and teardown.

The one implementation of that bring-up: the tests' session fixture
(tests/kits/gluster_kit.py) and the latency benchmarks (tools/bench/latency.py)
both use it. The server under it is tools/gluster/glusterd.py's; latency
added on the server side, and its measurement, tools/gluster/delay.py's.
From Python::

    from tools.gluster import loopback
    with loopback.volume(prefix="llmkvbench") as vol:   # up; down at the end
        print(vol.mount_a, vol.mount_b)                  # two clients of one volume

From a shell (root; the volume stays up until ``down``; tools/gluster/__main__.py)::

    python -m tools.gluster up               # prints NAME MOUNT_A MOUNT_B
    python -m tools.gluster delay NAME 2000  # µs per file operation; 0 clears it
    python -m tools.gluster down NAME

What ``up`` does: installs Debian's glusterfs-server and glusterfs-client when
``glusterd`` is missing, starts glusterd if it is not running, creates and
starts a volume with a unique name, mounts it on two mount points. ``down``
unmounts both, stops and deletes the volume and removes the brick.

Names: every volume, brick and pair of mount points is
``<prefix>_<pid>_<hex>`` under /var/tmp (``<dir>/brick``, ``<dir>/a``,
``<dir>/b``), the pid the owning process's. Before a bring-up, volumes,
mounts and brick directories of that prefix whose owning process is gone (a
crashed run) are removed; those of live owners are left alone, and so are
those made from the command line (owner file ``manual``), which only
``down`` removes.

Waiting is polling with a deadline, never a bare sleep. Errors a machine
cannot help raise ``glusterd.Unavailable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator

from llmkv_fs.volume.fsinfo import read_mounts
from tools.gluster.glusterd import (
    Unavailable,
    ensure_server,
    gluster,
    gluster_check,
    poll,
    run,
    run_checked,
)

__all__ = [
    "BASE_DIR",
    "BENCH_PREFIX",
    "MANUAL_OWNER",
    "Volume",
    "bring_up",
    "down",
    "find",
    "new_volume",
    "orphans",
    "process_start_ticks",
    "reap_stale",
    "up",
    "volume",
]

BENCH_PREFIX = "llmkvbench"
BASE_DIR = "/var/tmp"
MOUNT_DEADLINE_S = 60.0
UNMOUNT_DEADLINE_S = 30.0
MANUAL_OWNER = "manual"  # owner file of a volume made from the command line


@dataclasses.dataclass
class Volume:
    """One volume: its name, the host serving it, the brick directory and
    the two client mounts of it."""

    volume: str
    host: str
    brick: str
    mount_a: str = ""
    mount_b: str = ""
    startup_s: float = 0.0  # how long bringing it up took

    @property
    def session_dir(self) -> str:
        return os.path.dirname(self.brick)


# -- owners ------------------------------------------------------------------------------


def process_start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # Field 22 (starttime) counted after the ")" that closes the command name.
    return text.rsplit(")", 1)[1].split()[19]


def name_pattern(prefix: str) -> re.Pattern[str]:
    """Names of ``prefix``'s volumes: ``<prefix>_<owner pid>_<hex>``."""
    return re.compile(rf"^{re.escape(prefix)}_(\d+)_[0-9a-f]+$")


def owner_alive(name: str, pattern: re.Pattern[str], base_dir: str = BASE_DIR) -> bool:
    """Whether the process that created ``name`` is still running. The
    owner file pins the pid's start time against reuse; a volume made from
    the command line (``manual``) is always alive."""
    match = pattern.match(name)
    if match is None:
        return True  # not ours to judge
    try:
        with open(f"{base_dir}/{name}/owner") as f:
            owner = f.read().split()
    except OSError:
        owner = None
    if owner and owner[0] == MANUAL_OWNER:
        return True
    ticks = process_start_ticks(int(match.group(1)))
    if ticks is None:
        return False
    if owner is None:
        return True  # no record: be conservative, it may be starting up
    return len(owner) < 2 or owner[1] == ticks


def orphans(names: Iterable[str], prefix: str, base_dir: str = BASE_DIR) -> list[str]:
    """The names of ``prefix``'s volumes whose owning process is gone."""
    pattern = name_pattern(prefix)
    return [n for n in names if pattern.match(n) and not owner_alive(n, pattern, base_dir)]


# -- teardown ----------------------------------------------------------------------------


def glusterfs_mounts() -> list[tuple[str, str]]:
    """(source, mount point) of every FUSE GlusterFS mount."""
    return [(m.device, m.mount_point) for m in read_mounts() if m.fstype == "fuse.glusterfs"]


def _unmount(path: str) -> None:
    """Unmount ``path``; a busy mount is retried until the deadline, then
    detached lazily so teardown never hangs."""
    if not os.path.ismount(path):
        return
    try:
        poll(
            lambda: run(["umount", path], 30).returncode == 0 or not os.path.ismount(path),
            UNMOUNT_DEADLINE_S,
            f"umount {path}",
        )
    except Unavailable:
        run(["umount", "-l", path], 30)


def _remove_volume(name: str) -> None:
    gluster("volume", "stop", name, "force")
    gluster("volume", "delete", name)


def _remove_session_dir(directory: str) -> None:
    """rm -rf the session directory, but never through a live mount."""
    for sub in ("a", "b"):
        if os.path.ismount(f"{directory}/{sub}"):
            return
    shutil.rmtree(directory, ignore_errors=True)


def reap_stale(prefix: str, base_dir: str = BASE_DIR) -> None:
    """Remove what crashed earlier owners of ``prefix`` left: mounts,
    volumes, bricks."""
    mounts = {os.path.basename(os.path.dirname(m)): m for _source, m in glusterfs_mounts()}
    for name in orphans(mounts, prefix, base_dir):
        _unmount(mounts[name])
    listed = gluster("volume", "list")
    if listed.returncode == 0:
        for name in orphans(listed.stdout.split(), prefix, base_dir):
            _remove_volume(name)
    for name in orphans(os.listdir(base_dir), prefix, base_dir):
        _remove_session_dir(f"{base_dir}/{name}")


# -- one volume, up and down ------------------------------------------------------------


def new_volume(prefix: str, base_dir: str = BASE_DIR) -> Volume:
    """A fresh volume's names (nothing made yet), owned by this process."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    session = f"{base_dir}/{name}"
    return Volume(
        volume=name,
        host=socket.gethostname(),
        brick=f"{session}/brick",
        mount_a=f"{session}/a",
        mount_b=f"{session}/b",
    )


def up(vol: Volume, owner: str | None = None) -> None:
    """Create, start and mount ``vol`` twice. ``owner``: what the owner file
    says (default: this process, with its start time; ``manual``: kept
    until ``down``)."""
    os.makedirs(vol.session_dir)
    with open(f"{vol.session_dir}/owner", "w") as f:
        f.write((owner or f"{os.getpid()} {process_start_ticks(os.getpid())}") + "\n")
    for path in (vol.brick, vol.mount_a, vol.mount_b):
        os.makedirs(path, exist_ok=True)
    gluster_check("volume", "create", vol.volume, f"{vol.host}:{vol.brick}", "force")
    gluster_check("volume", "start", vol.volume)
    for mountpoint in (vol.mount_a, vol.mount_b):
        run_checked(
            ["mount", "-t", "glusterfs", f"{vol.host}:/{vol.volume}", mountpoint],
            f"mounting {vol.volume} on {mountpoint}",
        )
    poll(
        lambda: os.path.ismount(vol.mount_a) and os.path.ismount(vol.mount_b),
        MOUNT_DEADLINE_S,
        f"{vol.mount_a} and {vol.mount_b} to be mount points",
    )


def down(vol: Volume) -> None:
    """Unmount both mounts, stop and delete the volume, remove its directory."""
    _unmount(vol.mount_a)
    _unmount(vol.mount_b)
    if shutil.which("gluster"):
        _remove_volume(vol.volume)
    _remove_session_dir(vol.session_dir)


def bring_up(prefix: str, owner: str | None = None, base_dir: str = BASE_DIR) -> Volume:
    """Everything: the server, stale volumes of ``prefix`` reaped, a new
    volume up and mounted twice. Undone (down) if any step fails."""
    start = time.monotonic()
    ensure_server()
    reap_stale(prefix, base_dir)
    vol = new_volume(prefix, base_dir)
    try:
        up(vol, owner)
    except BaseException:
        with contextlib.suppress(Unavailable, OSError):
            down(vol)
        raise
    vol.startup_s = time.monotonic() - start
    return vol


@contextlib.contextmanager
def volume(prefix: str = BENCH_PREFIX, base_dir: str = BASE_DIR) -> Iterator[Volume]:
    """A volume for the duration of the block, torn down at its end."""
    vol = bring_up(prefix, base_dir=base_dir)
    try:
        yield vol
    finally:
        down(vol)


def find(name: str, base_dir: str = BASE_DIR) -> Volume:
    """The volume ``name`` made by ``up`` (its directories by convention)."""
    session = f"{base_dir}/{name}"
    return Volume(name, socket.gethostname(), f"{session}/brick", f"{session}/a", f"{session}/b")
