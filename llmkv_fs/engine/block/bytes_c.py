"""The compiled byte path: an I/O thread's whole slice of one job stored or
loaded in one call that releases the GIL (``_bytepath.c``), so small
blocks do not pay the interpreter's per-block cost, nor wait for the GIL
between blocks while other threads hold it.

The compiled call is the Python path's common case and nothing more: per
block, the deadline, the chunk index, the block's file (a load) or
directory (a store; its fan-out levels made where missing, with exactly
the directory mode) opened beneath the root's descriptor in one
``openat2`` without links or mount crossings, the bytes moved as
``BlockContents`` moves them (whole, or in pieces hashed as they land), a
load judged as ``BlockRules.judge_plain`` judges it (length, magic, version,
the trailer's own xxh3, payload length, key, the payload's xxh3-64 with the
checksum on), a store written with the trailer ``pack_trailer`` writes,
under ``temp_name``, fsync'ed as the options say, its length checked, the
deadline asked again, then renamed. It stops at the first block it does not
settle -- a miss, a bad or sealed or checksum-less file, any errno,
anything at a store's name (``BlockIO._found`` judges that: PRESENT or
REPLACED), a passed deadline -- and that block runs through
``BlockStep.run``, the Python path, which does what it always does (the
walk, quarantine, miss reasons, the space guard); the call then resumes
with the block after it. A load block the compiled call did not verify is
never reported loaded: the Python path reads it again into its row. A
store published whose directory's fsync then failed fails with that
OSError, as ``BlockIO.store`` fails it (it is not stored again). After a
load fails, the rest of the slice is SKIPPED, as ``BlockStep.run_slice``.

It serves a slice when: the module is built, ``openat2`` works and no root
is sealed (``SealedBytes`` moves those), in an I/O thread (with the job's
deadline) and in a worker process alike (deadline inf: its conductor keeps
the deadline and sets the job's cancel byte). The ``compiled_io`` setting
off (``IoOptions.compiled``) keeps the Python path. A root lost or refusing
stores, or whose descriptor cannot be had, is left to the Python path,
checked before each call (the Python path checks before each block).
While a test has a block's pause point armed, every slice takes the Python
path, which stops at it.

Deadlines: ``deadline`` is the job's ``time.monotonic()`` deadline (inf:
none) and ``cancelled`` its cancel byte, both read before each block starts
and before each store's rename: a job the scheduler expired (its byte set,
whatever clock it keeps) or past its deadline starts and publishes nothing
more in the call, which stops; the Python path then reads the byte, as for
every block.

Threading: one ``CompiledSlices`` per ``BlockStep``, shared by its I/O
threads (a worker process builds its own); it holds only settings. Calls block on the filesystem.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol

from llmkv_fs.engine.block.blockio import BlockIO, Cancel
from llmkv_fs.engine.outcomes import SKIPPED, BlockResult, Outcome, failed
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.beneath import DIR_FLAGS, OPENAT2
from llmkv_fs.volume.files import needs_chmod

if TYPE_CHECKING:
    from llmkv_fs.engine.block.blockio import BlockStep, StepRoot
    from llmkv_fs.engine.block.pause import PausePoints

__all__ = [
    "COMPILED_BYTES",
    "STOPS",
    "CompiledSlices",
    "HasBlockIO",
    "Settled",
    "byte_path_line",
    "compiled_available",
    "compiled_slices",
]

# A cancel byte never set: a call made without a job's (tests, tools).
_WANTED = memoryview(bytes(1))
COMPILED_BYTES = "compiled (_bytepath: a job's slice in one call without the GIL, xxh3 {})"
# Why a compiled call stopped, by the code it answers (_bytepath.c, enum stop).
STOPS = (
    None,
    "deadline",
    "chunk",
    "key",
    "open",
    "read",
    "length",
    "trailer",
    "sealed",
    "payload-length",
    "wrong-key",
    "no-checksum",
    "checksum",
    "dir",
    "there",
    "create",
    "write",
    "fsync",
    "size",
    "close",
    "abandoned",
    "rename",
    "fsync-dir",
    "chmod",
)
# The pause points a block reaches (block/pause.py), as armed files.
_BLOCK_POINTS = ("armed.enter", "armed.read", "armed.publish")
_PUBLISHED = {ord("W"): Outcome.WRITTEN, ord("P"): Outcome.PRESENT}


def _built() -> ModuleType | None:
    try:  # optional: compiled by the package's install where it can be
        return importlib.import_module("llmkv_fs.engine.block._bytepath")
    except ImportError:
        return None


_BUILT = _built()


class HasBlockIO(Protocol):
    """A root as the engine or a step holds it."""

    @property
    def blockio(self) -> BlockIO: ...


def _refusal(roots: Sequence[HasBlockIO]) -> str | None:
    """Why the compiled path cannot serve these roots (None: it can)."""
    if not OPENAT2:
        return "no openat2 here"
    if _BUILT is None:
        return "the compiled _bytepath is not built: no C compiler at install"
    for root in roots:
        blockio = root.blockio
        if not isinstance(blockio, BlockIO):
            return "a BlockIO of another kind"
        if not blockio.options.compiled:
            return "compiled_io is off"
        if blockio.options.sealed:
            return "sealed blocks"
        if not blockio._below.one_call:
            return "a root without openat2"
    return None


def compiled_available() -> bool:
    """The compiled byte path is built and this kernel has openat2 (each
    root's own refusals aside: ``byte_path_line`` says those)."""
    return OPENAT2 and _BUILT is not None


def byte_path_line(roots: Sequence[HasBlockIO]) -> str:
    """Which byte path the engine's blocks take, for the start-up log (in
    I/O threads and worker processes alike)."""
    why = _refusal(roots)
    if why is not None:
        return f"python ({why})"
    assert _BUILT is not None
    return COMPILED_BYTES.format(_BUILT.XXH3)


def _armed(pause: PausePoints) -> bool:
    """A pause point a block stops at is armed (block/pause.py): the slice
    then takes the Python path, block by block, so that each block stops
    where the test holds it. Only tests set pause points."""
    try:
        names = os.listdir(pause.directory)
    except OSError:
        return True
    return any(name.startswith(_BLOCK_POINTS) for name in names)


class Settled(NamedTuple):
    """What one compiled call settled: the results of its first blocks, in
    order, and why it stopped at the next (``STOPS``; None: it did not) with
    that block's errno where one applies (0 otherwise)."""

    results: list[BlockResult]
    stop: str | None
    errno: int


class _Root:
    """One root as the compiled calls take it: fixed at build."""

    __slots__ = (
        "below",
        "blockio",
        "checksum",
        "chmod",
        "dir_chmod",
        "dir_flags",
        "dir_mode",
        "file_mode",
        "fsync_dir",
        "fsync_file",
        "host",
        "loaded",
        "pid",
        "piece",
        "prefix",
        "read_flags",
        "signals",
        "temp_flags",
    )

    def __init__(self, root: StepRoot):
        blockio = root.blockio
        opts = blockio.options
        self.blockio = blockio
        self.signals = root.signals
        self.below = blockio._below
        self.prefix = blockio._rank.encode("utf-8", "surrogateescape")
        self.read_flags = blockio._read_flags
        self.dir_flags = DIR_FLAGS
        self.dir_mode = opts.dir_mode
        self.dir_chmod = needs_chmod(opts.dir_mode)
        self.temp_flags = blockio._temp_flags
        self.file_mode = opts.file_mode
        self.chmod = needs_chmod(opts.file_mode)
        self.piece = opts.hash_chunk
        self.checksum = opts.checksum
        self.fsync_file = opts.fsync_file
        self.fsync_dir = opts.fsync_dir
        self.host = os.fsencode(blockio._host)
        self.pid = blockio._pid
        self.loaded = Outcome.VERIFIED if opts.checksum else Outcome.UNVERIFIED


def compiled_slices(
    roots: Sequence[StepRoot],
    rows: memoryview,
    placement: RootPlacement,
    pause: PausePoints | None,
) -> CompiledSlices | None:
    """The compiled path for a BlockStep of ``roots``, or None where it
    cannot serve them (see the module doc)."""
    if _refusal(roots) is not None:
        return None
    return CompiledSlices(roots, rows, placement, pause)


class CompiledSlices:
    """See the module doc. ``rows``: the BlockStep's primary buffer."""

    def __init__(
        self,
        roots: Sequence[StepRoot],
        rows: memoryview,
        placement: RootPlacement,
        pause: PausePoints | None = None,
    ):
        assert _BUILT is not None
        self._load = _BUILT.load_slice
        self._store = _BUILT.store_slice
        self._roots = tuple(_Root(root) for root in roots)
        self._rows = rows
        self._block_size = roots[0].blockio.options.block_size
        self._placement = placement
        self._pause = pause

    def run_slice(
        self,
        step: BlockStep,
        is_load: bool,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        cancelled: Cancel,
        deadline: float,
    ) -> list[BlockResult]:
        """``BlockStep.run_slice`` for these blocks: runs of blocks with
        one home root in compiled calls, each block a call stops at by
        ``step.run``; the whole slice by ``step`` while a pause point of
        a block is armed. Never raises."""
        if self._pause is not None and _armed(self._pause):
            return step.run_each(is_load, keys, chunks, cancelled)
        results: list[BlockResult] = []
        n = len(keys)
        start = 0
        while start < n:
            if not cancelled[0]:
                index, stop = self._run_of(keys, start)
                try:
                    settled = self.call(
                        is_load, index, keys, chunks, start, stop, deadline, cancelled
                    )
                except Exception:  # the Python path decides the block (and records why)
                    settled = Settled([], None, 0)
                results += settled.results
                start += len(settled.results)
                if start == stop:
                    continue
                if settled.stop == "fsync-dir":  # published, not durable: as BlockIO fails it
                    results.append(failed(OSError(settled.errno, os.strerror(settled.errno))))
                    start += 1
                    continue
            result = step.run(is_load, keys[start], chunks[start], cancelled)
            results.append(result)
            start += 1
            if is_load and not isinstance(result, Outcome):
                results += [SKIPPED] * (n - start)
                break
        return results

    def _run_of(self, keys: Sequence[bytes], start: int) -> tuple[int, int]:
        """The home root of ``keys[start]`` and the end of the run of keys
        from there with that home."""
        if len(self._roots) == 1:
            return 0, len(keys)
        home = self._placement.home
        index = home(keys[start])
        stop = start + 1
        while stop < len(keys) and home(keys[stop]) == index:
            stop += 1
        return index, stop

    def call(
        self,
        is_load: bool,
        index: int,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        start: int,
        stop: int,
        deadline: float,
        cancelled: Cancel = _WANTED,
    ) -> Settled:
        """One compiled call for ``keys[start:stop]`` on root ``index``;
        ``cancelled``: the job's cancel byte, read before each block and
        before each rename (with the deadline);
        nothing is called for a root lost or refusing stores. Raises what
        taking the root's descriptor raises (RootLost) and ValueError for
        arguments the module refuses."""
        root = self._roots[index]
        lost, refused = root.signals.store_flags()  # one call, both flags
        if lost or (not is_load and refused):
            return Settled([], None, 0)
        root_fd = root.below.root_fd()
        if is_load:
            return self._load_run(root, root_fd, keys, chunks, start, stop, deadline, cancelled)
        return self._store_run(root, root_fd, keys, chunks, start, stop, deadline, cancelled)

    def _load_run(
        self,
        root: _Root,
        root_fd: int,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        start: int,
        stop: int,
        deadline: float,
        cancelled: Cancel,
    ) -> Settled:
        done, why, code = self._load(
            root_fd,
            root.prefix,
            keys,
            chunks,
            start,
            stop,
            self._rows,
            self._block_size,
            root.read_flags,
            root.checksum,
            root.piece,
            deadline,
            cancelled,
        )
        if done:
            root.blockio.note_loaded(keys[start : start + done])
        return Settled([root.loaded] * done, STOPS[why], code)

    def _store_run(
        self,
        root: _Root,
        root_fd: int,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        start: int,
        stop: int,
        deadline: float,
        cancelled: Cancel,
    ) -> Settled:
        _, why, code, published = self._store(
            root_fd,
            root.prefix,
            keys,
            chunks,
            start,
            stop,
            self._rows,
            self._block_size,
            root.dir_flags,
            root.dir_mode,
            root.dir_chmod,
            root.temp_flags,
            root.file_mode,
            root.chmod,
            root.piece,
            root.checksum,
            root.fsync_file,
            root.fsync_dir,
            root.host,
            root.pid,
            deadline,
            cancelled,
        )
        return Settled([_PUBLISHED[c] for c in published], STOPS[why], code)
