"""Whether a block's file is there (engine/block/presence.py), through the
compiled batch check (``_presence.c``) and through the Python path, which
must answer exactly alike over every case a volume can hold at a key's
place: a block, a file of the wrong size, nothing, a symlink at the name or
on the way, a directory at the name, a mount point in the tree (root
needed); and a path that would leave the root is no block. Real files below
a real root.

``LLMKV_FS_REQUIRE_COMPILED=1`` (set by .ci/run) makes a missing compiled
module a failure: CI cannot lose it without anyone noticing.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from llmkv_fs.engine.block import presence as presence_module
from llmkv_fs.engine.block.presence import BlockPresence, presence_path
from llmkv_fs.layout.names import block_place
from llmkv_fs.volume.beneath import OPENAT2, Beneath
from tests.kits.compiled_kit import built, require_built

COMPILED_MODULE = "llmkv_fs.engine.block._presence"
SIZE = 4160  # a block file's length (payload and trailer)
SIZES = frozenset((SIZE, 4096))


def _compiled_built() -> bool:
    return built(COMPILED_MODULE)


def test_the_compiled_check_is_built_in_this_install():
    """``pip install -e .`` compiles it wherever a C compiler and Python's
    headers are; a wheel without it still installs (optional)."""
    require_built(COMPILED_MODULE)
    if OPENAT2:
        assert presence_path().startswith("compiled")


def test_without_the_compiled_module_the_python_path_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, COMPILED_MODULE, None)  # its import fails
    monkeypatch.setattr(presence_module, "_BUILT", presence_module._built())
    assert presence_module.compiled_check() is None
    assert presence_path().startswith("python")


def test_compiled_io_off_keeps_the_python_path(tmp_path):
    assert presence_module.compiled_check(False) is None
    if OPENAT2 and _compiled_built():
        assert presence_path(False) == "python (compiled_io is off)"
    presence = BlockPresence(Beneath(str(tmp_path)), SIZES, False, compiled=False)
    assert not presence.compiled


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


# Each case has its own key; its block's place is where layout/names.py puts it.
def key_of(case: int, group: int = 0, hash_bytes: int = 16) -> bytes:
    return bytes([0xA0, case << 4]) + bytes(hash_bytes - 2) + group.to_bytes(4, "big")


def rel_of(key: bytes) -> str:
    return "/".join(block_place("rank", key))


def _block(vol: Volume, rel: str) -> None:
    vol.file(rel)


def _wrong_size(vol: Volume, rel: str) -> None:
    vol.file(rel, SIZE - 1)


def _empty(vol: Volume, rel: str) -> None:
    vol.file(rel, 0)


def _missing_file(vol: Volume, rel: str) -> None:
    os.makedirs(os.path.join(vol.root, os.path.dirname(rel)))


def _missing_dirs(vol: Volume, rel: str) -> None:
    pass


def _symlink_at_the_name(vol: Volume, rel: str) -> None:
    os.symlink(vol.file(rel + ".real"), os.path.join(vol.root, rel))


def _relative_symlink_at_the_name(vol: Volume, rel: str) -> None:
    vol.file(rel + ".real")
    os.symlink(os.path.basename(rel) + ".real", os.path.join(vol.root, rel))


def _symlink_dir_on_the_way(vol: Volume, rel: str) -> None:
    vol.outside_block(f"d/{os.path.basename(rel)}")
    leaf = os.path.join(vol.root, os.path.dirname(rel))
    os.makedirs(os.path.dirname(leaf))
    os.symlink(os.path.join(vol.outside, "d"), leaf)


def _symlink_dir_inside_the_root(vol: Volume, rel: str) -> None:
    leaf = os.path.dirname(rel)
    vol.file(f"{os.path.dirname(leaf)}/real/{os.path.basename(rel)}")
    os.symlink("real", os.path.join(vol.root, leaf))


def _directory_at_the_name(vol: Volume, rel: str) -> None:
    os.makedirs(os.path.join(vol.root, rel))


def _file_where_a_directory_belongs(vol: Volume, rel: str) -> None:
    vol.file(os.path.dirname(rel))


def _fifo_at_the_name(vol: Volume, rel: str) -> None:
    os.makedirs(os.path.join(vol.root, os.path.dirname(rel)))
    os.mkfifo(os.path.join(vol.root, rel))


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
}


def made(vol: Volume) -> dict[str, bytes]:
    """Every case set up on ``vol``: its name -> its key."""
    keys = {}
    for case, (name, (make, _hit)) in enumerate(CASES.items()):
        keys[name] = key_of(case)
        make(vol, rel_of(keys[name]))
    return keys


def _presence(root: str, compiled: bool, revalidate: bool, monkeypatch) -> BlockPresence:
    if compiled and (not _compiled_built() or not OPENAT2):
        pytest.skip("the compiled check is not built here, or no openat2")
    presence = BlockPresence(Beneath(root), SIZES, revalidate, compiled)
    assert presence.compiled is compiled
    return presence


@pytest.mark.parametrize("revalidate", [False, True], ids=["plain", "revalidating"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_both_paths_answer_every_case_alike(tmp_path, monkeypatch, compiled, revalidate):
    vol = Volume(str(tmp_path))
    keys = made(vol)
    presence = _presence(vol.root, compiled, revalidate, monkeypatch)

    batch = presence.many("rank", list(keys.values()))
    one_by_one = [presence.at(*block_place("rank", key)) for key in keys.values()]

    expected = [hit for _make, hit in CASES.values()]
    assert dict(zip(keys, batch)) == dict(zip(keys, expected))
    assert one_by_one == expected
    assert presence.many("rank", []) == []


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_path_that_leaves_the_root_is_no_block(tmp_path, monkeypatch, compiled):
    """Names no key gives (``at`` is asked for places): ``..`` out of the
    root, an absolute path spelled relative."""
    vol = Volume(str(tmp_path))
    outside = vol.outside_block("d/blk")
    presence = _presence(vol.root, compiled, False, monkeypatch)
    assert presence.at("../outside/d", "blk") is False
    assert presence.at(os.path.dirname(outside).lstrip("/"), "blk") is False


def test_the_compiled_answers_per_key(tmp_path):
    """What the C loop settles itself (0, 1), what it leaves to the Python
    path (2: a miss to revalidate, a key too short to name a block), and
    its paths: layout/names.py's, for every group and hash length; and a
    call given a time budget answers the keys it checked before it ran out."""
    if not _compiled_built() or not OPENAT2:
        pytest.skip("the compiled check is not built here, or no openat2")
    check = importlib.import_module(COMPILED_MODULE).check_keys
    vol = Volume(str(tmp_path))
    keys = made(vol)
    placed = [key_of(1, group, n) for group in (1, 10, 2**32 - 1) for n in (3, 32, 120)]
    for key in placed:
        vol.file(rel_of(key))
    fd = os.open(vol.root, os.O_PATH | os.O_DIRECTORY)
    try:
        answers = check(fd, b"rank", list(keys.values()), tuple(SIZES), False)
        assert list(answers) == [int(hit) for _make, hit in CASES.values()]
        assert list(check(fd, b"rank", placed, (SIZE,), False)) == [1] * len(placed)
        # A time budget: spent after the first key (1 ns), the call answers it alone.
        assert list(check(fd, b"rank", placed, (SIZE,), False, 1)) == [1]
        assert list(check(fd, b"rank", placed, (SIZE,), False, 0)) == [1] * len(placed)
        assert list(check(fd, b"rank", placed, (SIZE,), False, 10**12)) == [1] * len(placed)
        assert list(check(fd, b"rank", [keys["missing file"]], (SIZE,), True)) == [2]
        short, long = bytes(6), bytes(261)  # hashes of 2 and 257 bytes
        assert list(check(fd, b"rank", [short, long, "not bytes"], (SIZE,), False)) == [2, 2, 2]
        with pytest.raises(ValueError):
            check(fd, b"rank", [], tuple(range(9)), False)
        with pytest.raises(ValueError):
            check(fd, b"ra\0nk", [], (SIZE,), False)
    finally:
        os.close(fd)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_block_behind_a_mount_point_in_the_tree_is_not_one(
    tmp_path, monkeypatch, bind_mount, compiled
):
    """A directory holding a valid block bind-mounted at a fan-out
    directory (the root's own filesystem: the same st_dev)."""
    vol = Volume(str(tmp_path))
    key = key_of(0)
    leaf, name = block_place("rank", key)
    vol.outside_block(f"d/{name}")
    os.makedirs(os.path.join(vol.root, leaf))
    bind_mount(os.path.join(vol.outside, "d"), os.path.join(vol.root, leaf))
    assert os.path.isfile(os.path.join(vol.root, leaf, name))  # there, by the path
    presence = _presence(vol.root, compiled, False, monkeypatch)
    assert presence.many("rank", [key]) == [False]
    assert presence.at(leaf, name) is False
