"""The compiled byte path (engine/block/bytes_c.py, ``_bytepath.c``) against
the Python path it stands in for: the same ``BlockStep`` over real
``BlockIO``s and real files, a slice run once with the job's deadline (the
compiled path) and once without (the Python path), on two roots planted
alike. Stores must leave the same files (payload and trailer, the creation
time and the trailer's own checksum aside), modes and no temp file; loads
must give the same results, leave the same rows and do the same to every
planted bad file: truncated, a flipped payload bit, a flipped trailer bit,
another key's file, no checksum, a sealed trailer, too long, a symlink, a
FIFO, a directory, nothing. Each bad block is also one the compiled call
stops at (never reported loaded by it).

``LLMKV_FS_REQUIRE_COMPILED=1`` (set by .ci/run) makes a missing compiled
module a failure, as for the presence check.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from llmkv_fs.engine.block import bytes_c
from llmkv_fs.engine.block.blockio import BlockIO, BlockStep, StepRoot
from llmkv_fs.engine.block.bytes_c import CompiledSlices, byte_path_line, compiled_slices
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.outcomes import BlockResult, Failed, Outcome
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.layout.blockfile import TRAILER_SIZE, pack_trailer, unpack_trailer
from llmkv_fs.layout.names import block_place
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.beneath import OPENAT2
from tests.kits.compiled_kit import built, require_built
from tests.kits.engine_kit import IDENTITY, make_key

COMPILED_MODULE = "llmkv_fs.engine.block._bytepath"
BS = 16384
ROWS = 8


def _compiled_built() -> bool:
    return built(COMPILED_MODULE)


def test_the_compiled_byte_path_is_built_in_this_install():
    """``pip install -e .`` compiles it wherever a C compiler and Python's
    headers are; a wheel without it still installs (optional)."""
    require_built(COMPILED_MODULE)
    if OPENAT2:
        assert byte_path_line([]).startswith("compiled")


needs_compiled = pytest.mark.skipif(
    not (_compiled_built() and OPENAT2), reason="the compiled byte path is not built here"
)


def test_without_the_compiled_module_the_python_path_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, COMPILED_MODULE, None)  # its import fails
    monkeypatch.setattr(bytes_c, "_BUILT", bytes_c._built())
    assert byte_path_line([]).startswith("python")


def test_compiled_io_off_keeps_the_python_path(tmp_path):
    options = IoOptions(BS, use_o_direct=False, fsync_file=False, fsync_dir=False, checksum=True)
    side = Side(str(tmp_path), dataclasses.replace(options, compiled=False))
    try:
        assert side.step._compiled is None
        if OPENAT2 and _compiled_built():
            assert byte_path_line([StepRoot(side.blockio, side.signals)]) == (
                "python (compiled_io is off)"
            )
    finally:
        side.close()


def test_the_xxh3_is_python_xxhash_s():
    if not _compiled_built():
        pytest.skip("not built")
    import xxhash

    module = importlib.import_module(COMPILED_MODULE)
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 4096, 65536 + 7, 1 << 20):
        data = os.urandom(n)
        assert module.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), n


# -- two roots planted alike --------------------------------------------------


class Side:
    """One root, its BlockIO and a BlockStep over its own rows."""

    def __init__(self, base: str, options: IoOptions):
        self.root = os.path.join(base, "root")
        os.makedirs(self.root)
        self.layout = CacheLayout.for_identity(self.root, IDENTITY)
        self.blockio = BlockIO(self.layout, options)
        self.signals = VolumeSignals.create("test_bytes_c")
        self.rows = memoryview(bytearray(BS * ROWS))
        roots, placement = [StepRoot(self.blockio, self.signals)], RootPlacement([self.root])
        compiled = compiled_slices(roots, self.rows, placement, None)
        self.step = BlockStep(roots, self.rows, placement, None, compiled)

    def path(self, key: bytes) -> str:
        rel_dir, name = block_place(self.layout.rank_dir_rel, key)
        return os.path.join(self.root, rel_dir, name)

    def files(self) -> dict[str, bytes]:
        """Every file below the root (quarantine included) by its path below
        the root, the quarantine's time suffix dropped; and every
        directory's mode."""
        found = {}
        for top, dirs, names in os.walk(self.root):
            for name in dirs:
                path = os.path.join(top, name)
                mode = stat.S_IMODE(os.lstat(path).st_mode)
                found[os.path.relpath(path, self.root) + "/"] = b"mode:%o" % mode
            for name in names:
                path = os.path.join(top, name)
                rel = os.path.relpath(path, self.root)
                if ".quarantine" in rel:
                    rel = rel.rsplit(".", 1)[0]
                if os.path.islink(path):
                    found[rel] = b"link:" + os.fsencode(os.readlink(path))
                elif stat.S_ISREG(os.lstat(path).st_mode):
                    with open(path, "rb") as f:
                        found[rel] = without_times(f.read())
                else:
                    found[rel] = b"special"
        return found

    def close(self) -> None:
        self.signals.close()
        self.rows.release()


@pytest.fixture
def sides(tmp_path) -> Iterator[Callable[..., tuple[Side, Side]]]:
    made: list[Side] = []

    def make(checksum: bool = True, hash_chunk: int = 0) -> tuple[Side, Side]:
        options = IoOptions(
            block_size=BS,
            use_o_direct=False,
            fsync_file=True,
            fsync_dir=True,
            checksum=checksum,
            hash_chunk=hash_chunk,
        )
        pair = (Side(str(tmp_path / "c"), options), Side(str(tmp_path / "py"), options))
        made.extend(pair)
        return pair

    yield make
    for side in made:
        side.close()


def always() -> bytearray:
    """A job's cancel byte, not set: the job is wanted."""
    return bytearray(1)


def compiled(side: Side, is_load: bool, keys, chunks) -> list[BlockResult]:
    """The slice through the compiled path (the job's deadline given)."""
    assert side.step._compiled is not None
    return side.step.run_slice(is_load, keys, chunks, always(), math.inf)


def python(side: Side, is_load: bool, keys, chunks) -> list[BlockResult]:
    """The same slice through the Python path."""
    return side.step.run_each(is_load, keys, chunks, always())


def shown(results: list[BlockResult]) -> list[object]:
    """Results as comparable values: an Outcome, or a failure's reason, its
    error's type and corruption reason."""
    return [
        r
        if isinstance(r, Outcome)
        else (r.reason, type(r.error).__name__, str(getattr(r.error, "reason", "")))
        for r in results
    ]


def fill(rows: memoryview, i: int) -> None:
    rows[i * BS : (i + 1) * BS] = bytes([(i * 37 + j) % 251 for j in range(256)]) * (BS // 256)


def without_times(data: bytes) -> bytes:
    """A block file with its trailer's creation time and own checksum
    zeroed (the two sides wrote theirs at different times)."""
    if len(data) < BS + 42:
        return data
    page = bytearray(data[BS : BS + TRAILER_SIZE])
    page[32:40] = bytes(8)
    end = 42 + min(int.from_bytes(page[40:42], "little"), TRAILER_SIZE - 50)
    page[end : end + 8] = bytes(len(page[end : end + 8]))
    return data[:BS] + bytes(page) + data[BS + TRAILER_SIZE :]


STORE_CASES = [(True, 0), (True, 4096), (False, 0)]


@needs_compiled
@pytest.mark.parametrize(("checksum", "hash_chunk"), STORE_CASES)
def test_stores_leave_the_same_files(sides, checksum, hash_chunk):
    c, py = sides(checksum, hash_chunk)
    keys = [make_key(i) for i in range(ROWS)]
    for side in (c, py):
        for i in range(ROWS):
            fill(side.rows, i)
    assert compiled(c, False, keys, range(ROWS)) == [Outcome.WRITTEN] * ROWS
    assert python(py, False, keys, range(ROWS)) == [Outcome.WRITTEN] * ROWS
    for key in keys:
        with open(c.path(key), "rb") as f:
            ours = f.read()
        with open(py.path(key), "rb") as f:
            theirs = f.read()
        assert len(ours) == BS + TRAILER_SIZE
        assert unpack_trailer(ours[BS:]).key == key  # its own checksum checks
        assert without_times(ours) == without_times(theirs)
        assert os.stat(c.path(key)).st_mode == os.stat(py.path(key)).st_mode
    assert c.files() == py.files()  # the same directories, no temp file left
    # and each side loads the other's blocks
    for side in (c, py):
        side.rows[:] = bytes(BS * ROWS)
    expected = Outcome.VERIFIED if checksum else Outcome.UNVERIFIED
    assert compiled(c, True, keys, range(ROWS)) == [expected] * ROWS
    assert python(py, True, keys, range(ROWS)) == [expected] * ROWS
    assert bytes(c.rows) == bytes(py.rows)
    for i in range(ROWS):
        fill(py.rows, i)
    assert bytes(c.rows) == bytes(py.rows)


@needs_compiled
def test_a_store_that_finds_a_file_is_the_python_paths(sides):
    """A good block there is PRESENT, a bad file or a symlink is written
    over (REPLACED); the compiled call leaves each to BlockIO's probe."""
    c, py = sides()
    keys = [make_key(i) for i in range(4)]
    for side in (c, py):
        for i in range(4):
            fill(side.rows, i)
        python(side, False, keys[:1], [0])  # a good block at key 0
        for key, plant in ((keys[1], "bad"), (keys[2], "link")):
            path = side.path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if plant == "bad":
                with open(path, "wb") as f:
                    f.write(b"x" * 100)
            else:
                os.symlink("/etc/passwd", path)
    got = compiled(c, False, keys, range(4))
    assert got == python(py, False, keys, range(4))
    assert got == [Outcome.PRESENT, Outcome.REPLACED, Outcome.REPLACED, Outcome.WRITTEN]
    assert sorted(c.files()) == sorted(py.files())


def plant(side: Side, key: bytes, other: bytes, case: str) -> None:
    """Make the file at ``key``'s place what ``case`` says, from good
    blocks of ``key`` and ``other`` stored before."""
    path = side.path(key)
    with open(path, "rb") as f:
        good = f.read()
    with open(side.path(other), "rb") as f:
        others = f.read()
    if case == "good":
        return
    os.unlink(path)
    if case == "truncated":
        data = good[: BS + 100]
    elif case == "payload-bit":
        data = bytes([good[0] ^ 1]) + good[1:]
    elif case == "trailer-bit":
        data = good[:BS] + bytes([good[BS] ^ 1]) + good[BS + 1 :]
    elif case == "wrong-key":
        data = others
    elif case == "oversize":
        data = good + b"\0" * 4096
    elif case in ("no-checksum", "sealed"):
        page = memoryview(bytearray(TRAILER_SIZE))
        pack_trailer(page, key, BS, None, time.time_ns())
        data = good[:BS] + bytes(page)
        if case == "sealed":  # version 2 with a valid own checksum
            import xxhash

            raw = bytearray(data[BS:])
            raw[8:10] = (2).to_bytes(2, "little")
            end = 42 + len(key)
            raw[end : end + 8] = xxhash.xxh3_64_intdigest(bytes(raw[:end])).to_bytes(8, "little")
            data = good[:BS] + bytes(raw)
    elif case == "symlink":
        os.symlink(os.path.relpath(side.path(other), os.path.dirname(path)), path)
        return
    elif case == "fifo":
        os.mkfifo(path)
        return
    elif case == "directory":
        os.mkdir(path)
        return
    elif case == "missing":
        return
    else:
        raise AssertionError(case)
    with open(path, "wb") as f:
        f.write(data)


LOAD_CASES = [
    "good",
    "truncated",
    "payload-bit",
    "trailer-bit",
    "wrong-key",
    "oversize",
    "no-checksum",
    "sealed",
    "symlink",
    "fifo",
    "directory",
    "missing",
]


@needs_compiled
@pytest.mark.parametrize("hash_chunk", [0, 4096])
@pytest.mark.parametrize("case", LOAD_CASES)
def test_loads_of_planted_files_are_judged_as_the_python_path(sides, case, hash_chunk):
    """Blocks 0 and 1 good, block 2 planted, block 3 good: both paths load
    0 and 1, judge 2 alike and skip 3 (or load it, when 2 is good), leave
    the same rows and the same files (quarantine included)."""
    c, py = sides(True, hash_chunk)
    keys = [make_key(i) for i in range(4)]
    for side in (c, py):
        for i in range(4):
            fill(side.rows, i)
        assert python(side, False, keys, range(4)) == [Outcome.WRITTEN] * 4
        plant(side, keys[2], keys[3], case)
        side.rows[:] = b"\xee" * (BS * ROWS)
    if case != "good":  # the compiled call itself stops at the planted block
        slices = c.step._compiled
        assert slices is not None
        settled = slices.call(True, 0, keys, list(range(4, 8)), 0, 4, math.inf)
        assert len(settled.results) == 2 and settled.stop is not None
        c.rows[:] = b"\xee" * (BS * ROWS)
    got = compiled(c, True, keys, range(4))
    assert shown(got) == shown(python(py, True, keys, range(4)))
    if case == "good":
        assert got == [Outcome.VERIFIED] * 4
    else:
        assert got[:2] == [Outcome.VERIFIED] * 2 and not isinstance(got[2], Outcome)
    assert bytes(c.rows) == bytes(py.rows)
    assert c.files() == py.files()


def _three_rows(sides) -> tuple[Side, list[bytes], CompiledSlices]:
    """A compiled side with rows 0-2 filled, their keys, and its compiled slices."""
    c, _ = sides()
    keys = [make_key(i) for i in range(3)]
    for i in range(3):
        fill(c.rows, i)
    slices = c.step._compiled
    assert slices is not None
    return c, keys, slices


@needs_compiled
def test_a_set_cancel_byte_stops_the_call_before_its_deadline(sides):
    """The scheduler expires a job by its own clock and sets its cancel byte:
    the compiled call reads it before each block, so nothing of the job is
    started or published, whatever the deadline it was given says."""
    c, keys, slices = _three_rows(sides)
    settled = slices.call(False, 0, keys, [0, 1, 2], 0, 3, math.inf, bytearray(b"\x01"))
    assert settled.results == [] and settled.stop == "deadline"
    assert not any(os.path.exists(c.path(k)) for k in keys)
    # The same slice of a job still wanted: stored.
    assert c.step.run_slice(False, keys, [0, 1, 2], bytearray(1), math.inf) == [Outcome.WRITTEN] * 3


@needs_compiled
def test_a_passed_deadline_leaves_the_blocks_to_the_cancel_byte(sides):
    """The compiled call starts no block after the deadline; the Python
    path then reads the job's cancel byte: blocks of a job not yet expired
    still move, those of an expired one do not."""
    c, keys, slices = _three_rows(sides)
    settled = slices.call(False, 0, keys, [0, 1, 2], 0, 3, time.monotonic() - 1)
    assert settled.results == [] and settled.stop == "deadline"
    past = time.monotonic() - 1
    assert c.step.run_slice(False, keys, [0, 1, 2], always(), past) == [Outcome.WRITTEN] * 3
    expired = c.step.run_slice(True, keys, [0, 1, 2], bytearray(b"\x01"), past)
    assert [r.reason.value for r in expired if isinstance(r, Failed)] == [
        "deadline",
        "skipped",
        "skipped",
    ]


@needs_compiled
def test_a_lost_root_is_the_python_paths(sides):
    c, py = sides()
    keys = [make_key(i) for i in range(2)]
    for side in (c, py):
        side.signals.root_lost = True
    assert shown(compiled(c, False, keys, [0, 1])) == shown(python(py, False, keys, [0, 1]))
    assert shown(compiled(c, True, keys, [0, 1])) == shown(python(py, True, keys, [0, 1]))


def test_the_engine_says_which_byte_path_runs(engines, caplog, tmp_path):
    """The start-up line: compiled where it is built, in I/O threads and
    worker processes alike."""
    with caplog.at_level(logging.INFO, logger="vllm.llmkv_fs.engine"):
        engines(str(tmp_path / "kv"))
    (line,) = [r.getMessage() for r in caplog.records if "byte path" in r.getMessage()]
    if _compiled_built() and OPENAT2:
        assert "compiled" in line
