"""The per-block step (engine/block/blockio.py) on its own, with stand-in
``BlockIO``s and real ``VolumeSignals`` pages: every check a block passes
before and while it moves, and that a step never raises. The same step runs
in I/O threads and worker processes (tests/engine/test_executor_parity.py
proves both modes through the engine)."""

from __future__ import annotations

import errno

import pytest

from llmkv_fs.engine.block.blockio import BlockStep, StepRoot
from llmkv_fs.engine.outcomes import DEADLINE, SKIPPED, BlockMissing, Failure, Outcome
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.pinned_root import RootLost

BS = 4096


class Options:
    block_size = BS


class Layout:
    def __init__(self, root_dir: str):
        self.root_dir = root_dir


class FakeBlockIO:
    """Answers loads from ``blocks`` (else BlockMissing) and stores into it;
    ``fail_with`` is raised by every call instead."""

    def __init__(self, root_dir: str, fail_with: BaseException | None = None):
        self.options = Options()
        self.layout = Layout(root_dir)
        self.blocks: dict[bytes, bytes] = {}
        self.fail_with = fail_with
        self.calls: list[tuple[str, bytes]] = []

    def load(self, key: bytes, row: memoryview) -> Outcome:
        self.calls.append(("load", key))
        if self.fail_with is not None:
            raise self.fail_with
        if key not in self.blocks:
            raise BlockMissing(key.hex())
        row[:] = self.blocks[key]
        return Outcome.VERIFIED

    def store(self, key: bytes, row: memoryview, cancelled, pause) -> Outcome:
        self.calls.append(("store", key))
        if self.fail_with is not None:
            raise self.fail_with
        self.blocks[key] = bytes(row)
        return Outcome.WRITTEN


@pytest.fixture
def signals():
    made: list[VolumeSignals] = []

    def make() -> VolumeSignals:
        made.append(VolumeSignals.create("test_step"))
        return made[-1]

    yield make
    for page in made:
        page.close()


def step_over(ios, signals, n_rows: int = 4) -> tuple[BlockStep, memoryview]:
    rows = memoryview(bytearray(BS * n_rows))
    roots = [StepRoot(io, signals()) for io in ios]
    placement = RootPlacement([io.layout.root_dir for io in ios])
    return BlockStep(roots, rows, placement), rows


WANTED = bytearray(1)  # a job's cancel byte, never set


def key_homed_on(placement: RootPlacement, index: int) -> bytes:
    return next(
        k for i in range(1000) if placement.home(k := bytes([i % 256, i // 256]) * 18) == index
    )


def test_a_block_its_job_no_longer_wants_moves_nothing(signals):
    io = FakeBlockIO("/r0")
    step, _ = step_over([io], signals)
    assert step.run(False, b"k" * 36, 0, bytearray(b"\x01")) is DEADLINE
    assert io.calls == []


def test_a_chunk_outside_the_primary_buffer_fails_without_io(signals):
    io = FakeBlockIO("/r0")
    step, _ = step_over([io], signals, n_rows=4)
    for chunk in (-1, 4):
        result = step.run(True, b"k" * 36, chunk, WANTED)
        assert result.reason is Failure.ERROR and isinstance(result.error, IndexError)
    assert io.calls == []


def test_a_store_then_a_load_move_the_rows_bytes(signals):
    io = FakeBlockIO("/r0")
    step, rows = step_over([io], signals)
    rows[BS : 2 * BS] = b"\x07" * BS
    assert step.run(False, b"k" * 36, 1, WANTED) is Outcome.WRITTEN
    assert step.run(True, b"k" * 36, 3, WANTED) is Outcome.VERIFIED
    assert bytes(rows[3 * BS :]) == b"\x07" * BS


def test_a_lost_root_fails_volume_failed_untouched(signals):
    io = FakeBlockIO("/r0")
    step, _ = step_over([io], signals)
    step.roots[0].signals.root_lost = True
    assert step.run(False, b"k" * 36, 0, WANTED).reason is Failure.ROOT_LOST
    assert step.run(True, b"k" * 36, 0, WANTED).reason is Failure.ROOT_LOST
    assert io.calls == []


def test_refused_stores_fail_space_and_loads_still_run(signals):
    io = FakeBlockIO("/r0")
    step, _ = step_over([io], signals)
    step.roots[0].signals.set_refused(over_watermark=True)
    assert step.run(False, b"k" * 36, 0, WANTED).reason is Failure.SPACE
    assert step.run(True, b"k" * 36, 0, WANTED).reason is Failure.MISSING
    assert io.calls == [("load", b"k" * 36)]


def test_a_load_tries_the_second_choice_when_home_misses_or_is_gone(signals):
    home, second = FakeBlockIO("/r0"), FakeBlockIO("/r1")
    step, _ = step_over([home, second], signals)
    placement = RootPlacement(["/r0", "/r1"])
    key = key_homed_on(placement, 0)
    second.blocks[key] = b"\x01" * BS
    assert step.run(True, key, 0, WANTED) is Outcome.VERIFIED  # home missed
    home.fail_with = RootLost(errno.ENOENT, "root gone", "/r0")
    assert step.run(True, key, 0, WANTED) is Outcome.VERIFIED  # home gone since last check
    del second.blocks[key]
    assert step.run(True, key, 0, WANTED).reason is Failure.ROOT_LOST  # the first error


def test_enospc_trips_the_space_guard_of_that_root_only(signals, tmp_path):
    full, other = FakeBlockIO(str(tmp_path)), FakeBlockIO(str(tmp_path))
    full.fail_with = OSError(errno.ENOSPC, "No space left on device")
    step, _ = step_over([full, other], signals)
    placement = RootPlacement([full.layout.root_dir, "/r1"])
    key = key_homed_on(placement, 0)
    assert step.run(False, key, 0, WANTED).reason is Failure.ERROR
    assert step.roots[0].signals.stores_refused and step.roots[0].signals.enospc
    assert not step.roots[1].signals.stores_refused


def test_any_exception_is_the_blocks_result_and_never_escapes(signals):
    io = FakeBlockIO("/r0", fail_with=RuntimeError("a byte path that throws"))
    step, _ = step_over([io], signals)
    result = step.run(True, b"k" * 36, 0, WANTED)
    assert result.reason is Failure.ERROR and result.error.__traceback__ is None


def test_after_a_failed_load_the_rest_of_the_slice_is_skipped_without_io(signals):
    io = FakeBlockIO("/r0")
    step, _ = step_over([io], signals)
    keys = [bytes([i]) * 36 for i in range(3)]
    io.blocks[keys[0]] = b"\x02" * BS
    results = step.run_slice(True, keys, [0, 1, 2], WANTED)
    assert results[0] is Outcome.VERIFIED and results[1].reason is Failure.MISSING
    assert results[2] is SKIPPED
    assert [k for _, k in io.calls] == keys[:2]
