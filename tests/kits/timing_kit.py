"""How long the slow fixtures took -- the GlusterFS volume's bring-up, the
e2e venv, each ``vllm serve`` start, each NFS guest's boot -- gathered for
the run's last lines (tests/conftest.py's ``pytest_terminal_summary``), so a
CI log says where the integration lane's minutes went. Measured only: no
test asserts on these figures (docs/testing.md, race rules)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# what -> seconds of each time it was paid, in order
SLOW: dict[str, list[float]] = {}
# title -> lines, printed after the fixtures (e.g. an NFS guest's slowest tests)
DETAILS: dict[str, list[str]] = {}


def note(what: str, seconds: float) -> None:
    SLOW.setdefault(what, []).append(seconds)


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    """Note how long the block took under ``what`` (also when it raised)."""
    started = time.monotonic()
    try:
        yield
    finally:
        note(what, time.monotonic() - started)


def detail(title: str, lines: list[str]) -> None:
    """Lines that say where a slow fixture's time went inside it."""
    DETAILS[title] = list(lines)


def slowest_section(output: str) -> list[str]:
    """The lines of pytest's ``--durations`` section in ``output`` (a
    pytest run in another process), without its banner."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if "slowest" in line and "durations" in line]
    if not starts:
        return []
    section = []
    for line in lines[starts[-1] + 1 :]:
        if not line.strip() or line.startswith("="):
            break
        section.append(line.strip())
    return section


def summary() -> list[str]:
    """One line per kind of fixture: how often it was paid, in seconds; then
    each detail, its lines indented."""
    lines = []
    for what, seconds in SLOW.items():
        each = " ".join(f"{s:.0f}" for s in seconds)
        lines.append(f"{what}: {len(seconds)}x, {sum(seconds):.0f}s ({each})")
    for title, more in DETAILS.items():
        lines.append(f"{title}:")
        lines += [f"    {line}" for line in more]
    return lines
