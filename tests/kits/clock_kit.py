"""A clock the test moves: what a component reads as "now" when the test
wants its deadlines and intervals to pass at known points rather than when
the machine gets round to it (a loaded 2-core machine stretches any real
interval). Either called (``clock()``: an injectable ``now``), or put in a
module's place of ``time`` with ``install`` -- then that module's
``time.monotonic()`` is this clock and every other ``time`` function stays
the real one.

Threading: ``now`` is one float, read by any thread, moved by the test.
"""

from __future__ import annotations

import time

# "Just before" a deadline, in the clock's steps: a binary fraction (exact).
JUST_BEFORE_S = 2**-7


class ManualClock:
    def __init__(self, start: float | None = None):
        # Near the real clock by default (a value compared with a real
        # reading by some code path not under test stays sensible), and
        # whole: steps of binary fractions (2**-7 s) then add up exactly, so
        # "just before the deadline" is never a rounding error away from it.
        self.now = float(int(time.monotonic())) if start is None else start

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)  # sleep, perf_counter, time, ...: the real ones

    def install(self, monkeypatch, *modules) -> ManualClock:
        """Be ``time`` for ``modules`` for the rest of the test."""
        for module in modules:
            monkeypatch.setattr(module, "time", self)
        return self
