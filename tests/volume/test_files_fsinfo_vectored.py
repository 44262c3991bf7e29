"""The small helpers the engine and the ops tools share from the layout
room: the mount table, statvfs usage, whole-file vectored reads and writes,
and the retry loop for transient shared-filesystem errors."""

from __future__ import annotations

import errno
import os

import pytest

from llmkv_fs.volume import fsinfo
from llmkv_fs.volume.files import (
    SHARED_FS_ATTEMPTS,
    UnsafeFileError,
    file_type,
    read_small_regular_file,
    retry_transient,
    write_file_atomically_at,
)
from llmkv_fs.volume.fsinfo import Mount, VolumeUsage, mount_of, parse_mounts
from llmkv_fs.volume.vectored import read_all, write_all

# As /proc/self/mounts writes them: a space is \040, a backslash \134, a tab \011.
MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /mnt/kv\\040cache tmpfs rw,size=1g 0 0
server:/vol\\040a /mnt/kv\\040cache/deep fuse.glusterfs rw,user_id=0 0 0
/dev/sdb /mnt/back\\134slash\\011tab xfs rw 0 0
/dev/sdc /mnt/kv\\040cache/deep nfs4 rw 0 0
truncated-line
"""


def test_mount_table_fields_are_unescaped():
    mounts = parse_mounts(MOUNTS)
    assert mounts[1] == Mount("tmpfs", "/mnt/kv cache", "tmpfs")
    assert mounts[2] == Mount("server:/vol a", "/mnt/kv cache/deep", "fuse.glusterfs")
    assert mounts[3].mount_point == "/mnt/back\\slash\ttab"
    assert len(mounts) == 5  # the line without three fields is skipped


def test_mount_of_takes_the_longest_and_then_the_latest_mount_point():
    mounts = parse_mounts(MOUNTS)
    assert mount_of("/mnt/kv cache/m_0123456789ab_r0", mounts).fstype == "tmpfs"
    assert mount_of("/mnt/kv cache", mounts).fstype == "tmpfs"
    assert mount_of("/mnt/kv cachex/y", mounts).fstype == "ext4"
    # Mounted twice on one point: the later mount shadows the earlier one.
    assert mount_of("/mnt/kv cache/deep/x", mounts).fstype == "nfs4"
    assert mount_of("/mnt/back\\slash\ttab/z", mounts).fstype == "xfs"
    assert mount_of("/anything", []) is None


def test_filesystem_type_of_real_mounts(tmp_path):
    assert fsinfo.filesystem_type("/proc/self") == "proc"
    assert fsinfo.filesystem_type(str(tmp_path)) == mount_of(str(tmp_path)).fstype != ""


def test_volume_usage_fields():
    usage = VolumeUsage(1000, 250, 250, inodes=10, inodes_free=4)
    assert usage.usable_bytes == 500
    assert usage.used_percent == 50.0
    real = fsinfo.volume_usage("/proc")  # a filesystem whose numbers never move
    st = os.statvfs("/proc")
    assert (real.total_bytes, real.inodes, real.inodes_free) == (
        st.f_blocks * st.f_frsize,
        st.f_files,
        st.f_ffree,
    )


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
