"""I/O worker processes (io_workers > 0): the region handed over by fd, real
SIGKILLs and SIGSTOPs of workers, deadlines through the cancel board, and no
process left behind. No vLLM; real processes, real files."""

from __future__ import annotations

import ctypes
import errno
import glob
import itertools
import mmap
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from llmkv_fs.config import TierConfigError, TierSettings
from llmkv_fs.engine import Direction, Failure, FsEngine, Tally
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.workers import crew as crew_module
from llmkv_fs.engine.workers.crew import DEPTH, resolve_io_workers
from llmkv_fs.engine.workers.process_executor import ProcessExecutor
from llmkv_fs.engine.workers.region import NoHandover, find_handover
from llmkv_fs.layout.blockfile import verify_block
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume.leases import pid_alive
from tests.kits.engine_kit import (
    BS,
    DEADLINE_S,
    IDENTITY,
    Gate,
    fill,
    inside,
    make_key,
    pattern,
    round_trip,
    row,
    settle,
    wait_jobs,
    wait_until,
    worker_engine,
    workers_started,
    write_blocks,
)
from tests.kits.seal_kit import key_file

CHUNKS = 32


def memfd_primary(size: int = CHUNKS * BS) -> mmap.mmap:
    fd = os.memfd_create("llmkv_test_primary", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    primary = mmap.mmap(fd, size)
    os.close(fd)  # like vLLM after start-up: only the mapping is left
    return primary


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "vol")


def start(root, primary, workers=2, pause_dir: str | None = None, **extra) -> FsEngine:
    os.makedirs(root, exist_ok=True)
    settings = TierSettings.from_mapping({"root_dir": root, "io_workers": workers, **extra})
    pause = PausePoints(pause_dir) if pause_dir else None
    layout = CacheLayout.for_identity(root, IDENTITY)
    engine = FsEngine(settings, layout, primary, BS, pause=pause)
    assert engine.io_workers == workers
    return engine


def executor(engine: FsEngine) -> ProcessExecutor:
    assert isinstance(inside(engine).executor, ProcessExecutor)
    return inside(engine).executor


def in_flight(engine: FsEngine) -> int:
    return engine.gauges()["held_blocks"]


def store_all(engine, primary, ids, job_id=1):
    for i in ids:
        fill(primary, i, pattern(i))
    engine.submit_store(job_id, [make_key(i) for i in ids], list(ids))
    return wait_jobs(engine, [job_id])[job_id]


def test_round_trip_in_workers_and_nothing_left_behind(root):
    primary = memfd_primary()
    engine = start(root, primary)
    pids = executor(engine).worker_pids()
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    assert not store_all(engine, primary, range(8)).failed
    primary[:] = bytes(len(primary))
    engine.submit_load(2, [make_key(i) for i in range(8)], list(range(8)))
    assert not wait_jobs(engine, [2])[2].failed
    assert all(row(primary, i) == pattern(i) for i in range(8))
    assert engine.counters[Failure.ERROR] == 0
    engine.shutdown()
    assert not any(pid_alive(p) for p in pids)


def test_a_private_primary_falls_back_to_threads(root, caplog):
    os.makedirs(root)
    settings = TierSettings.from_mapping({"root_dir": root, "io_workers": 2})
    engine = FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), bytearray(4 * BS), BS)
    try:
        assert engine.io_workers == 0
        assert "I/O worker processes not used" in caplog.text
    finally:
        engine.shutdown()
    with pytest.raises(NoHandover):
        find_handover(memoryview(bytearray(4 * BS)))


def _segmented_primary(tmp_name: str, segments: int) -> tuple[mmap.mmap, int]:
    """vLLM's multi-segment layout: /dev/shm files mapped back to back with
    MAP_FIXED, names unlinked, only the first segment's fd kept open."""
    length = CHUNKS * BS // segments
    reserve = mmap.mmap(-1, CHUNKS * BS, flags=mmap.MAP_PRIVATE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(reserve))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    first_fd = -1
    for i in range(segments):
        path = f"/dev/shm/{tmp_name}.{i}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, length)
        got = libc.mmap(base + i * length, length, 3, mmap.MAP_SHARED | 0x10, fd, 0)
        assert got == base + i * length
        os.unlink(path)
        if i:
            os.close(fd)
        else:
            first_fd = fd
    return reserve, first_fd


@pytest.mark.skipif(os.geteuid() != 0, reason="later segments need /proc/self/map_files (root)")
def test_multi_segment_region_unlinked_like_vllms(root):
    primary, first_fd = _segmented_primary(f"llmkv_test_{os.getpid()}", 4)
    try:
        handover = find_handover(memoryview(primary))
        assert len(handover.fds) == 4 and len(handover.segments) == 4
        assert "fd" in handover.how and "map_files" in handover.how
        handover.close()
        engine = start(root, primary)
        try:
            ids = range(CHUNKS)  # every segment
            assert not store_all(engine, primary, ids).failed
            primary[:] = bytes(len(primary))
            engine.submit_load(2, [make_key(i) for i in ids], list(ids))
            assert not wait_jobs(engine, [2])[2].failed
            assert all(row(primary, i) == pattern(i) for i in ids)
        finally:
            engine.shutdown()
    finally:
        os.close(first_fd)


def _hold_all(engine, count):
    """SIGSTOP every worker; returns their pids (resume with _resume)."""
    pids = executor(engine).worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _resume(pids):
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)


def test_sigkill_fails_exactly_the_killed_workers_blocks_and_is_replaced(root):
    primary = memfd_primary()
    engine = start(root, primary)
    try:
        assert not store_all(engine, primary, range(4)).failed
        primary[:] = bytes(len(primary))
        procs = executor(engine)
        pids = _hold_all(engine, 2)
        keys = [make_key(i) for i in range(4)]
        engine.submit_load(2, keys, list(range(4)))
        # 2 workers x 2 places: every block is held by a stopped worker.
        wait_until(lambda: in_flight(engine) == 4, "all blocks dispatched")
        victim = procs._workers[0]
        victim_keys = {key for held in victim.held if held is not None for key in held.keys}
        assert len(victim_keys) == 2
        os.kill(victim.proc.pid, signal.SIGKILL)
        _resume(pids)
        job = wait_jobs(engine, [2])[2]
        # Exactly the victim's two blocks fail (worker_died); as a load keeps only
        # the prefix before its first failure, the blocks after it that other
        # workers did read are reported not loaded (skipped), never served.
        first = min(keys.index(k) for k in victim_keys)
        assert job.succeeded == keys[:first]
        assert set(job.failed) == set(keys[first:])
        assert engine.counters[Direction.LOAD, Failure.WORKER_DIED] == 2
        assert engine.counters[Direction.LOAD, Failure.SKIPPED] == len(keys) - first - 2
        for i in range(first):
            assert row(primary, i) == pattern(i)
        wait_until(lambda: len(procs.worker_pids()) == 2, "a replacement worker")
        assert pids[0] not in procs.worker_pids() and procs.deaths() == 1
        # What an operator sees: the death counted once, the crew whole again.
        engine.end_step()
        assert engine.counters[Tally.WORKER_DEATHS] == 1
        assert engine.gauges()["io_workers"] == 2
        # ENOSPC's headroom covers every block the workers can hold.
        held_most = 2 * DEPTH * inside(engine).slice_blocks
        assert engine.roots[0].guard.headroom_bytes == (held_most + 1) * BS
        # The tier keeps serving.
        engine.submit_load(3, keys, list(range(4)))
        assert not wait_jobs(engine, [3])[3].failed
    finally:
        engine.shutdown()


@pytest.fixture
def pause_dir(tmp_path):
    """A directory for the pause points of the engine (and workers) the test
    starts (``start(..., pause_dir=...)``)."""
    path = tmp_path / "pause"
    path.mkdir()
    return str(path)


def _fresh_gate(engine, pause_dir: str, point: str) -> Gate:
    """A closed gate for stores at ``point``, no block marked at it yet."""
    for name in os.listdir(pause_dir):
        os.unlink(os.path.join(pause_dir, name))
    return Gate(engine, pause_dir, kinds=("store",), point=point)


def test_sigkill_under_load_never_publishes_a_bad_file_or_hangs(root, pause_dir):
    primary = memfd_primary()
    engine = start(root, primary, workers=3, pause_dir=pause_dir)
    try:
        for i in range(CHUNKS):
            fill(primary, i, pattern(i))
        killed, jobs, keys_of, finished, stopped = 0, 0, {}, {}, []
        # Each round keeps every worker place busy with store blocks and
        # holds them still at a pause point: before the block's I/O
        # ("enter") or with its temp file written, right before the rename
        # ("publish"). The worker holding the first block there is
        # SIGKILLed; the others go on once the gate opens.
        for point in ("enter", "publish", "publish"):
            gate = _fresh_gate(engine, pause_dir, point)
            round_jobs = range(jobs, jobs + 2)
            for job in round_jobs:
                ids = [(job * 5 + i) % CHUNKS for i in range(5)]
                keys = [make_key((job, i)) for i in range(5)]
                keys_of.update({engine.roots[0].layout.block_path(k): k for k in keys})
                assert engine.submit_store(job, keys, ids)
            jobs += 2
            gate.wait_entered(1)
            place, _kind, key = gate.entries[0]
            os.kill(int(place.split(".")[0]), signal.SIGKILL)
            stopped.append(key)
            killed += 1
            gate.close_for_good()
            finished.update(wait_jobs(engine, round_jobs))
        failures = [k for j in finished.values() for k in j.failed]
        # Each victim held the block at the gate, and at most one more
        # (DEPTH places, one block each: too little is queued for slices).
        assert set(stopped) <= set(failures) and len(failures) <= killed * DEPTH
        assert engine.counters[Direction.STORE, Failure.WORKER_DIED] == len(failures)
        for key in failures:
            assert not os.path.exists(engine.roots[0].layout.block_path(key))
        for path in glob.glob(f"{engine.roots[0].layout.rank_dir}/*/*/*.bin"):
            with open(path, "rb") as f:
                data = memoryview(f.read())
            verify_block(data[:BS], data[BS:], keys_of[path], True)
    finally:
        engine.shutdown()


SENTINEL = b"\xaa"  # every row before the load: what vLLM's row held


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_dead_workers_load_leaves_zeros_in_every_row_it_held(root, pause_dir, tmp_path, sealed):
    """Worker processes only: an I/O thread cannot die in the middle of a
    block. The victim has read its slice's first block into the row (sealed:
    decrypted and authenticated there) and is held at the next block's read
    when it is SIGKILLed; by the time the job comes back failed, every row
    of every load block it held -- the one it read, the one it was reading,
    the slice waiting in its pipe -- holds zeros."""
    extra = {}
    if sealed:
        secrets = tmp_path / "secrets"
        secrets.mkdir()
        extra = {"seal_key_files": {"1": key_file(secrets)}}
    primary = memfd_primary()
    engine = start(root, primary, pause_dir=pause_dir, **extra)
    try:
        n = 16  # 2 workers x DEPTH places: the first slices take 2 blocks each
        keys = [make_key(i) for i in range(n)]
        assert not store_all(engine, primary, range(n)).failed
        primary[:] = SENTINEL * len(primary)
        gate = Gate(engine, pause_dir, kinds=("load",), point="read")
        gate.hold(keys[1])
        gate.open()
        assert engine.submit_load(2, keys, list(range(n)))
        wait_until(lambda: keys[1] in [key for _, _, key in gate.entries], "block 1 at its read")
        pid = int(next(place for place, _, key in gate.entries if key == keys[1]).split(".")[0])
        victim = next(w for w in executor(engine)._workers if w.proc and w.proc.pid == pid)
        wait_until(lambda: all(victim.held), "both of the victim's places taken")
        running = next(h for h in victim.held if h is not None and keys[1] in h.keys)
        assert list(running.keys[:2]) == keys[:2], "block 0 must run before block 1 in its slice"
        assert row(primary, 0) == pattern(0)  # read into the row, not reported yet
        held = [chunk for h in victim.held if h is not None for chunk in h.chunks]
        os.kill(pid, signal.SIGKILL)
        job = wait_jobs(engine, [2])[2]
        assert set(job.failed) == set(keys)  # block 0 failed: nothing of the job is served
        assert engine.counters[Direction.LOAD, Failure.WORKER_DIED] == len(held)
        gate.close_for_good()
        for chunk in held:
            assert row(primary, chunk) == bytes(BS), f"row {chunk} kept the dead worker's bytes"
    finally:
        engine.shutdown()


def test_a_store_past_its_deadline_is_never_published(root):
    primary = memfd_primary()
    engine = start(root, primary, job_timeout_s=0.2)
    pids = _hold_all(engine, 2)
    try:
        for i in range(2):
            fill(primary, i, pattern(i))
        keys = [make_key(("late", i)) for i in range(2)]
        engine.submit_store(1, keys, [0, 1])
        wait_until(lambda: in_flight(engine) == 2, "blocks dispatched")
        job = wait_jobs(engine, [1])[1]  # reported at the deadline, workers still stopped
        assert set(job.failed) == set(keys)
        assert inside(engine).recheck_stalled()
        _resume(pids)
        wait_until(lambda: in_flight(engine) == 0, "the cancelled blocks came back")
        assert not inside(engine).recheck_stalled()
        assert not any(os.path.exists(engine.roots[0].layout.block_path(k)) for k in keys)
        assert not glob.glob(f"{engine.roots[0].layout.rank_dir}/*/*/.*.tmp")
    finally:
        _resume(pids)
        engine.shutdown()


def test_a_load_past_its_deadline_waits_for_its_held_blocks(root):
    # Written without the engine: its 0.2 s deadline is for the load, not
    # for stores on a loaded machine.
    write_blocks(root, range(2))
    primary = memfd_primary()
    engine = start(root, primary, job_timeout_s=0.2)
    try:
        pids = _hold_all(engine, 2)
        engine.submit_load(2, [make_key(0), make_key(1)], [0, 1])
        wait_until(lambda: in_flight(engine) == 2, "blocks dispatched")
        wait_until(
            lambda: engine.take_finished() == [] and inside(engine).recheck_stalled(), "the stall"
        )
        assert engine.has_pending_work()  # not reported while a worker may still write the rows
        _resume(pids)
        job = wait_jobs(engine, [2])[2]
        assert job.failed  # cancelled in the worker before it started
    finally:
        engine.shutdown()


def test_a_load_stops_at_its_first_failed_block(root):
    primary = memfd_primary()
    engine = start(root, primary, workers=1)  # one worker holds at most 2 blocks
    try:
        ids = [i for i in range(10) if i != 2]
        assert not store_all(engine, primary, ids).failed
        keys = [make_key(i) for i in range(10)]
        engine.submit_load(2, keys, list(range(10)))
        job = wait_jobs(engine, [2])[2]
        # Block 2 is missing; when its failure came back the worker held at
        # most block 3 as well, so blocks 4.. were never read.
        assert {keys[2], *keys[4:]} <= set(job.failed) <= {keys[2], *keys[3:]}
        assert engine.counters[Direction.LOAD, Failure.MISSING] == 1
        assert engine.counters[Direction.LOAD, Failure.SKIPPED] >= 6
    finally:
        engine.shutdown()


def test_workers_die_with_their_engine_process(root):
    script = textwrap.dedent(
        f"""
        import mmap, os, sys
        from llmkv_fs.config import TierSettings
        from llmkv_fs.engine import FsEngine
        from llmkv_fs.layout.paths import CacheLayout
        from tests.kits.engine_kit import BS, IDENTITY, inside
        os.makedirs({root!r}, exist_ok=True)
        fd = os.memfd_create("p"); os.ftruncate(fd, 8 * BS)
        primary = mmap.mmap(fd, 8 * BS)
        settings = TierSettings.from_mapping({{"root_dir": {root!r}, "io_workers": 2}})
        engine = FsEngine(settings, CacheLayout.for_identity({root!r}, IDENTITY), primary, BS)
        print(*inside(engine).executor.worker_pids(), flush=True)
        sys.stdin.read()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        owner.kill()
        owner.wait()
        wait_until(lambda: not any(pid_alive(p) for p in pids), "workers to die with the owner")
    finally:
        owner.kill()
        owner.wait()


def test_io_workers_setting():
    assert resolve_io_workers("auto", cpus=2) == 0
    assert resolve_io_workers("auto", cpus=16) == 14
    assert resolve_io_workers("auto", cpus=128) == 16
    assert resolve_io_workers(3, cpus=2) == 3
    assert TierSettings.from_mapping({"root_dir": "/x"}).io_workers == "auto"
    for bad in (-1, 257, "many", True, 1.5):
        with pytest.raises(TierConfigError, match="io_workers"):
            TierSettings.from_mapping({"root_dir": "/x", "io_workers": bad})


# -- drifts found by an operator's tries (issue 18) -----------------------------------


class _CrewClock:
    """The crew's ``time``: the real clock, remembering each thread's last
    reading -- what the conductor computed a respawn time from, or compared
    it with."""

    def __init__(self):
        self.last: dict[int, float] = {}

    def monotonic(self) -> float:
        now = time.monotonic()
        self.last[threading.get_ident()] = now
        return now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_a_replacement_that_dies_at_start_up_is_counted_and_backs_off(root, monkeypatch):
    """Reproduced before: with the interpreter broken after start, one
    SIGKILLed worker led to 523 interpreter starts in 4 s, none counted.
    The backoff is read from the crew's own schedule (the pause it set
    before each replacement, and the clock reading each replacement started
    at), not from how long the test waited."""
    clock = _CrewClock()
    monkeypatch.setattr(crew_module, "time", clock)
    pauses: list[float] = []  # scheduled before each replacement, in order
    early: list[float] = []  # replacements started before their time (none)
    real_schedule, real_spawn = crew_module.Crew._schedule_respawn, crew_module.Crew.spawn

    def schedule(self, worker):
        real_schedule(self, worker)
        pauses.append(worker.respawn_at - clock.last[threading.get_ident()])

    def spawn(self, worker, selector):
        if worker.respawn_at is not None:  # a replacement: respawn_due read the clock
            due_in = worker.respawn_at - clock.last[threading.get_ident()]
            if due_in > 0:
                early.append(due_in)
        return real_spawn(self, worker, selector)

    monkeypatch.setattr(crew_module.Crew, "_schedule_respawn", schedule)
    monkeypatch.setattr(crew_module.Crew, "spawn", spawn)
    primary = memfd_primary()
    engine = start(root, primary)
    try:
        procs = executor(engine)
        started = workers_started(procs)
        monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # replacements cannot start
        os.kill(procs.worker_pids()[0], signal.SIGKILL)
        # The pauses, not the deaths: a death is counted (and logged) before
        # its replacement is scheduled.
        wait_until(lambda: len(pauses) >= 4, "three replacements to die")
        # Death 1 is the kill (a worker that had served: replaced at once);
        # replacements 1..3 die before their hello, each replaced after a
        # pause twice the last, from 0.1 s: never a tight loop.
        assert pauses[:4] == pytest.approx([0.0, 0.1, 0.2, 0.4]), pauses
        for before, after in itertools.pairwise(pauses[1:]):
            assert after == pytest.approx(min(crew_module._RESPAWN_MAX_PAUSE_S, 2 * before))
        assert early == []  # none started before its pause was over
        assert workers_started(procs) - started <= procs.deaths()  # no start uncounted
        engine.end_step()
        assert engine.counters[Tally.WORKER_DEATHS] == procs.deaths()
        monkeypatch.delenv("PYTHONHOME")
        wait_until(
            lambda: len(procs.worker_pids()) == 2,
            "a replacement once it can start",
            # After a pause that may have grown to its cap meanwhile.
            deadline_s=crew_module._RESPAWN_MAX_PAUSE_S + DEADLINE_S,
        )
        assert not store_all(engine, primary, range(4)).failed
    finally:
        engine.shutdown()


def test_shutdown_kills_a_stopped_worker_holding_a_block(root, monkeypatch):
    """Reproduced before: shutdown() still blocked after 30 s while a
    SIGSTOPped worker held a block (the docs promise SIGKILL after the grace)."""
    monkeypatch.setattr(crew_module, "STOP_GRACE_S", 1.0)
    primary = memfd_primary()
    engine = start(root, primary)
    pids = _hold_all(engine, 2)
    try:
        engine.submit_store(1, [make_key(i) for i in range(2)], [0, 1])
        wait_until(lambda: in_flight(engine) == 2, "blocks held by stopped workers")
        stopper = threading.Thread(target=engine.shutdown, daemon=True)
        stopper.start()
        stopper.join(DEADLINE_S)  # a hang bound: the grace is 1 s
        assert not stopper.is_alive(), "shutdown hangs on a stopped worker"
        assert not any(pid_alive(p) for p in pids)
        job = wait_jobs(engine, [1])[1]
        assert len(job.failed) == 2  # given back cancelled, never published
        assert engine.counters[Direction.STORE, Failure.CANCELLED] == 2
        assert not glob.glob(f"{engine.roots[0].layout.rank_dir}/*/*/*.bin")
    finally:
        _resume(pids)


def test_a_workers_death_does_not_make_good_blocks_miss(root):
    """Reproduced before: the blocks a dying worker held were failed as a
    generic error, which the negative cache keeps as a miss for
    failed_load_miss_s (60 s) although their files are fine."""
    primary = memfd_primary()
    engine = start(root, primary)
    try:
        assert not store_all(engine, primary, range(4)).failed
        pids = _hold_all(engine, 2)
        keys = [make_key(i) for i in range(4)]
        engine.submit_load(2, keys, list(range(4)))
        wait_until(lambda: in_flight(engine) == 4, "every block held")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        job = wait_jobs(engine, [2])[2]
        assert set(job.failed) == set(keys)
        assert engine.counters[Direction.LOAD, Failure.WORKER_DIED] == 4
        assert engine.counters[Direction.LOAD, Failure.ERROR] == 0
        wait_until(lambda: len(executor(engine).worker_pids()) == 2, "replacements")
        assert all(settle(engine, key, "next request") for key in keys)
        engine.submit_load(3, keys, list(range(4)))
        assert not wait_jobs(engine, [3])[3].failed
    finally:
        engine.shutdown()


def test_workers_import_the_engines_package_not_one_in_the_current_directory(tmp_path, monkeypatch):
    """``python -c`` puts the current directory first on a worker's path: an
    unrelated llmkv_fs there (another checkout) must not be what it runs."""
    decoy = tmp_path / "cwd" / "llmkv_fs"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy in the current directory')\n")
    monkeypatch.chdir(decoy.parent)
    engine, primary = worker_engine(str(tmp_path / "kv"), n_blocks=4)
    try:
        round_trip(engine, primary, 4)
    finally:
        engine.shutdown()


def _still_open(made: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Those of ``made`` (descriptor, its pipe) still open on the same pipe
    (a number another thread reused names another pipe)."""
    left = []
    for fd, target in made:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                left.append((fd, target))
        except OSError:
            continue  # closed
    return left


def test_a_worker_that_cannot_be_started_leaves_no_pipe_open(root, monkeypatch):
    """A respawn whose fork the system refuses (EAGAIN under memory pressure)
    is retried later: every failed start must close the pipes it made. The
    pipes counted are those this thread's spawns made (a count of the whole
    process's would race other threads)."""
    engine = start(root, memfd_primary())
    try:
        crew = executor(engine)._crew
        made: list[tuple[int, str]] = []
        me = threading.get_ident()
        real_pipe2 = os.pipe2

        def recorded(flags: int) -> tuple[int, int]:
            ends = real_pipe2(flags)
            if threading.get_ident() == me:
                made.extend((fd, os.readlink(f"/proc/self/fd/{fd}")) for fd in ends)
            return ends

        def refused(*args, **kwargs):
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

        monkeypatch.setattr(crew_module.os, "pipe2", recorded)
        monkeypatch.setattr(crew_module.subprocess, "Popen", refused)
        for _ in range(3):
            with pytest.raises(OSError, match="temporarily unavailable"):
                crew.spawn(crew.workers[0], selectors.DefaultSelector())
        assert made  # each spawn made its pipes before the fork was refused
        assert _still_open(made) == []
    finally:
        monkeypatch.undo()
        engine.shutdown()
