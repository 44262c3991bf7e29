"""What BlockIO is told once: the block size, how to move and check bytes,
the modes of what it creates, the root it resolves every name beneath.
Immutable and picklable: a worker process gets it inside its launch's
pickled ``StepSpec`` (workers/crew.py), the pinned root as its path and
``(st_dev, st_ino)``."""

from __future__ import annotations

import dataclasses
import os

from llmkv_fs.volume.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE
from llmkv_fs.volume.pinned_root import PinnedRoot

__all__ = ["O_DIRECT", "IoOptions"]

O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclasses.dataclass(frozen=True)
class IoOptions:
    block_size: int
    use_o_direct: bool
    fsync_file: bool
    fsync_dir: bool
    checksum: bool
    accept_trailerless: bool = False
    file_mode: int = DEFAULT_FILE_MODE
    dir_mode: int = DEFAULT_DIR_MODE
    stamp_access: bool = True
    # Loads and stores move and hash the payload in pieces of this many
    # bytes (0: one vectored call, then one hash; block/contents.py). On
    # memory-backed volumes each move is a memcpy and hashing each piece
    # while it is still in cache saves most of the hash's memory traffic; on
    # disks one large call matters more.
    hash_chunk: int = 0
    # The root the tier started on: everything is resolved beneath it, and
    # only a descriptor of that very directory is used (None: the layout's
    # root_dir as it is, for tools and tests without a running tier).
    root: PinnedRoot | None = None
    # NFS clients keep a name they found missing "missing" for acdirmin..
    # acdirmax (30-60 s measured) after another client creates it; a miss is
    # then re-checked after opening the deepest directory on its path that
    # exists, which forces a GETATTR of that directory (close-to-open) and so
    # drops stale negative entries under it (docs/reliability.md, NFS).
    revalidate_misses: bool = False
    # Blocks are sealed (seal_key_files): BlockIO then refuses to be built
    # without the keyring (a worker whose keys did not arrive must never
    # write plain blocks where sealed ones live; block/sealed.py).
    sealed: bool = False
    # Sealed blocks are encrypted and decrypted in pieces of this many bytes
    # (0: the whole block in one cipher call; block/sealed.py). Chosen, as
    # hash_chunk, by who moves the bytes: startup/io_setup.py.
    seal_piece: int = 0
    # The compiled byte path and presence check may run (compiled_io;
    # block/bytes_c.py, block/presence.py); False: the Python paths.
    compiled: bool = True
