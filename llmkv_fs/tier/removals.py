"""Removals the tier learns of, for its KV events: a block it knew was on
the volume -- it stored it, or a lookup or load found it -- that a lookup
now misses or a load finds gone (evicted by gc or a sweeper, quarantined by
another replica). The router heard of the block when some replica stored
it; without a removal it keeps routing prefixes to replicas for a hit none
of them will get.

Only a miss that looked at the volume counts (``miss_was_checked``): a
stalled volume's refusal, a lost root's, a lookup answered MISS by its
deadline or by a failed check (EIO) say nothing of the file, so the key
stays known -- a router told "gone" for blocks still there would route
their prefixes away until they were stored again.

And what this replica announced removed and then finds again (a lookup
hits it, a load reads it: another replica stored it again, or a root that
answered wrongly is back) is announced stored again (``take_back``), so a
removal announced in error never outlives the next hit. A store that lands
announces itself.

Bounded and quiet: the keys known present are the most recent
``capacity`` (a dict in insertion order, the oldest dropped first), and so
are the keys announced removed. A key missed again at every scheduling step
(vLLM asks about every key of a waiting prompt each step) is announced
once: the first miss forgets it. A key is announced removed at most once
per ``window_s`` unless it was found present in between: a block removed,
stored again and removed again is announced removed twice.

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
        self._said_removed: dict[bytes, None] = {}  # announced removed, oldest first
        self._found: list[bytes] = []
        self._back: list[bytes] = []

    def present(self, keys: Iterable[bytes], stored: bool = False) -> None:
        """``keys`` are on the volume (hit or loaded; ``stored``: this
        replica's store landed them and announces them itself)."""
        known, said_removed = self._known, self._said_removed
        for key in keys:
            if key not in known:
                known[key] = None
                if said_removed and key in said_removed:
                    del said_removed[key]
                    self._announced.pop(key, None)
                    if not stored:
                        self._back.append(key)
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
            self._said(key)

    def _found_gone(self, key: bytes) -> None:
        now = self._clock()
        self._expire(now)
        if key in self._announced:
            return
        self._announced[key] = now
        self._found.append(key)
        self._said(key)

    def _said(self, key: bytes) -> None:
        said_removed = self._said_removed
        said_removed.pop(key, None)
        said_removed[key] = None
        while len(said_removed) > self._capacity:
            del said_removed[next(iter(said_removed))]

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

    def take_back(self) -> list[bytes]:
        """The keys announced removed and found present since, each once."""
        back, self._back = self._back, []
        return back
