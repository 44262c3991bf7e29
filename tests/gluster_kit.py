"""A real shared filesystem for the tests: a one-brick GlusterFS volume on
loopback, mounted twice through FUSE (two independent clients, like two vLLM
replicas on two nodes sharing one volume).

The session fixture ``gluster`` installs Debian's glusterfs-server and
glusterfs-client when ``glusterd`` is missing, starts glusterd if it is not
running, creates and starts a volume with a unique name, mounts it on two mount
points and yields a ``GlusterVolume`` (``.volume``, ``.mount_a``, ``.mount_b``).
At teardown it unmounts both, stops and deletes the volume and removes the brick.

A machine that cannot provide it (not root, no /dev/fuse, no apt-get, install or
start-up failure) skips the tests that need it -- unless LLMKV_FS_REQUIRE_GLUSTER=1
(CI sets it), which turns every such skip into a failure.

Names: every session's volume, brick and mount points are ``llmkvtest_<pid>_<hex>``
under /var/tmp. At session start, volumes, mounts and brick directories of that
pattern whose owning process is gone (a crashed run) are removed; those of live
sessions (another pytest on the same machine) are left alone.

Waiting is polling with a deadline, never a bare sleep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import service_kit

from llmkv_fs.volume.fsinfo import read_mounts

REQUIRE_ENV = "LLMKV_FS_REQUIRE_GLUSTER"
PREFIX = "llmkvtest"
BASE_DIR = "/var/tmp"
GLUSTERD_LOG = "/var/tmp/llmkvtest-glusterd.log"
INSTALL_TIMEOUT_S = 900.0
DAEMON_DEADLINE_S = 60.0
MOUNT_DEADLINE_S = 60.0
UNMOUNT_DEADLINE_S = 30.0
CLI_TIMEOUT_S = 120.0
POLL_S = 0.05

_NAME_RE = re.compile(rf"^{PREFIX}_(\d+)_[0-9a-f]+$")


class GlusterUnavailable(service_kit.ServiceUnavailable):
    """This machine cannot provide a GlusterFS volume (the reason says why)."""


@dataclasses.dataclass
class GlusterVolume(service_kit.TwoClients):
    volume: str
    host: str
    brick: str


# -- small helpers ----------------------------------------------------------------------


def _run(
    argv: list[str], timeout: float = CLI_TIMEOUT_S, env: dict | None = None
) -> subprocess.CompletedProcess:
    return service_kit.run(argv, timeout, env, GlusterUnavailable)


def _check(argv: list[str], what: str, timeout: float = CLI_TIMEOUT_S) -> str:
    done = _run(argv, timeout)
    if done.returncode != 0:
        raise GlusterUnavailable(
            f"{what} failed ({' '.join(argv)}, rc={done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return done.stdout


# glusterd runs one transaction at a time; a second CLI call meanwhile (another
# pytest session on this machine creating its volume) is refused, not queued.
_BUSY = ("another transaction is in progress", "locking failed", "try again")


def _gluster(*args: str, deadline_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``gluster --mode=script ARGS``, retried while glusterd is busy with
    another transaction, until ``deadline_s``."""
    start = time.monotonic()
    while True:
        done = _run(["gluster", "--mode=script", *args])
        text = (done.stderr + done.stdout).lower()
        if (
            done.returncode == 0
            or not any(b in text for b in _BUSY)
            or time.monotonic() - start > deadline_s
        ):
            return done
        time.sleep(POLL_S)


def _gluster_check(*args: str) -> str:
    done = _gluster(*args)
    if done.returncode != 0:
        raise GlusterUnavailable(
            f"gluster {' '.join(args)} failed (rc={done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return done.stdout


def _poll(predicate, deadline_s: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Raises
    GlusterUnavailable at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > deadline_s:
            raise GlusterUnavailable(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - start


def _process_start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # Field 22 (starttime) counted after the ")" that closes the command name.
    return text.rsplit(")", 1)[1].split()[19]


def _daemon_running(name: str) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() == name:
                    return True
        except OSError:
            continue
    return False


def _glusterfs_mounts() -> list[tuple[str, str]]:
    """(source, mount point) of every FUSE GlusterFS mount."""
    return [(m.device, m.mount_point) for m in read_mounts() if m.fstype == "fuse.glusterfs"]


def _owner_alive(name: str) -> bool:
    """Whether the session that created ``name`` (llmkvtest_<pid>_<hex>) is
    still running. The owner file pins the pid's start time against reuse."""
    pid = service_kit.owner_pid(name, _NAME_RE)
    if pid is None:
        return True  # not ours to judge
    ticks = _process_start_ticks(pid)
    if ticks is None:
        return False
    try:
        with open(f"{BASE_DIR}/{name}/owner") as f:
            return f.read().split()[1] == ticks
    except (OSError, IndexError):
        return True  # no record: be conservative, it may be starting up


def _unmount(path: str) -> None:
    """Unmount ``path``; a busy mount is retried until the deadline, then
    detached lazily so teardown never hangs."""
    if not os.path.ismount(path):
        return
    try:
        _poll(
            lambda: _run(["umount", path], 30).returncode == 0 or not os.path.ismount(path),
            UNMOUNT_DEADLINE_S,
            f"umount {path}",
        )
    except GlusterUnavailable:
        _run(["umount", "-l", path], 30)


def _remove_volume(name: str) -> None:
    _gluster("volume", "stop", name, "force")
    _gluster("volume", "delete", name)


def _remove_session_dir(directory: str) -> None:
    """rm -rf the session directory, but never through a live mount."""
    for sub in ("a", "b"):
        if os.path.ismount(f"{directory}/{sub}"):
            return
    shutil.rmtree(directory, ignore_errors=True)


def _reap_stale() -> None:
    """Remove what crashed earlier sessions left: mounts, volumes, bricks."""
    mounts = {os.path.basename(os.path.dirname(m)): m for _source, m in _glusterfs_mounts()}
    for name in service_kit.orphans(mounts, _NAME_RE, _owner_alive):
        _unmount(mounts[name])
    listed = _gluster("volume", "list")
    if listed.returncode == 0:
        for name in service_kit.orphans(listed.stdout.split(), _NAME_RE, _owner_alive):
            _remove_volume(name)
    for name in service_kit.orphans(os.listdir(BASE_DIR), _NAME_RE, _owner_alive):
        _remove_session_dir(f"{BASE_DIR}/{name}")


# -- bring-up ----------------------------------------------------------------------------


def _preflight() -> None:
    if os.geteuid() != 0:
        raise GlusterUnavailable("needs root (glusterd, mount)")
    if not os.path.exists("/dev/fuse"):
        raise GlusterUnavailable("no /dev/fuse: FUSE mounts are impossible here")


def _install() -> None:
    if shutil.which("glusterd") and shutil.which("mount.glusterfs"):
        return
    if not shutil.which("apt-get"):
        raise GlusterUnavailable("glusterd is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "glusterfs-server", "glusterfs-client"],
    ):
        done = _run(argv, INSTALL_TIMEOUT_S, env)
        if done.returncode != 0:
            raise GlusterUnavailable(
                f"installing GlusterFS failed ({' '.join(argv)}, rc={done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
    if not shutil.which("glusterd"):
        raise GlusterUnavailable("glusterfs-server installed but glusterd is not on PATH")


def _start_glusterd() -> None:
    if not _daemon_running("glusterd"):
        # glusterd daemonizes itself; its exit status says whether it started.
        _check(["glusterd", f"--log-file={GLUSTERD_LOG}"], "starting glusterd", 60)
    _poll(
        lambda: _gluster("pool", "list", deadline_s=0).returncode == 0,
        DAEMON_DEADLINE_S,
        f"glusterd to answer `gluster pool list` (log: {GLUSTERD_LOG})",
    )


def _up(vol: GlusterVolume) -> None:
    session = os.path.dirname(vol.brick)
    os.makedirs(session)
    with open(f"{session}/owner", "w") as f:
        f.write(f"{os.getpid()} {_process_start_ticks(os.getpid())}\n")
    for path in (vol.brick, vol.mount_a, vol.mount_b):
        os.makedirs(path, exist_ok=True)
    _gluster_check("volume", "create", vol.volume, f"{vol.host}:{vol.brick}", "force")
    _gluster_check("volume", "start", vol.volume)
    for mountpoint in (vol.mount_a, vol.mount_b):
        _check(
            ["mount", "-t", "glusterfs", f"{vol.host}:/{vol.volume}", mountpoint],
            f"mounting {vol.volume} on {mountpoint}",
        )
    _poll(
        lambda: os.path.ismount(vol.mount_a) and os.path.ismount(vol.mount_b),
        MOUNT_DEADLINE_S,
        f"{vol.mount_a} and {vol.mount_b} to be mount points",
    )


def _down(vol: GlusterVolume) -> None:
    _unmount(vol.mount_a)
    _unmount(vol.mount_b)
    if shutil.which("gluster"):
        _remove_volume(vol.volume)
    _remove_session_dir(os.path.dirname(vol.brick))


def _unavailable(reason: str):
    service_kit.unavailable("GlusterFS", REQUIRE_ENV, reason)


def new_volume() -> GlusterVolume:
    name = f"{PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    session = f"{BASE_DIR}/{name}"
    return GlusterVolume(
        volume=name,
        host=socket.gethostname(),
        brick=f"{session}/brick",
        mount_a=f"{session}/a",
        mount_b=f"{session}/b",
    )


@pytest.fixture(scope="session")
def gluster():
    """One GlusterFS volume for the whole session, mounted twice (two clients)."""
    start = time.monotonic()
    vol = None
    try:
        _preflight()
        _install()
        _start_glusterd()
        _reap_stale()
        vol = new_volume()
        _up(vol)
    except (GlusterUnavailable, OSError) as exc:
        if vol is not None:
            with contextlib.suppress(GlusterUnavailable, OSError):
                _down(vol)
        _unavailable(str(exc))
    vol.startup_s = time.monotonic() - start
    try:
        yield vol
    finally:
        _down(vol)
