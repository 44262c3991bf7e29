"""Latency on a loopback GlusterFS volume (tools/gluster/loopback.py): the
server-side delay that makes it behave like a distant network filesystem,
and the measurements that check what the volume then costs.

The delay (``set_delay``): the brick's graph gets ``debug/delay-gen`` above
its ``posix`` translator, sleeping ``us`` microseconds in every file
operation of ``DELAY_FOPS`` (it sleeps in the brick's I/O thread, so the
brick's thread count, ``server_threads``, bounds how many operations wait
at once); the volume is restarted so the brick loads the new graph, and the
call returns once both mounts answer again.

The measurements: ``negative_stat_p50`` (the median time of a ``stat`` of a
missing name, in ``probe_dir``) checks that the delay is there;
``profile_start`` then ``profile_counts`` give the brick's own count of the
file operations in between; ``volume_options`` reads back what the volume
runs with. From Python::

    from tools.gluster import delay, loopback
    with loopback.volume(prefix="llmkvbench") as vol:   # up; down at the end
        delay.set_delay(vol, 2000)                       # 2 ms per file operation
        print(delay.negative_stat_p50(delay.probe_dir(vol)))  # ~0.002 s
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tools.gluster.glusterd import Unavailable, gluster, gluster_check, poll

if TYPE_CHECKING:
    from tools.gluster.loopback import Volume

__all__ = [
    "DELAY_FOPS",
    "RECONNECT_DEADLINE_S",
    "delay_settings",
    "negative_stat_p50",
    "parse_profile",
    "probe_dir",
    "profile_counts",
    "profile_start",
    "restart",
    "set_delay",
    "volume_options",
]

RECONNECT_DEADLINE_S = 120.0

# Every file operation a client sends for what the cache does (metadata,
# data, directories, attributes); not the lock and internal ones.
DELAY_FOPS = (
    "LOOKUP",
    "STAT",
    "FSTAT",
    "ACCESS",
    "OPEN",
    "OPENDIR",
    "CREATE",
    "MKNOD",
    "MKDIR",
    "READ",
    "WRITE",
    "FLUSH",
    "FSYNC",
    "FSYNCDIR",
    "RENAME",
    "LINK",
    "UNLINK",
    "RMDIR",
    "SYMLINK",
    "READLINK",
    "READDIR",
    "READDIRP",
    "SETATTR",
    "FSETATTR",
    "TRUNCATE",
    "FTRUNCATE",
    "STATFS",
    "GETXATTR",
    "FGETXATTR",
    "SETXATTR",
    "FSETXATTR",
    "REMOVEXATTR",
    "FREMOVEXATTR",
    "FALLOCATE",
    "DISCARD",
    "ZEROFILL",
    "SEEK",
)
# The brick's I/O threads (GlusterFS's default 16; its maximum 64): delay-gen
# sleeps in them, so they bound the operations in flight.
_THREAD_OPTIONS = (
    "performance.io-thread-count",
    "performance.high-prio-threads",
    "performance.normal-prio-threads",
)
_DELAY_OPTIONS = (
    "debug.delay-gen",
    "delay-gen.delay-duration",
    "delay-gen.delay-percentage",
    "delay-gen.enable",
)


# -- the server-side delay ---------------------------------------------------------------


def delay_settings(us: int, fops: Iterable[str] = DELAY_FOPS) -> list[tuple[str, str]]:
    """The volume options that delay every operation of ``fops`` by ``us``
    microseconds on the brick (``us`` 0: none, the options to reset)."""
    if us < 0:
        raise ValueError(f"a delay is at least 0 µs, not {us}")
    if us == 0:
        return []
    return [
        ("debug.delay-gen", "posix"),  # the translator it wraps; "on" does nothing
        ("delay-gen.delay-duration", str(int(us))),
        ("delay-gen.delay-percentage", "100"),
        ("delay-gen.enable", ",".join(f.upper() for f in fops)),
    ]


def set_delay(
    vol: Volume,
    us: int,
    fops: Iterable[str] = DELAY_FOPS,
    server_threads: int | None = None,
) -> float:
    """Delay every file operation of ``fops`` on ``vol``'s brick by ``us``
    microseconds (0 clears it), with ``server_threads`` brick I/O threads
    when given (1..64); restart the volume so the brick loads the new graph
    and wait until both mounts answer again. Returns the seconds it took."""
    start = time.monotonic()
    settings = delay_settings(us, fops)
    if settings:
        for key, value in settings:
            gluster_check("volume", "set", vol.volume, key, value)
    else:
        for key in _DELAY_OPTIONS:
            gluster("volume", "reset", vol.volume, key)  # fails harmlessly when not set
    if server_threads is not None:
        if not 1 <= server_threads <= 64:
            raise ValueError(f"server_threads must be 1..64, not {server_threads}")
        for key in _THREAD_OPTIONS:
            gluster_check("volume", "set", vol.volume, key, str(server_threads))
    restart(vol)
    return time.monotonic() - start


def restart(vol: Volume) -> None:
    """Stop and start the volume (the brick reloads its graph); back once
    both mounts answer a lookup again (FUSE clients reconnect by themselves
    within seconds)."""
    gluster_check("volume", "stop", vol.volume, "force")
    gluster_check("volume", "start", vol.volume, "force")
    poll(
        lambda: _answers(vol.mount_a) and _answers(vol.mount_b),
        RECONNECT_DEADLINE_S,
        f"{vol.mount_a} and {vol.mount_b} to reconnect after the restart",
    )


def _answers(mount: str) -> bool:
    """The mount's client is connected: a new name can be looked up (a
    missing one: ENOENT, not ENOTCONN) and the root listed."""
    try:
        os.stat(f"{mount}/.llmkv-reconnect-{uuid.uuid4().hex}")
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.listdir(mount)
    except OSError:
        return False
    return True


# -- what a file operation costs ---------------------------------------------------------

PROBE = ".llmkv-probe"


def probe_dir(vol: Volume) -> str:
    """A directory made through mount A, named through mount B, for timing
    stats. Not the volume's root: there a missing name costs two LOOKUPs
    (the distribute translator looks everywhere when the root's layout is
    not committed, measured), in any directory made since, one."""
    os.makedirs(os.path.join(vol.mount_a, PROBE), exist_ok=True)
    return os.path.join(vol.mount_b, PROBE)


def negative_stat_p50(directory: str, n: int = 50) -> float:
    """Median seconds of ``n`` stats of names that are not in ``directory``
    (each a new name: no client cache can answer it)."""
    samples = []
    tag = uuid.uuid4().hex[:8]
    for i in range(n):
        path = f"{directory}/.llmkv-absent-{tag}-{i}"
        t = time.perf_counter()
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def volume_options(vol: Volume, keys: Iterable[str]) -> dict[str, str]:
    """``gluster volume get`` of each key (what the volume runs with)."""
    out = {}
    for key in keys:
        done = gluster("volume", "get", vol.volume, key)
        value = "?"
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == key:
                value = " ".join(parts[1:])
        out[key] = value
    return out


# -- counting file operations ------------------------------------------------------------


def profile_start(name: str) -> None:
    """Have the brick count its file operations (``volume profile start``;
    already started is fine)."""
    done = gluster("volume", "profile", name, "start")
    if done.returncode != 0 and "already started" not in (done.stderr + done.stdout).lower():
        raise Unavailable(f"volume profile {name} start: {(done.stderr or done.stdout).strip()}")


def parse_profile(text: str) -> dict[str, int]:
    """File operations and their counts from ``volume profile VOL info
    incremental`` (one brick): rows ``... <calls> <FOP>``."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-1].isupper() and parts[-1].isalpha() and parts[-2].isdigit():
            counts[parts[-1]] = counts.get(parts[-1], 0) + int(parts[-2])
    return counts


def profile_counts(name: str) -> dict[str, int]:
    """The brick's file operations since the previous call (the first call
    after ``profile_start``: since then)."""
    return parse_profile(gluster_check("volume", "profile", name, "info", "incremental"))
