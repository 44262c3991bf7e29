"""The block file format: the payload exactly as vLLM's built-in fs tier
writes it, then one trailer page.

    [ payload: block_size bytes ][ trailer: TRAILER_SIZE bytes ]

vLLM's reader reads only the first ``block_size`` bytes, so our files stay
readable by it; a file of exactly ``block_size`` bytes (written by vLLM) is
accepted by ours as *unverified*.

A writer with ``checksum: false`` writes the same trailer with flags 0 and a
zero checksum field: length and key are still there, the payload is not
protected. A reader never counts such a block as verified; one that wants
checksums refuses it unless it accepts unverified blocks
(``accept_trailerless``).

Trailer (little-endian, rest of the page zero)::

    0   8s  magic  b"LLMKVFS\\x00"
    8   H   format version (FORMAT_VERSION)
    10  H   flags (FLAG_CHECKSUM: payload_xxh3 is meaningful)
    12  I   reserved (0)
    16  Q   payload length in bytes
    24  Q   xxh3-64 of the payload
    32  Q   creation time, ns since the epoch
    40  H   key length
    42  ..  key (the OffloadKey: block hash + 4-byte group)
    ..  Q   xxh3-64 of bytes [0, 42 + key length): the trailer's own checksum

One page keeps O_DIRECT I/O aligned and leaves room for later fields.

A sealed block (``seal_key_files``; layout/sealed.py) has the same shape:
the payload is its AES-256-GCM ciphertext and the trailer is format
version ``SEALED_VERSION``, whose offset 12 holds the key id (reserved in
version 1), whose xxh3 field is zero (a plaintext hash would let a reader
test a guess of the prompt), and whose key is followed by a seal record
before the trailer's own checksum::

    ..  12s nonce (fresh, random, per write)
    ..  8s  key check (identifies the key under its id: layout/sealed.py)
    ..  16s GCM tag over the payload, with every trailer byte before it
            and the block's place as associated data

A version 1 reader refuses it (bad-version) and vLLM's built-in never
looks where sealed blocks live (the namespace digest names the scheme).
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
from typing import NamedTuple, TypeAlias

import xxhash

__all__ = [
    "FLAG_CHECKSUM",
    "FORMAT_VERSION",
    "MAGIC",
    "SEALED_VERSION",
    "TRAILER_SIZE",
    "BlockFileError",
    "Corruption",
    "SealRecord",
    "Trailer",
    "check_trailer_names",
    "file_sizes",
    "finish_sealed_trailer",
    "length_fault",
    "pack_sealed_trailer",
    "pack_trailer",
    "pack_trailer_of",
    "payload_checksum",
    "unpack_trailer",
    "verify_block",
]

# What the payload and trailer functions read (collections.abc.Buffer is 3.12+).
Buffer: TypeAlias = bytes | bytearray | memoryview | mmap.mmap

MAGIC = b"LLMKVFS\x00"
FORMAT_VERSION = 1
SEALED_VERSION = 2
FLAG_CHECKSUM = 0x1
TRAILER_SIZE = 4096
MAX_KEY_LEN = 1024

_HEAD = struct.Struct("<8sHHIQQQH")  # up to and including the key length
_TAIL = struct.Struct("<Q")
_SEAL = struct.Struct("<12s8s16s")  # nonce, key check, tag
_TAG_SIZE = 16


class Corruption(str, enum.Enum):
    """What is wrong with a block file. The values are stable tokens: the
    quarantine file names, ``llmkv-fs verify`` and the ``corrupt_blocks``
    metric's ``reason`` label all carry them (docs/metrics.md lists each).

    A str-valued Enum that prints as its value, as enum.StrEnum does: that is
    Python 3.11+, and gc and verify run on 3.10 (docs/gc.md)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    BAD_CHECKSUM = "bad-checksum"
    TRUNCATED = "truncated"
    BAD_LENGTH = "bad-length"
    WRONG_KEY = "wrong-key"
    BAD_MAGIC = "bad-magic"
    BAD_VERSION = "bad-version"
    BAD_TRAILER = "bad-trailer"
    SYMLINK = "symlink"
    # a sealed block whose key we hold failed authentication: forged,
    # tampered with, or moved from another place (layout/sealed.py)
    BAD_SEAL = "bad-seal"


class BlockFileError(Exception):
    """A block file failed verification; ``reason`` says how."""

    def __init__(self, reason: Corruption, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.quarantined_to: str | None = None  # set by whoever moved the file aside
        # Why it was not moved aside, when it was not (for the log).
        self.left_because = "not moved aside"


class SealRecord(NamedTuple):
    """What a sealed trailer adds: the key it was sealed with (``key_id``,
    ``key_check``), the nonce and the tag; ``tag_at`` is the tag's offset
    in the page (every byte before it is associated data)."""

    key_id: int
    nonce: bytes
    key_check: bytes
    tag: bytes
    tag_at: int


class Trailer(NamedTuple):
    """A trailer as read (a NamedTuple: built for every block loaded, and a
    frozen dataclass's constructor cost several microseconds of it)."""

    version: int
    flags: int
    payload_len: int
    payload_xxh3: int
    created_ns: int
    key: bytes
    has_checksum: bool  # FLAG_CHECKSUM set: payload_xxh3 holds the payload's xxh3-64
    seal: SealRecord | None = None  # a sealed block's (SEALED_VERSION)


_ZEROS = bytes(TRAILER_SIZE)


def payload_checksum(payload: Buffer) -> int:
    """xxh3-64 of a buffer (zero-copy: xxhash reads the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(payload)


def pack_trailer_of(
    out: memoryview, key: bytes, payload: memoryview, checksum: bool, created_ns: int
) -> None:
    """``pack_trailer`` for ``payload`` (its length, and its checksum when
    ``checksum``): a whole row's trailer in one call."""
    digest = payload_checksum(payload) if checksum else None
    pack_trailer(out, key, payload.nbytes, digest, created_ns)


def pack_trailer(
    out: memoryview, key: bytes, payload_len: int, checksum: int | None, created_ns: int
) -> None:
    """Fill ``out`` (TRAILER_SIZE writable bytes, reused per thread) in place."""
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_LEN}")
    flags = FLAG_CHECKSUM if checksum is not None else 0
    _HEAD.pack_into(
        out,
        0,
        MAGIC,
        FORMAT_VERSION,
        flags,
        0,
        payload_len,
        checksum or 0,
        created_ns,
        len(key),
    )
    key_end = _HEAD.size + len(key)
    out[_HEAD.size : key_end] = key
    _TAIL.pack_into(out, key_end, xxhash.xxh3_64_intdigest(out[:key_end]))
    # The page is reused (and also serves reads): the format promises zeros
    # after the trailer, so nothing from an earlier use may leak into a file.
    tail_end = key_end + _TAIL.size
    out[tail_end:] = _ZEROS[: len(out) - tail_end]


def unpack_trailer(buf: Buffer) -> Trailer:
    """Parse and self-check a trailer page; raise BlockFileError if it is not
    one of ours, is from another format version, or is damaged."""
    view = memoryview(buf).cast("B")
    if len(view) < _HEAD.size + _TAIL.size:
        raise BlockFileError(Corruption.TRUNCATED, "trailer shorter than its header")
    magic, version, flags, key_id, payload_len, xxh, created, key_len = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlockFileError(Corruption.BAD_MAGIC, f"trailer magic {magic!r}")
    if version not in (FORMAT_VERSION, SEALED_VERSION):
        raise BlockFileError(
            Corruption.BAD_VERSION,
            f"format version {version}, this reader knows {FORMAT_VERSION} and {SEALED_VERSION}",
        )
    key_end = _HEAD.size + key_len
    sums_end = key_end + (_SEAL.size if version == SEALED_VERSION else 0)
    if key_len > MAX_KEY_LEN or sums_end + _TAIL.size > len(view):
        raise BlockFileError(Corruption.BAD_TRAILER, f"key length {key_len}")
    (stored,) = _TAIL.unpack_from(view, sums_end)
    if stored != xxhash.xxh3_64_intdigest(view[:sums_end]):
        raise BlockFileError(Corruption.BAD_TRAILER, "trailer checksum mismatch")
    key = bytes(view[_HEAD.size : key_end])
    summed = bool(flags & FLAG_CHECKSUM)
    if version == FORMAT_VERSION:
        return Trailer(version, flags, payload_len, xxh, created, key, summed)
    nonce, check, tag = _SEAL.unpack_from(view, key_end)
    seal = SealRecord(key_id, nonce, check, tag, sums_end - _TAG_SIZE)
    return Trailer(version, flags, payload_len, xxh, created, key, summed, seal)


def pack_sealed_trailer(
    out: memoryview,
    key: bytes,
    payload_len: int,
    created_ns: int,
    key_id: int,
    nonce: bytes,
    key_check: bytes,
) -> int:
    """Fill ``out`` with a sealed trailer whose tag is still zero; returns
    the tag's offset (every byte before it is associated data). Call
    ``finish_sealed_trailer`` with the tag once the payload is sealed."""
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_LEN}")
    _HEAD.pack_into(out, 0, MAGIC, SEALED_VERSION, 0, key_id, payload_len, 0, created_ns, len(key))
    key_end = _HEAD.size + len(key)
    out[_HEAD.size : key_end] = key
    _SEAL.pack_into(out, key_end, nonce, key_check, bytes(_TAG_SIZE))
    tail_end = key_end + _SEAL.size + _TAIL.size
    out[tail_end:] = _ZEROS[: len(out) - tail_end]
    return key_end + _SEAL.size - _TAG_SIZE


def finish_sealed_trailer(out: memoryview, tag_at: int, tag: bytes) -> None:
    """Write the tag at ``tag_at`` and the trailer's own checksum after it."""
    out[tag_at : tag_at + _TAG_SIZE] = tag
    sums_end = tag_at + _TAG_SIZE
    _TAIL.pack_into(out, sums_end, xxhash.xxh3_64_intdigest(out[:sums_end]))


def check_trailer_names(trailer: Trailer, key: bytes, payload_len: int) -> None:
    """The trailer is this block's: it records ``payload_len`` bytes and
    ``key`` (sealed or not); raises BlockFileError."""
    if trailer.payload_len != payload_len:
        raise BlockFileError(
            Corruption.BAD_LENGTH,
            f"trailer says {trailer.payload_len} bytes, block is {payload_len}",
        )
    if trailer.key != key:
        raise BlockFileError(Corruption.WRONG_KEY, "file holds another block's key")


def verify_block(
    payload: Buffer,
    trailer_page: Buffer,
    key: bytes,
    verify_checksum: bool,
    payload_xxh3: int | None = None,
) -> Trailer:
    """Check a payload against its trailer: length, key, and (when both the
    writer recorded one and the reader wants it) the xxh3 checksum --
    ``payload_xxh3`` if the caller already hashed the payload while reading."""
    trailer = unpack_trailer(trailer_page)
    check_trailer_names(trailer, key, memoryview(payload).nbytes)
    if trailer.seal is not None:  # only a sealed reader opens it (layout/sealed.py)
        raise BlockFileError(Corruption.BAD_VERSION, "a sealed block where unsealed blocks live")
    if verify_checksum and trailer.has_checksum:
        actual = payload_checksum(payload) if payload_xxh3 is None else payload_xxh3
        if actual != trailer.payload_xxh3:
            raise BlockFileError(Corruption.BAD_CHECKSUM, "payload xxh3 mismatch")
    return trailer


def file_sizes(payload_len: int, trailerless: bool) -> frozenset[int]:
    """The lengths a block file of ``payload_len`` payload bytes may have:
    payload and trailer, and with ``trailerless`` the bare payload that
    vLLM's built-in tier writes."""
    return frozenset((payload_len + TRAILER_SIZE, *((payload_len,) if trailerless else ())))


def length_fault(n: int, payload_len: int, trailerless: bool) -> BlockFileError:
    """Why a block file of ``n`` bytes is bad (``n`` not in ``file_sizes``):
    truncated when shorter than the payload, else a bad length."""
    reason = Corruption.TRUNCATED if n < payload_len else Corruption.BAD_LENGTH
    empty = " (empty)" if n == 0 else ""
    also = f" (or {payload_len} without trailer)" if trailerless else ""
    return BlockFileError(reason, f"{n} bytes{empty}, expected {payload_len + TRAILER_SIZE}{also}")


# The tier stamps a block's atime explicitly when it loads it (relatime and
# noatime make implicit atime useless), at most once per this many seconds per
# file so a hot block costs one metadata write a minute, not one per hit.
ACCESS_STAMP_INTERVAL_S = 60.0


def last_used(st: os.stat_result) -> float:
    """When a block was last stored or loaded, for LRU eviction: the explicit
    access stamp (atime), or the store time (mtime) if that is later."""
    return max(st.st_atime, st.st_mtime)
