"""The records that travel between the ProcPool's conductor (procpool.py)
and its worker processes (worker.py) through pipes, and their codec.

Records (struct-packed, little-endian): a job record is ``JOB`` + the key; a
result record is ``RESULT`` + an optional UTF-8 text (error message, or
detail and quarantine path). ``slot`` names the block's place in the shared
cancel board (workers.CancelBoard): the worker answers with the slot it got.

Pure functions of their arguments: safe from any thread or process.
"""

from __future__ import annotations

import struct

from llmkv_fs.engine.outcomes import (
    DEADLINE,
    Abandoned,
    BlockMissing,
    BlockResult,
    Outcome,
    failed,
)
from llmkv_fs.layout.blockfile import BlockFileError, Corruption

__all__ = [
    "CORRUPTION_CODES",
    "JOB",
    "OUTCOME_CODES",
    "RESULT",
    "decode_result",
    "encode_error",
    "take_results",
]

# op u8, slot u16, chunk u32, key length u16 (then the key)
JOB = struct.Struct("<BHIH")
# slot u16, kind u8, extra u8 (corruption code), errno i32 (pid for HELLO), text length u32
RESULT = struct.Struct("<HBBiI")
OP_LOAD, OP_STORE, OP_STOP = 1, 2, 3
OUTCOME_CODES = (Outcome.WRITTEN, Outcome.PRESENT, Outcome.VERIFIED, Outcome.UNVERIFIED)
CORRUPTION_CODES = tuple(Corruption)
RESULT_MISSING, RESULT_CORRUPT, RESULT_ABANDONED = 10, 11, 12
RESULT_OSERROR, RESULT_ERROR, RESULT_CANCELLED, RESULT_HELLO = 13, 14, 15, 16


def encode_error(slot: int, exc: BaseException) -> bytes:
    """The result record of a block that raised ``exc`` (worker side)."""
    errno_ = 0
    extra = 0
    if isinstance(exc, BlockMissing):
        kind, text = RESULT_MISSING, str(exc)
    elif isinstance(exc, Abandoned):
        kind, text = RESULT_ABANDONED, str(exc)
    elif isinstance(exc, BlockFileError):
        kind, extra = RESULT_CORRUPT, CORRUPTION_CODES.index(exc.reason)
        text = f"{exc}\0{exc.quarantined_to or ''}"
    elif isinstance(exc, OSError):
        kind, errno_ = RESULT_OSERROR, exc.errno or 0
        text = f"{exc.strerror or exc}\0{exc.filename or ''}"
    else:
        kind, text = RESULT_ERROR, repr(exc)
    data = text.encode("utf-8", "surrogateescape")[:4000]
    return RESULT.pack(slot, kind, extra, errno_, len(data)) + data


def take_results(buf: bytearray) -> list[tuple[int, int, int, int, str]]:
    """Cut the whole result records off the front of ``buf`` (owner side):
    (slot, kind, extra, errno, text) each; a partial record stays in ``buf``."""
    records = []
    while len(buf) >= RESULT.size:
        slot, kind, extra, err, text_len = RESULT.unpack_from(buf)
        end = RESULT.size + text_len
        if len(buf) < end:
            break
        text = bytes(buf[RESULT.size : end]).decode("utf-8", "surrogateescape")
        del buf[:end]
        records.append((slot, kind, extra, err, text))
    return records


def decode_result(kind: int, extra: int, err: int, text: str) -> BlockResult:
    """The block result a result record stands for (owner side)."""
    if kind < len(OUTCOME_CODES):
        return OUTCOME_CODES[kind]
    if kind == RESULT_CANCELLED:
        return DEADLINE
    if kind == RESULT_MISSING:
        return failed(BlockMissing(text))
    if kind == RESULT_ABANDONED:
        return failed(Abandoned(text))
    if kind == RESULT_CORRUPT:
        detail, _, moved = text.partition("\0")
        exc = BlockFileError(CORRUPTION_CODES[extra], detail.split(": ", 1)[-1])
        exc.quarantined_to = moved or None
        return failed(exc)
    if kind == RESULT_OSERROR:
        message, _, filename = text.partition("\0")
        return failed(OSError(err, message, filename or None))
    return failed(RuntimeError(text))
