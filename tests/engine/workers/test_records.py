"""The worker pipe's codec (engine/workers/records.py): every block result a
worker can send reaches the owner as the same result -- each Outcome, and
each Failure reason with each kind of error it can carry. A reason added to
``Failure`` is covered here by construction, so it cannot silently become
``error`` in worker mode (a hand-written chain once did that to
``no_checksum`` and ``volume_failed``)."""

from __future__ import annotations

import errno

import pytest

from llmkv_fs.engine import Failure, Outcome
from llmkv_fs.engine.outcomes import (
    Abandoned,
    BlockMissing,
    BlockOnLostRoot,
    Failed,
    NoChecksum,
    StoreRefused,
)
from llmkv_fs.engine.workers.records import (
    ERROR_TYPES,
    HELLO,
    JOB,
    encode_result,
    hello_record,
    job_record,
    stop_record,
    take_jobs,
    take_results,
)
from llmkv_fs.layout.blockfile import BlockFileError, Corruption


def _bad_file(reason: Corruption) -> BlockFileError:
    exc = BlockFileError(reason, "/v/m_d_r0/abc/ab_g0/k.bin: checksum differs")
    exc.quarantined_to = "/v/m_d_r0/.quarantine/k.bin.x.1"
    exc.left_because = "the rename was refused"
    return exc


ERRORS = [
    None,
    BlockMissing("/v/k.bin"),
    Abandoned("/v/k.bin"),
    NoChecksum("/v/k.bin"),
    StoreRefused("ENOSPC"),
    BlockOnLostRoot("/v"),
    *(_bad_file(reason) for reason in Corruption),
    OSError(errno.EIO, "Input/output error", "/v/k.bin"),
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/v/x"),
    OSError(errno.ENOSPC, "No space left on device"),
    IndexError("chunk 99 outside the primary buffer (0..15)"),
    RuntimeError("anything else \N{SNOWMAN} \udcff"),
]


def round_trip(slot: int, result):
    buf = bytearray(encode_result(slot, result))
    (got,) = take_results(buf)
    assert not buf
    return got


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_survives_the_pipe(outcome):
    assert round_trip(7, outcome) == (7, 0, 0, outcome)


@pytest.mark.parametrize("reason", list(Failure))
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_failure_reason_and_error_survives_the_pipe(reason, error):
    slot, _kind, _errno, got = round_trip(3, Failed(reason, error))
    assert slot == 3 and isinstance(got, Failed)
    assert got.reason is reason
    if error is None:
        assert got.error is None
        return
    known = next((t for t in ERROR_TYPES[1:] if t is not Exception and isinstance(error, t)), None)
    if known is None:  # any other exception arrives as a RuntimeError with its repr
        assert isinstance(got.error, RuntimeError) and repr(error)[:200] in str(got.error)
        return
    assert type(got.error) is type(error)  # OSError comes back as its errno's subclass
    if isinstance(error, BlockFileError):
        assert isinstance(got.error, BlockFileError)
        assert (got.error.reason, got.error.quarantined_to, got.error.left_because) == (
            error.reason,
            error.quarantined_to,
            error.left_because,
        )
        assert str(got.error) == str(error)
    elif isinstance(error, OSError):
        assert isinstance(got.error, OSError)
        assert (got.error.errno, got.error.strerror, got.error.filename) == (
            error.errno,
            error.strerror,
            error.filename,
        )
    else:
        assert str(got.error) == str(error)


def test_records_split_anywhere_are_reassembled():
    stream = b"".join(
        [
            hello_record(4242),
            *(
                encode_result(i, Failed(Failure.CORRUPT, _bad_file(Corruption.BAD_CHECKSUM)))
                for i in range(3)
            ),
        ]
    )
    buf, got = bytearray(), []
    for i in range(0, len(stream), 5):  # the pipe delivers arbitrary pieces
        buf += stream[i : i + 5]
        got += take_results(buf)
    assert not buf
    assert got[0] == (0, HELLO, 4242, None)
    assert [slot for slot, *_ in got[1:]] == [0, 1, 2]


@pytest.mark.parametrize("chunk", [0, 2**32, -1, -(2**70), 2**70])
def test_any_chunk_index_fits_the_job_record(chunk):
    buf = bytearray(job_record(1, 5, [chunk], [b"k" * 36]))
    ((op, slot, chunks, keys),) = take_jobs(buf)
    assert (op, slot, keys) == (1, 5, [b"k" * 36])
    # Out of i64 it travels as -1: out of range either way, the worker fails it.
    assert chunks == [chunk if -(2**63) <= chunk < 2**63 else -1]


def test_a_slice_of_blocks_travels_in_one_record_split_anywhere():
    """A slice (several blocks of one job) is one record; the pipe may
    deliver it, and the stop record after it, in any pieces."""
    keys = [bytes([i]) * (32 + i) for i in range(5)]
    stream = job_record(2, 9, [10, 11, 12, 13, 14], keys) + stop_record()
    buf, got = bytearray(), []
    for i in range(0, len(stream), 7):
        buf += stream[i : i + 7]
        got += take_jobs(buf)
    assert not buf
    assert got == [(2, 9, [10, 11, 12, 13, 14], keys), (3, 0, [], [])]
    assert JOB.size == 5  # op, slot, count: the header of every record
