"""Issue 20: on memory filesystems the payload is hashed in pieces next to
each read or write, and the piece depends on who moves the bytes -- 1 MiB
for I/O threads in vLLM's process (each piece is one more GIL hand-off),
256 KiB for worker processes (no GIL; 14 busy workers evict a 1 MiB piece
before it is hashed). Both measured: engine/startup/io_setup.py. Sealed
blocks likewise: threads seal a whole block (up to 4 MiB) in one cipher
call, workers 256 KiB pieces, on every medium.

What a worker process moves blocks with is what it was started with: the
launch spec on its command line, read here from /proc. Real tmpfs and ext4,
real worker processes, bytes checked through both.
"""

from __future__ import annotations

import pytest

from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.workers.crew import WorkerLaunch
from tests.kits.engine_kit import inside, round_trip, worker_engine


def worker_options(pid: int) -> IoOptions:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    launch = WorkerLaunch.decoded(argv[3].decode())  # python -c CODE LAUNCH
    (root,) = launch.step.roots  # one root here
    return root.options


@pytest.mark.parametrize("medium", ["tmpfs", "ext4"])
def test_workers_hash_and_seal_in_smaller_pieces_than_threads(medium, mount_tmpfs, tmp_path):
    base = mount_tmpfs("64m") if medium == "tmpfs" else str(tmp_path)
    # 2 MiB blocks: larger than either piece, so both paths hash in pieces.
    engine, primary = worker_engine(f"{base}/kv", 8, 2 << 20)
    try:
        threads_piece = engine.roots[0].blockio.options.hash_chunk
        pieces = [worker_options(pid).hash_chunk for pid in inside(engine).executor.worker_pids()]
        if medium == "tmpfs":
            assert threads_piece == 1 << 20
            assert pieces == [256 << 10, 256 << 10]
        else:  # a disk: one large read matters more than the cache
            assert threads_piece == 0 and pieces == [0, 0]
        assert engine.roots[0].blockio.options.seal_piece == 4 << 20
        assert [
            worker_options(pid).seal_piece for pid in inside(engine).executor.worker_pids()
        ] == [256 << 10] * 2
        round_trip(engine, primary, 8)
    finally:
        engine.shutdown()
