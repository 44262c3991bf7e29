"""The lookups (engine/lookup.py, engine/lookup_checks.py).

A key whose load failed in a way that would repeat answers MISS to new
requests for ``failed_load_miss_s``, without being read again: a bad file
that could not be moved aside (its quarantine directory is read-only)
and a file the kernel answers with EIO. Real files, a real loop-mounted
ext4 shut down under the engine.

Issue 33: the checks go parallel as soon as the volume makes them wait,
however the batch began; a volume that answers slowly is not a stalled one;
answers go out for the whole batch or up to a miss, never as piecemeal
hits; shutdown leaves a check held inside the volume behind instead of
waiting for it. Checks are held with events and the engine's ``exists``
pause point; the time a check takes is a clock the test moves. Lookups
through the compiled batch check and through the Python path agree with
the files on disk, and the start-up log says which one runs.
"""

import errno
import logging
import os
import subprocess
import threading
import time
import types
from collections import Counter
from collections.abc import Callable

import pytest

from llmkv_fs.config import SETTINGS
from llmkv_fs.engine import Direction, Failure, LookupAnswer, MissReason, lookup_checks
from llmkv_fs.engine import lookup as lookup_module
from llmkv_fs.engine.block.presence import compiled_check
from llmkv_fs.engine.lookup import _MAX_REMEMBERED_MISSES, AsyncExistence
from llmkv_fs.layout.blockfile import Corruption
from llmkv_fs.layout.placement import RootPlacement
from tests.kits.clock_kit import ManualClock
from tests.kits.engine_kit import (
    DEADLINE_S,
    Checks,
    inside,
    make_key,
    remembered_misses,
    settle,
    store_blocks,
    tracked_keys,
    wait_jobs,
)
from tests.kits.matrix_kit import ext4_shutdown, loop_ext4
from tests.kits.volume_kit import flip_a_bit


def loads_seen(engine, gate_for):
    """A record of every load a block of ``engine`` starts from now on, in
    I/O threads or worker processes alike (an open gate only records)."""
    gate = gate_for(engine, kinds=("load",))
    gate.open()
    return gate


def fails_then_misses(engine, key: bytes, loads) -> None:
    """A request finds ``key``, its load fails; fresh requests then answer
    MISS at their first lookup (no probe, no RETRY) and never load it."""
    assert settle(engine, key, "first") is True
    assert engine.submit_load(1, [key], [1])
    assert not wait_jobs(engine, [1])[1].success
    engine.forget_request("first")
    for i in range(5):
        assert engine.lookup(key, f"again-{i}") is False
        engine.end_step()
        engine.forget_request(f"again-{i}")
    assert [k for _place, _kind, k in loads.entries] == [key]
    assert inside(engine).remembered_misses() == 1


def test_bad_file_that_cannot_be_quarantined_is_a_miss_for_a_while(disk_root, engines, gate_for):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 0, ["bad"], [0])
    key = make_key("bad")
    flip_a_bit(layout.block_path(key), offset=100)
    # The quarantine directory is a read-only mount of its own: the move
    # aside fails (EXDEV/EROFS) the way it does on a volume gone read-only.
    qdir = layout.quarantine_dir
    os.makedirs(qdir)
    subprocess.run(["mount", "--bind", qdir, qdir], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", qdir], check=True)
        loads = loads_seen(engine, gate_for)

        fails_then_misses(engine, key, loads)
        c = engine.counters
        assert c[Direction.LOAD, Failure.CORRUPT] == 1 and c[Corruption.BAD_CHECKSUM] == 1
        assert c[Direction.LOAD, Failure.ERROR] == 0  # still a bad file, not an I/O error
        assert os.path.exists(layout.block_path(key))  # left in place
        assert os.listdir(qdir) == []
    finally:
        subprocess.run(["umount", "-l", qdir], check=False)


def test_a_block_answering_eio_is_a_miss_for_a_while(tmp_path, engines, gate_for):
    with loop_ext4(tmp_path / "eio") as root:
        engine, _layout, primary = engines(root, n_blocks=4)
        store_blocks(engine, primary, 0, ["eio"], [0])
        key = make_key("eio")
        os.sync()
        loads = loads_seen(engine, gate_for)
        ext4_shutdown(root)  # lstat still answers (cached); every read is EIO

        fails_then_misses(engine, key, loads)
        assert engine.counters[Direction.LOAD, Failure.ERROR] == 1


def test_remembered_misses_expire_and_are_bounded(tmp_path):
    probes: list[bytes] = []

    def exists(key: bytes) -> bool:
        probes.append(key)
        return True

    lookups = AsyncExistence(Checks(exists), 1, miss_for_s=60.0)
    try:
        lookups.remember_misses([b"old"], now=time.monotonic() - 61)
        lookups.remember_misses([b"new"])
        assert lookups.lookup(b"new", "r") is False  # no probe
        assert lookups.lookup(b"old", "r") is None  # expired: probed again
        lookups.end_step()
        deadline = time.monotonic() + 10
        while lookups.lookup(b"old", "r") is None:
            assert time.monotonic() < deadline
            lookups.end_step()
            time.sleep(0.002)
        assert probes == [b"old"]
        assert remembered_misses(lookups) == 1  # the expired entry is gone
        lookups.remember_misses(i.to_bytes(4, "big") for i in range(_MAX_REMEMBERED_MISSES + 5))
        assert remembered_misses(lookups) == _MAX_REMEMBERED_MISSES
    finally:
        lookups.shutdown()
    doc = next(s.doc for s in SETTINGS if s.key == "failed_load_miss_s")
    assert str(_MAX_REMEMBERED_MISSES) in doc


# -- issue 33: how a batch is checked and answered -------------------------------------------


def number(i: int) -> bytes:
    return i.to_bytes(4, "big")


class ThreadClock:
    """``time`` for lookup_checks: ``perf_counter`` is each thread's own
    clock, moved by the checks that thread makes (``spend``), so "this
    check took 3 ms" is what the test says, not what the machine did."""

    def __init__(self):
        self._local = threading.local()

    def perf_counter(self) -> float:
        return getattr(self._local, "now", 0.0)

    def spend(self, seconds: float) -> None:
        self._local.now = self.perf_counter() + seconds

    def __getattr__(self, name: str):
        return getattr(time, name)


def step_until_known(lookups: AsyncExistence, keys: list[bytes], request: str = "r") -> list:
    """vLLM's scheduler: every key asked every step until all are known."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        verdicts = [lookups.lookup(k, request) for k in keys]
        if None not in verdicts:
            return verdicts
        assert time.monotonic() < deadline, "verdicts still missing"
        lookups.end_step()
        time.sleep(0.002)


def test_a_guessed_miss_is_not_handed_to_a_new_request():
    """A miss no check found (the check failed: EIO, a lost root) answers the
    request that saw it; a request asking for the first time checks again,
    and finds the block once the volume answers. A checked miss is shared
    without a probe; a remembered miss (its file would fail again) too."""
    there: set[bytes] = set()
    failing: set[bytes] = set()
    probes: list[bytes] = []

    def exists(key: bytes) -> bool | None:
        probes.append(key)
        if key in failing:
            raise OSError(errno.EIO, "Input/output error")
        return key in there

    lookups = AsyncExistence(Checks(exists), 1)
    try:
        failing.add(b"eio")
        assert step_until_known(lookups, [b"eio", b"gone"], "open") == [False, False]
        assert lookups.guessed_miss(b"eio") and not lookups.guessed_miss(b"gone")
        lookups.remember_misses([b"bad"])
        assert lookups.lookup(b"bad", "open") is False
        failing.clear()
        there.update((b"eio", b"gone", b"bad"))
        probes.clear()
        assert lookups.lookup(b"eio", "open") is False  # the request that saw it
        assert step_until_known(lookups, [b"eio", b"gone", b"bad"], "new") == [True, False, False]
        assert probes == [b"eio"]
        assert lookups.lookup(b"eio", "open") is True  # the fresh answer is shared
    finally:
        lookups.shutdown()


def test_checks_go_parallel_once_the_volume_makes_them_wait(monkeypatch):
    """The first checks answer in CPU time (cached names), every later one
    waits 3 ms on the volume: the helpers join, where a choice made from the
    first checks left the whole batch on one thread."""
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)
    checked: list[int] = []

    def exists(key: bytes) -> bool:
        i = int.from_bytes(key, "big")
        if i >= 8:
            clock.spend(3e-3)
            time.sleep(0)  # the GIL goes while the volume answers, as in a real check
        checked.append(i)
        return i % 3 != 2

    lookups = AsyncExistence(Checks(exists), 8, timeout=60.0, name="slowvol")
    try:
        keys = [number(i) for i in range(600)]
        verdicts = step_until_known(lookups, keys)
        helpers = [t for t in threading.enumerate() if t.name.startswith("slowvol_stat")]
    finally:
        lookups.shutdown()
    assert verdicts == [i % 3 != 2 for i in range(600)]
    assert len(helpers) == 7, "the batch stayed on the lookup thread"
    assert sorted(checked) == list(range(600))  # each key checked once, by whichever thread


def test_a_chunk_checked_at_once_is_timed_whole_and_a_failure_checked_key_by_key(monkeypatch):
    """The compiled check answers a chunk of 16 in one call: 3 ms a key on
    the volume recruits the helpers as single checks would; a chunk whose
    call fails (one key's error) is checked again one key at a time."""
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)
    one_by_one: list[int] = []

    def exists(key: bytes) -> bool:
        one_by_one.append(int.from_bytes(key, "big"))
        return int.from_bytes(key, "big") % 3 != 2

    def exist_many(keys: list[bytes], budget_s: float) -> list[bool]:
        if number(40) in keys:
            raise OSError(5, "one key's failure")
        clock.spend(3e-3 * len(keys))
        time.sleep(0)
        return [int.from_bytes(k, "big") % 3 != 2 for k in keys]

    lookups = AsyncExistence(Checks(exists, exist_many), 8, timeout=60.0, name="chunkvol")
    try:
        verdicts = step_until_known(lookups, [number(i) for i in range(600)])
        helpers = [t for t in threading.enumerate() if t.name.startswith("chunkvol_stat")]
    finally:
        lookups.shutdown()
    assert verdicts == [i % 3 != 2 for i in range(600)]
    assert len(helpers) == 7, "the batch stayed on the lookup thread"
    assert sorted(one_by_one) == list(range(32, 48))  # the failed chunk alone


def test_checks_on_a_volume_answering_in_cpu_time_stay_on_one_thread(monkeypatch):
    clock = ThreadClock()  # a check preempted on a loaded machine must not look slow
    monkeypatch.setattr(lookup_checks, "time", clock)
    checked_on = set()

    def exists(key: bytes) -> bool:
        checked_on.add(threading.get_ident())
        clock.spend(2e-6)
        return True

    lookups = AsyncExistence(Checks(exists), 8, name="fastvol", cpus=2)  # Python checks: no spread
    try:
        assert step_until_known(lookups, [number(i) for i in range(2048)]) == [True] * 2048
        assert not [t for t in threading.enumerate() if t.name.startswith("fastvol_stat")]
    finally:
        lookups.shutdown()
    assert len(checked_on) == 1


def _budgeted(clock: ThreadClock, cost_s: Callable[[int], float], calls: list[tuple[int, float]]):
    """A compiled check on a test clock: key number i costs ``cost_s(i)``;
    it stops once the budget is spent, as ``check_keys`` does; records each
    call's (keys asked, seconds spent)."""

    def exist_many(keys: list[bytes], budget_s: float) -> list[bool]:
        spent = 0.0
        answers = []
        for key in keys:
            cost = cost_s(int.from_bytes(key, "big"))
            clock.spend(cost)
            spent += cost
            answers.append(True)
            if 0 < budget_s <= spent:
                break
        calls.append((len(keys), spent))
        return answers

    return exist_many


def _checked_in_chunks(monkeypatch, name: str, cost_s: Callable[[int], float], cpus: int = 1):
    """8,192 keys through the lookups with a budgeted compiled check (two
    lookup threads, ``cpus`` CPUs): the verdicts, the calls made and the
    helper threads started."""
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)
    calls: list[tuple[int, float]] = []
    checks = Checks(lambda key: True, _budgeted(clock, cost_s, calls))
    lookups = AsyncExistence(checks, 2, timeout=60.0, name=name, cpus=cpus)
    try:
        verdicts = step_until_known(lookups, [number(i) for i in range(8192)])
        helpers = [t for t in threading.enumerate() if t.name.startswith(f"{name}_stat")]
    finally:
        lookups.shutdown()
    return verdicts, calls, helpers


def test_chunks_grow_while_the_volume_answers_in_cpu_time(monkeypatch):
    """A long prompt on a fast volume is checked in few compiled calls (each
    gives the interpreter lock back once): chunks double (one CPU: on one
    thread); on a volume that makes checks wait they stay small, for the
    helpers."""
    verdicts, fast, helpers = _checked_in_chunks(monkeypatch, "fast", lambda i: 2e-6)
    assert verdicts == [True] * 8192 and not helpers
    assert [asked for asked, _spent in fast] == [16, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]

    verdicts, slow, helpers = _checked_in_chunks(monkeypatch, "slow", lambda i: 3e-3)
    assert verdicts == [True] * 8192 and len(helpers) == 1
    assert max(asked for asked, _spent in slow) == lookup_checks.CHUNK_KEYS


def test_a_long_batch_in_cpu_time_is_shared_with_a_helper_where_there_is_a_cpu(monkeypatch):
    """The compiled check holds no GIL: with a second CPU a long prompt on a
    fast volume is checked on two threads at once (a long chunk is held
    inside the check until the other thread has checked too: a batch left
    on one thread never gets past it), each chunk at most a thread's share
    of the keys left; every key checked once."""
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)
    inside: set[int] = set()
    both_inside = threading.Event()
    lock = threading.Lock()
    calls: list[tuple[int, int]] = []  # (first key, keys asked)

    def exist_many(keys: list[bytes], budget_s: float) -> list[bool]:
        first = int.from_bytes(keys[0], "big")
        with lock:
            calls.append((first, len(keys)))
            inside.add(threading.get_ident())
            if len(inside) == 2:
                both_inside.set()
        if len(keys) >= 256:  # a long chunk waits for the other thread to be checking too
            assert both_inside.wait(DEADLINE_S), "one thread checked the batch alone"
        clock.spend(2e-6 * len(keys))
        return [True] * len(keys)

    lookups = AsyncExistence(
        Checks(lambda key: True, exist_many), 32, timeout=60.0, name="spread", cpus=2
    )
    try:
        verdicts = step_until_known(lookups, [number(i) for i in range(8192)])
        helpers = [t for t in threading.enumerate() if t.name.startswith("spread_stat")]
    finally:
        lookups.shutdown()
    assert verdicts == [True] * 8192
    assert len(helpers) == lookup_checks.SPREAD_HELPERS == 1  # not the 31 lookup_threads allow
    assert both_inside.is_set()
    checked = sorted(k for first, n in calls for k in range(first, first + n))
    assert checked == list(range(8192))
    untaken = 8192
    for _first, n in sorted(calls):  # in the order they were taken
        assert n <= max(lookup_checks.CHUNK_KEYS, -(-untaken // 2))
        untaken -= n
    assert max(n for _first, n in calls) == 2048  # on one thread: 4096, half the batch


def test_a_helper_that_cannot_be_started_leaves_the_batch_to_the_lookup_thread(monkeypatch, caplog):
    """No thread can be started (a pids limit): the batch that would be
    shared, or recruited, is decided on the lookup thread all the same."""
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    no_threads = types.SimpleNamespace(**{**vars(threading), "Thread": NoThread})
    lookups = AsyncExistence(
        Checks(lambda key: True, lambda keys, budget: [True] * len(keys)),
        32,
        name="nothreads",
        cpus=2,
    )
    monkeypatch.setattr(lookup_checks, "threading", no_threads)  # after the lookup thread
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.llmkv_fs.lookup"):
            assert step_until_known(lookups, [number(i) for i in range(4096)]) == [True] * 4096
    finally:
        lookups.shutdown()
    assert "lookup helper not started" in caplog.text


def test_a_short_batch_or_one_cpu_keeps_one_thread(monkeypatch):
    verdicts, calls, helpers = _checked_in_chunks(monkeypatch, "onecpu", lambda i: 2e-6, cpus=1)
    assert verdicts == [True] * 8192 and not helpers
    assert max(asked for asked, _spent in calls) == 4096  # doubling on the one thread
    clock = ThreadClock()
    monkeypatch.setattr(lookup_checks, "time", clock)
    threads: set[int] = set()

    def exist_many(keys: list[bytes], budget_s: float) -> list[bool]:
        threads.add(threading.get_ident())
        return [True] * len(keys)

    lookups = AsyncExistence(Checks(lambda key: True, exist_many), 32, name="short", cpus=16)
    try:
        # Fewer than SPREAD_KEYS untaken once the first chunk is taken.
        keys = [number(i) for i in range(lookup_checks.SPREAD_KEYS)]
        assert step_until_known(lookups, keys) == [True] * len(keys)
        assert not [t for t in threading.enumerate() if t.name.startswith("short_stat")]
    finally:
        lookups.shutdown()
    assert len(threads) == 1


@pytest.mark.parametrize("cpus", [1, 2])  # 2: the batch was shared when it turned slow
def test_a_chunk_stops_itself_when_the_volume_turns_slow(monkeypatch, cpus):
    """A prompt whose head answers from cache (2 us a key) and whose tail
    takes 3 ms a key: the long chunk that reaches the tail stops once its
    budget is spent, gives the rest back, and the helpers share it -- no
    call holds verdicts for much longer than the budget (a 2,048-key chunk
    would have taken 3.2 s)."""
    verdicts, calls, helpers = _checked_in_chunks(
        monkeypatch, f"turning{cpus}", lambda i: 2e-6 if i < 3000 else 3e-3, cpus
    )
    assert verdicts == [True] * 8192 and len(helpers) == 1
    assert lookup_checks.CHUNK_BUDGET_S <= 0.05
    assert max(spent for _asked, spent in calls) < lookup_checks.CHUNK_BUDGET_S + 3e-3
    assert any(asked >= 2048 for asked, _spent in calls)  # the long chunk was asked


def test_a_volume_that_answers_slowly_is_not_stalled(monkeypatch):
    """Each check takes a quarter of a second of the test's clock: the batch
    is older than the timeout long before it is decided, but checks keep
    answering, so the lookups are not stuck (the engine would refuse every
    store as stalled); once nothing answers for the timeout, they are."""
    clock = ManualClock().install(monkeypatch, lookup_module, lookup_checks)
    at_40, go_on = threading.Event(), threading.Event()

    def exists(key: bytes) -> bool:
        clock.advance(0.25)
        if key == number(40):
            at_40.set()
            assert go_on.wait(DEADLINE_S)
        return True

    lookups = AsyncExistence(Checks(exists), 1, timeout=5.0)
    try:
        keys = [number(i) for i in range(64)]
        assert lookups.lookup(keys[0], "r") is None
        for key in keys[1:]:
            lookups.lookup(key, "r")
        posted = clock.now
        lookups.end_step()
        assert at_40.wait(DEADLINE_S)
        assert clock.now - posted > 10.0  # twice the timeout since the batch was posted
        assert not lookups.stuck()
        clock.advance(5.0)  # and now nothing answers for the timeout
        assert lookups.stuck()
        go_on.set()
        assert step_until_known(lookups, keys) == [True] * 64
        assert not lookups.stuck()
    finally:
        go_on.set()
        lookups.shutdown()


@pytest.mark.parametrize("miss_at", [None, 20])
def test_answers_come_for_the_whole_batch_or_up_to_a_miss(miss_at):
    """A check held at key 70 of 100: no hit is answered before the batch is
    decided (vLLM would record each again every step); a miss before the held
    key is answered, with every key before it, at once (vLLM's prefix ends
    there)."""
    at_70, go_on = threading.Event(), threading.Event()
    missing = None if miss_at is None else number(miss_at)

    def exists(key: bytes) -> bool:
        if key == number(70):
            at_70.set()
            assert go_on.wait(DEADLINE_S)
        return key != missing

    lookups = AsyncExistence(Checks(exists), 1)
    keys = [number(i) for i in range(100)]
    try:
        assert all(lookups.lookup(k, "r") is None for k in keys)
        lookups.end_step()
        assert at_70.wait(DEADLINE_S)
        if miss_at is not None:
            deadline = time.monotonic() + DEADLINE_S
            while lookups.lookup(keys[miss_at], "r") is None:
                assert time.monotonic() < deadline
                time.sleep(0.002)
        verdicts = [lookups.lookup(k, "r") for k in keys]
        if miss_at is None:
            assert verdicts == [None] * 100
        else:
            known = [True] * miss_at + [False]
            assert verdicts[: miss_at + 1] == known
            assert set(verdicts[32:]) == {None}  # decided hits after it wait for the batch
        go_on.set()
        assert step_until_known(lookups, keys) == [k != missing for k in keys]
    finally:
        go_on.set()
        lookups.shutdown()


def test_shutdown_leaves_a_check_held_in_the_volume_behind(tmp_path, engines, gate_for, caplog):
    """A check held inside the volume (the engine's ``exists`` pause point,
    as in a stalled mount): shutdown returns after the lookup timeout, says
    what it left behind, and the held check is still held."""
    engine, _layout, _primary = engines(str(tmp_path / "kv"), job_timeout_s=0.5)
    gate = gate_for(engine, kinds=("lookup",), point="exists")  # never opened here
    key = make_key("held")
    assert engine.lookup(key, "r") is None
    engine.end_step()
    gate.wait_entered(1)
    with caplog.at_level(logging.WARNING, logger="vllm.llmkv_fs.lookup"):
        stopping = threading.Thread(target=engine.shutdown, daemon=True)
        stopping.start()
        stopping.join(DEADLINE_S)  # a bound for the failure, not a measurement
        assert not stopping.is_alive(), "shutdown waited for the held check"
    assert [k for _place, _kind, k in gate.entries] == [key]  # still at the gate
    left = [r.getMessage() for r in caplog.records if "left behind" in r.getMessage()]
    assert len(left) == 1 and "_lookup" in left[0] and "1 key(s)" in left[0], left


# -- the compiled presence check against the Python path -------------------------------------


def engine_steps_until_known(engine, keys: list[bytes], request: str = "r") -> list:
    """``step_until_known`` through the engine."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        verdicts = [engine.lookup(k, request) for k in keys]
        if None not in verdicts:
            return verdicts
        assert time.monotonic() < deadline, "verdicts still missing"
        engine.end_step()
        time.sleep(0.002)


@pytest.mark.parametrize("presence", ["compiled", "python"])
def test_lookups_agree_with_the_files_on_disk(tmp_path, engines, monkeypatch, caplog, presence):
    """Six blocks stored, then four of them spoilt on disk (a truncated file,
    a symlink to a good block at the name, a removed file, a directory at
    the name), among keys never stored: every verdict is what is on disk,
    with the compiled check and with the Python path forced."""
    if presence == "compiled" and compiled_check() is None:
        pytest.skip("the compiled presence check is not built here (or no openat2)")
    with caplog.at_level(logging.INFO, logger="vllm.llmkv_fs.engine"):
        engine, layout, primary = engines(
            str(tmp_path / "kv"), n_blocks=8, lookup_threads=1, compiled_io=presence == "compiled"
        )
    started = [r.getMessage() for r in caplog.records if "presence check" in r.getMessage()]
    assert len(started) == 1 and started[0].split("presence check ")[1].startswith(presence)

    store_blocks(engine, primary, 0, range(6), range(6))
    path = [layout.block_path(make_key(i)) for i in range(6)]
    os.truncate(path[1], 100)
    os.replace(path[0], path[2])
    os.symlink(path[2], path[0])  # a good block's file, behind a symlink
    os.unlink(path[3])
    os.mkdir(path[3])
    os.unlink(path[4])
    keys = [make_key(i) for i in range(40)]  # 6..39 were never stored

    verdicts = engine_steps_until_known(engine, keys)
    assert verdicts == [i in (2, 5) for i in range(40)]


def test_each_miss_says_why():
    """A MISS carries its reason from where its verdict is decided: a check
    that found no file, one that failed, the deadline, a failed load, a
    remembered bad file, a block sealed with a key this reader lacks."""
    release = threading.Event()

    def exists(key: bytes) -> bool:
        if key == b"eio":
            raise OSError(errno.EIO, "I/O error")
        if key == b"hung":
            release.wait(DEADLINE_S)
        return key == b"there"

    lookups = AsyncExistence(Checks(exists), 1, timeout=5.0)
    why = lookups.miss_reason
    try:
        for key in (b"gone", b"eio", b"there"):
            assert lookups.lookup(key, "r") is None
        lookups.end_step()
        assert lookups.lookup(b"hung", "r") is None
        lookups.end_step()
        deadline = time.monotonic() + DEADLINE_S
        while lookups.lookup(b"there", "r") is None or lookups.lookup(b"eio", "r") is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert lookups.lookup(b"gone", "r") is False and why(b"gone") is MissReason.NOT_ON_VOLUME
        assert lookups.lookup(b"eio", "r") is False and why(b"eio") is MissReason.CHECK_FAILED
        assert lookups.expire_overdue(time.monotonic() + 6.0) == 1
        assert lookups.lookup(b"hung", "r") is False and why(b"hung") is MissReason.DEADLINE
        lookups.set_verdict([b"there"], False)  # its load failed
        assert lookups.lookup(b"there", "r") is False and why(b"there") is MissReason.LOAD_FAILED
        lookups.remember_misses([b"there"])
        assert why(b"there") is MissReason.REMEMBERED_BAD
        lookups.remember_misses([b"gone"], why=MissReason.FOREIGN_KEY)
        lookups.set_verdict([b"gone"], False)  # the failed load's own verdict keeps the reason
        assert why(b"gone") is MissReason.FOREIGN_KEY
        assert lookups.lookup(b"gone", "new") is False  # a new request: remembered, no probe
        assert why(b"gone") is MissReason.FOREIGN_KEY
    finally:
        release.set()
        lookups.shutdown()


def test_posted_answers_are_flagged_until_the_owner_takes_them():
    """The owner's lookups read one flag to learn that answers wait: set by
    every publication, cleared only by the take that reads them all."""
    answers = lookup_checks.Answers()
    assert not answers.posted and answers.take() == []
    first, second = (1, [(b"a", 0, True)], False), (1, [(b"b", 0, None)], True)
    answers.put(first)
    answers.put(second)
    assert answers.posted
    assert answers.take() == [first, second]
    assert not answers.posted and answers.take() == []


def test_refused_lookups_miss_untracked_and_every_answer_is_counted_once():
    """While the engine says the volume is stalled, or a key's home root is
    lost, a lookup answers MISS at once (counted with its reason) and the
    key is not tracked; otherwise it is checked. Each answer is counted
    once, by answer and, for a miss, by why."""
    placement = RootPlacement(["/a", "/b"])
    on_b = next(make_key(str(i)) for i in range(100) if placement.home(make_key(str(i))) == 1)
    on_a = next(make_key(str(i)) for i in range(100) if placement.home(make_key(str(i))) == 0)
    lookups = AsyncExistence(Checks(lambda key: key == on_a), 1, placement=placement)
    counters: Counter = Counter()
    try:
        lookups.recheck(True, frozenset())
        assert lookups.lookup(on_a, "r") is False
        lookups.recheck(False, frozenset({1}))
        assert lookups.lookup(on_b, "r") is False
        assert tracked_keys(lookups) == 0
        assert lookups.lookup(on_a, "r") is None  # its home is not lost: checked
        lookups.end_step()
        deadline = time.monotonic() + DEADLINE_S
        while lookups.lookup(on_a, "r") is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        lookups.fold_tally(counters)
        retries = counters[LookupAnswer.RETRY]
        assert retries >= 1
        assert counters[LookupAnswer.HIT] == 1
        assert counters[MissReason.STALLED] == 1 == counters[MissReason.LOST_ROOT]
        assert counters[LookupAnswer.MISS] == 2
        lookups.recheck(False, frozenset())
        assert lookups.lookup(on_a, "r") is True
        lookups.fold_tally(counters)
        assert counters[LookupAnswer.HIT] == 2 and counters[LookupAnswer.RETRY] == retries
    finally:
        lookups.shutdown()


def test_a_key_is_tracked_while_any_request_that_asked_it_is():
    """Two requests ask one key: it stays tracked until both are
    forgotten; a request id equal to the first's but another string is the
    same request (asked once, forgotten once)."""
    lookups = AsyncExistence(Checks(lambda key: True), 1)
    first = "request-" + str(1)
    same = "".join(["request-", "1"])
    assert same == first and same is not first
    try:
        assert lookups.lookup(b"k", first) is None
        lookups.end_step()
        deadline = time.monotonic() + DEADLINE_S
        while lookups.lookup(b"k", same) is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert lookups.lookup(b"k", "other") is True
        assert lookups.lookup(b"k", "third") is True
        lookups.forget_request(first)
        assert tracked_keys(lookups) == 1  # "other" and "third" still refer to it
        lookups.forget_request("other")
        assert tracked_keys(lookups) == 1
        assert lookups.lookup(b"k", first) is True  # asked again after it was forgotten
        lookups.forget_request("third")
        lookups.forget_request(same)
        assert tracked_keys(lookups) == 0
    finally:
        lookups.shutdown()
