"""A network client's stale directory handle during a store (issue 21's
regression, found by CI on GlusterFS and NFS v3): a client that still caches
a directory another client removed or re-made hands out its old handle to
an ``O_PATH`` open, and every lookup in that handle answers ESTALE. Only a
real open revalidates it (FUSE_OPENDIR, NFS close-to-open). The store's
walk must then retry with real opens and land; it gave up after eight
identical ``O_PATH`` walks.

A local filesystem cannot stage a stale handle, so this is the one thing
imitated: ``os.open``/``os.mkdir`` as the walk beneath the root sees them
(``volume.beneath``) answer ESTALE for a lookup
relative to an ``O_PATH`` descriptor of the chosen directory, as the
network clients did. Everything else is real: BlockIO,
tmpfs-or-disk files, the bytes read back. The real races run in
test_matrix_races.py (GlusterFS) and test_gc_race.py (NFS).
"""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from llmkv_fs.engine.block import blockio as blockio_module
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.outcomes import Outcome
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume import beneath
from llmkv_fs.volume.files import SHARED_FS_ATTEMPTS
from tests.kits.engine_kit import BS, IDENTITY, make_key, pattern


def stage_os(monkeypatch, client) -> None:
    """``client`` as ``os`` wherever the walk beneath the root calls it: the
    walk and its one-level steps (beneath.py)."""
    monkeypatch.setattr(beneath, "os", client)


class CheckingOs:
    """``os`` with every call relative to a directory descriptor (and fstat)
    first passed through ``_check``, which raises what the network client
    would; subclasses say when."""

    def _check(self, fd: int | None) -> None:
        raise NotImplementedError

    def mkdir(self, path, mode=0o777, *, dir_fd=None):
        self._check(dir_fd)
        return os.mkdir(path, mode, dir_fd=dir_fd)

    def stat(self, path, *, dir_fd=None, follow_symlinks=True):
        self._check(dir_fd)
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    def fstat(self, fd):
        self._check(fd)
        return os.fstat(fd)

    def __getattr__(self, name):
        return getattr(os, name)


class StaleClient(CheckingOs):
    """``os`` as beneath.py uses it, with ``stale_dir`` (an absolute path)
    cached stale: an ``O_PATH`` descriptor of it resolves, but any name
    looked up through it fails with ESTALE; a real open revalidates it,
    unless ``repairable`` is False (the server keeps answering ESTALE).
    Counts the ESTALEs given."""

    def __init__(self, stale_dir: str, repairable: bool = True):
        self.stale_dir = stale_dir
        self.repairable = repairable
        self.stale_fds: set[int] = set()
        self.estales = 0

    def _check(self, dir_fd: int | None) -> None:
        if dir_fd in self.stale_fds and os.readlink(f"/proc/self/fd/{dir_fd}") == self.stale_dir:
            self.estales += 1
            raise OSError(errno.ESTALE, "Stale file handle")

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        self._check(dir_fd)
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        if (flags & os.O_PATH or not self.repairable) and os.readlink(
            f"/proc/self/fd/{fd}"
        ) == self.stale_dir:
            self.stale_fds.add(fd)
        else:
            self.stale_fds.discard(fd)
        return fd


@pytest.fixture
def blockio(tmp_path) -> BlockIO:
    layout = CacheLayout.for_identity(str(tmp_path / "kv"), IDENTITY)
    os.makedirs(layout.rank_dir)
    options = IoOptions(
        block_size=BS, use_o_direct=False, fsync_file=False, fsync_dir=False, checksum=True
    )
    io = BlockIO(layout, options)
    # The stale handle is staged in ``os`` as the walk calls it; the
    # one-call openat2 path (ctypes) would bypass it. On a real client that
    # call meets the same ESTALE and takes this walk: the walk is under test.
    io._below.one_call = False
    return io


@pytest.mark.parametrize("level", ["hhh", "rank"])
def test_a_store_through_a_stale_directory_handle_retries_with_real_opens(
    blockio, monkeypatch, level
):
    key = make_key(7)
    block_dir = os.path.dirname(blockio.layout.block_path(key))
    os.makedirs(block_dir)  # the directories exist; this client's handle is stale
    stale = os.path.dirname(block_dir) if level == "hhh" else blockio.layout.rank_dir
    client = StaleClient(os.path.realpath(stale))
    stage_os(monkeypatch, client)
    row = mmap.mmap(-1, BS)
    row[:] = pattern(7)

    assert blockio.store(key, memoryview(row)) is Outcome.WRITTEN
    assert client.estales == 1  # one stale walk, then a revalidating one
    with open(blockio.layout.block_path(key), "rb") as f:
        assert f.read(BS) == pattern(7)


def test_a_directory_that_stays_stale_fails_the_store_after_bounded_attempts(blockio, monkeypatch):
    """A handle no real open can repair (the server keeps answering ESTALE)
    costs the store, after SHARED_FS_ATTEMPTS walks: never a loop."""
    key = make_key(8)
    block_dir = os.path.dirname(blockio.layout.block_path(key))
    os.makedirs(block_dir)
    client = StaleClient(os.path.realpath(os.path.dirname(block_dir)), repairable=False)
    stage_os(monkeypatch, client)
    row = mmap.mmap(-1, BS)

    with pytest.raises(OSError) as failed:
        blockio.store(key, memoryview(row))
    assert failed.value.errno == errno.ESTALE
    assert client.estales == SHARED_FS_ATTEMPTS
    assert not os.listdir(block_dir)  # nothing left behind


class ReplacedBlockClient:
    """``os`` as blockio.py uses it, where the block file another writer had
    just published was replaced through another client meanwhile: access()
    still finds the name, the open of the old file (to read its trailer)
    answers ESTALE (once)."""

    def __init__(self, name: str):
        self.name = name
        self.estales = 0

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        if path == self.name and dir_fd is not None and not self.estales:
            self.estales += 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def __getattr__(self, name):
        return getattr(os, name)


def test_a_block_replaced_by_another_client_meanwhile_is_written_again(blockio, monkeypatch):
    key = make_key(9)
    row = mmap.mmap(-1, BS)
    row[:] = pattern(9)
    assert blockio.store(key, memoryview(row)) is Outcome.WRITTEN  # the other writer's
    client = ReplacedBlockClient(os.path.basename(blockio.layout.block_path(key)))
    monkeypatch.setattr(blockio_module, "os", client)

    assert blockio.store(key, memoryview(row)) is Outcome.WRITTEN
    assert client.estales == 1
    with open(blockio.layout.block_path(key), "rb") as f:
        assert f.read(BS) == pattern(9)


class StaleRootClient(CheckingOs):
    """``os`` as beneath.py uses it after the NFS server lost
    the handle of the root this thread holds open (a failover, a re-export):
    every lookup through that descriptor, and its fstat, answer ESTALE.
    Opening the root by its path again -- a full lookup, revalidated -- gives
    a good one."""

    def __init__(self, root_path: str, stale_fd: int):
        self.root_path = root_path
        self.stale_fd: int | None = stale_fd
        self.estales = 0

    def _check(self, fd: int | None) -> None:
        if fd is not None and fd == self.stale_fd:
            self.estales += 1
            raise OSError(errno.ESTALE, "Stale file handle")

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        self._check(dir_fd)
        if dir_fd is None and path == self.root_path:
            self.stale_fd = None  # the server hands out a fresh handle
        return os.open(path, flags, mode, dir_fd=dir_fd)


def test_a_root_handle_the_server_lost_is_opened_again_not_kept(blockio, monkeypatch):
    """Kept, a stale root descriptor failed every later store and made every
    load a miss until the tier restarted."""
    first, second = make_key(10), make_key(11)
    row = mmap.mmap(-1, BS)
    row[:] = pattern(10)
    assert blockio.store(first, memoryview(row)) is Outcome.WRITTEN
    below = blockio._below  # the thread's root descriptor is open by now
    client = StaleRootClient(below.path, below.root_fd())
    stage_os(monkeypatch, client)

    row[:] = pattern(11)
    assert blockio.store(second, memoryview(row)) is Outcome.WRITTEN  # a store walks...
    assert client.estales >= 1 and client.stale_fd is None
    client.stale_fd = below.root_fd()  # ...and so does a load, which never creates
    row[:] = bytes(BS)
    assert blockio.load(first, memoryview(row)) is Outcome.VERIFIED
    assert bytes(row) == pattern(10)
    assert client.stale_fd is None
