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


def summary() -> list[str]:
    """One line per kind of fixture: how often it was paid, in seconds."""
    lines = []
    for what, seconds in SLOW.items():
        each = " ".join(f"{s:.0f}" for s in seconds)
        lines.append(f"{what}: {len(seconds)}x, {sum(seconds):.0f}s ({each})")
    return lines
