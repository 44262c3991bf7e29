"""service_kit.run_watched, the watchdog the NFS guest's batch runs under
(tests/system/test_nfs.py), proven without QEMU: a local command prints each line
the test sends it, under a clock the test moves, so no run depends on how
fast this machine is.

The NFS batch used to run under one fixed total limit (900 s), which a
batch slowed down by the host's load ran past while still making progress.
test_a_fixed_total_limit_kills_a_steady_command shows that with the old
policy; test_a_steady_command_outlives_the_old_total_limit runs the same
command under the new one.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading

import pytest

from llmkv_fs.volume.leases import pid_alive
from tests.kits.clock_kit import ManualClock
from tests.kits.engine_kit import DEADLINE_S, wait_until
from tests.kits.service_kit import WATCHDOG_EXIT, run_watched

# Prints each line it reads from the FIFO; "spawn" starts a grandchild that
# shares its output (a kill must reach it too). Ends when the FIFO closes.
ECHO = """
import subprocess, sys
for line in open(sys.argv[1]):
    word = line.strip()
    if word == "spawn":
        print("spawned", subprocess.Popen(["sleep", "1000"]).pid, flush=True)
    else:
        print(word, flush=True)
"""
QUIET_S = 10.0  # the limits, in the test clock's seconds
STEP_S = 9.0  # between two lines: under the quiet limit
OLD_TOTAL_S = 100.0  # the old fixed limit (900 s), scaled down like the rest


class Echo:
    """The ECHO command under run_watched in a thread of its own."""

    def __init__(self, tmp_path, clock: ManualClock, quiet_s: float, total_s: float):
        self.clock = clock
        self.text = ""
        self.result = None
        tmp_path.mkdir()
        fifo = str(tmp_path / "say")
        os.mkfifo(fifo)
        argv = [sys.executable, "-c", ECHO, fifo]
        self.thread = threading.Thread(target=self._run, args=(argv, quiet_s, total_s), daemon=True)
        self.thread.start()
        self.fd = -1

        def opened() -> bool:  # the child opened its end of the FIFO
            try:
                self.fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                return True
            except OSError as exc:
                assert exc.errno == errno.ENXIO, exc
                return False

        wait_until(opened, "the command to start")

    def _run(self, argv, quiet_s: float, total_s: float) -> None:
        self.result = run_watched(
            argv,
            None,
            quiet_limit_s=quiet_s,
            total_limit_s=total_s,
            clock=self.clock,
            poll_s=0.01,
            on_output=self._saw,
        )

    def _saw(self, chunk: bytes) -> None:
        self.text += chunk.decode()

    def say(self, word: str, reply: str | None = None) -> None:
        """Send ``word`` and wait until the watchdog has read the whole line
        answering it (``reply``, a regex: by default the word itself)."""
        os.write(self.fd, f"{word}\n".encode())
        line = re.compile(f"^{reply or re.escape(word)}\n", re.MULTILINE)
        wait_until(lambda: line.search(self.text), f"{line.pattern!r} to come back")

    def finish(self):
        """Close the FIFO (the command ends) unless killed; its result."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "run_watched did not return"
        return self.result

    def stop(self) -> None:
        """Teardown: whatever the test did, the watchdog ends the command
        (the clock jumps past any limit)."""
        if self.thread.is_alive():
            self.clock.advance(1e9)
        self.finish()


@pytest.fixture
def start_echo(tmp_path):
    """Echo(clock, quiet_s, total_s), stopped at teardown."""
    started: list[Echo] = []

    def make(clock: ManualClock, quiet_s: float, total_s: float) -> Echo:
        started.append(Echo(tmp_path / str(len(started)), clock, quiet_s, total_s))
        return started[-1]

    yield make
    for one in started:
        one.stop()


def test_a_steady_command_outlives_the_old_total_limit(start_echo):
    clock = ManualClock(start=0.0)
    echo = start_echo(clock, quiet_s=QUIET_S, total_s=10 * OLD_TOTAL_S)
    ticks = [f"tick{i}" for i in range(20)]
    for tick in ticks:
        clock.advance(STEP_S)  # slow, but never silent for the quiet limit
        echo.say(tick)
    assert clock.now > OLD_TOTAL_S  # it ran past the old limit
    done = echo.finish()
    assert done.returncode == 0, done.stdout
    assert done.stdout.split() == ticks


def test_a_fixed_total_limit_kills_a_steady_command(start_echo):
    """The old policy (one total limit, no quiet limit) on the same command:
    killed at the limit although it kept printing. The total limit stays as
    the last resort, so this is also its test."""
    clock = ManualClock(start=0.0)
    echo = start_echo(clock, quiet_s=float("inf"), total_s=OLD_TOTAL_S)
    said = 0
    while clock.now + STEP_S <= OLD_TOTAL_S:
        clock.advance(STEP_S)
        echo.say(f"tick{said}")
        said += 1
    clock.advance(STEP_S)  # past the limit, the command still printing
    done = echo.finish()
    assert done.returncode == WATCHDOG_EXIT
    assert f"still running after {said * STEP_S + STEP_S:.0f}s (limit 100s)" in done.stdout
    assert done.stdout.rstrip().endswith(f"tick{said - 1})")  # what it printed last


def test_a_silent_command_is_killed_with_what_it_printed_last(start_echo):
    clock = ManualClock(start=0.0)
    echo = start_echo(clock, quiet_s=QUIET_S, total_s=10 * OLD_TOTAL_S)
    echo.say("tests/test_x.py::test_that_hangs")
    echo.say("spawn", reply=r"spawned \d+")
    (grandchild,) = [int(line.split()[1]) for line in echo.text.splitlines() if "spawned" in line]
    clock.advance(QUIET_S - 1)
    assert echo.thread.is_alive()  # not silent for long enough yet: ...
    echo.say("still here")  # ... it still reads and answers
    clock.advance(QUIET_S + 1)  # now silent past the limit
    done = echo.finish()
    assert done.returncode == WATCHDOG_EXIT
    assert "no output for 11s (limit 10s)" in done.stdout
    last = done.stdout.split("the last output was:\n", 1)[1]
    assert "tests/test_x.py::test_that_hangs" in last and last.rstrip().endswith("still here)")
    # The whole process group went: the grandchild holding its output too.
    wait_until(lambda: not pid_alive(grandchild), f"grandchild {grandchild} to be killed")
