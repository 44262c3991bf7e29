"""The GlusterFS server on this machine and the commands that drive it:
glusterd installed (Debian's glusterfs-server and glusterfs-client, when
``glusterd`` is missing) and running, and every command the tools run
(``gluster`` CLI calls included) bounded in time.

The volumes themselves are tools/gluster/loopback.py's; their delay and
measurements are tools/gluster/delay.py's. Waiting is polling with a
deadline, never a bare sleep. Errors a machine cannot help (not root, no
/dev/fuse, a failed install, a command that hangs) raise ``Unavailable``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

__all__ = [
    "CLI_TIMEOUT_S",
    "Unavailable",
    "ensure_server",
    "gluster",
    "gluster_check",
    "poll",
    "run",
    "run_checked",
]

GLUSTERD_LOG = "/var/tmp/llmkvtest-glusterd.log"
INSTALL_TIMEOUT_S = 900.0
DAEMON_DEADLINE_S = 60.0
CLI_TIMEOUT_S = 120.0
POLL_S = 0.05


class Unavailable(Exception):
    """This machine cannot provide a GlusterFS volume (the reason says why)."""


# -- commands ----------------------------------------------------------------------------


def run(
    argv: list[str], timeout: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``argv`` with its output captured; a missing program or one still
    running after ``timeout`` (a hang bound) raises Unavailable."""
    try:
        return subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise Unavailable(f"{argv[0]} not found: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{' '.join(argv)} did not finish in {timeout:.0f}s") from exc


def _output_tail(done: subprocess.CompletedProcess) -> str:
    """What a failed command said, short enough for an exception message."""
    return (done.stderr or done.stdout).strip()[-2000:]


def run_checked(
    argv: list[str],
    what: str,
    timeout: float = CLI_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> str:
    """``run`` that raises Unavailable (naming ``what``) unless ``argv``
    succeeds; returns its standard output."""
    done = run(argv, timeout, env)
    if done.returncode != 0:
        raise Unavailable(
            f"{what} failed ({' '.join(argv)}, rc={done.returncode}): {_output_tail(done)}"
        )
    return done.stdout


# glusterd runs one transaction at a time; a second CLI call meanwhile (another
# process on this machine creating its volume) is refused, not queued.
_BUSY = ("another transaction is in progress", "locking failed", "try again")


def gluster(*args: str, deadline_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``gluster --mode=script ARGS``, retried while glusterd is busy with
    another transaction, until ``deadline_s``."""
    start = time.monotonic()
    while True:
        done = run(["gluster", "--mode=script", *args])
        text = (done.stderr + done.stdout).lower()
        if (
            done.returncode == 0
            or not any(b in text for b in _BUSY)
            or time.monotonic() - start > deadline_s
        ):
            return done
        time.sleep(POLL_S)


def gluster_check(*args: str) -> str:
    """``gluster ARGS`` that raises Unavailable unless it succeeds; returns
    its standard output."""
    done = gluster(*args)
    if done.returncode != 0:
        raise Unavailable(
            f"gluster {' '.join(args)} failed (rc={done.returncode}): {_output_tail(done)}"
        )
    return done.stdout


def poll(predicate: Callable[[], bool], deadline_s: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Raises
    Unavailable at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > deadline_s:
            raise Unavailable(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - start


# -- the server --------------------------------------------------------------------------


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


def _preflight() -> None:
    if os.geteuid() != 0:
        raise Unavailable("needs root (glusterd, mount)")
    if not os.path.exists("/dev/fuse"):
        raise Unavailable("no /dev/fuse: FUSE mounts are impossible here")


def _install() -> None:
    if shutil.which("glusterd") and shutil.which("mount.glusterfs"):
        return
    if not shutil.which("apt-get"):
        raise Unavailable("glusterd is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "glusterfs-server", "glusterfs-client"],
    ):
        run_checked(argv, "installing GlusterFS", INSTALL_TIMEOUT_S, env)
    if not shutil.which("glusterd"):
        raise Unavailable("glusterfs-server installed but glusterd is not on PATH")


def _start_glusterd() -> None:
    if not _daemon_running("glusterd"):
        # glusterd daemonizes itself; its exit status says whether it started.
        run_checked(["glusterd", f"--log-file={GLUSTERD_LOG}"], "starting glusterd", 60)
    poll(
        lambda: gluster("pool", "list", deadline_s=0).returncode == 0,
        DAEMON_DEADLINE_S,
        f"glusterd to answer `gluster pool list` (log: {GLUSTERD_LOG})",
    )


def ensure_server() -> None:
    """Root and FUSE here, GlusterFS installed, glusterd answering."""
    _preflight()
    _install()
    _start_glusterd()
