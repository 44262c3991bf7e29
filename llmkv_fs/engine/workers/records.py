"""The records that travel between the worker executor's conductor
(workers/process_executor.py) and its worker processes (workers/child.py) through
pipes, and their codec.

Records (struct-packed, little-endian): a job record is ``JOB`` and then,
per block of its slice, ``BLOCK`` + the key; a result record is ``RESULT`` +
an optional UTF-8 text, one per block, in the slice's order. ``slot`` names
the slice's place in the shared cancel board (workers/crew.CancelBoard): the
worker answers every block of it with the slot it got.

A result is a block's ``BlockResult`` whole: an ``Outcome`` by its index, or
a ``Failed`` by its ``Failure`` index plus the type of its error (one of
``ERROR_TYPES``) and that error's fields. So every reason a block can end
with in a worker reaches the owner as the same reason it has in a thread,
never ``error`` in its place (tests/engine/workers/test_records.py
round-trips every member).

Pure functions of their arguments: safe from any thread or process.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from llmkv_fs.engine.outcomes import (
    Abandoned,
    BlockMissing,
    BlockOnLostRoot,
    BlockResult,
    Failed,
    Failure,
    NoChecksum,
    Outcome,
    StoreRefused,
)
from llmkv_fs.layout.blockfile import BlockFileError, Corruption
from llmkv_fs.layout.sealed import ForeignKey

__all__ = [
    "BLOCK",
    "ERROR_TYPES",
    "HELLO",
    "JOB",
    "OP_LOAD",
    "OP_STOP",
    "OP_STORE",
    "RESULT",
    "decode_result",
    "encode_result",
    "hello_record",
    "job_record",
    "stop_record",
    "take_jobs",
    "take_results",
]

# op u8, slot u16, blocks u16; then per block: chunk i64, key length u16 (then
# the key). The chunk is range-checked by the worker's BlockStep like a
# thread's, so any index the owner passed must fit (-1 included: a bad chunk
# is the block's failure in the worker, never a struct.error on the conductor).
JOB = struct.Struct("<BHH")
BLOCK = struct.Struct("<qH")
_CHUNK_RANGE = range(-(1 << 63), 1 << 63)
# slot u16, kind u8, code u8, error type u8, corruption u8, errno i32 (pid
# for HELLO), text length u32 (then the text)
RESULT = struct.Struct("<HBBBBiI")
OP_LOAD, OP_STORE, OP_STOP = 1, 2, 3
KIND_OUTCOME, KIND_FAILED, HELLO = 0, 1, 2

OUTCOMES = tuple(Outcome)
FAILURES = tuple(Failure)
CORRUPTIONS = tuple(Corruption)
# Index 0: no error. The last entry catches every other exception, which
# arrives as a RuntimeError carrying its repr (its reason is kept anyway).
ERROR_TYPES: tuple[type[Exception] | None, ...] = (
    None,
    BlockMissing,
    Abandoned,
    NoChecksum,
    StoreRefused,
    BlockOnLostRoot,
    BlockFileError,
    ForeignKey,
    OSError,
    Exception,
)
_TEXT_LIMIT = 4000
_SEP = "\0"


def job_record(op: int, slot: int, chunks: Sequence[int], keys: Sequence[bytes]) -> bytes:
    """A job record for a slice of blocks (conductor side). A chunk beyond
    i64 travels as -1: out of range either way, and failed as such by the
    worker."""
    parts = [JOB.pack(op, slot, len(keys))]
    for chunk, key in zip(chunks, keys):
        parts += (BLOCK.pack(chunk if chunk in _CHUNK_RANGE else -1, len(key)), key)
    return b"".join(parts)


def stop_record() -> bytes:
    return JOB.pack(OP_STOP, 0, 0)


def take_jobs(buf: bytearray) -> list[tuple[int, int, list[int], list[bytes]]]:
    """Cut the whole job records off the front of ``buf`` (worker side):
    (op, slot, chunks, keys) each. A partial record stays in ``buf``."""
    records: list[tuple[int, int, list[int], list[bytes]]] = []
    while len(buf) >= JOB.size:
        op, slot, count = JOB.unpack_from(buf)
        at = JOB.size
        chunks: list[int] = []
        keys: list[bytes] = []
        for _ in range(count):
            if len(buf) < at + BLOCK.size:
                return records
            chunk, key_len = BLOCK.unpack_from(buf, at)
            at += BLOCK.size
            if len(buf) < at + key_len:
                return records
            chunks.append(chunk)
            keys.append(bytes(buf[at : at + key_len]))
            at += key_len
        del buf[:at]
        records.append((op, slot, chunks, keys))
    return records


def hello_record(pid: int) -> bytes:
    return RESULT.pack(0, HELLO, 0, 0, 0, pid, 0)


def encode_result(slot: int, result: BlockResult) -> bytes:
    """The result record of one block (worker side)."""
    if isinstance(result, Outcome):
        return RESULT.pack(slot, KIND_OUTCOME, OUTCOMES.index(result), 0, 0, 0, 0)
    error = result.error
    type_index = _error_type_index(error)
    corruption, errno_, text = 0, 0, ""
    if isinstance(error, BlockFileError):
        corruption = CORRUPTIONS.index(error.reason)
        detail = str(error).split(": ", 1)[-1]
        text = _SEP.join((detail, error.quarantined_to or "", error.left_because))
    elif isinstance(error, OSError):
        errno_ = error.errno or 0
        text = _SEP.join((str(error.strerror or error), str(error.filename or "")))
    elif ERROR_TYPES[type_index] is Exception:
        text = repr(error)
    elif error is not None:
        text = str(error)
    data = text.encode("utf-8", "surrogateescape")[:_TEXT_LIMIT]
    reason = FAILURES.index(result.reason)
    return RESULT.pack(slot, KIND_FAILED, reason, type_index, corruption, errno_, len(data)) + data


def _error_type_index(error: BaseException | None) -> int:
    if error is None:
        return 0
    for index, kind in enumerate(ERROR_TYPES[1:], start=1):
        if kind is not None and isinstance(error, kind):
            return index
    return len(ERROR_TYPES) - 1


def take_results(buf: bytearray) -> list[tuple[int, int, int, BlockResult | None]]:
    """Cut the whole result records off the front of ``buf`` (conductor
    side): (slot, kind, errno field, result) each -- result None for HELLO,
    whose errno field is the worker's pid. A partial record stays in ``buf``."""
    records: list[tuple[int, int, int, BlockResult | None]] = []
    while len(buf) >= RESULT.size:
        slot, kind, code, type_index, corruption, errno_, text_len = RESULT.unpack_from(buf)
        end = RESULT.size + text_len
        if len(buf) < end:
            break
        text = bytes(buf[RESULT.size : end]).decode("utf-8", "surrogateescape")
        del buf[:end]
        result = (
            None
            if kind == HELLO
            else decode_result(kind, code, type_index, corruption, errno_, text)
        )
        records.append((slot, kind, errno_, result))
    return records


def decode_result(
    kind: int, code: int, type_index: int, corruption: int, errno_: int, text: str
) -> BlockResult:
    """The BlockResult a result record stands for (conductor side)."""
    if kind == KIND_OUTCOME:
        return OUTCOMES[code]
    error_type = ERROR_TYPES[type_index] if type_index < len(ERROR_TYPES) else Exception
    error: Exception | None
    if error_type is None:
        error = None
    elif error_type is BlockFileError:
        detail, moved, left_because = [*text.split(_SEP), "", ""][:3]
        error = BlockFileError(CORRUPTIONS[corruption], detail)
        error.quarantined_to = moved or None
        error.left_because = left_because
    elif error_type is OSError:
        message, _, filename = text.partition(_SEP)
        error = OSError(errno_, message, filename or None)  # the errno's own subclass
    elif error_type is Exception:
        error = RuntimeError(text)
    else:
        error = error_type(text)
    return Failed(FAILURES[code], error)
