"""Whole-file vectored reads and writes (``volume/vectored.py``): every
buffer filled or written, a read a network filesystem splits followed up."""

from __future__ import annotations

import os

import pytest

from llmkv_fs.volume.vectored import read_all, write_all


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
