"""What the suite's two shared-filesystem services have in common: a
GlusterFS volume on loopback (tests/kits/gluster_kit.py) and knfsd in a QEMU
guest (tests/kits/nfs_kit.py). Both are brought up by running commands with a
timeout, skip -- or fail, with their REQUIRE variable set (CI) -- where the
machine cannot provide them, name every instance after the pytest process
that owns it and shut down what dead owners left behind, and hand the tests
two client mounts.

``run_watched`` runs a long command (the NFS guest's pytest batch) under a
watchdog that follows its progress rather than the clock alone: it is killed
when it has printed nothing for a while, or past a very generous total.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

import pytest

from llmkv_fs.volume.leases import pid_alive


class ServiceUnavailable(Exception):
    """This machine cannot provide the service (the reason says why)."""


@dataclasses.dataclass(kw_only=True)
class TwoClients:
    """The two client mounts of one shared volume, as the tests see them."""

    mount_a: str = ""
    mount_b: str = ""
    startup_s: float = 0.0  # how long bringing it up took


def run(
    argv: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    unavailable: type[ServiceUnavailable] = ServiceUnavailable,
) -> subprocess.CompletedProcess:
    """``argv`` with its output captured; a missing program or one still
    running after ``timeout`` (a hang bound) raises ``unavailable``."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise unavailable(f"{argv[0]} not found: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise unavailable(f"{' '.join(argv)} did not finish in {timeout:.0f}s") from exc


def unavailable(service: str, require_env: str, reason: str) -> NoReturn:
    """Skip the test that needs ``service``, or fail it when ``require_env``
    is 1 (CI: a machine that cannot provide it is a broken machine)."""
    if os.environ.get(require_env) == "1":
        pytest.fail(
            f"{service} required ({require_env}=1) but unavailable: {reason}", pytrace=False
        )
    pytest.skip(f"{service} unavailable: {reason}")


def owner_pid(name: str, pattern: re.Pattern[str]) -> int | None:
    """The pid an instance name carries (``pattern``'s first group), None for
    a name that is not one of ours."""
    match = pattern.match(name)
    return int(match.group(1)) if match else None


def orphans(
    names: Iterable[str],
    pattern: re.Pattern[str],
    alive: Callable[[str], bool] | None = None,
) -> list[str]:
    """The names of ours (``pattern``) whose owning process is gone: by
    default the pid in the name no longer runs; ``alive(name)`` may judge
    more strictly (pid reuse)."""
    found = []
    for name in names:
        pid = owner_pid(name, pattern)
        if pid is not None and not (alive(name) if alive else pid_alive(pid)):
            found.append(name)
    return found


# -- a long command under a progress watchdog ------------------------------------------------

WATCHDOG_EXIT = 124  # what a killed command returns, like timeout(1)
_TAIL_CHARS = 400  # of the output, quoted in the kill message


def run_watched(
    argv: list[str],
    env: dict[str, str] | None,
    *,
    quiet_limit_s: float,
    total_limit_s: float,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.5,
    on_output: Callable[[bytes], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` (stdout and stderr merged, read as it comes) and kill it
    -- its whole process group -- when it printed nothing for
    ``quiet_limit_s`` or ran for ``total_limit_s`` in all, by ``clock``.

    A slow machine slows a command down without stopping its output: a
    limit on silence fails a hung command, not a slow one. The total is a
    last resort for a command that keeps printing but never ends.

    Returns CompletedProcess(argv, returncode, output text). A killed
    command returns WATCHDOG_EXIT, and its output ends with a line saying
    which limit it hit and what it printed last. ``on_output`` sees every
    chunk as it arrives (tests use it to move a fake ``clock``)."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group: a kill reaches every child
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    out = bytearray()
    started = last_output = clock()
    eof = False
    why = ""
    try:
        while not (eof and proc.poll() is not None):
            if not eof and select.select([fd], [], [], poll_s)[0]:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    out += chunk
                    last_output = clock()
                    if on_output is not None:
                        on_output(chunk)
                else:
                    eof = True
            elif eof:
                # Output closed, the process not reaped yet: poll, not wait,
                # so the limits still apply to it.
                time.sleep(poll_s)
            now = clock()
            if now - last_output > quiet_limit_s:
                why = f"no output for {now - last_output:.0f}s (limit {quiet_limit_s:.0f}s)"
            elif now - started > total_limit_s:
                why = f"still running after {now - started:.0f}s (limit {total_limit_s:.0f}s)"
            if why:
                break
    finally:
        if why or proc.poll() is None:
            _kill_group(proc)
        proc.stdout.close()
    text = out.decode(errors="replace")
    if why:
        tail = text.rstrip()[-_TAIL_CHARS:] or "(nothing)"
        text += f"\n(killed by the watchdog: {why}; the last output was:\n{tail})\n"
        return subprocess.CompletedProcess(argv, WATCHDOG_EXIT, text)
    return subprocess.CompletedProcess(argv, proc.returncode, text)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
