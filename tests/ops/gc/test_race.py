"""gc removing directories while a writer process stores blocks into them:
the writer must never fail. The writer is the tier's real store path
(``BlockIO.store``) in its own process -- on GlusterFS through the second
mount, like a replica on another node; gc runs as its own process.

The two deterministic tests stop the writer (by wrapping a function in the
writer process only) exactly inside the window where gc's rmdir hurts, wait
until a real gc run has removed the directory, then let the writer go on.
The stress test lets both run freely."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys

from tests.kits.engine_kit import wait_until
from tests.kits.gc_kit import (
    DAY,
    PAYLOAD,
    block_bytes,
    gc_env,
    gc_process,
    gc_run,
    make_digest,
    put_block,
    running,
    stop_watch,
)

WRITER = r"""
import json, os, posixpath, sys, time
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.layout.paths import CacheLayout

root, hook = sys.argv[1], sys.argv[2]
spec = json.loads(sys.stdin.readline())
layout = CacheLayout(root, spec["run_config"], 0)
io = BlockIO(layout, IoOptions(block_size=spec["payload"], use_o_direct=False,
                               fsync_file=False, fsync_dir=False, checksum=True))
race_dir = spec.get("race_dir")

def gone(path):
    # Open the parent first: on NFS that revalidates it (close-to-open), so a
    # name removed through the other client is not kept alive by this
    # client's cache (NFS v3 held it past the 60 s limit).
    try:
        os.close(os.open(posixpath.dirname(path), os.O_RDONLY | os.O_DIRECTORY))
        os.lstat(path)
    except FileNotFoundError:
        return True
    return False

def hold_until_gone(path, what):
    # Held until the test says gc has finished (a line on stdin), not for a
    # time: starting gc in the emulated NFS guest beside two busy loops took
    # longer than the 60 s this wait once allowed from here. The deadline
    # only bounds how long this client's cache may still show the removed name.
    print(what, flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 60
    while not gone(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} was never removed")
        time.sleep(0.002)

if hook == "open":
    # Stop right before the temp file's open -- made relative to the
    # descriptor of the block's directory, resolved (and made) by then.
    real_open, armed = os.open, [True]
    def hooked_open(path, *args, **kwargs):
        if armed[0] and isinstance(path, str) and path.endswith(".tmp"):
            armed[0] = False
            hold_until_gone(race_dir, "at-open")
        return real_open(path, *args, **kwargs)
    os.open = hooked_open
elif hook == "parent":
    # Stop right before the first mkdir of the block's directory (a name
    # relative to the descriptor of its parent, which the walk holds) until
    # gc has removed that parent. Whatever the walk checked before, the
    # parent is gone now.
    real_mkdir, armed = os.mkdir, [True]
    def hooked_mkdir(path, *args, **kwargs):
        if armed[0] and path == posixpath.basename(spec["trigger"]):
            armed[0] = False
            hold_until_gone(race_dir, "at-mkdir")
        return real_mkdir(path, *args, **kwargs)
    os.mkdir = hooked_mkdir

print("ready", flush=True)
outcomes, failed = [], []
for hexkey in spec["keys"]:
    key = bytes.fromhex(hexkey)
    data = bytes.fromhex(spec["data"][hexkey])
    try:
        outcomes.append(io.store(key, memoryview(bytearray(data))).value)
    except Exception as exc:
        failed.append(f"{hexkey[:12]}: {exc!r}")
print(json.dumps({"outcomes": outcomes, "failed": failed}), flush=True)
"""


def hkey(hex_prefix: str, i, seed: str) -> bytes:
    """A key whose block hash starts with ``hex_prefix`` (so it lands in a
    chosen ``<hhh>/<hh>_g0`` directory)."""
    rest = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
    return bytes.fromhex(hex_prefix + rest[len(hex_prefix) :]) + (0).to_bytes(4, "big")


def payload(k: bytes) -> bytes:
    return block_bytes(k)[:PAYLOAD]


def start_writer(
    root: str, hook: str, layout, keys, race_dir: str | None = None, trigger: str | None = None
):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, root, hook],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gc_env(),
    )
    spec = {
        "run_config": layout.run_config,
        "payload": PAYLOAD,
        "race_dir": race_dir,
        "trigger": trigger,
        "keys": [k.hex() for k in keys],
        "data": {k.hex(): payload(k).hex() for k in keys},
    }
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    return proc


def next_line(proc) -> str:
    # Byte by byte from the pipe itself: proc.stdout.readline() may buffer the
    # writer's later lines, which writer_result's communicate() (reading the
    # pipe beneath that buffer) would then never see -- seen under load.
    raw = bytearray()
    while (byte := os.read(proc.stdout.fileno(), 1)) not in (b"", b"\n"):
        raw += byte
    line = raw.decode()
    if not line:
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"writer exited early: {proc.returncode}\n{out}\n{err}")
    return line.strip()


def gc_finished(proc) -> None:
    """Let a writer held at its hook go on: gc has removed the directory."""
    proc.stdin.write("gc finished\n")
    proc.stdin.flush()


def writer_result(proc) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def assert_block(path: str, k: bytes) -> None:
    # Open every directory down to the block first, as the engine's lookup
    # does after a miss: this client's gc removed them, and an NFS client
    # keeps names it saw removed "missing" for 30-60 s after the writer's
    # client created them again (docs/reliability.md, NFS).
    parts = path.split("/")
    for depth in range(2, len(parts)):
        with contextlib.suppress(OSError):
            os.close(os.open("/".join(parts[:depth]), os.O_RDONLY | os.O_DIRECTORY))
    with open(path, "rb") as f:
        assert f.read()[:PAYLOAD] == payload(k)


GC_EVICT = ("--max-bytes", "0", "--protect", "10m", "--high", "off")


def test_gc_removes_the_directory_right_before_the_writers_open(shared_volume):
    """Leaf and parent both go between the writer's check and its open: the
    open relative to the removed directory's descriptor fails with ENOENT
    (nothing lands in a removed directory), the store resolves and
    recreates the directories and goes on."""
    (layout,) = make_digest(shared_volume.a, "acme/race")
    x = hkey("", 0, "x")
    y = hkey(x.hex()[:5], 1, "y")  # an old block in x's directory: gc empties it
    old = put_block(layout, y, DAY)
    (writer_layout,) = make_digest(shared_volume.b, "acme/race")
    leaf_b = os.path.dirname(writer_layout.block_path(x))
    assert os.path.dirname(layout.block_path(x)) == os.path.dirname(old)

    writer = start_writer(shared_volume.b, "open", writer_layout, [x], race_dir=leaf_b)
    assert next_line(writer) == "ready"
    assert next_line(writer) == "at-open"
    done = gc_run(shared_volume.a, *GC_EVICT, "--json")
    gc_finished(writer)
    assert done.returncode == 0, done.stderr
    # It removed <hh>_g0, and <hhh> too where nothing else is left in it.
    assert json.loads(done.stdout)["dirs_pruned"] in (1, 2)

    result = writer_result(writer)
    assert result == {"outcomes": ["written"], "failed": []}
    assert_block(layout.block_path(x), x)


def test_gc_removes_the_parent_before_the_writers_mkdir(shared_volume):
    """The block's ``<hh>_g0`` is missing, its ``<hhh>`` holds only an old
    block elsewhere; ``<hhh>`` goes after the writer's open failed and before
    it creates ``<hh>_g0`` in it: the directory creation must go up a level
    and retry, not fail. (At 65ba7cd ``BlockIO._create_temp`` called
    ``os.makedirs``, which checks the parent, then raises FileNotFoundError
    from the child's mkdir: this test failed there.)"""
    (layout,) = make_digest(shared_volume.a, "acme/race")
    x = hkey("", 0, "x")
    hhh = x.hex()[:3]
    sibling = hkey(hhh + ("00" if x.hex()[3:5] != "00" else "01"), 1, "z")
    old = put_block(layout, sibling, DAY)  # the only thing in <hhh>
    (writer_layout,) = make_digest(shared_volume.b, "acme/race")
    hhh_b = f"{writer_layout.rank_dir}/{hhh}"
    leaf_b = os.path.dirname(writer_layout.block_path(x))

    writer = start_writer(
        shared_volume.b, "parent", writer_layout, [x], race_dir=hhh_b, trigger=leaf_b
    )
    assert next_line(writer) == "ready"
    assert next_line(writer) == "at-mkdir"
    done = gc_run(shared_volume.a, *GC_EVICT, "--json")
    gc_finished(writer)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dirs_pruned"] == 2  # <hh>_g0 of the old block, <hhh>
    assert not os.path.exists(old)

    result = writer_result(writer)
    assert result == {"outcomes": ["written"], "failed": []}
    assert_block(layout.block_path(x), x)


def test_writer_never_fails_while_gc_keeps_emptying_its_directories(shared_volume):
    """Free-running: 200 buckets each hold one old block; a --watch gc evicts
    them and prunes, while the writer stores a new block into every bucket."""
    (layout,) = make_digest(shared_volume.a, "acme/stress")
    new = [hkey("", i, "new") for i in range(200)]
    olds = [put_block(layout, hkey(k.hex()[:5], i, "old"), DAY) for i, k in enumerate(new)]
    (writer_layout,) = make_digest(shared_volume.b, "acme/stress")

    writer = start_writer(shared_volume.b, "none", writer_layout, new)
    assert next_line(writer) == "ready"
    with running(gc_process(shared_volume.a, *GC_EVICT, "--watch", "0", "--json")) as watcher:
        result = writer_result(writer)
        assert result["failed"] == []
        assert sorted(set(result["outcomes"])) == ["written"]
        wait_until(
            lambda: not any(os.path.exists(p) for p in olds),
            "gc to evict every old block",
            deadline_s=120,
        )
        passes = stop_watch(watcher)
    assert passes and all(p["error_count"] == 0 for p in passes)
    for k in new:  # every new block is there (protected), byte exact
        assert_block(layout.block_path(k), k)
