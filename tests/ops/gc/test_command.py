"""gc as operators run it: real processes (``python -m llmkv_fs gc``), the
volume lock, --watch and SIGTERM, the progress line on a terminal, and
watermark eviction on a real, small tmpfs."""

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios

import pytest

from llmkv_fs.layout.names import gc_lock_path
from llmkv_fs.ops.gc import EXIT_BUSY
from tests.kits.engine_kit import wait_until
from tests.kits.gc_kit import (
    DAY,
    DEADLINE_S,
    cache_entries,
    dead_pid,
    gc,
    gc_env,
    gc_process,
    gc_run,
    key,
    lock_held,
    make_digest,
    put_block,
    put_lease,
    put_temp,
    read_line,
    running,
)

OLD = 8 * DAY


def build_tree(root: str, blocks: int = 100):
    """An orphan, a live digest with old blocks and dead temp files."""
    orphan = make_digest(root, "acme/orphan", config_age=OLD)
    for i in range(20):
        put_block(orphan[0], key(i, "orphan"), OLD, OLD)
    live = make_digest(root, "acme/live")
    put_lease(live[0], os.getpid())
    paths = [put_block(live[0], key(i, "live"), DAY) for i in range(blocks)]
    gone = dead_pid()
    temps = [put_temp(live[0], key(i, "tmp"), gone) for i in range(10)]
    return orphan, live, paths, temps


# -- without vLLM ----------------------------------------------------------------------

BLOCKER = r"""
import sys, runpy
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'torch'):
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
sys.argv = ['python -m llmkv_fs', 'gc'] + sys.argv[1:]
try:
    runpy.run_module('llmkv_fs', run_name='__main__')
except SystemExit as exc:
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))
    assert not heavy, heavy
    raise
"""


def test_python_m_runs_without_vllm_or_torch(volume):
    orphan, _live, _paths, _temps = build_tree(volume, blocks=5)
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, volume, "--json", "--high", "off"],
        capture_output=True,
        text=True,
        env=gc_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["digests_removed"] == 1 and report["temps"]["removed"] == 10
    assert not os.path.exists(orphan[0].base_path)
    # And the console script's subcommand, checked the same way.
    check = (
        "import sys; from llmkv_fs.cli import main; rc = main(sys.argv[1:]); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check, "gc", volume, "--dry-run"],
        capture_output=True,
        text=True,
        env=gc_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "dry run: nothing changed" in done.stdout


# -- the lock ----------------------------------------------------------------------------


def wait_blocked_on_lock(proc: subprocess.Popen, root: str) -> None:
    """Until ``proc`` (a ``gc --wait``) has the volume's lock file open: it
    installed its SIGTERM handler before opening it (ops/gc/command.py), and
    with the lock held elsewhere it is then in the lock's wait loop. A fixed
    wait instead passed vacuously, or signalled a process still starting
    (killed by SIGTERM's default action), on a loaded machine."""
    lock = os.path.realpath(gc_lock_path(root))

    def has_it_open() -> bool:
        assert proc.poll() is None, proc.communicate()
        fds = f"/proc/{proc.pid}/fd"
        for fd in os.listdir(fds):
            try:
                if os.path.realpath(os.readlink(f"{fds}/{fd}")) == lock:
                    return True
            except OSError:  # closed meanwhile
                pass
        return False

    wait_until(has_it_open, f"gc {proc.pid} waiting on {lock}", deadline_s=DEADLINE_S)


def test_second_gc_is_refused_or_waits(disk_root):
    orphan, _live, _paths, _temps = build_tree(disk_root, blocks=5)
    with lock_held(disk_root) as holder:
        busy = gc_run(disk_root, "--high", "off")
        assert busy.returncode == EXIT_BUSY
        assert "another gc holds" in busy.stderr and f"pid={holder.pid}" in busy.stderr
        assert "--wait" in busy.stderr
        assert os.path.exists(orphan[0].base_path)  # it did nothing

        waiting = gc_process(disk_root, "--high", "off", "--wait", "--json")
        wait_blocked_on_lock(waiting, disk_root)
        # It stays blocked while the lock is held...
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=1.0)
        assert os.path.exists(orphan[0].base_path)
        holder.stdin.close()  # ...and runs once it is released.
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert json.loads(out)["digests_removed"] == 1


def test_gc_lock_holds_across_clients_and_dies_with_its_holder(shared_volume):
    """The lock taken through one client (lockf: NLM on NFSv3, a lock state
    on v4, the posix-locks translator on GlusterFS) refuses a gc through the
    other; a gc waiting there runs once the holder is SIGKILLed."""
    orphan, _live, _paths, _temps = build_tree(shared_volume.a, blocks=5)
    with lock_held(shared_volume.a) as holder:
        busy = gc_run(shared_volume.b, "--high", "off")
        assert busy.returncode == EXIT_BUSY, busy.stderr
        assert f"pid={holder.pid}" in busy.stderr
        with running(gc_process(shared_volume.b, "--high", "off", "--wait", "--json")) as waiting:
            wait_blocked_on_lock(waiting, shared_volume.b)
            with pytest.raises(subprocess.TimeoutExpired):
                waiting.wait(timeout=1.0)
            assert os.path.exists(orphan[0].base_path)
            holder.kill()  # no unlock: the lock must not outlive its process
            out, err = waiting.communicate(timeout=120)
            assert waiting.returncode == 0, err
            assert json.loads(out)["digests_removed"] == 1


def test_concurrent_gc_runs_do_not_fight(volume):
    orphan, live, _paths, _temps = build_tree(volume)
    runs = [
        gc_process(volume, "--json", "--max-bytes", "0", "--protect", "0", "--high", "off")
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in runs]
    statuses = sorted(r[0] for r in results)
    assert set(statuses) <= {0, EXIT_BUSY} and statuses[0] == 0, results
    # Whoever ran, the outcome is one clean gc: all gone, no errors, no trash.
    assert cache_entries(live[0].rank_dir) == set()
    assert not os.path.exists(orphan[0].base_path)
    for status, out, err in results:
        if status == 0:
            assert json.loads(out)["error_count"] == 0
        else:
            assert "another gc holds" in err

    # With --wait they queue up: all succeed, exactly one found the work.
    build_tree(volume)
    runs = [
        gc_process(
            volume, "--json", "--wait", "--max-bytes", "0", "--protect", "0", "--high", "off"
        )
        for _ in range(3)
    ]
    reports = []
    for p in runs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    assert sum(r["digests_removed"] for r in reports) == 1
    assert sum(r["temps"]["removed"] for r in reports) == 10
    assert sum(r["capacity"]["evicted_blocks"] for r in reports) == 100
    assert all(r["error_count"] == 0 for r in reports)


# -- --watch and SIGTERM ---------------------------------------------------------------


def test_watch_loops_until_sigterm_and_exits_zero(disk_root):
    _orphan, live, _paths, _temps = build_tree(disk_root, blocks=5)
    with running(gc_process(disk_root, "--watch", "0.05", "--json", "--high", "off")) as watcher:
        first = json.loads(read_line(watcher.stdout))
        assert first["digests_removed"] == 1
        # It keeps going: a temp file of a dead writer planted now is removed
        # by a later pass.
        late = put_temp(live[0], key(1, "late"), dead_pid())
        wait_until(
            lambda: not os.path.exists(late),
            "a later pass to remove the temp file",
            deadline_s=DEADLINE_S,
        )
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0


def test_sigterm_while_waiting_for_the_lock_exits_zero(disk_root):
    with lock_held(disk_root), running(gc_process(disk_root, "--watch", "1h", "--wait")) as watcher:
        wait_blocked_on_lock(watcher, disk_root)
        with pytest.raises(subprocess.TimeoutExpired):
            watcher.wait(timeout=1.0)  # blocked on the lock
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0


# -- progress on a terminal -------------------------------------------------------------


def test_progress_line_only_on_a_terminal(disk_root):
    build_tree(disk_root, blocks=50)
    master, slave = pty.openpty()
    # A terminal has a size (a bare pty has 0 columns, and tqdm fits its line to that).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmkv_fs", "gc", disk_root, "--dry-run"],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=gc_env(),
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, "gc produced no terminal output"
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    tty = b"".join(chunks).decode()
    assert "\rgc: scanning 2 digests" in tty
    cleared = tty.rsplit("\r", 2)
    assert cleared[-1] == "" and cleared[-2].strip() == ""  # the line is cleared when done
    assert b"\r" not in out  # stdout (a pipe) got the plain summary
    # Not a terminal: no progress at all.
    done = gc_run(disk_root, "--dry-run")
    assert done.returncode == 0 and done.stderr == ""


# -- watermarks on a real small volume --------------------------------------------------------


@pytest.fixture
def tmpfs16(mount_tmpfs):
    return mount_tmpfs("16m")


def used_percent(root: str) -> float:
    st = os.statvfs(root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return 100.0 * used / (used + st.f_bavail * st.f_frsize)


def test_watermarks_evict_lru_until_below_low(tmpfs16, capsys):
    layouts = make_digest(tmpfs16, "acme/full")
    put_lease(layouts[0], os.getpid())
    mib = 1 << 20
    # 12 x 1 MiB blocks: block i last used (12 - i) hours ago; the two
    # newest were loaded within --protect.
    paths = [
        put_block(layouts[0], key(i), DAY, used_ago=(12 - i) * 3600, payload=mib - 4096)
        for i in range(10)
    ]
    paths += [put_block(layouts[0], key(i), DAY, used_ago=60, payload=mib - 4096) for i in (10, 11)]
    assert used_percent(tmpfs16) > 70

    status, report = gc(tmpfs16, "--high", "60", "--low", "30", "--protect", "10m", capsys=capsys)
    assert status == 0, report
    assert used_percent(tmpfs16) <= 30
    kept = [i for i, p in enumerate(paths) if os.path.exists(p)]
    assert kept == list(range(12 - len(kept), 12))  # the most recently used survive
    assert len(kept) >= 3 and {10, 11} <= set(kept)
    assert "high 60%" in report["capacity"]["why"]
    assert os.path.exists(layouts[0].config_path)

    # Below the high mark nothing more goes.
    status, report = gc(tmpfs16, "--high", "60", "--low", "10", capsys=capsys)
    assert report["capacity"]["evicted_blocks"] == 0
    assert [os.path.exists(paths[i]) for i in kept] == [True] * len(kept)


def test_watermark_cannot_touch_protected_blocks(tmpfs16, capsys):
    layouts = make_digest(tmpfs16, "acme/hot")
    paths = [
        put_block(layouts[0], key(i), DAY, used_ago=30, payload=(1 << 20) - 4096) for i in range(12)
    ]
    status, report = gc(tmpfs16, "--high", "50", "--low", "20", "--protect", "10m", capsys=capsys)
    assert status == 0
    assert all(os.path.exists(p) for p in paths)
    assert report["capacity"]["evicted_blocks"] == 0
    assert report["capacity"]["short_bytes"] > 0
    human = subprocess.run(
        [sys.executable, "-m", "llmkv_fs", "gc", tmpfs16, "--high", "50", "--dry-run"],
        capture_output=True,
        text=True,
        env=gc_env(),
    )
    assert "short by" in human.stdout and "--protect 10m" in human.stdout
