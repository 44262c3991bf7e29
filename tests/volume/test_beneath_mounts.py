"""Issue 33: another filesystem mounted inside the cache tree is outside the
root too. A tmpfs bind-mounted at a fan-out directory, holding a copy of a
valid block: the block is not served (a lookup miss, a failed load) and a
new store does not go through the mount -- through the engine with I/O
threads and with worker processes (``openat2`` with ``RESOLVE_NO_XDEV``),
and the walk that serves kernels without ``openat2`` compares each level's
device with the root's. Real mounts (root needed; skipped without).
"""

from __future__ import annotations

import os
import shutil

import pytest

from llmkv_fs.engine import Direction
from llmkv_fs.volume.beneath import Beneath, MountInTree
from tests.kits.engine_kit import BS, pattern, row, settle
from tests.volume.test_beneath import MODES, Tree, key_at, link_failures, load, store


@pytest.fixture(params=["tmpfs", "ext4"])
def base(request, tmp_path, mount_tmpfs):
    """The root's filesystem: a tmpfs of its own, or the disk under tmp_path."""
    return mount_tmpfs("64m") if request.param == "tmpfs" else str(tmp_path)


@pytest.fixture
def start(engines, base):
    def make(mode: int):
        engine, layout, primary = engines(f"{base}/kv", 8, io_workers=mode)
        assert engine.io_workers == mode  # worker processes really in use
        return engine, layout, primary

    return make


def plant_a_copy(hhh: str, other: str, bind_mount) -> Tree:
    """The ``<hhh>`` directory's blocks copied onto the filesystem at
    ``other``, which is then mounted over ``<hhh>``; returns it, watched."""
    shutil.copytree(hhh, other, dirs_exist_ok=True)
    outside = Tree(other)
    bind_mount(other, hhh)
    return outside


@pytest.mark.parametrize("mode", MODES)
def test_a_mount_at_a_fanout_dir_is_never_crossed(start, mode, mount_tmpfs, bind_mount):
    engine, layout, primary = start(mode)
    served, new = key_at("abcde", 11), key_at("abcde", 12)  # one <hhh>/<hh>_g directory
    assert store(engine, primary, 1, served).success
    hhh = os.path.dirname(os.path.dirname(layout.block_path(served)))
    outside = plant_a_copy(hhh, mount_tmpfs("16m"), bind_mount)
    assert os.path.isfile(layout.block_path(served))  # a valid block, through the mount

    assert settle(engine, served, "r1") is False
    job = load(engine, 2, served, 1)
    assert not job.success and row(primary, 1) == bytes(BS)
    job = store(engine, primary, 3, new, 2, pattern("new"))
    assert not job.success
    outside.assert_untouched()
    assert link_failures(engine, Direction.LOAD) == 1
    assert link_failures(engine, Direction.STORE) == 1


def test_the_walk_compares_each_level_with_the_roots_device(base, mount_tmpfs, bind_mount):
    """Without ``openat2`` (old kernels, seccomp): the walk alone."""
    root = f"{base}/kv"
    os.makedirs(f"{root}/rank/abc/de_g0")
    outside = plant_a_copy(f"{root}/rank/abc", mount_tmpfs("16m"), bind_mount)
    below = Beneath(root)
    below.one_call = False
    for create in (False, True):
        with pytest.raises(MountInTree) as caught:
            below.open_dir("rank/abc/de_g0", create=create)
        assert caught.value.filename == f"{root}/rank/abc"
    with pytest.raises(MountInTree):
        below.open_dir("rank/abc/new_g0", create=True)
    outside.assert_untouched()
    os.close(below.open_dir("rank", create=True))  # the root's own levels still open
