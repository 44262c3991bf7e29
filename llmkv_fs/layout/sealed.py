"""Sealed blocks: AES-256-GCM, authenticated and bound to their place.

With ``seal_key_files`` set, every block's payload is stored as its
AES-256-GCM ciphertext (``cryptography``: OpenSSL, AES-NI/VAES) under a
fresh random 96-bit nonce per write, and its trailer is format version
``SEALED_VERSION`` (layout/blockfile.py). The associated data binds the
block to where it lives, so a valid sealed block copied, renamed or
replayed anywhere else fails authentication:

    b"llmkv-fs sealed\\0" + place + b"\\0" + trailer[: tag_at]

``place`` is the rank directory's name, ``<model>_<digest>_r<rank>``
(model and run-config digest -- which names the sealing scheme, see
``sealed_layout`` -- and rank); the trailer bytes before the tag carry the
format version, the key id, the payload length, the creation time, the
block key (block hash and KV group), the nonce and the key check.

Keys have ids (several for reading, one for writing: rotation). A block
records its key's id and an 8-byte *key check* (HMAC-SHA256 of the key
over a fixed label, truncated: it identifies the key without revealing
it). A block whose id this reader does not hold, or whose key check is not
that of our key under its id (another deployment's key), raises
``ForeignKey``: a miss, left in place -- it is not corrupt, just not ours.
A block sealed with our key that fails authentication is a
``BlockFileError`` (``bad-seal``): forged, tampered with or misplaced,
quarantined like any bad file.

Pure: no I/O. Key material lives only in ``SealKey`` objects, whose repr
shows the id alone and which refuse to be pickled (a worker process gets
its keys through a pipe, engine/workers/crew.py, never on its command
line). Threading: keys and keyrings are immutable; a sealing or opening
context (``begin_seal``/``begin_open``) belongs to one thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)

from llmkv_fs.layout.blockfile import (
    BlockFileError,
    Buffer,
    Corruption,
    SealRecord,
    check_trailer_names,
    finish_sealed_trailer,
    pack_sealed_trailer,
    unpack_trailer,
)
from llmkv_fs.layout.paths import CacheLayout

__all__ = [
    "KEY_BYTES",
    "NAMESPACE_FIELD",
    "SCHEME",
    "ForeignKey",
    "Keyring",
    "SealKey",
    "begin_open",
    "begin_seal",
    "check_unopened",
    "end_open",
    "end_seal",
    "open_payload",
    "sealed_layout",
]

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # 96 bits: GCM's native nonce
MAX_KEY_ID = (1 << 32) - 1  # stored in the trailer's u32 at offset 12
# The run-config field that puts sealed blocks in their own namespace: the
# digest of ``<model>_<digest>`` covers it, so vLLM's built-in tier and an
# unsealed deployment (whose run configs lack it) never look there.
NAMESPACE_FIELD = "llmkv_fs_sealing"
SCHEME = "aes-256-gcm/1"
_AD_LABEL = b"llmkv-fs sealed\0"
_CHECK_LABEL = b"llmkv-fs key check v1"


class ForeignKey(Exception):
    """A sealed block this reader holds no key for: its key id is unknown,
    or the key under that id is another one (another deployment). Not
    corrupt: a miss, left in place."""


class SealKey:
    """One key and its id. The secret never appears in a repr, a pickle or
    an error."""

    __slots__ = ("check", "key_id", "secret")

    def __init__(self, key_id: int, secret: bytes):
        if not 1 <= key_id <= MAX_KEY_ID:
            raise ValueError(f"key id {key_id} outside [1, {MAX_KEY_ID}]")
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(secret)}")
        self.key_id = key_id
        self.secret = bytes(secret)
        self.check = hmac.new(self.secret, _CHECK_LABEL, hashlib.sha256).digest()[:8]

    def __repr__(self) -> str:
        return f"SealKey(id={self.key_id})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key material is never pickled (workers get it through a pipe)")


class Keyring:
    """The keys a deployment reads with, by id, and the one it writes with."""

    __slots__ = ("by_id", "write")

    def __init__(self, keys: Iterable[SealKey], write_id: int):
        by_id: dict[int, SealKey] = {}
        for key in keys:
            if key.key_id in by_id:
                raise ValueError(f"key id {key.key_id} given twice")
            by_id[key.key_id] = key
        if write_id not in by_id:
            raise ValueError(f"write key id {write_id} is not among the keys {sorted(by_id)}")
        self.by_id: Mapping[int, SealKey] = by_id
        self.write = by_id[write_id]

    def __repr__(self) -> str:
        return f"Keyring(ids={sorted(self.by_id)}, write={self.write.key_id})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("key material is never pickled (workers get it through a pipe)")

    _ENTRY = struct.Struct(f"<I{KEY_BYTES}s")

    def to_bytes(self) -> bytes:
        """The keyring as bytes for a worker's key pipe: the write id, then
        id and secret per key."""
        entries = [self._ENTRY.pack(k.key_id, k.secret) for k in self.by_id.values()]
        return struct.pack("<I", self.write.key_id) + b"".join(entries)

    @classmethod
    def from_bytes(cls, data: bytes) -> Keyring:
        (write_id,) = struct.unpack_from("<I", data)
        body = memoryview(data)[4:]
        if not body or len(body) % cls._ENTRY.size:
            raise ValueError(f"a keyring record of {len(data)} bytes")
        keys = [
            SealKey(*cls._ENTRY.unpack_from(body, at))
            for at in range(0, len(body), cls._ENTRY.size)
        ]
        return cls(keys, write_id)


def sealed_layout(layout: CacheLayout) -> CacheLayout:
    """``layout`` with the sealing scheme in its run config: its own
    ``<model>_<digest>`` directory, its ``config.json`` naming the scheme
    (never a key)."""
    if layout.run_config.get(NAMESPACE_FIELD) == SCHEME:
        return layout
    run_config: dict[str, Any] = {**layout.run_config, NAMESPACE_FIELD: SCHEME}
    return CacheLayout(layout.root_dir, run_config, layout.rank)


def _associated_data(place: bytes, head: Buffer) -> bytes:
    return b"".join((_AD_LABEL, place, b"\0", head))


def begin_seal(
    keyring: Keyring,
    place: bytes,
    trailer: memoryview,
    key: bytes,
    payload_len: int,
    created_ns: int,
) -> tuple[AEADEncryptionContext, int]:
    """Start sealing one block: fills ``trailer`` (tag still zero) and
    returns the encryptor, its associated data given, and the tag's offset.
    Feed the payload through the encryptor (``update_into``), then call
    ``end_seal``."""
    write = keyring.write
    nonce = os.urandom(NONCE_BYTES)
    tag_at = pack_sealed_trailer(
        trailer, key, payload_len, created_ns, write.key_id, nonce, write.check
    )
    encryptor = Cipher(algorithms.AES(write.secret), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(_associated_data(place, trailer[:tag_at]))
    return encryptor, tag_at


def end_seal(encryptor: AEADEncryptionContext, trailer: memoryview, tag_at: int) -> None:
    """Finish the block ``begin_seal`` started: its tag into the trailer."""
    encryptor.finalize()
    finish_sealed_trailer(trailer, tag_at, encryptor.tag)


def check_unopened(trailer_page: Buffer, key: bytes, payload_len: int) -> SealRecord:
    """What can be checked of a sealed block without a key: its trailer is
    sealed and intact, of ``payload_len`` bytes and ``key``'s. Returns its
    seal record; raises BlockFileError."""
    trailer = unpack_trailer(trailer_page)
    if trailer.seal is None:
        raise BlockFileError(Corruption.BAD_VERSION, "an unsealed block where sealed blocks live")
    check_trailer_names(trailer, key, payload_len)
    return trailer.seal


def _sealing_key(keyring: Keyring, seal: SealRecord) -> SealKey:
    """The key of ``keyring`` that sealed ``seal``; ForeignKey if none."""
    held = keyring.by_id.get(seal.key_id)
    if held is None:
        raise ForeignKey(f"sealed with key id {seal.key_id}, which this reader does not hold")
    if not hmac.compare_digest(held.check, seal.key_check):
        raise ForeignKey(f"sealed with another key under key id {seal.key_id}")
    return held


def holds_key(keyring: Keyring, trailer_page: Buffer, key: bytes, payload_len: int) -> bool:
    """Whether ``keyring`` holds the key that sealed the block of this
    trailer page (checked as ``check_unopened``, BlockFileError; nothing
    authenticated: the payload is not read)."""
    try:
        _sealing_key(keyring, check_unopened(trailer_page, key, payload_len))
    except ForeignKey:
        return False
    return True


def begin_open(
    keyring: Keyring, place: bytes, trailer_page: memoryview, key: bytes, payload_len: int
) -> tuple[AEADDecryptionContext, bytes]:
    """Start opening one block from its trailer page: returns the decryptor
    (associated data given) and the tag to finish with (``end_open``).
    Raises BlockFileError for a damaged trailer, an unsealed block, another
    length or another block's key, and ForeignKey for a key we do not hold.
    """
    seal = check_unopened(trailer_page, key, payload_len)
    held = _sealing_key(keyring, seal)
    decryptor = Cipher(algorithms.AES(held.secret), modes.GCM(seal.nonce)).decryptor()
    decryptor.authenticate_additional_data(_associated_data(place, trailer_page[: seal.tag_at]))
    return decryptor, seal.tag


def end_open(decryptor: AEADDecryptionContext, tag: bytes) -> None:
    """Authenticate what ``decryptor`` was fed; BlockFileError (bad-seal) if
    it is not what our key sealed at this place. Until this returns, the
    bytes decrypted so far are unauthenticated and must not be used."""
    try:
        decryptor.finalize_with_tag(tag)
    except InvalidTag:
        raise BlockFileError(
            Corruption.BAD_SEAL, "authentication failed (forged, altered or moved here)"
        ) from None


def open_payload(
    keyring: Keyring, place: bytes, payload: memoryview, trailer_page: memoryview, key: bytes
) -> None:
    """Open a whole sealed block held in memory: ``payload`` is decrypted in
    place and authenticated (``llmkv-fs verify``). Raises as ``begin_open``
    and ``end_open``."""
    decryptor, tag = begin_open(keyring, place, trailer_page, key, payload.nbytes)
    decryptor.update_into(payload, payload)
    end_open(decryptor, tag)
