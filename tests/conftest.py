import os
import shutil
import subprocess
import sys
import uuid
from typing import NamedTuple

import pytest

from tests.kits import timing_kit
from tests.kits.e2e_kit import e2e_base, e2e_env  # noqa: F401  (session fixtures: vllm serve)
from tests.kits.engine_kit import (  # noqa: F401  (engine fixtures)
    engine_clock,
    engines,
    gate_for,
    gate_on,
    io_mode,
)
from tests.kits.gluster_kit import gluster  # noqa: F401  (session fixture: GlusterFS mounted twice)
from tests.kits.nfs_kit import MOUNT_A_ENV, MOUNT_B_ENV, NO_VLLM_ENV, in_guest
from tests.kits.volume_kit import bind_mount  # noqa: F401  (fixture: a bind mount until teardown)

SHM = "/dev/shm"


class _NoVllm:
    """Import hook of the NFS guest's CI batch: importing vLLM there costs
    ~6 min of emulated CPU (measured), so its tests skip (``importorskip``)
    and run in the guest's vLLM batch instead (tests/system/test_nfs.py)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("vllm", "torch"):
            # ModuleNotFoundError: what pytest.importorskip turns into a skip.
            raise ModuleNotFoundError(
                f"{name}: not imported in the NFS guest's CI batch ({NO_VLLM_ENV})", name=name
            )


if os.environ.get(NO_VLLM_ENV) == "1":
    sys.meta_path.insert(0, _NoVllm())


def _tmpfs_dir() -> str:
    path = f"{SHM}/llmkv_fs_test_{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    return path


# "nfs" exists only inside the NFS guest that tests/system/test_nfs.py boots (the
# mounts are there only); it passes the two client mounts in the environment.
FILESYSTEMS = ["tmpfs", "ext4", "gluster"] + (["nfs"] if in_guest() else [])


def _nfs_dir() -> tuple[str, str]:
    """A fresh directory on the guest's NFS export: (path via client A, the
    same directory via client B)."""
    name = f"llmkv_fs_test_{uuid.uuid4().hex[:10]}"
    path_a = os.path.join(os.environ[MOUNT_A_ENV], name)
    os.makedirs(path_a)
    return path_a, os.path.join(os.environ[MOUNT_B_ENV], name)


def _gluster_dir(request) -> tuple[str, str]:
    """A fresh directory on the session's GlusterFS volume: (path via mount A,
    the same directory via mount B). Brings the volume up on first use."""
    vol = request.getfixturevalue("gluster")
    name = f"llmkv_fs_test_{uuid.uuid4().hex[:10]}"
    path_a = os.path.join(vol.mount_a, name)
    os.makedirs(path_a)
    return path_a, os.path.join(vol.mount_b, name)


@pytest.fixture(params=FILESYSTEMS)
def volume(request, tmp_path):
    """A root directory on each real filesystem we support: tmpfs (/dev/shm),
    the disk under pytest's tmp_path (ext4 on CI) and a GlusterFS volume
    through FUSE (skipped where the machine cannot provide one)."""
    if request.param == "tmpfs":
        path = _tmpfs_dir()
        yield path
        shutil.rmtree(path, ignore_errors=True)
    elif request.param == "ext4":
        path = tmp_path / "kv"
        path.mkdir()
        yield str(path)
    elif request.param == "nfs":
        path, _ = _nfs_dir()
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        path, _ = _gluster_dir(request)
        yield path
        shutil.rmtree(path, ignore_errors=True)


class SharedVolume(NamedTuple):
    """One cache root as two replicas see it: ``a`` and ``b`` name the same
    directory -- the same path on a local filesystem, the same directory
    through two independent FUSE clients (two "nodes") on GlusterFS,
    through two kernel NFS clients with their own caches on NFS."""

    a: str
    b: str
    fs: str

    @property
    def is_network(self) -> bool:
        return self.a != self.b


@pytest.fixture(params=FILESYSTEMS)
def shared_volume(request, tmp_path):
    if request.param == "tmpfs":
        path = _tmpfs_dir()
        yield SharedVolume(path, path, "tmpfs")
        shutil.rmtree(path, ignore_errors=True)
    elif request.param == "ext4":
        path = tmp_path / "kv"
        path.mkdir()
        yield SharedVolume(str(path), str(path), "ext4")
    elif request.param == "nfs":
        path_a, path_b = _nfs_dir()
        yield SharedVolume(path_a, path_b, "nfs")
        shutil.rmtree(path_a, ignore_errors=True)
    else:
        path_a, path_b = _gluster_dir(request)
        yield SharedVolume(path_a, path_b, "gluster")
        shutil.rmtree(path_a, ignore_errors=True)


@pytest.fixture
def disk_root(tmp_path):
    path = tmp_path / "kv"
    path.mkdir()
    return str(path)


@pytest.fixture
def replicas():
    """Collects Replica objects and shuts them down at teardown."""
    made = []
    yield made
    for replica in reversed(made):
        replica.close()


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(size="16m", options="") -> path of a real tmpfs of our own
    (nobody else writes to it: exact space and atime behaviour); unmounted at
    teardown. Needs root, else the test is skipped."""
    mounted: list[str] = []

    def mount(size: str = "16m", options: str = "") -> str:
        mountpoint = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        mountpoint.mkdir()
        opts = ",".join(filter(None, [f"size={size}", options]))
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(str(mountpoint))
        return str(mountpoint)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", path], check=False)


# The fast lane (plain ``pytest``) runs every test on tmpfs and the machine's
# own disk; a test on another filesystem, or one that needs a server, a
# guest or a long run, is in the integration lane (``-m integration``; the
# README's test command runs both: ``-m ""``).
INTEGRATION_FS = frozenset(("ext4", "gluster", "nfs"))


def _integration(item) -> bool:
    if item.get_closest_marker("integration") is not None:
        return True
    if "gluster" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    # Any parameter naming such a filesystem (volume, shared_volume, medium,
    # or a test's own), as its id shows it.
    return callspec is not None and not INTEGRATION_FS.isdisjoint(callspec.id.split("-"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "integration: a test of the integration lane -- ext4 mounts, GlusterFS, an NFS guest, "
        "a real vllm serve, the soak or the demo (added by tests/conftest.py to every test on "
        "those filesystems); plain pytest deselects it, -m '' runs everything",
    )
    config.addinivalue_line(
        "markers",
        "threads_only(reason): the test injects its fault into the engine's own process "
        "(a monkeypatched BlockIO) to check owner-side behaviour that both modes share; "
        "its workers variant is deselected, with the reason in the marker",
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    """Mark the integration lane (see INTEGRATION_FS); drop the workers
    variant of tests marked threads_only (see above)."""
    keep, drop = [], []
    for item in items:
        if _integration(item):
            item.add_marker(pytest.mark.integration)
        callspec = getattr(item, "callspec", None)
        workers = callspec is not None and callspec.params.get("io_mode") == 2
        (drop if workers and item.get_closest_marker("threads_only") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_MODE_SECONDS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    """Time per engine mode (setup, call and teardown of each test), for the
    summary below: what running every engine test in both modes costs CI."""
    params = getattr(report, "_llmkv_mode", None)
    if params is None:
        return
    _MODE_SECONDS.setdefault(params, []).append(report.duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    callspec = getattr(item, "callspec", None)
    mode = callspec.params.get("io_mode") if callspec is not None else None
    if mode is not None:
        outcome.get_result()._llmkv_mode = "workers" if mode else "threads"


def pytest_terminal_summary(terminalreporter):
    # Last: where the integration lane's minutes went (tests/kits/timing_kit.py).
    for line in timing_kit.summary():
        terminalreporter.write_line("slow fixture: " + line)
    if not _MODE_SECONDS:
        return
    parts = []
    for mode in ("threads", "workers"):
        seconds = _MODE_SECONDS.get(mode, [])
        # Three reports per test (setup, call, teardown).
        parts.append(f"{mode} {len(seconds) // 3} tests {sum(seconds):.0f}s")
    terminalreporter.write_line("io_mode time: " + ", ".join(parts))
