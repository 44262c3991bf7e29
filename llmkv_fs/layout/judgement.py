"""How a block file is judged: the one rule the engine's loads and
``llmkv-fs verify`` both apply, so a block one calls good the other never
refuses, nor the reverse.

A namespace (a ``<model>_<digest>`` and its rank directories) holds plain
blocks (layout/blockfile.py) or sealed ones (layout/sealed.py), never both:
which, is the namespace's -- its run config names the sealing scheme and so
its digest does -- and never the word of a file's own trailer. So, in a
sealed namespace, a plain trailer is ``bad-version`` (a forgery with a
valid xxh3 is exactly that) and a trailer-less file ``bad-length``:
``accept_trailerless`` is for plain namespaces only, a trailer-less file
being neither sealed nor authenticated. In a plain namespace a sealed
trailer is ``bad-version``.

Bad is a BlockFileError (its ``reason`` the Corruption token); what is not
bad is a ``Judgement``. Pure: no I/O. Threading: ``BlockRules`` is
immutable, shared by every reader thread.
"""

from __future__ import annotations

import enum

from llmkv_fs.layout.blockfile import (
    TRAILER_SIZE,
    BlockFileError,
    Buffer,
    Corruption,
    check_trailer_names,
    file_sizes,
    length_fault,
    unpack_trailer,
    verify_block,
)
from llmkv_fs.layout.sealed import (
    ForeignKey,
    Keyring,
    check_unopened,
    holds_key,
    open_payload,
)

__all__ = ["BlockRules", "Judgement"]


class Judgement(enum.Enum):
    """A block that is not bad, and how far it could be checked."""

    VERIFIED = "verified"  # plain: length, key and payload xxh3; sealed: authenticated
    # served without a payload check: trailer-less (vLLM's built-in wrote it),
    # written with checksum: false, or the reader has checksum: false
    UNVERIFIED = "unverified"
    # written with checksum: false and the reader wants checksums and does not
    # accept unverified blocks: refused, yet not corrupt (left in place)
    NO_CHECKSUM = "no_checksum"
    # sealed, and no keyring to open it with (only ``llmkv-fs verify`` without
    # --seal-key-file): trailer, length and key checked, the payload not
    SEALED_UNCHECKED = "sealed_unchecked"
    # sealed with a key not held (another id, or another key under a held
    # id): not corrupt, a miss, left in place
    FOREIGN_KEY = "foreign_key"


class BlockRules:
    """The rules of one namespace's blocks of ``payload_len`` bytes, as one
    reader holds them: ``sealed`` (the namespace's, not a file's), whether
    it checks payload checksums, whether it accepts trailer-less and
    checksum-less blocks as unverified (plain namespaces only), and, sealed,
    the ``keyring`` to open them with (None: checked up to key and length,
    ``SEALED_UNCHECKED``) and their ``place`` (the rank directory's name,
    layout/sealed.py)."""

    __slots__ = (
        "accept_trailerless",
        "checksum",
        "keyring",
        "payload_len",
        "place",
        "sealed",
        "sizes",
    )

    def __init__(
        self,
        payload_len: int,
        sealed: bool,
        checksum: bool = True,
        accept_trailerless: bool = False,
        keyring: Keyring | None = None,
        place: bytes = b"",
    ):
        if sealed and accept_trailerless:
            raise ValueError("accept_trailerless is for plain namespaces: a sealed one has none")
        if keyring is not None and not sealed:
            raise ValueError(f"{keyring!r} for a plain namespace")
        self.payload_len = payload_len
        self.sealed = sealed
        self.checksum = checksum
        self.accept_trailerless = accept_trailerless
        self.keyring = keyring
        self.place = place
        # The file sizes a reader accepts (with a trailer; without one too if
        # accept_trailerless).
        self.sizes = file_sizes(payload_len, accept_trailerless)

    def judge_plain(
        self, key: bytes, payload: Buffer, trailer_page: Buffer, n: int, payload_xxh3: int | None
    ) -> Judgement:
        """A block of a plain namespace, ``n`` bytes of it read into
        ``payload`` and ``trailer_page`` (``payload_xxh3``: its hash if the
        reader took it while reading). Raises BlockFileError when bad."""
        if n == self.payload_len + TRAILER_SIZE:
            trailer = verify_block(payload, trailer_page, key, self.checksum, payload_xxh3)
            if not self.checksum:
                return Judgement.UNVERIFIED  # length and key checked, the payload not
            if trailer.has_checksum:
                return Judgement.VERIFIED
            # Written with checksum: false. Without a checksum a flipped bit
            # cannot be seen: like a trailer-less file, served only to a
            # reader that accepts unverified blocks. Not corrupt: left alone.
            return Judgement.UNVERIFIED if self.accept_trailerless else Judgement.NO_CHECKSUM
        if n == self.payload_len and self.accept_trailerless:
            return Judgement.UNVERIFIED
        raise length_fault(n, self.payload_len, self.accept_trailerless)

    def judge(self, key: bytes, payload: memoryview, trailer_page: memoryview, n: int) -> Judgement:
        """A whole block file of ``n`` bytes held in memory (``payload``
        then ``trailer_page``; a sealed one is decrypted in ``payload``).
        Raises BlockFileError when bad."""
        if not self.sealed:
            return self.judge_plain(key, payload, trailer_page, n, None)
        if self.keyring is None:
            return self.judge_unopened(key, trailer_page, n)
        if n != self.payload_len + TRAILER_SIZE:
            raise length_fault(n, self.payload_len, trailerless=False)
        try:
            open_payload(self.keyring, self.place, payload, trailer_page, key)
        except ForeignKey:
            return Judgement.FOREIGN_KEY
        return Judgement.VERIFIED

    def judge_trailer(self, key: bytes, trailer_page: Buffer, n: int) -> Judgement:
        """What a load could at best make of a block file of ``n`` bytes, by
        its trailer page alone (the payload unread; ``trailer_page`` unused
        for a trailer-less file): raises BlockFileError where the load would
        find it bad; ``NO_CHECKSUM`` or ``FOREIGN_KEY`` where it would refuse
        it and leave it in place; else what a good payload would get. A store
        that finds a file asks this (engine/block/blockio.py)."""
        if not self.sealed:
            if n == self.payload_len and self.accept_trailerless:
                return Judgement.UNVERIFIED
            if n != self.payload_len + TRAILER_SIZE:
                raise length_fault(n, self.payload_len, self.accept_trailerless)
            trailer = unpack_trailer(trailer_page)
            check_trailer_names(trailer, key, self.payload_len)
            if trailer.seal is not None:
                raise BlockFileError(Corruption.BAD_VERSION, "a sealed block where plain ones live")
            if not self.checksum:
                return Judgement.UNVERIFIED
            if trailer.has_checksum:
                return Judgement.VERIFIED
            return Judgement.UNVERIFIED if self.accept_trailerless else Judgement.NO_CHECKSUM
        if self.keyring is None:
            return self.judge_unopened(key, trailer_page, n)
        if n != self.payload_len + TRAILER_SIZE:
            raise length_fault(n, self.payload_len, trailerless=False)
        if holds_key(self.keyring, trailer_page, key, self.payload_len):
            return Judgement.VERIFIED
        return Judgement.FOREIGN_KEY

    def judge_unopened(self, key: bytes, trailer_page: Buffer, n: int) -> Judgement:
        """What a sealed namespace's block file of ``n`` bytes is by its
        trailer page alone, no key used: ``SEALED_UNCHECKED`` when its length
        is right and its trailer an intact sealed one of ``key`` and the
        payload length; else raises BlockFileError."""
        if n != self.payload_len + TRAILER_SIZE:
            raise length_fault(n, self.payload_len, trailerless=False)
        check_unopened(trailer_page, key, self.payload_len)
        return Judgement.SEALED_UNCHECKED
