"""Fault matrix, crashes: a writer process SIGKILLed at random points while
it stores 2 MiB blocks (tmpfs, ext4, GlusterFS), and what each durability
mode asks of the kernel, seen with strace.

The writer is the real store path (FsEngine -> BlockIO.store, in its I/O
threads or its worker processes: the test's io_mode) in a forked process;
the reader is a real vLLM TieringOffloadingManager.
"""

import dataclasses
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine, Outcome
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.volume.leases import pid_alive
from tests.kits.engine_kit import IO_WORKERS_ENV, Gate, inside, memfd_primary
from tests.kits.matrix_kit import (
    BLOCK,
    HIT,
    Forked,
    TierClock,
    block_problem,
    record,
    served,
    temp_owner,
)
from tests.kits.tier_kit import (
    Replica,
    assert_io_mode,
    make_keys,
    offloading_config,
    ours,
    payload_for,
    wait_until,
)
from tests.kits.volume_kit import block_files, files_under

TRIALS = int(os.environ.get("LLMKV_FS_MATRIX_TRIALS", "10"))  # per filesystem
SEED = int(os.environ.get("LLMKV_FS_MATRIX_SEED", "5"))
KEYS_PER_TRIAL = 8
# Our tiers in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")


def _write(layout, keys_hex: list[str], ready_fd: int, io_workers: int, pause_dir: str) -> dict:
    """Child: store every key through a real engine (with the test's pause
    points), as fast as it can. It says when it is ready (b"!"), with its
    worker pids (the writers of its temp files), then when every block is
    written (b".")."""
    keys = [bytes.fromhex(k) for k in keys_hex]
    primary = memfd_primary(len(keys) * BLOCK)  # worker processes can map it
    for i, key in enumerate(keys):
        primary[i * BLOCK : (i + 1) * BLOCK] = payload_for(key, BLOCK)
    settings = TierSettings(
        root_dir=layout.root_dir,
        n_read_threads=1,
        n_write_threads=2,
        lookup_threads=1,
        io_workers=io_workers,
    )
    engine = FsEngine(settings, layout, primary, BLOCK, pause=PausePoints(pause_dir))
    assert engine.io_workers == io_workers
    pids = ",".join(str(pid) for pid in inside(engine).executor.worker_pids())
    os.write(ready_fd, f"!{pids}\n".encode())
    for start in range(0, len(keys), 2):
        engine.submit_store(
            start, keys[start : start + 2], list(range(start, min(start + 2, len(keys))))
        )
    while engine.has_pending_work():
        engine.take_finished()
        time.sleep(0.0005)
    os.write(ready_fd, b".")  # every block is written
    engine.shutdown()
    return {"written": engine.counters[Outcome.WRITTEN]}


@dataclasses.dataclass
class Writer:
    child: Forked
    started: float  # when it started storing
    pipe: int  # what it reports on (closed by the caller once the child is gone)
    workers: list[int]  # its I/O worker processes' pids (none with threads)

    @property
    def pids(self) -> set[int]:
        """Every process that may have written a temp file of it."""
        return {self.child.pid, *self.workers}


def _start_writer(layout, keys, pause_dir: str) -> Writer:
    """Fork a writer in the test's io mode (as many workers as its threads)."""
    io_workers = 3 if os.environ.get(IO_WORKERS_ENV, "0") != "0" else 0
    ready_r, ready_w = os.pipe()
    child = Forked(_write, layout, [k.hex() for k in keys], ready_w, io_workers, pause_dir)
    os.close(ready_w)
    hello = b""
    while not hello.endswith(b"\n"):
        got = os.read(ready_r, 256)
        assert got, f"writer died before it was ready: {child.result()}"
        hello += got
    assert hello.startswith(b"!"), hello
    workers = [int(pid) for pid in hello[1:-1].decode().split(",") if pid]
    assert len(workers) == io_workers, hello
    return Writer(child, time.monotonic(), ready_r, workers)


def _wait_gone(pids: set[int]) -> None:
    """Until none of ``pids`` runs: a SIGKILLed writer's worker processes die
    with it (PR_SET_PDEATHSIG), but a moment later."""
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), f"{sorted(pids)} to be gone")


def test_sigkill_mid_write_never_publishes_a_torn_file(shared_volume, replicas, io_mode):
    """Every trial: fork a writer of 8 x 2 MiB blocks, SIGKILL it at a random
    instant, then check the volume through the other client: every final
    ``.bin`` is complete and correct, every leftover is a ``.*.tmp`` named
    after the dead pid, and a vLLM reader serves exactly the published keys,
    byte exact. The trial's last block is held before its rename (the
    engine's pause point, in the writer's threads or workers), so every
    kill lands inside the store stream however the machine's load moves
    the writer's pace against the calibration."""
    reader = Replica(offloading_config(tiers=[ours(shared_volume.b)]))
    replicas.append(reader)
    assert_io_mode(reader)
    clock = TierClock(reader.tier)
    writer_layout = dataclasses.replace(
        reader.tier.engine.roots[0].layout, root_dir=shared_volume.a
    )
    rank_dir = reader.tier.engine.roots[0].layout.rank_dir
    rng = random.Random(f"{SEED}-{shared_volume.fs}")

    # Calibration: writers run to the end; kills then land anywhere in the
    # span from the first store to the last block published (the faster of
    # two runs: the first one on a cold volume is slow).
    spans = []
    for run in range(2):
        keys = make_keys(KEYS_PER_TRIAL, seed=f"kill-{shared_volume.fs}-calibrate-{run}")
        writer = _start_writer(writer_layout, keys, io_mode.pause_dir)
        assert os.read(writer.pipe, 1) == b"."
        spans.append(time.monotonic() - writer.started)
        counters = writer.child.result()
        os.close(writer.pipe)
        assert counters["written"] == KEYS_PER_TRIAL, counters
        for path in files_under(rank_dir):
            os.unlink(path)
    span = min(spans)
    # From here on, a held key's block waits with its temp file written,
    # right before its rename, until the writer is killed.
    gate = Gate(reader.tier.engine, io_mode.pause_dir, kinds=("store",), point="publish")
    gate.open()

    figures = {
        "trials": TRIALS,
        "killed_alive": 0,
        "interrupted": 0,
        "temp_left": 0,
        "published": 0,
        "verified": 0,
        "served": 0,
        "wrong": 0,
    }
    for trial in range(TRIALS):
        keys = make_keys(KEYS_PER_TRIAL, seed=f"kill-{shared_volume.fs}-{trial}")
        paths = {reader.tier.engine.roots[0].layout.block_path(k): k for k in keys}
        gate.hold(keys[-1])
        writer = _start_writer(writer_layout, keys, io_mode.pause_dir)
        # A random instant, not a synchronization: the held block keeps the
        # writer storing until the kill, whenever it lands.
        time.sleep(max(0.0, writer.started + rng.uniform(0, span) - time.monotonic()))
        figures["killed_alive"] += writer.child.kill()
        os.close(writer.pipe)
        _wait_gone(writer.pids)
        gate.release(keys[-1])

        published = block_files(rank_dir)
        for path in published:
            assert path in paths, f"trial {trial}: unexpected file {path}"
            problem = block_problem(path, paths[path])
            assert problem is None, (
                f"trial {trial}: torn file under a final name: {path}: {problem}"
            )
        figures["published"] += len(published)
        figures["interrupted"] += len(published) < KEYS_PER_TRIAL
        figures["verified"] += len(published)
        leftovers = [p for p in files_under(rank_dir) if p not in published]
        for path in leftovers:
            name = os.path.basename(path)
            assert name.startswith(".") and name.endswith(".tmp"), f"stray file {path}"
            assert temp_owner(path) in writer.pids, f"{path} is not the dead writer's {writer.pids}"
        figures["temp_left"] += len(leftovers)

        ctx = reader.new_request()
        final, _ = reader.find(keys, ctx)
        hits, wrong = served(reader, keys, final, ctx)
        figures["served"] += hits
        figures["wrong"] += wrong
        assert {k for k, v in final.items() if v is HIT} == {paths[p] for p in published}
        assert wrong == 0
        reader.finish_request(ctx)
        for path in published + leftovers:  # keep the volume small for the next trial
            os.unlink(path)

    gate.close_for_good()
    assert clock.errors == []
    # Every kill landed inside the store stream: the held block never got
    # its final name, and the writer never said it was done.
    assert figures["interrupted"] == figures["killed_alive"] == TRIALS, figures
    record(
        "sigkill_mid_write",
        fs=shared_volume.fs,
        calibration_s=round(span, 3),
        seed=SEED,
        scheduler_exceptions=len(clock.errors),
        **figures,
    )


# -- durability: the syscalls each mode makes -------------------------------------------

STORE_N_BLOCKS = r"""
import hashlib, mmap, os, sys, time
from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine, Outcome
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

root, n, durability, io_workers = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
bs = 1 << 20
layout = CacheLayout.for_identity(root, RunIdentity(
    model_name="m/strace", dtype="bfloat16", tokens_per_hash=16, blocks_per_file=1,
    kv_cache_groups=((16, ("l0",)),)))
fd = os.memfd_create("strace_primary")  # a primary worker processes can map
os.ftruncate(fd, n * bs)
primary = mmap.mmap(fd, n * bs)
os.close(fd)
keys = [hashlib.sha256(b"%d" % i).digest() + bytes(4) for i in range(n)]
engine = FsEngine(TierSettings(root_dir=root, durability=durability, n_read_threads=1,
                               n_write_threads=2, lookup_threads=1, io_workers=io_workers),
                  layout, primary, bs)
assert engine.io_workers == io_workers, engine.io_workers
engine.submit_store(1, keys, list(range(n)))
while engine.has_pending_work():
    engine.take_finished()
    time.sleep(0.001)
engine.shutdown()
print(engine.counters[Outcome.WRITTEN])
"""

N_STRACED = 6
_TID = r"^(?P<tid>\d+)\s+"
_FSYNC = re.compile(_TID + r"(?:fsync|fdatasync)\(\d+<(?P<path>[^>]*)>")
# renameat: the names are relative to directory descriptors (strace -y shows
# their paths: "5</root/kv/...>"), joined below into full paths.
_DIR_FD = r"(?:\d+<(?P<{}>[^>]*)>|[A-Z_]+), "
_RENAME = re.compile(
    _TID
    + r"rename(?:at2?)?\((?:"
    + _DIR_FD.format("srcdir")
    + r")?\"(?P<src>[^\"]+)\", (?:"
    + _DIR_FD.format("dstdir")
    + r")?\"(?P<dst>[^\"]+)\""
)


def _full(directory: str | None, name: str) -> str:
    return os.path.join(directory, name) if directory else name


def _strace_store(
    root: str, durability: str, out: str, io_workers: int
) -> list[tuple[str, str, str, str]]:
    """Store N_STRACED blocks in a child under strace (``-f``: its worker
    processes too); returns its (tid, 'fsync'|'rename', path, rename target)
    events about block files, in order."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    done = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-y",
            "-o",
            out,
            "-e",
            "trace=fsync,fdatasync,rename,renameat,renameat2",
            sys.executable,
            "-c",
            STORE_N_BLOCKS,
            root,
            str(N_STRACED),
            durability,
            str(io_workers),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(N_STRACED)
    events = []
    with open(out) as f:
        for line in f:
            if (m := _FSYNC.match(line)) and "_r0/" in m["path"]:
                events.append((m["tid"], "fsync", m["path"], ""))
            elif (m := _RENAME.match(line)) and m["dst"].endswith(".bin"):
                src, dst = _full(m["srcdir"], m["src"]), _full(m["dstdir"], m["dst"])
                events.append((m["tid"], "rename", src, dst))
    return events


@pytest.mark.parametrize("durability", ["none", "file", "full"])
def test_durability_mode_makes_exactly_its_fsyncs(durability, disk_root, tmp_path, io_mode):
    io_workers = 3 if io_mode.workers else 0
    events = _strace_store(disk_root, durability, str(tmp_path / "strace.out"), io_workers)
    renames = [e for e in events if e[1] == "rename"]
    file_syncs = [e for e in events if e[1] == "fsync" and e[2].endswith(".tmp")]
    dir_syncs = [e for e in events if e[1] == "fsync" and not e[2].endswith((".tmp", ".bin"))]
    assert len(renames) == N_STRACED
    if durability == "none":
        assert file_syncs == [] and dir_syncs == []
    else:
        # The temp file is fsynced by the thread that renames it, before the rename.
        for tid, _, tmp, final in renames:
            before = events[: events.index((tid, "rename", tmp, final))]
            assert (tid, "fsync", tmp, "") in before, f"{final}: no fsync of {tmp} before rename"
        assert len(file_syncs) == N_STRACED
        if durability == "file":
            assert dir_syncs == []
        else:
            # ...and its directory after the rename, so the name is durable too.
            for tid, _, tmp, final in renames:
                after = events[events.index((tid, "rename", tmp, final)) + 1 :]
                assert (tid, "fsync", os.path.dirname(final), "") in after, f"{final}: no dir fsync"
            assert len(dir_syncs) == N_STRACED
    record(
        "durability_strace",
        mode=durability,
        blocks=N_STRACED,
        renames=len(renames),
        file_fsyncs=len(file_syncs),
        dir_fsyncs=len(dir_syncs),
    )
