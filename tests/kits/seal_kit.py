"""Key files and attacks on sealed blocks, shared by the sealing tests
(engine, tier, ops): keys are written as a mounted Secret would hold them,
and every attack is made with the package's own format code -- what
anyone who can read our source and write the volume can do."""

from __future__ import annotations

import base64
import os

from llmkv_fs.layout.blockfile import (
    TRAILER_SIZE,
    finish_sealed_trailer,
    pack_trailer,
    payload_checksum,
    unpack_trailer,
)

__all__ = [
    "flip_bit",
    "forge_plain",
    "key_file",
    "rekey_trailer",
    "sealed_trailer",
]


def key_file(directory, name: str = "key", secret: bytes | None = None, mode: int = 0o400) -> str:
    """A key file of 32 random bytes (or ``secret``) in base64, as
    ``openssl rand -base64 32`` writes it; returns its path."""
    path = os.path.join(str(directory), name)
    secret = os.urandom(32) if secret is None else secret
    with open(path, "wb") as f:
        f.write(base64.b64encode(secret) + b"\n")
    os.chmod(path, mode)
    return path


def sealed_trailer(path: str):
    """The trailer of the block file at ``path`` (asserting it is sealed:
    a test whose blocks were not sealed must fail here, not pass later)."""
    with open(path, "rb") as f:
        data = f.read()
    trailer = unpack_trailer(data[-TRAILER_SIZE:])
    assert trailer.seal is not None, f"{path} is not a sealed block"
    return trailer


def forge_plain(path: str, key: bytes, payload: bytes) -> None:
    """Replace the block at ``path`` with ``payload`` and a valid unsealed
    trailer (xxh3 recomputed with ``pack_trailer``): the forgery anyone
    could write before sealing."""
    trailer = memoryview(bytearray(TRAILER_SIZE))
    pack_trailer(trailer, key, len(payload), payload_checksum(payload), 1)
    with open(path, "wb") as f:
        f.write(payload + bytes(trailer))


def rekey_trailer(path: str, key: bytes) -> None:
    """Make the sealed block at ``path`` claim to be ``key``'s, its trailer
    still self-consistent (its checksum recomputed): only the seal can tell."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    page = memoryview(data)[-TRAILER_SIZE:]
    old = unpack_trailer(page)
    assert old.seal is not None and len(old.key) == len(key)
    start = page.tobytes().index(old.key)
    page[start : start + len(key)] = key
    finish_sealed_trailer(page, old.seal.tag_at, old.seal.tag)
    with open(path, "wb") as f:
        f.write(data)


def flip_bit(path: str, offset: int, tag_at: int | None = None) -> None:
    """Flip one bit at ``offset``; with ``tag_at`` (the sealed trailer's,
    from before) the trailer's own checksum is then made right again, so
    only the seal can tell."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    if tag_at is None:
        return
    with open(path, "rb") as f:
        data = bytearray(f.read())
    page = memoryview(data)[-TRAILER_SIZE:]
    finish_sealed_trailer(page, tag_at, bytes(page[tag_at : tag_at + 16]))
    with open(path, "wb") as f:
        f.write(data)
