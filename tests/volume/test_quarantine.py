"""Moving a bad block file aside (volume/quarantine.py): by path for the
volume tools (``move_to_quarantine``) and beneath a root for a running tier
(``quarantine_at``), one move either way -- a descriptor-to-descriptor
rename that never goes through a symlink. Real files, real directories."""

from __future__ import annotations

import os
import stat

import pytest

from llmkv_fs.layout.names import block_rel_path
from llmkv_fs.volume.beneath import Beneath, LinkInTree
from llmkv_fs.volume.quarantine import file_ident, move_to_quarantine, quarantine_at
from tests.kits.engine_kit import make_key
from tests.kits.volume_kit import quarantined


def _block(rank_dir: str, n: int, data: bytes = b"bad") -> str:
    path = f"{rank_dir}/{block_rel_path(make_key(n))}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.fixture
def rank_dir(tmp_path):
    path = tmp_path / "root" / "m_0123456789ab_r0"
    path.mkdir(parents=True)
    return str(path)


def test_by_path_moves_the_file_into_a_quarantine_with_the_rank_directory_mode(rank_dir):
    os.chmod(rank_dir, 0o2750)
    path = _block(rank_dir, 1)
    target = move_to_quarantine(path, rank_dir, "bad-checksum", file_ident(os.lstat(path)))
    assert target is not None and quarantined(rank_dir) == [target]
    assert os.path.basename(target).startswith(os.path.basename(path) + ".bad-checksum.")
    assert not os.path.lexists(path)
    assert stat.S_IMODE(os.stat(os.path.dirname(target)).st_mode) == 0o2750


def test_by_path_leaves_a_file_that_is_not_the_one_judged(rank_dir):
    path = _block(rank_dir, 1)
    judged = file_ident(os.lstat(path))
    fresh = f"{os.path.dirname(path)}/.fresh"
    with open(fresh, "wb") as f:
        f.write(b"good")
    os.rename(fresh, path)  # republished: another inode at the name
    assert move_to_quarantine(path, rank_dir, "truncated", judged) is None
    assert quarantined(rank_dir) == []


def test_by_path_never_moves_a_file_out_of_a_symlinked_directory(rank_dir, tmp_path):
    # A fan-out directory replaced by a link to a directory elsewhere: the
    # file there is someone else's, never moved into this volume.
    path = _block(rank_dir, 1)
    elsewhere = tmp_path / "elsewhere"
    os.rename(os.path.dirname(path), elsewhere)
    os.symlink(elsewhere, os.path.dirname(path))
    victim = elsewhere / os.path.basename(path)
    with pytest.raises(LinkInTree):
        move_to_quarantine(path, rank_dir, "bad-checksum")
    assert victim.read_bytes() == b"bad"
    assert quarantined(rank_dir) == []


def test_a_link_planted_at_the_quarantine_is_replaced_not_followed(rank_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, f"{rank_dir}/.quarantine")
    path = _block(rank_dir, 1)
    target = move_to_quarantine(path, rank_dir, "bad-checksum")
    assert target is not None and os.path.isfile(target)
    assert not os.path.islink(f"{rank_dir}/.quarantine")
    assert list(outside.iterdir()) == []


def test_beneath_a_root_the_quarantine_has_the_given_mode(rank_dir):
    root = os.path.dirname(rank_dir)
    path = _block(rank_dir, 2)
    below = Beneath(root)
    rank_rel = os.path.basename(rank_dir)
    dir_fd = below.open_dir(os.path.dirname(below.relative(path)))
    try:
        target = quarantine_at(
            below, rank_rel, dir_fd, os.path.basename(path), "truncated", dir_mode=0o770
        )
    finally:
        os.close(dir_fd)
        below.release()
    assert target is not None and quarantined(rank_dir) == [target]
    assert stat.S_IMODE(os.stat(os.path.dirname(target)).st_mode) == 0o770


def test_a_directory_is_never_moved_aside(rank_dir):
    path = _block(rank_dir, 1)
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(IsADirectoryError):
        move_to_quarantine(path, rank_dir, "not-regular")
    assert os.path.isdir(path)
