"""Files on the shared volume (``volume/files.py``): the retry loop for
transient shared-filesystem errors and a small file written atomically."""

from __future__ import annotations

import errno
import os

import pytest

from llmkv_fs.volume.files import (
    SHARED_FS_ATTEMPTS,
    UnsafeFileError,
    file_type,
    read_all,
    read_small_regular_file,
    retry_transient,
    write_all,
    write_file_atomically_at,
)


def flaky(failures: list[OSError]):
    """An operation that raises the given errors, one per call, then succeeds."""
    calls = []

    def operation():
        calls.append(len(calls))
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return "done"

    return operation, calls


def test_retry_rides_out_transient_errors():
    stale = OSError(errno.ESTALE, "Stale file handle")
    operation, calls = flaky([stale, FileNotFoundError(errno.ENOENT, "gone"), stale])
    recovered = []
    assert retry_transient(operation, recovered.append) == "done"
    assert len(calls) == 4 and len(recovered) == 3


def test_retry_gives_up_after_the_named_number_of_attempts():
    stale = OSError(errno.ESTALE, "Stale file handle")
    operation, calls = flaky([stale] * SHARED_FS_ATTEMPTS)
    with pytest.raises(OSError) as raised:
        retry_transient(operation, lambda exc: None)
    assert raised.value.errno == errno.ESTALE
    assert len(calls) == SHARED_FS_ATTEMPTS == 8


def test_retry_passes_other_errors_through_at_once():
    operation, calls = flaky([PermissionError(errno.EACCES, "no")])
    recovered = []
    with pytest.raises(PermissionError):
        retry_transient(operation, recovered.append)
    assert len(calls) == 1 and recovered == []


def test_a_failed_close_of_the_temp_file_is_not_closed_again(tmp_path, monkeypatch):
    """On NFS a close reports a lost writeback (EIO), yet has released the
    descriptor: closing the number again would close whatever another
    thread opened under it meanwhile."""
    closed: list[int] = []
    real_close = os.close

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)
        if len(closed) == 1:  # the temp file's close
            raise OSError(errno.EIO, "Input/output error")

    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        monkeypatch.setattr(os, "close", close)
        with pytest.raises(OSError) as raised:
            write_file_atomically_at(dir_fd, "config.json", b"{}", durable=False)
        monkeypatch.undo()
    finally:
        os.close(dir_fd)
    assert raised.value.errno == errno.EIO
    assert len(closed) == 1
    assert os.listdir(tmp_path) == []  # the temp file removed, nothing published


def test_file_type_names_each_kind_of_entry_once(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "f", tmp_path / "l")
    os.mkfifo(tmp_path / "p")
    kinds = {n: file_type(os.lstat(tmp_path / n).st_mode) for n in ("f", "d", "l", "p")}
    assert kinds == {"f": "file", "d": "directory", "l": "symlink", "p": "fifo"}
    assert file_type(os.stat("/dev/null").st_mode) == "char-device"


def test_a_small_file_that_is_not_regular_is_named_by_its_type(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(UnsafeFileError, match=r"not a regular file \(directory\)"):
        read_small_regular_file(str(tmp_path / "config.json"))


# -- whole-file vectored reads and writes: every buffer filled or written, a read a
# network filesystem splits followed up


def buffers(*sizes: int) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("file_size", [0, 1, 4095, 4096, 4097, 10000, 12288, 20000])
def test_read_all_fills_buffers_in_order_until_eof(tmp_path, file_size):
    data = os.urandom(file_size)
    path = tmp_path / "f"
    path.write_bytes(data)
    bufs = buffers(4096, 4096, 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = read_all(fd, bufs)
    finally:
        os.close(fd)
    assert n == min(file_size, 3 * 4096)
    assert b"".join(bytes(b) for b in bufs)[:n] == data[:n]


def test_read_all_follows_up_split_reads_unless_the_count_is_enough(tmp_path, monkeypatch):
    data = os.urandom(10000)
    path = tmp_path / "f"
    path.write_bytes(data)
    real_preadv = os.preadv
    calls = []

    def split_preadv(fd, bufs, offset):  # as FUSE or NFS may split a read
        calls.append(offset)
        first = bytearray(min(3000, sum(b.nbytes for b in bufs)))
        n = real_preadv(fd, [first], offset)
        view = memoryview(first)[:n]
        for b in bufs:
            take = min(b.nbytes, view.nbytes)
            b[:take] = view[:take]
            view = view[take:]
        return n

    monkeypatch.setattr(os, "preadv", split_preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = buffers(4096, 8192)
        assert read_all(fd, bufs) == 10000
        assert bytes(bufs[0]) + bytes(bufs[1][: 10000 - 4096]) == data
        assert calls == [0, 3000, 6000, 9000, 10000]
        calls.clear()
        assert read_all(fd, buffers(4096, 8192), enough={6000}) == 6000
        assert calls == [0, 3000]
    finally:
        os.close(fd)


def test_write_all_writes_every_buffer(tmp_path):
    parts = [os.urandom(n) for n in (5000, 1, 4096)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, [memoryview(p) for p in parts])
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)
