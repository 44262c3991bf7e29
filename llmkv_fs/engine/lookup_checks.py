"""The checking side of the lookups (engine/lookup.py): one posted batch of
keys checked in order, in chunks, by the lookup thread -- and by helper
threads as soon as the volume makes checks wait, or by one helper beside it
where a long batch is checked in CPU time by the compiled check (below).

Which it is follows the volume as the batch goes: every chunk's checks are
timed one by one, and a chunk most of whose checks waited on the volume (a
network round trip: 0.1 ms and up) recruits the helpers, which then take
chunks from the same cursor. A check answered in CPU time (tmpfs, cached
dentries) gains nothing from more threads, which only queue for the GIL
(docs/benchmarks.md), so a batch on such a volume stays on the lookup
thread. The decision is taken again at every chunk, never from a batch's
first checks alone: a batch whose first names are cached and whose later
ones wait on the volume recruits the helpers when they start waiting. The
compiled check is the exception: it checks a whole chunk without the GIL,
so two threads on two CPUs do check in parallel, and a long batch
(SPREAD_KEYS untaken) is shared with SPREAD_HELPERS helpers where the
process has that many CPUs more, chunks still growing but never past a
thread's share of the rest.

What is checked is the ``Presence`` the lookups are given (the engine's:
``RootsPresence``, engine/roots.py). A chunk is checked in one call where it
checks in batches (``Presence.many``: the compiled presence check,
engine/block/presence.py, which runs without the GIL); then the chunk is
timed whole, and it waited on the volume when its time per key did. A batch
check that raises (a key's own failure: the volume, a replaced root) has its
chunk checked again key by key, each failure an unknown of its own key. A
chunk stops itself once CHUNK_BUDGET_S is spent, in the compiled call or key
by key, and gives the keys it did not check back to the batch: on a volume
that answers a prompt's known head from cache and turns slow for its tail,
nobody's verdicts wait on one thread's long chunk for longer than that.

An answer is True (the block is there), False (a check looked and found
none) or None (nothing was learned: the check failed, or the key's root is
lost). None is a miss to the scheduler but not proof that the file is gone,
so removal announcements never trust it (engine/lookup.py ``guessed_miss``).

Answers go out -- onto the answer queue the lookups read -- when a batch is
decided, or earlier for the prefix decided so far when it holds a miss:
vLLM's prefix lookup stops at the first miss, and answering hits piecemeal
would only make its scheduler record more of them per step (the batch's
order is the lookup order: each request's keys in prefix order).

Progress: ``progress_at`` is the monotonic time any chunk was last decided;
a volume that answers, however slowly, keeps moving it, so the owner calls
it stalled only when no check has answered for the whole timeout.

A check that raises OSError (an unreachable volume) answers None for its key
and is logged: a miss, not a crash, not a stall, and not a finding that the
file is gone.

Threading: ``check`` runs on the lookup thread, one batch at a time; the
helpers are daemon threads (a check held inside a stalled mount must not
hold up the interpreter's exit); ``stop`` from the owner. Whichever checking
thread first sees a batch wait on the volume (or first shares it) starts the
helpers; one thread at a time starts them. A chunk taken is always decided
(a check that raises is a miss) before any helper is started, so a batch
ends unless a check never returns.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Protocol

__all__ = ["Answers", "BatchChecks", "Found", "Presence"]

logger = logging.getLogger("vllm.llmkv_fs.lookup")

# Keys checked between two looks at how the volume answers: a batch starts
# with this many, and while no chunk waited on the volume each chunk takes as
# many keys as were taken before it. A compiled chunk gives the interpreter
# lock back only when it ends, and a thread that wants it back while the
# scheduler re-scans a long prompt waits for the switch interval (5 ms), so
# few, doubling chunks cost a long prompt the fewest scheduler steps
# (docs/benchmarks.md has the step counts). What bounds a chunk is its
# time, CHUNK_BUDGET_S, not a key count: a volume that turns slow in the
# middle of a long chunk is noticed within it. Once helpers are recruited,
# chunks are CHUNK_KEYS again, to share.
CHUNK_KEYS = 16
CHUNK_BUDGET_S = 0.02
WAITS_ON_THE_VOLUME_S = 100e-6
# A batch answered in CPU time by a compiled check (which holds no GIL while
# it checks) is shared with this many helpers once at least SPREAD_KEYS of it
# are untaken, where the process has a CPU for each: a long prompt's verdict
# comes sooner (docs/benchmarks.md); a batch of Python checks stays on one
# thread, where more threads only queue for the GIL. More helpers would take
# CPUs the scheduler and vLLM's workers use.
SPREAD_HELPERS = 1
SPREAD_KEYS = 1024

# One key's answer: there, checked and not there, or unknown (the module doc).
Found = bool | None
# One publication of a batch: (batch id, [(key, generation, found)], final).
Posted = tuple[int, list[tuple[bytes, int, Found]], bool]


class Answers:
    """Where batches' answers go: a queue, and ``posted``, which a checking
    thread sets after each ``put`` and the owner clears before it ``take``s
    them, so one attribute read tells the owner's every lookup whether
    answers wait. Cleared before the queue is read and set after it is
    written, it is never False while a publication waits unread."""

    __slots__ = ("_queue", "posted")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Posted] = queue.SimpleQueue()
        self.posted = False

    def put(self, item: Posted) -> None:
        """A checking thread's publication."""
        self._queue.put(item)
        self.posted = True

    def take(self) -> list[Posted]:
        """The owner's: every publication waiting, in posting order."""
        self.posted = False
        taken: list[Posted] = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken


class Presence(Protocol):
    """What the lookups check keys with (the engine's ``RootsPresence``)."""

    @property
    def batched(self) -> bool:
        """``many`` checks a chunk in one call (else it is asked ``one`` key
        at a time)."""
        ...

    def one(self, key: bytes) -> Found:
        """One key's answer; raises OSError when the volume fails it."""
        ...

    def many(self, keys: list[bytes], budget_s: float) -> list[Found]:
        """Keys' answers in one call, in order; given a time budget (seconds)
        it may answer the first keys only, one at least."""
        ...


class _Run:
    """One batch being checked: who took which keys, what is decided."""

    __slots__ = (
        "batch",
        "batch_id",
        "decided",
        "finished",
        "found",
        "left",
        "lock",
        "prefix",
        "published",
        "recruited",
        "returned",
        "scanned",
        "spread",
        "taken",
    )

    def __init__(self, batch_id: int, batch: list[tuple[bytes, int]]):
        self.batch_id = batch_id
        self.spread = 0  # threads sharing its chunks in CPU time (0: not shared); recruited wins
        self.batch = batch
        self.taken = 0  # keys handed to a checking thread, from the start
        self.found: list[Found] = [None] * len(batch)
        self.decided: dict[int, int] = {}  # decided chunks past the prefix: start -> end
        self.left = len(batch)  # keys not decided
        self.prefix = 0  # keys decided from the start, without a gap
        self.scanned = 0  # keys of that prefix looked at for a miss
        self.published = 0  # keys answered
        self.recruited = False
        self.returned: list[list[int]] = []  # [start, end) given back by chunks that stopped
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def take(self) -> tuple[int, int] | None:
        """The next chunk's keys (start, end), None when all are taken:
        keys given back first (they come before the cursor)."""
        with self.lock:
            if self.returned:
                given = self.returned[-1]
                start = given[0]
                end = min(given[1], start + CHUNK_KEYS) if self.recruited else given[1]
                if end == given[1]:
                    self.returned.pop()
                else:
                    given[0] = end
                return start, end
            start = self.taken
            untaken = len(self.batch) - start
            if untaken <= 0:
                return None
            if self.recruited:
                size = CHUNK_KEYS
            elif self.spread:  # doubling, but never more than a thread's share of the rest
                size = max(CHUNK_KEYS, min(start, -(-untaken // self.spread)))
            else:
                size = max(CHUNK_KEYS, start)
            self.taken = end = min(start + size, len(self.batch))
        return start, end

    def mark_recruited(self) -> bool:
        """Mark the batch as waiting on the volume; True for the one thread
        that marked it (it calls the helpers)."""
        with self.lock:
            if self.recruited:
                return False
            self.recruited = True
            return True

    def mark_spread(self, threads: int) -> bool:
        """Share the batch (in CPU time) among ``threads``; True for the one
        thread that did (it calls the helper), False once shared or recruited."""
        with self.lock:
            if self.recruited or self.spread:
                return False
            self.spread = threads
            return True

    def give_back(self, start: int, end: int) -> None:
        """Keys a chunk took and did not check (its budget spent)."""
        with self.lock:
            self.returned.append([start, end])


class BatchChecks:
    """Checks posted batches against ``presence`` -- a chunk at once where
    it checks in batches -- on the calling thread and up to ``n_helpers``
    helper threads; puts the answers on ``answers``."""

    def __init__(
        self,
        presence: Presence,
        n_helpers: int,
        answers: Answers,
        name: str = "llmkv_fs",
        cpus: int | None = None,
    ):
        self._presence = presence
        self._batched = presence.batched
        self._n_helpers = n_helpers
        # Helpers a batch in CPU time is shared with (SPREAD_HELPERS); ``cpus``:
        # the CPUs the checks may run on (None: this thread's affinity mask).
        cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
        self._spread = max(0, min(n_helpers, SPREAD_HELPERS, cpus - 1)) if self._batched else 0
        self._answers = answers
        self._name = name
        self._help: queue.SimpleQueue[_Run | None] = queue.SimpleQueue()
        self._helpers: list[threading.Thread] = []
        self._starting = threading.Lock()  # helpers are started by one thread at a time
        self.progress_at = time.monotonic()

    def check(self, batch_id: int, batch: list[tuple[bytes, int]]) -> None:
        """Decide every key of ``batch`` ((key, generation) pairs) and post
        the answers; returns when the batch is decided."""
        run = _Run(batch_id, batch)
        if not batch:
            self._answers.put((batch_id, [], True))
            return
        self._take_chunks(run)
        run.finished.wait()  # helpers still on their last chunks

    def stop(self, deadline: float) -> list[threading.Thread]:
        """Ask the helpers to end and wait for them until ``deadline``
        (monotonic); returns those still inside a check."""
        for _ in self._helpers:
            self._help.put(None)
        for helper in self._helpers:
            helper.join(max(0.0, deadline - time.monotonic()))
        return [helper for helper in self._helpers if helper.is_alive()]

    # -- any checking thread ---------------------------------------------------------

    def _take_chunks(self, run: _Run) -> None:
        keys = run.batch
        while (chunk := run.take()) is not None:
            lo, hi = chunk
            try:
                found, waited = self._check_chunk(keys[lo:hi])
            except Exception:
                # Every chunk taken must be decided, or its batch never ends.
                logger.exception("llmkv_fs: existence checks failed; answering miss")
                found, waited = [None] * (hi - lo), 0
            self.progress_at = time.monotonic()
            if lo + len(found) < hi:
                run.give_back(lo + len(found), hi)
            self._decided(run, lo, found)
            # After the chunk is decided: starting a helper may fail.
            if 2 * waited > len(found):
                if run.mark_recruited():
                    self._call_helpers(run, self._n_helpers)
            elif (
                self._spread
                and len(keys) - run.taken >= SPREAD_KEYS
                and run.mark_spread(1 + self._spread)
            ):
                self._call_helpers(run, self._spread)

    def _check_chunk(self, pairs: list[tuple[bytes, int]]) -> tuple[list[Found], int]:
        """The answers of the chunk's first keys (all, unless its budget was
        spent first; one at least), and how many of them waited on the volume."""
        found: list[Found]
        if self._batched:
            started = time.perf_counter()
            try:
                found = self._presence.many([key for key, _generation in pairs], CHUNK_BUDGET_S)
            except Exception:  # each key again on its own: its failure is its miss
                logger.debug("llmkv_fs: a batch of existence checks failed", exc_info=True)
            else:
                if found:  # none for keys asked would give the chunk back forever
                    per_key = (time.perf_counter() - started) / len(found)
                    return found, len(found) if per_key >= WAITS_ON_THE_VOLUME_S else 0
        check, clock, limit = self._check_one, time.perf_counter, WAITS_ON_THE_VOLUME_S
        found = []
        waited = 0
        chunk_started = clock()
        for key, _generation in pairs:
            started = clock()
            found.append(check(key))
            done = clock()
            if done - started >= limit:
                waited += 1
            if done - chunk_started >= CHUNK_BUDGET_S:
                break
        return found, waited

    def _check_one(self, key: bytes) -> Found:
        try:
            return self._presence.one(key)
        except OSError as exc:
            # An unreachable volume is a miss, not a crash and not a stall,
            # and not a finding that the file is gone.
            logger.warning("llmkv_fs: existence check failed (%s); treating as a miss", exc)
            return None

    def _call_helpers(self, run: _Run, n: int) -> None:
        """Start helpers up to ``n`` (any thread; serialized) and hand each
        the run. A helper that cannot be started (no threads left) is
        logged; the run goes on with those there are."""
        with self._starting:
            while len(self._helpers) < n:
                helper = threading.Thread(
                    target=self._help_out,
                    name=f"{self._name}_stat{len(self._helpers)}",
                    daemon=True,
                )
                try:
                    helper.start()
                except RuntimeError as exc:
                    logger.warning("llmkv_fs: lookup helper not started (%s)", exc)
                    break
                self._helpers.append(helper)
            for _ in range(min(n, len(self._helpers))):
                self._help.put(run)

    def _help_out(self) -> None:
        while (run := self._help.get()) is not None:
            self._take_chunks(run)

    def _decided(self, run: _Run, lo: int, found: list[Found]) -> None:
        """Record a chunk's answers; post what a scheduler can use: the
        prefix decided so far when it holds a new miss, or the whole batch."""
        with run.lock:
            run.found[lo : lo + len(found)] = found
            run.decided[lo] = lo + len(found)
            run.left -= len(found)
            end = run.prefix
            while end in run.decided:
                end = run.decided.pop(end)
            run.prefix = end
            final = run.left == 0
            new_miss = not all(run.found[run.scanned : end])
            run.scanned = end
            if final or new_miss:
                start, stop = run.published, end
                run.published = end
                answers = [
                    (key, generation, hit)
                    for (key, generation), hit in zip(run.batch[start:stop], run.found[start:stop])
                ]
                self._answers.put((run.batch_id, answers, final))
            if final:
                run.finished.set()
