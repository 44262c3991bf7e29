"""One block, start to end: every check it passes before and while it moves
(``BlockStep``), and moving it between a primary-tier row and its file
(``BlockIO``). An I/O thread of the engine and an I/O worker process call
the same ``BlockStep.run``, so the two modes cannot drift apart.

The step's checks, in order: the job still wants the block (its cancel byte,
set once the deadline failed the job); the chunk index lies inside the
primary buffer (a memoryview slice would clamp silently and copy the wrong
bytes); root_dir is still the directory the tier started on (shared
``VolumeSignals``, one page per root); for a store, the space guard admits
it (both read from the root's ``VolumeSignals``, the page the engine's
housekeeping writes). Then the block moves (``BlockIO``) on the root its key
is placed on (a load also tries the key's second choice, see
``RootPlacement``). A store or load that finds its root lost underneath it
(pinned root, ``RootLost``: unmounted or replaced since the last
housekeeping check) fails ROOT_LOST (reason `volume_failed`) -- never remembered as a bad file,
and a load then tries the key's next choice; ENOSPC trips the space guard
right there, with the free space of that moment.

Threading: a ``BlockIO`` is shared by every I/O thread and lookup thread
of its process. It holds only immutable settings; the per-thread scratch
pages and root descriptors live in ``threading.local``. ``store`` and
``load`` run on I/O threads (or in a worker process), ``exists`` and
``exists_many`` on lookup threads, ``apply_access_stamps`` on the
housekeeping thread (or in an idle worker) -- never on the owner's: they
block on the filesystem.

Every name is resolved beneath the root (``volume.beneath``): a block is
first opened from the root's descriptor in one ``openat2`` call
(``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``) where the kernel has it, and so
is a store's directory once this process has made or found it
(``Beneath.open_dir``); any failure of that call, a store's directory not
yet known, and a store retried after its directory vanished take the walk:
the block's directory ``<rank>/<hhh>/<hh>_g<g>`` opened one component at a
time without following a link, the block and its temp file then opened,
renamed, stat'ed and unlinked relative to that directory's descriptor.
A symlink or a mount point where a directory of the tree belongs makes a
lookup a miss and a store or load fail
(``LinkInTree``, ``MountInTree``, counted ``link_in_tree``); nothing is
ever made, written or moved through it.

What the open file holds and how its bytes move -- the row and the
trailer written, the length, key and checksum checked on a load -- is
``BlockContents``' (block/contents.py): zero copy, the payload straight
between the caller's row (a slice of the page-aligned primary mmap) and the
file with ``pwritev``/``preadv``, the trailer in the same syscall from a
per-thread aligned page. Everything around the file -- resolving,
creating, renaming, quarantine, stamps -- is here. Sealed blocks (``options.sealed``) move
through ``SealedBytes`` instead (block/sealed.py: AES-256-GCM where the
checksum would be); a sealed block of a key this reader does not hold is a
``ForeignKey`` miss, never moved.

A BlockStep is shared by the I/O threads of one process; it holds no
mutable state of its own. ``run`` blocks on the filesystem and never raises.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import socket
import stat
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from llmkv_fs.engine.block.contents import BlockContents
from llmkv_fs.engine.block.options import O_DIRECT, IoOptions
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.presence import BlockPresence
from llmkv_fs.engine.block.stamps import AccessStamps
from llmkv_fs.engine.outcomes import (
    DEADLINE,
    SKIPPED,
    Abandoned,
    BlockMissing,
    BlockNotMoved,
    BlockOnLostRoot,
    BlockResult,
    Outcome,
    StoreRefused,
    failed,
)
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.upkeep.space import trip_on_enospc
from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError, Corruption
from llmkv_fs.layout.judgement import Judgement
from llmkv_fs.layout.names import block_place, store_place
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.volume.beneath import Beneath, MountInTree
from llmkv_fs.volume.files import (
    SHARED_FS_ATTEMPTS,
    create_exclusive,
    create_flags,
    missing_or_stale,
    needs_chmod,
)
from llmkv_fs.volume.pinned_root import RootLost
from llmkv_fs.volume.quarantine import file_ident, quarantine_at

if TYPE_CHECKING:
    from llmkv_fs.engine.block.bytes_c import CompiledSlices

__all__ = ["BlockIO", "BlockStep", "Cancel", "DirectoryGone", "StepRoot"]

# A job's cancel byte: nonzero once its deadline failed the job (the
# scheduler's ``IoJob.cancelled``, or a worker's byte of the cancel board).
Cancel = bytearray | memoryview

_PAGE = mmap.PAGESIZE
# A file a store finds is opened to read its trailer page: never through a
# symlink, never blocking on a FIFO, never O_DIRECT (one page, any offset).
_PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What a load refuses without calling the file bad (left in place).
_REFUSED = frozenset((Judgement.NO_CHECKSUM, Judgement.FOREIGN_KEY))
_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))
_E = TypeVar("_E", bound=BaseException)


class DirectoryGone(OSError):
    """The block's directory was removed (gc pruned it, another client
    removed it: ENOENT/ESTALE) between resolving it and creating the temp
    file in it. Nothing was written: the store resolves it again."""


class BlockIO:
    """One root's blocks: plain, or sealed with ``keyring``."""

    def __init__(self, layout: CacheLayout, options: IoOptions, keyring: Keyring | None = None):
        self.layout = layout
        self.options = options
        # What the file holds, written and checked (block/contents.py);
        # refuses a keyring that does not match options.sealed.
        self._contents = BlockContents(layout, options, keyring)
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._local = threading.local()
        # Every name below the root is resolved from the root's descriptor,
        # one component at a time, never through a link (volume.beneath).
        # Each process that builds a BlockIO opens its own descriptors.
        self._below = Beneath(layout.root_dir, options.root)
        self._rank = layout.rank_dir_rel
        self._temp_flags = create_flags(self._open_flags(os.O_WRONLY))
        self._chmod_files = needs_chmod(options.file_mode)
        # O_NONBLOCK: a FIFO planted at a block path must not hang an I/O
        # thread in open(); it fails in preadv instead (no effect on files).
        self._read_flags = self._open_flags(os.O_RDONLY | os.O_NONBLOCK)
        self._stamps = AccessStamps(self._below, self._rank)
        self._presence = BlockPresence(
            self._below, self._contents.valid_sizes, options.revalidate_misses, options.compiled
        )

    # -- per-thread scratch ------------------------------------------------

    def _scratch(self) -> memoryview:
        # Two pages: the trailer, plus one more so a read can tell a file
        # longer than payload + trailer from a correct one without fstat.
        scratch = getattr(self._local, "pages", None)
        if scratch is None:
            scratch = memoryview(mmap.mmap(-1, 2 * _PAGE))
            self._local.pages = scratch
            # The temp-name nonce: threading.get_native_id() is a gettid
            # syscall on every call, so it is taken once per thread.
            self._local.nonce = f"{threading.get_native_id():x}"
        return scratch

    def _open_flags(self, base: int) -> int:
        flags = base | os.O_NOFOLLOW | os.O_CLOEXEC
        return flags | O_DIRECT if self.options.use_o_direct else flags

    def release(self) -> None:
        """Close the calling thread's descriptor of the root (see
        Beneath.release)."""
        self._below.release()

    # -- queries -------------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        """A regular file of a size our reader accepts is at the block's path
        (see BlockPresence)."""
        return self._presence.at(*block_place(self._rank, key))

    def exists_many(self, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
        """``exists`` for each key, in order: in one compiled call without
        the GIL where ``checks_in_batches``; with ``budget_s``, possibly for
        the first keys only (see BlockPresence.many)."""
        return self._presence.many(self._rank, keys, budget_s)

    @property
    def checks_in_batches(self) -> bool:
        """``exists_many`` runs the compiled check (else ``exists`` per key)."""
        return self._presence.compiled

    # -- store -----------------------------------------------------------------

    def store(
        self,
        key: bytes,
        row: memoryview,
        cancelled: Cancel | None = None,
        pause: PausePoints | None = None,
    ) -> Outcome:
        """Publish ``row`` as the block file of ``key``: temp file named after
        this writer, optional fsync, rename -- all relative to the block's
        directory, resolved beneath the root and made as needed (a symlink
        on the way refuses the store: LinkInTree). Never leaves a partial
        file under the final name; removes its temp file on any failure.
        PRESENT when a block file this replica would load is there already;
        REPLACED when it wrote over a file it would not (``_found``).

        ``cancelled`` (the job's cancel byte) is read right before the
        rename: a job that passed its deadline meanwhile was already reported
        failed, and vLLM may have reused ``row``, so what was written must
        not be published (Abandoned). ``pause``: the "publish" pause point,
        reached right before that read (tests).
        """
        trailer = self._scratch()[:TRAILER_SIZE]
        rel_dir, name, tmp = store_place(self._rank, key, self._host, self._pid, self._local.nonce)
        attempts = SHARED_FS_ATTEMPTS
        after_race = False
        while True:
            try:
                return self._store_in(
                    rel_dir, name, tmp, key, row, trailer, cancelled, pause, after_race
                )
            except DirectoryGone:
                # gc removed the directory between our walk and the create
                # (nothing written yet): walk, and make it, again, opening
                # every level for real (a network client may still cache the
                # removed one: Beneath.open_dir).
                attempts -= 1
                if not attempts:
                    raise
                after_race = True

    def _store_in(
        self,
        rel_dir: str,
        name: str,
        tmp: str,
        key: bytes,
        row: memoryview,
        trailer: memoryview,
        cancelled: Cancel | None,
        pause: PausePoints | None,
        after_race: bool,
    ) -> Outcome:
        opts = self.options
        dir_fd = self._below.open_dir(
            rel_dir, create=True, dir_mode=opts.dir_mode, after_race=after_race
        )
        try:
            # access() answers "absent" without raising FileNotFoundError, the
            # common case here and measurably cheaper than lstat under the GIL.
            there = os.access(name, os.F_OK, dir_fd=dir_fd, follow_symlinks=False)
            if there:
                usable, there = self._found(dir_fd, name, key)
                if usable:
                    return Outcome.PRESENT
            fd = self._create_temp(dir_fd, tmp)
            try:
                try:
                    self._contents.write(fd, key, row, trailer)
                finally:
                    os.close(fd)
                if pause is not None:  # tests: a store written, not published yet
                    pause.reached("publish", "store", key)
                if cancelled is not None and cancelled[0]:
                    raise Abandoned(self.layout.block_path(key))
                try:
                    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except FileExistsError:
                    # Some shared filesystems refuse to rename over an existing
                    # name; names are content keys, so the file there is this block.
                    os.unlink(tmp, dir_fd=dir_fd)
                    return Outcome.PRESENT
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            if opts.fsync_dir:
                self._fsync_dir(dir_fd)
            return Outcome.REPLACED if there else Outcome.WRITTEN
        finally:
            os.close(dir_fd)

    def _create_temp(self, dir_fd: int, tmp: str) -> int:
        """A new temp file ``tmp`` in the directory open as ``dir_fd``
        (O_EXCL: never an existing name, never through a link), with exactly
        ``file_mode``. A leftover under our own temp name (a dead
        predecessor with our pid, or a link planted there) is unlinked
        itself and the create tried once more. DirectoryGone when the
        directory no longer exists: a descriptor of a removed directory
        creates nothing (the kernel answers ENOENT), so a store never lands
        in a directory gc took away."""
        mode = self.options.file_mode
        try:
            try:  # create_exclusive's first step, inline: once per block
                fd = os.open(tmp, self._temp_flags, mode, dir_fd=dir_fd)
            except FileExistsError:
                fd = create_exclusive(tmp, self._temp_flags, mode, True, dir_fd)
        except OSError as exc:
            if missing_or_stale(exc):
                raise DirectoryGone(exc.errno, exc.strerror, tmp) from exc
            raise
        if self._chmod_files:
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _found(self, dir_fd: int, name: str, key: bytes) -> tuple[bool, bool]:
        """What a store finds at the block's name: (a block file this
        replica would load, anything there). Judged by the file's size and
        trailer page alone (layout/judgement.py ``judge_trailer``): a file
        a load would find bad, or refuse and leave in place -- sealed with a
        key this replica does not hold, no checksum where it wants one -- is
        written over, so no such file keeps its key uncached (a retired
        seal key's blocks, or a planted file). A symlink, a non-regular file
        or a file behind a mount point is never opened through (O_NOFOLLOW,
        O_NONBLOCK, the root's device). A file gone meanwhile, or replaced
        by another writer's rename (ESTALE on a network client), is nothing."""
        try:
            fd = os.open(name, _PROBE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if missing_or_stale(exc):
                return False, False
            if exc.errno == errno.ELOOP:  # a symlink at the name: renamed over
                return False, True
            raise
        try:
            st = os.fstat(fd)
            n = st.st_size
            if (
                not stat.S_ISREG(st.st_mode)
                or n not in self._contents.valid_sizes
                or st.st_dev != self._below.root_dev()
            ):
                return False, True
            page = self._scratch()[:TRAILER_SIZE]
            if n > self.options.block_size:
                got = os.preadv(fd, [page], self.options.block_size)
                if got != TRAILER_SIZE:
                    return False, True
            judged = self._contents.rules.judge_trailer(key, page, n)
        except BlockFileError:
            return False, True
        except OSError as exc:
            if missing_or_stale(exc):
                return False, False
            raise
        finally:
            # A network client's close of a file another client replaced
            # meanwhile may answer ENOENT or ESTALE (FUSE's flush): nothing
            # was written through it, and Linux frees the descriptor anyway.
            with contextlib.suppress(OSError):
                os.close(fd)
        return judged not in _REFUSED, True

    @staticmethod
    def _fsync_dir(dir_fd: int) -> None:
        # The walk's descriptor is O_PATH (no fsync through it): open the
        # same directory for reading, relative to it.
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- load ------------------------------------------------------------------

    def load(self, key: bytes, row: memoryview) -> Outcome:
        """Read the block of ``key`` into ``row`` and verify it.

        Raises BlockMissing, BlockFileError (the file is bad: it has been
        moved to quarantine when this returns), LinkInTree (a symlink where
        a directory of the tree belongs: never followed) or OSError. On any
        raise the row holds garbage and must not be reported as loaded.
        """
        rel_dir, name = block_place(self._rank, key)
        scratch = self._scratch()
        below = self._below
        if below.one_call:  # the common case in one call; any failure takes the walk
            try:
                fd = below.open_file(f"{rel_dir}/{name}", self._read_flags)
            except MountInTree:
                raise  # final: the walk would not see a bind mount of the same device
            except OSError:
                pass
            else:
                return self._load_from(fd, -1, rel_dir, name, key, row, scratch)
        try:
            dir_fd = below.open_dir(rel_dir)
        except OSError as exc:
            if missing_or_stale(exc):
                raise BlockMissing(self.layout.block_path(key)) from exc
            raise
        try:
            fd = self._open_block_in(dir_fd, name, key)
            return self._load_from(fd, dir_fd, rel_dir, name, key, row, scratch)
        finally:
            os.close(dir_fd)

    def _open_block_in(self, dir_fd: int, name: str, key: bytes) -> int:
        try:
            return os.open(name, self._read_flags, dir_fd=dir_fd)
        except OSError as exc:
            if missing_or_stale(exc):
                raise BlockMissing(self.layout.block_path(key)) from exc
            if exc.errno == errno.ELOOP:  # a symlink planted at a block path
                link = BlockFileError(Corruption.SYMLINK, self.layout.block_path(key))
                link.left_because = "a symlink is never followed nor moved"
                raise link from exc
            raise

    def _load_from(
        self,
        fd: int,
        dir_fd: int,
        rel_dir: str,
        name: str,
        key: bytes,
        row: memoryview,
        scratch: memoryview,
    ) -> Outcome:
        """Read and check the block open as ``fd`` (closed here). A bad file
        is moved aside through ``dir_fd``, its directory (-1: opened now)."""
        try:
            try:
                outcome = self._contents.read(fd, key, row, scratch)
            except OSError as exc:
                # The file (or a directory above it) was removed through
                # another client -- gc on another node -- while this client
                # still had it cached: a clean miss (test_cross_client.py).
                if missing_or_stale(exc):
                    raise BlockMissing(self.layout.block_path(key)) from exc
                raise
            except BlockFileError as exc:
                bad, ident = exc, file_ident(os.fstat(fd))
            else:
                self.note_loaded((key,))
                return outcome
        finally:
            # A read-only descriptor: closing it can lose nothing, and a
            # GlusterFS client answers the close of a file removed through
            # another client with ESTALE (which would hide the outcome).
            # (try, not contextlib.suppress: three Python calls per block.)
            try:
                os.close(fd)
            except OSError:
                pass
        if dir_fd >= 0:
            self._set_aside(dir_fd, name, bad, ident)
            raise bad
        try:
            dir_fd = self._below.open_dir(rel_dir)
        except OSError as exc:
            bad.left_because = f"could not be moved aside: {exc}"
            raise bad from None
        try:
            self._set_aside(dir_fd, name, bad, ident)
        finally:
            os.close(dir_fd)
        raise bad

    def _set_aside(
        self, dir_fd: int, name: str, bad: BlockFileError, ident: tuple[int, int]
    ) -> None:
        """Quarantine the bad file ``name`` we read in ``dir_fd``; say in
        ``bad`` where it went or why it stayed."""
        try:
            bad.quarantined_to = self._quarantine_in(dir_fd, name, bad.reason, ident)
            if bad.quarantined_to is None:
                bad.left_because = "the path names another file by now"
        except OSError as exc:
            # Still a bad file (counted as such); the engine remembers the
            # key as a miss so new requests do not re-read it.
            bad.left_because = f"could not be moved aside: {exc}"

    def note_loaded(self, keys: Sequence[bytes]) -> None:
        """Blocks of ``keys`` were loaded (here, or by the compiled byte
        path): their access stamps, with ``stamp_access``."""
        if self.options.stamp_access:
            self._stamps.note(keys)

    def has_queued_stamps(self) -> bool:
        return self._stamps.pending()

    def apply_access_stamps(self) -> int:
        """Set atime and mtime of every block loaded since the last call to
        now (the housekeeping thread, or a worker process when idle; see
        AccessStamps). Returns the count."""
        return self._stamps.apply()

    def quarantine(
        self, path: str, reason: str, ident: tuple[int, int] | None = None
    ) -> str | None:
        """Move a bad block file aside so no lookup finds it again, unless
        ``path`` names another file by now than the one we read (a writer
        republished it meanwhile). Returns the new path, or None. ``path``
        (below the root) is resolved beneath the root: a file reached
        through a symlinked directory is never moved (LinkInTree)."""
        rel_dir, _, name = self._below.relative(path).rpartition("/")
        try:
            dir_fd = self._below.open_dir(rel_dir)
        except FileNotFoundError:
            return None
        try:
            return self._quarantine_in(dir_fd, name, reason, ident)
        finally:
            os.close(dir_fd)

    def _quarantine_in(
        self, dir_fd: int, name: str, reason: str, ident: tuple[int, int] | None
    ) -> str | None:
        try:
            return quarantine_at(
                self._below, self._rank, dir_fd, name, reason, ident, self.options.dir_mode
            )
        except FileNotFoundError:
            return None


# -- the step ------------------------------------------------------------------------------


def without_tracebacks(exc: _E) -> _E:
    """Drop the frames an exception holds: they reference the primary-buffer
    row being copied, and a result keeping that alive stops vLLM from
    unmapping the region at shutdown."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class StepRoot(NamedTuple):
    """One root as a block step sees it: how blocks move there, and its
    shared signals (lost? stores refused?)."""

    blockio: BlockIO
    signals: VolumeSignals


class BlockStep:
    """See the module doc. ``rows`` is the primary as one view of
    ``rows.nbytes // block_size`` rows; ``roots`` the engine's roots in
    list order and ``placement`` where a key lives among them; ``compiled``
    the compiled byte path for whole slices (block/bytes_c.py) where it can
    serve these roots. Built by ``block.spec.build_step`` in I/O threads and
    worker processes alike."""

    def __init__(
        self,
        roots: Sequence[StepRoot],
        rows: memoryview,
        placement: RootPlacement,
        pause: PausePoints | None = None,
        compiled: CompiledSlices | None = None,
    ):
        self.roots = tuple(roots)
        self.block_size = self.roots[0].blockio.options.block_size
        self.num_chunks = rows.nbytes // self.block_size
        self._rows = rows
        self._placement = placement
        self._one_root = len(self.roots) == 1  # every key's only choice: no placement
        self._pause = pause
        self._compiled = compiled

    def run(self, is_load: bool, key: bytes, chunk: int, cancelled: Cancel) -> BlockResult:
        """Move one block; its result (an Outcome, or a Failed naming why).
        ``cancelled``: the job's cancel byte (nonzero: not wanted any more)."""
        if self._pause is not None:  # tests: before every check, so a held block re-checks
            self._pause.reached("enter", "load" if is_load else "store", key)
        if cancelled[0]:
            return DEADLINE
        if not 0 <= chunk < self.num_chunks:
            message = f"chunk {chunk} outside the primary buffer (0..{self.num_chunks - 1})"
            return failed(IndexError(message))
        start = chunk * self.block_size
        row = self._rows[start : start + self.block_size]
        try:
            if is_load:
                return self._load(key, row)
            return self._store(key, row, cancelled)
        except Exception as exc:  # recorded per block; never ends a thread or worker
            return failed(without_tracebacks(exc))
        finally:
            try:
                row.release()
            except BufferError:  # a view still exported: freed with it
                pass

    def run_slice(
        self,
        is_load: bool,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        cancelled: Cancel,
        deadline: float = math.inf,
    ) -> list[BlockResult]:
        """``run`` for consecutive blocks of one job, in order. After a load
        fails the rest are SKIPPED without I/O: vLLM can use only the blocks
        before the first failure (the load prefix rule: scheduling/scheduler.py).
        ``deadline``: the job's ``time.monotonic()`` deadline (inf: none, or
        not known here -- a worker process, whose conductor keeps the deadline
        and sets the cancel byte); the compiled byte path runs the slice
        where it can. Never raises."""
        if self._compiled is not None:
            return self._compiled.run_slice(self, is_load, keys, chunks, cancelled, deadline)
        return self.run_each(is_load, keys, chunks, cancelled)

    def run_each(
        self, is_load: bool, keys: Sequence[bytes], chunks: Sequence[int], cancelled: Cancel
    ) -> list[BlockResult]:
        """``run_slice`` on the Python path: ``run`` for each block in
        order, the rest SKIPPED after a failed load. Never raises."""
        results: list[BlockResult] = []
        for key, chunk in zip(keys, chunks):
            result = self.run(is_load, key, chunk, cancelled)
            results.append(result)
            if is_load and not isinstance(result, Outcome):
                results += [SKIPPED] * (len(keys) - len(results))
                break
        return results

    def _load(self, key: bytes, row: memoryview) -> BlockResult:
        """From the block's home root, else its second choice (where it was
        written before the home root was added); a lost root is skipped."""
        first_error: BlockNotMoved | None = None
        for index in (0,) if self._one_root else self._placement.choices(key):
            blockio, signals = self.roots[index]
            if signals.root_lost:
                first_error = first_error or BlockOnLostRoot(blockio.layout.root_dir)
                continue
            if self._pause is not None:  # tests: a read the volume has not answered yet
                self._pause.reached("read", "load", key)
            try:
                return blockio.load(key, row)
            except BlockMissing as exc:
                first_error = first_error or exc
            except RootLost as exc:  # lost since the last housekeeping check
                lost = BlockOnLostRoot(blockio.layout.root_dir)
                lost.__cause__ = exc
                first_error = first_error or lost
        assert first_error is not None
        raise first_error

    def _store(self, key: bytes, row: memoryview, cancelled: Cancel) -> BlockResult:
        blockio, signals = self.roots[0 if self._one_root else self._placement.home(key)]
        lost, refused = signals.store_flags()
        if lost:
            raise BlockOnLostRoot(blockio.layout.root_dir)
        if refused:
            raise StoreRefused(signals.refusal)
        try:
            return blockio.store(key, row, cancelled, self._pause)
        except RootLost as exc:
            raise BlockOnLostRoot(blockio.layout.root_dir) from exc
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                trip_on_enospc(signals, blockio.layout.root_dir)
            raise
