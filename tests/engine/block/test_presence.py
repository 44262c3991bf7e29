"""Whether a block's file is there (engine/block/presence.py), through the
compiled batch check (``_presence.c``) and through the Python path, which
must answer exactly alike over every case a volume can hold: a block, a
file of the wrong size, nothing, a symlink at the name or on the way, a
directory at the name, a mount point in the tree (root needed), a path that
would leave the root. Real files below a real root.

``LLMKV_FS_REQUIRE_COMPILED=1`` (set by .ci/run) makes a missing compiled
module a failure: CI cannot lose it without anyone noticing.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from llmkv_fs.engine.block import presence as presence_module
from llmkv_fs.engine.block.presence import PRESENCE_ENV, BlockPresence, presence_path
from llmkv_fs.volume.beneath import Beneath
from llmkv_fs.volume.openat2 import AVAILABLE as OPENAT2

COMPILED_MODULE = "llmkv_fs.engine.block._presence"
REQUIRE_ENV = "LLMKV_FS_REQUIRE_COMPILED"
SIZE = 4160  # a block file's length (payload and trailer)
SIZES = frozenset((SIZE, 4096))


def _compiled_built() -> bool:
    try:
        importlib.import_module(COMPILED_MODULE)
    except ImportError:
        return False
    return True


def test_the_compiled_check_is_built_in_this_install():
    """``pip install -e .`` compiles it wherever a C compiler and Python's
    headers are; a wheel without it still installs (optional)."""
    if not _compiled_built():
        message = f"{COMPILED_MODULE} is not built (pip install -e . with a C compiler)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(message)
        pytest.skip(message)
    if OPENAT2 and not os.environ.get(PRESENCE_ENV):
        assert presence_path().startswith("compiled")


def test_without_the_compiled_module_the_python_path_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, COMPILED_MODULE, None)  # its import fails
    monkeypatch.setattr(presence_module, "_BUILT", presence_module._built())
    assert presence_module.compiled_check() is None
    assert presence_path().startswith("python")


def test_forcing_the_python_path(monkeypatch):
    monkeypatch.setenv(PRESENCE_ENV, "python")
    assert presence_module.compiled_check() is None
    assert presence_path() == f"python ({PRESENCE_ENV}=python)"


class Volume:
    """A root with a rank directory and an outside directory beside it."""

    def __init__(self, base: str):
        self.root = os.path.join(base, "root")
        self.outside = os.path.join(base, "outside")
        os.makedirs(os.path.join(self.root, "rank"))
        os.makedirs(self.outside)

    def file(self, rel: str, size: int = SIZE) -> str:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
        return path

    def outside_block(self, rel: str = "d/blk") -> str:
        path = os.path.join(self.outside, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(SIZE)
        return path


def _block(vol: Volume) -> str:
    vol.file("rank/a00/b0/blk")
    return "rank/a00/b0/blk"


def _wrong_size(vol: Volume) -> str:
    vol.file("rank/a01/b0/blk", SIZE - 1)
    return "rank/a01/b0/blk"


def _empty(vol: Volume) -> str:
    vol.file("rank/a02/b0/blk", 0)
    return "rank/a02/b0/blk"


def _missing_file(vol: Volume) -> str:
    os.makedirs(os.path.join(vol.root, "rank/a03/b0"))
    return "rank/a03/b0/blk"


def _missing_dirs(vol: Volume) -> str:
    return "rank/a04/b0/blk"


def _symlink_at_the_name(vol: Volume) -> str:
    target = vol.file("rank/a05/b0/real")
    os.symlink(target, os.path.join(vol.root, "rank/a05/b0/blk"))
    return "rank/a05/b0/blk"


def _relative_symlink_at_the_name(vol: Volume) -> str:
    vol.file("rank/a06/b0/real")
    os.symlink("real", os.path.join(vol.root, "rank/a06/b0/blk"))
    return "rank/a06/b0/blk"


def _symlink_dir_on_the_way(vol: Volume) -> str:
    vol.outside_block("d/blk")
    os.makedirs(os.path.join(vol.root, "rank/a07"))
    os.symlink(os.path.join(vol.outside, "d"), os.path.join(vol.root, "rank/a07/b0"))
    return "rank/a07/b0/blk"


def _symlink_dir_inside_the_root(vol: Volume) -> str:
    vol.file("rank/a08/real/blk")
    os.symlink("real", os.path.join(vol.root, "rank/a08/b0"))
    return "rank/a08/b0/blk"


def _directory_at_the_name(vol: Volume) -> str:
    os.makedirs(os.path.join(vol.root, "rank/a09/b0/blk"))
    return "rank/a09/b0/blk"


def _file_where_a_directory_belongs(vol: Volume) -> str:
    vol.file("rank/a0a/b0")
    return "rank/a0a/b0/blk"


def _fifo_at_the_name(vol: Volume) -> str:
    os.makedirs(os.path.join(vol.root, "rank/a0b/b0"))
    os.mkfifo(os.path.join(vol.root, "rank/a0b/b0/blk"))
    return "rank/a0b/b0/blk"


def _leaving_the_root(vol: Volume) -> str:
    vol.outside_block("d/blk")
    return "../outside/d/blk"


def _absolute_path(vol: Volume) -> str:
    return vol.outside_block("d/blk").lstrip("/")  # relative by its spelling, outside by the root


CASES = {
    "block": (_block, True),
    "wrong size": (_wrong_size, False),
    "empty file": (_empty, False),
    "missing file": (_missing_file, False),
    "missing directories": (_missing_dirs, False),
    "symlink at the name": (_symlink_at_the_name, False),
    "relative symlink at the name": (_relative_symlink_at_the_name, False),
    "symlink dir on the way (outside)": (_symlink_dir_on_the_way, False),
    "symlink dir on the way (inside)": (_symlink_dir_inside_the_root, False),
    "directory at the name": (_directory_at_the_name, False),
    "file where a directory belongs": (_file_where_a_directory_belongs, False),
    "fifo at the name": (_fifo_at_the_name, False),
    "leaving the root": (_leaving_the_root, False),
    "a path that is not below the root": (_absolute_path, False),
}


def _presence(root: str, compiled: bool, revalidate: bool, monkeypatch) -> BlockPresence:
    if compiled:
        if not _compiled_built() or not OPENAT2:
            pytest.skip("the compiled check is not built here, or no openat2")
        monkeypatch.delenv(PRESENCE_ENV, raising=False)
    else:
        monkeypatch.setenv(PRESENCE_ENV, "python")
    presence = BlockPresence(Beneath(root), SIZES, revalidate)
    assert presence.compiled is compiled
    return presence


def _split(rel: str) -> tuple[str, str]:
    rel_dir, _, name = rel.rpartition("/")
    return rel_dir, name


@pytest.mark.parametrize("revalidate", [False, True], ids=["plain", "revalidating"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_both_paths_answer_every_case_alike(tmp_path, monkeypatch, compiled, revalidate):
    vol = Volume(str(tmp_path))
    places = {name: _split(make(vol)) for name, (make, _expected) in CASES.items()}
    presence = _presence(vol.root, compiled, revalidate, monkeypatch)

    batch = presence.many(list(places.values()))
    one_by_one = [presence.at(*place) for place in places.values()]

    expected = [hit for _make, hit in CASES.values()]
    assert dict(zip(places, batch)) == dict(zip(places, expected))
    assert one_by_one == expected
    assert presence.many([]) == []


def test_the_compiled_answers_per_path(tmp_path):
    """What the C loop settles itself (0, 1) and what it leaves to the Python
    path (2): a mount point or an escape (EXDEV), a miss to revalidate."""
    if not _compiled_built() or not OPENAT2:
        pytest.skip("the compiled check is not built here, or no openat2")
    check = importlib.import_module(COMPILED_MODULE).check_many
    vol = Volume(str(tmp_path))
    paths = [_block(vol), _wrong_size(vol), _missing_dirs(vol), _symlink_at_the_name(vol)]
    paths += [_directory_at_the_name(vol), _leaving_the_root(vol), "rank/a00/b0/blk\0x"]
    fd = os.open(vol.root, os.O_PATH | os.O_DIRECTORY)
    try:
        assert list(check(fd, paths, tuple(SIZES), False)) == [1, 0, 0, 0, 0, 2, 2]
        assert list(check(fd, [p.encode() for p in paths[:3]], (SIZE,), True)) == [1, 0, 2]
        with pytest.raises(TypeError):
            check(fd, [1], (SIZE,), False)
        with pytest.raises(ValueError):
            check(fd, [], tuple(range(9)), False)
    finally:
        os.close(fd)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_block_behind_a_mount_point_in_the_tree_is_not_one(
    tmp_path, monkeypatch, bind_mount, compiled
):
    """A directory holding a valid block bind-mounted at a fan-out
    directory (the root's own filesystem: the same st_dev)."""
    vol = Volume(str(tmp_path))
    vol.outside_block("d/blk")
    os.makedirs(os.path.join(vol.root, "rank/a00/b0"))
    bind_mount(os.path.join(vol.outside, "d"), os.path.join(vol.root, "rank/a00/b0"))
    assert os.path.isfile(os.path.join(vol.root, "rank/a00/b0/blk"))  # there, by the path
    presence = _presence(vol.root, compiled, False, monkeypatch)
    assert presence.many([("rank/a00/b0", "blk")]) == [False]
    assert presence.at("rank/a00/b0", "blk") is False
