"""Removals the tier learns of, for its KV events: a block it knew was on
the volume -- it stored it, or a lookup or load found it -- that a lookup
now misses or a load finds gone (evicted by gc or a sweeper, quarantined by
another replica, on a root that was lost). The router heard of the block
when some replica stored it; without a removal it keeps routing prefixes
to replicas for a hit none of them will get.

Bounded and quiet: the keys known present are the most recent
``capacity`` (a dict in insertion order, the oldest dropped first), a key
is announced removed at most once per ``window_s``, and a key missed again
at every scheduling step (vLLM asks about every key of a waiting prompt
each step) is announced once: the first miss forgets it.

Only a miss that looked at the volume counts: a stalled volume's refusal
and a lookup answered MISS by its deadline say nothing of the file, so the
key stays known (a router told "gone" for blocks still there would route
their prefixes away until they were stored again).

Threading: the tier's methods run under vLLM's manager lock, one at a
time; so does everything here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["RemovalWatch"]

KNOWN_KEYS = 1 << 17  # ~20 MB of keys at most
WINDOW_S = 60.0


class RemovalWatch:
    def __init__(
        self,
        capacity: int = KNOWN_KEYS,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        miss_was_checked: Callable[[bytes], bool] = lambda key: True,
    ):
        self._capacity = capacity
        self._miss_was_checked = miss_was_checked
        self._window_s = window_s
        self._clock = clock
        self._known: dict[bytes, None] = {}
        self._announced: dict[bytes, float] = {}  # key -> when, oldest first
        self._found: list[bytes] = []

    def present(self, keys: Iterable[bytes]) -> None:
        """``keys`` are on the volume (stored, hit or loaded)."""
        known = self._known
        for key in keys:
            if key not in known:
                known[key] = None
        while len(known) > self._capacity:
            del known[next(iter(known))]

    def looked_up(self, key: bytes, hit: bool) -> None:
        """A lookup's verdict (called for every one: keep it cheap)."""
        if hit:
            if key not in self._known:
                self.present((key,))
        elif key in self._known and self._miss_was_checked(key):
            del self._known[key]
            self._found_gone(key)

    def gone(self, keys: Iterable[bytes]) -> None:
        """A load found these files missing: whoever let the lookup hit
        announced them stored."""
        for key in keys:
            self._known.pop(key, None)
            self._found_gone(key)

    def announced(self, keys: Iterable[bytes]) -> None:
        """These were announced removed by another path (a quarantine)."""
        now = self._clock()
        for key in keys:
            self._known.pop(key, None)
            self._announced.pop(key, None)
            self._announced[key] = now

    def _found_gone(self, key: bytes) -> None:
        now = self._clock()
        self._expire(now)
        if key in self._announced:
            return
        self._announced[key] = now
        self._found.append(key)

    def _expire(self, now: float) -> None:
        announced = self._announced
        while announced:
            oldest = next(iter(announced))
            if now - announced[oldest] < self._window_s:
                break
            del announced[oldest]

    def take(self) -> list[bytes]:
        """The keys found gone since the last call, each once."""
        found, self._found = self._found, []
        return found
