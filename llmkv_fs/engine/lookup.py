"""Existence checks that never block the scheduler.

A lookup that has no verdict yet returns None (vLLM: RETRY) and joins this
step's batch; ``end_step`` hands the batch to a background thread, which
checks the files (in parallel on up to ``n_threads`` once the volume makes
checks wait, as on network filesystems, where each check is a round trip:
engine/lookup_checks.py) and posts verdicts -- for the whole batch, or
earlier up to a miss -- that the next step's first lookup applies. A key
keeps its verdict while some request refers to it; ``set_verdict``
overrides it when a load fails or a store lands, so a failed promotion
turns into MISS instead of being retried forever. A guessed miss -- one no
check found: the deadline's, a failed check's (EIO), a lost root's, a
failed load's -- answers the requests that saw it, and a request asking
for the first time checks again (``guessed_miss``).

A key whose load failed in a way that would repeat -- the file is still
there but unreadable (EIO), bad and could not be moved aside, carries no
checksum, or is sealed with a key this replica does not hold -- is
remembered (``remember_misses``, from a finished job's ``unreadable`` and
``foreign`` keys: ``jobs_finished``) and answers MISS without a
probe to every new lookup for ``miss_for_s`` seconds: otherwise each new
request would find the file, load it and fail again. At most
``_MAX_REMEMBERED_MISSES`` keys are remembered (oldest dropped first).

Threading rules
---------------
* ``lookup``, ``end_step``, ``jobs_finished``, ``set_verdict``,
  ``remember_misses``, ``forget_misses``, ``forget_request``, ``recheck``,
  ``stuck``, ``expire_overdue``, ``fold_tally`` and ``shutdown`` belong to
  the owner (one caller at a time: vLLM's manager
  lock). They touch ``_states``, ``_misses`` and the tally without a lock.
* The background thread sees only the batches it is handed (key and
  generation) and answers through ``Answers`` (a queue and the flag the
  owner's every lookup reads); it never touches ``_states``. A generation
  number lets the owner drop answers for states that were forgotten and
  recreated meanwhile.
* ``expire_overdue`` (owner) answers MISS for keys whose batch has waited
  longer than the deadline -- a stalled mount holds the lookup thread
  inside its ``openat2``/``fstat`` (or the walk's) -- so requests
  recompute instead of waiting. A late
  answer for a key decided that way is ignored (a failed load may have
  overridden it meanwhile, and MISS is always safe). ``stuck`` says the
  volume stopped answering only when no check has answered for the whole
  timeout: a slow volume that answers is not a stalled one.
* ``shutdown`` waits for the lookup thread and its helpers at most the
  timeout: a thread held inside a stalled mount is left behind (a daemon),
  and the log says so.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from llmkv_fs.engine.lookup_checks import Answers, BatchChecks, Found, Presence
from llmkv_fs.engine.outcomes import CounterKey, LookupAnswer, MissReason
from llmkv_fs.engine.scheduling.scheduler import FinishedJob
from llmkv_fs.layout.placement import RootPlacement

__all__ = ["AsyncExistence"]

logger = logging.getLogger("vllm.llmkv_fs.lookup")

# Bound of the remembered misses: ~100 bytes a key, so at most ~6 MiB.
_MAX_REMEMBERED_MISSES = 1 << 16

# The reasons a key's state takes per lookup or answer, read as globals: an
# Enum member read through its class is several dictionary lookups.
_NOT_ON_VOLUME = MissReason.NOT_ON_VOLUME
_LOAD_FAILED = MissReason.LOAD_FAILED
_CHECK_FAILED = MissReason.CHECK_FAILED
# A key's requests other than its first while there are none: shared, so
# that a key one request asks allocates no set.
_NO_OTHERS: frozenset[str] = frozenset()


class _State:
    __slots__ = (
        "asker",
        "generation",
        "guessed",
        "in_flight",
        "others",
        "override",
        "override_why",
        "verdict",
        "why",
    )

    def __init__(self, generation: int, request_id: str):
        self.generation = generation
        self.verdict: bool | None = None
        # The MISS is not a check's finding that no file is there: the
        # deadline answered, the check failed, the root is lost, or a load
        # of the key failed (guessed_miss).
        self.guessed = False
        # Why the verdict is MISS (meaningless while it is not).
        self.why = _NOT_ON_VOLUME
        self.in_flight = False
        self.override: bool | None = None  # set while in flight; wins over the probe
        self.override_why = _LOAD_FAILED
        # The requests that asked it: the first (None once it is forgotten)
        # and the others; the owner's lookup compares the first by identity
        # (vLLM passes one request's id as the same string every time).
        self.asker: str | None = request_id
        self.others: set[str] | frozenset[str] = _NO_OTHERS

    def asked_by(self, request_id: str) -> bool:
        return request_id == self.asker or request_id in self.others

    def unasked(self) -> bool:
        """No request refers to it."""
        return self.asker is None and not self.others


def _settle(state: _State, found: Found, unknown: MissReason) -> None:
    """An in-flight key's verdict from its check's answer (None: unknown,
    for the reason ``unknown``), unless the owner overrode it meanwhile
    (``set_verdict``)."""
    if state.override is not None:
        if not state.override:
            found, unknown = None, state.override_why  # a failed load: the file may be there
        state.override = None
    state.verdict = found is True
    state.guessed = found is None
    if found is None:
        state.why = unknown
    elif found is False:
        state.why = _NOT_ON_VOLUME


class AsyncExistence:
    """The lookups of one engine (the module doc), checking keys against
    ``presence`` (the engine's roots: ``RootsPresence``) on a lookup thread
    and up to ``n_threads - 1`` helpers. ``placement`` places keys on the
    roots ``recheck`` names by index (None: one root, index 0). ``cpus``:
    the CPUs the checks may use (None: the constructing thread's affinity
    mask, as the executor counts them; lookup_checks.BatchChecks)."""

    def __init__(
        self,
        presence: Presence,
        n_threads: int,
        name: str = "llmkv_fs",
        timeout: float = 5.0,
        miss_for_s: float = 60.0,
        placement: RootPlacement | None = None,
        cpus: int | None = None,
    ):
        self._timeout = timeout
        self._placement = placement
        # As of the engine's last ``recheck``.
        self._stalled = False
        self._lost_roots: frozenset[int] = frozenset()
        self._refusing = False
        # Lookups answered since the last ``fold_tally``: by answer, and the
        # misses by why (they sum to the misses).
        self._hits = 0
        self._retries = 0
        self._miss_tally: dict[MissReason, int] = dict.fromkeys(MissReason, 0)
        self._miss_for_s = miss_for_s
        # key -> (monotonic time its remembered miss ends, why); insertion
        # order is expiry order (one duration for all), so the oldest is first.
        self._misses: collections.OrderedDict[bytes, tuple[float, MissReason]] = (
            collections.OrderedDict()
        )
        self._batch_ids = itertools.count()
        # Posted, unanswered batches in posting order: [id, posted, batch, expired].
        self._unanswered: collections.deque[list[Any]] = collections.deque()
        self._states: dict[bytes, _State] = {}
        self._request_keys: dict[str, set[bytes]] = {}
        self._batch: list[tuple[bytes, int]] = []
        self._next_generation = 0
        self._to_worker: queue.SimpleQueue[tuple[int, list[tuple[bytes, int]]] | None] = (
            queue.SimpleQueue()
        )
        self._answers = Answers()
        self._checks = BatchChecks(presence, n_threads - 1, self._answers, name, cpus)
        self._thread = threading.Thread(target=self._worker, name=f"{name}_lookup", daemon=True)
        self._thread.start()

    # -- owner side ----------------------------------------------------------------

    def lookup(self, key: bytes, request_id: str) -> bool | None:
        """True/False when known, None while the check is pending; MISS at
        once, without a check, while the last ``recheck`` says the volume is
        stalled or the key's home root is lost. Counted by answer
        (``fold_tally``)."""
        # vLLM asks every key of a prompt again every step until it is
        # known: one frame, and a few attribute reads while nothing changed.
        if self._refusing or self._answers.posted:
            if self._answers.posted:
                self._apply_answers()
            if self._refusing:
                refused = self._refused(key)
                if refused is not None:
                    self._miss_tally[refused] += 1
                    return False
        state = self._states.get(key)
        if state is None or (state.asker is not request_id and request_id not in state.others):
            state = self._first_lookup(key, request_id, state)
        verdict = state.verdict
        if verdict is None:
            self._retries += 1
        elif verdict:
            self._hits += 1
        else:
            self._miss_tally[state.why] += 1
        return verdict

    def recheck(self, blocks_stuck: bool, lost_roots: frozenset[int]) -> bool:
        """The engine's recheck of the volume (owner): stalled when a block
        is stuck inside a syscall (``blocks_stuck``) or the volume stopped
        answering the checks (``stuck()``). While stalled every lookup
        answers MISS (STALLED), and while roots are lost (by index) so does a
        lookup of a key whose home is one of them (LOST_ROOT) -- at once,
        without a check, and untracked. Returns whether stalled."""
        stalled = blocks_stuck or self.stuck()
        self._stalled, self._lost_roots = stalled, lost_roots
        self._refusing = stalled or bool(lost_roots)
        return stalled

    def _refused(self, key: bytes) -> MissReason | None:
        if self._stalled:
            return MissReason.STALLED
        home = 0 if self._placement is None else self._placement.home(key)
        return MissReason.LOST_ROOT if home in self._lost_roots else None

    def fold_tally(self, counters: collections.Counter[CounterKey]) -> None:
        """Add the lookups answered since the last fold to ``counters``
        (owner): by answer, and the misses by why."""
        if self._hits:
            counters[LookupAnswer.HIT] += self._hits
            self._hits = 0
        if self._retries:
            counters[LookupAnswer.RETRY] += self._retries
            self._retries = 0
        tally = self._miss_tally
        for reason, count in tally.items():
            if count:
                counters[LookupAnswer.MISS] += count
                counters[reason] += count
                tally[reason] = 0

    def _first_lookup(self, key: bytes, request_id: str, state: _State | None) -> _State:
        """A key this request has not asked before (unless by an equal id,
        not the same string): tracked, and new to the batch unless known."""
        if state is None:
            state = self._states[key] = _State(self._next_generation, request_id)
            self._next_generation += 1
            if self._misses:
                self._ask(key, state)
            else:
                self._batch.append((key, state.generation))
        else:
            if state.asked_by(request_id):
                return state
            if state.guessed:
                # A miss nobody found (the deadline, a failed check, a lost
                # root, a failed load) is not handed on: this request asks
                # again, so a root that is back or a volume that answers
                # again is seen.
                state.generation = self._next_generation
                self._next_generation += 1
                state.verdict = None
                state.guessed = False
                self._ask(key, state)
            if state.asker is None:
                state.asker = request_id
            elif isinstance(state.others, set):
                state.others.add(request_id)
            else:
                state.others = {request_id}
        keys = self._request_keys.get(request_id)
        if keys is None:  # not setdefault: a new set per call, 8,192 per prompt
            keys = self._request_keys[request_id] = set()
        keys.add(key)
        return state

    def _ask(self, key: bytes, state: _State) -> None:
        """Into this step's batch -- unless a remembered miss answers."""
        if self._misses and self._remembered_miss(key):
            state.verdict = False  # no probe: the file would fail again
            state.guessed = True  # and it is there
            state.why = self._misses[key][1]
        else:
            self._batch.append((key, state.generation))

    def end_step(self) -> None:
        """Apply answers that arrived and post this step's batch (one queue
        item per step, however many keys)."""
        self._apply_answers()
        batch, self._batch = self._batch, []
        live = []
        for key, generation in batch:
            state = self._states.get(key)
            if state is not None and state.generation == generation:
                state.in_flight = True
                live.append((key, generation))
        if live:
            batch_id = next(self._batch_ids)
            self._unanswered.append([batch_id, time.monotonic(), live, False])
            self._to_worker.put((batch_id, live))

    def expire_overdue(self, now: float | None = None) -> int:
        """Answer MISS for every key of a batch older than the timeout that
        has no answer yet; returns how many keys that decided."""
        now = time.monotonic() if now is None else now
        decided = 0
        for entry in self._unanswered:
            _, posted, batch, expired = entry
            if posted + self._timeout > now:
                break
            if expired:
                continue
            entry[3] = True
            for key, generation in batch:
                state = self._states.get(key)
                if state is None or state.generation != generation or not state.in_flight:
                    continue
                state.in_flight = False
                _settle(state, None, MissReason.DEADLINE)
                decided += 1
        return decided

    def stuck(self, now: float | None = None) -> bool:
        """Whether the volume stopped answering metadata calls: a batch is
        unanswered and no check has answered for the timeout since it was
        posted (a volume that answers slowly keeps ``progress_at`` moving)."""
        if not self._unanswered:
            return False
        now = time.monotonic() if now is None else now
        posted: float = self._unanswered[0][1]
        return max(posted, self._checks.progress_at) + self._timeout <= now

    def guessed_miss(self, key: bytes) -> bool:
        """Whether ``key``'s MISS says nothing of its file: answered by the
        deadline (a stalled or slow volume), by a check that failed (EIO, a
        root lost), by a remembered miss or a failed load -- the file may
        well be there. False for a key this owner is not tracking."""
        state = self._states.get(key)
        return state is not None and state.guessed

    def miss_reason(self, key: bytes) -> MissReason:
        """Why ``key``'s verdict is MISS (asked right after a lookup
        answered False; NOT_ON_VOLUME for a key this owner is not tracking)."""
        state = self._states.get(key)
        return MissReason.NOT_ON_VOLUME if state is None else state.why

    def remember_misses(
        self,
        keys: Iterable[bytes],
        now: float | None = None,
        why: MissReason = MissReason.REMEMBERED_BAD,
    ) -> None:
        """These keys' loads failed and would fail again: MISS, without a
        probe, for ``miss_for_s`` seconds (see the module doc), counted as
        ``why``."""
        keys = list(keys)
        until = (time.monotonic() if now is None else now) + self._miss_for_s
        misses = self._misses
        for key in keys:
            misses.pop(key, None)
            misses[key] = (until, why)
        self.set_verdict(keys, False)
        while len(misses) > _MAX_REMEMBERED_MISSES:
            misses.popitem(last=False)

    def jobs_finished(self, results: Iterable[FinishedJob]) -> None:
        """What finished jobs teach the lookups (owner, once per
        ``take_finished``): a failed load answers miss; a load that would
        fail again is remembered as a miss for a while (``remember_misses``);
        a stored block is there -- and a file remembered as unloadable that
        a store wrote over is a good block now."""
        for result in results:
            if result.is_load:
                if result.unreadable:
                    self.remember_misses(result.unreadable)
                if result.foreign:
                    self.remember_misses(result.foreign, why=MissReason.FOREIGN_KEY)
                if self._states and result.failed:
                    self.set_verdict(result.failed, False)
            else:
                if self._misses and result.replaced:
                    self.forget_misses(result.replaced)
                if self._states:
                    self.set_verdict(result.succeeded, True)

    def forget_misses(self, keys: Iterable[bytes]) -> None:
        """These keys' files were written over (Outcome.REPLACED): probe
        them again."""
        if self._misses:
            for key in keys:
                self._misses.pop(key, None)

    def _remembered_miss(self, key: bytes) -> bool:
        remembered = self._misses.get(key)
        if remembered is None:
            return False
        now = time.monotonic()
        if remembered[0] > now:
            return True
        # Expired: drop it and every older entry (they expired first).
        misses = self._misses
        while misses:
            oldest, (oldest_until, _) = next(iter(misses.items()))
            if oldest_until > now:
                break
            del misses[oldest]
        return False

    def set_verdict(self, keys: Iterable[bytes], verdict: bool) -> None:
        """Force what the next lookups of these keys say (a load failed: False,
        counted LOAD_FAILED unless the key is a remembered miss, which keeps
        its own reason; a store landed: True, except for a remembered miss: a
        store finds the unreadable file present). Keys nobody is looking up
        are ignored."""
        if not self._states:
            return
        misses = self._misses
        for key in keys:
            state = self._states.get(key)
            if state is None:
                continue
            remembered = misses.get(key) if misses else None
            if verdict and remembered is not None and self._remembered_miss(key):
                continue
            why = MissReason.LOAD_FAILED if remembered is None else remembered[1]
            if state.in_flight:
                state.override = verdict
                state.override_why = why
            else:
                state.verdict = verdict
                state.guessed = not verdict  # a failed load: the file may be there
                state.why = why

    def forget_request(self, request_id: str) -> None:
        for key in self._request_keys.pop(request_id, ()):
            state = self._states.get(key)
            if state is None:
                continue
            if state.asker == request_id:
                state.asker = None
            elif isinstance(state.others, set):
                state.others.discard(request_id)
            if state.unasked() and not state.in_flight:
                del self._states[key]

    def shutdown(self) -> None:
        """Stop the lookup thread and its helpers, waiting at most the
        timeout: a check still inside the volume then is left behind (a
        daemon thread) and named in the log, as the workers' shutdown
        bounds its wait (workers/crew.py)."""
        deadline = time.monotonic() + self._timeout
        self._to_worker.put(None)
        self._thread.join(self._timeout)
        left = self._checks.stop(deadline)
        if self._thread.is_alive():
            left.append(self._thread)
        self._apply_answers()
        if left:
            keys = sum(len(entry[2]) for entry in self._unanswered)
            logger.warning(
                "llmkv_fs: shutdown did not wait for %d lookup thread(s) (%s) still inside "
                "an existence check after %.1fs -- the volume is not answering; left behind "
                "with %d unanswered batch(es), %d key(s)",
                len(left),
                ", ".join(thread.name for thread in left),
                self._timeout,
                len(self._unanswered),
                keys,
            )

    def _apply_answers(self) -> None:
        for batch_id, answers, final in self._answers.take():
            if final:
                while self._unanswered and self._unanswered[0][0] <= batch_id:
                    self._unanswered.popleft()  # batches end in posting order
            for key, generation, found in answers:
                state = self._states.get(key)
                if state is None or state.generation != generation:
                    continue
                if not state.in_flight:
                    # Decided by expire_overdue (maybe overridden since, by a
                    # failed load): the late answer changes nothing.
                    if state.unasked():
                        del self._states[key]
                    continue
                state.in_flight = False
                if state.unasked():
                    del self._states[key]
                    continue
                if found is True and state.override is None:
                    state.verdict, state.guessed = True, False  # _settle's, for most answers
                    continue
                _settle(state, found, _CHECK_FAILED)

    # -- lookup thread ---------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            item = self._to_worker.get()
            if item is None:
                return
            self._checks.check(*item)
