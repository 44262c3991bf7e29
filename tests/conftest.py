import os
import shutil
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/harness.py, tests/engine_kit.py

from engine_kit import engines, gate_for  # noqa: E402,F401  (engine fixtures)

SHM = "/dev/shm"


def _tmpfs_dir() -> str:
    path = f"{SHM}/llmkv_fs_test_{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    return path


@pytest.fixture(params=["tmpfs", "ext4"])
def volume(request, tmp_path):
    """A root directory on each real local filesystem we support: tmpfs
    (/dev/shm) and the disk under pytest's tmp_path (ext4 on CI)."""
    if request.param == "tmpfs":
        path = _tmpfs_dir()
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        path = tmp_path / "kv"
        path.mkdir()
        yield str(path)


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
