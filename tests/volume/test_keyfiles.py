"""Key files (volume/keyfiles.py) that another local user could choose the
key of are refused at start-up: a file its group or others may write, a
file, directory or link on its path owned by anyone but the tier's user and
root, a directory on its path its group or others may write (unless sticky
and the entry taken in it is trusted). A Kubernetes Secret volume's layout
is accepted. Every refusal names the setting, the key id, the path and the
mode or owner at fault, never the key.

Real files, chowned for real: these tests run as root (skipped otherwise).
"""

from __future__ import annotations

import base64
import os

import pytest

from llmkv_fs.checks import TierConfigError
from llmkv_fs.volume.keyfiles import load_keyring, read_key_file

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other users needs root")

OTHER = 12345  # a uid that is neither root nor the tier's user
SECRET = bytes(range(32))


def write_key(path, mode: int = 0o400, uid: int = 0, gid: int = 0) -> str:
    path = str(path)
    with open(path, "wb") as f:
        f.write(base64.b64encode(SECRET) + b"\n")
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


def make_dir(path, mode: int = 0o755, uid: int = 0, gid: int = 0) -> str:
    path = str(path)
    os.mkdir(path)
    os.chown(path, uid, gid)
    os.chmod(path, mode)  # after the chown, which clears set-id bits
    return path


@pytest.fixture
def keys(tmp_path):
    """A directory for key files, root's and 0755, below tmp_path (itself
    below /tmp: 1777, the sticky rule)."""
    return make_dir(tmp_path / "keys")


def refused(path: str, key_id: int = 7) -> str:
    with pytest.raises(TierConfigError) as raised:
        read_key_file(key_id, path)
    message = str(raised.value)
    assert "seal_key_files" in message and f"key id {key_id}" in message and path in message
    for spelled in (SECRET.hex(), base64.b64encode(SECRET).decode(), repr(SECRET)):
        assert spelled not in message
    return message


@pytest.mark.parametrize("mode", [0o400, 0o440, 0o600, 0o640], ids=oct)
def test_a_key_file_only_its_owner_may_change_is_accepted(keys, mode):
    assert read_key_file(1, write_key(f"{keys}/k", mode)).secret == SECRET


@pytest.mark.parametrize("mode", [0o602, 0o460, 0o620, 0o660, 0o642], ids=oct)
def test_a_key_file_its_group_or_others_may_write_is_refused(keys, mode):
    message = refused(write_key(f"{keys}/k", mode))
    assert f"is writable by its group or others (mode {mode:04o})" in message


def test_a_key_file_everyone_may_read_is_still_refused(keys):
    assert "readable by everyone (mode 0644)" in refused(write_key(f"{keys}/k", 0o644))


def test_a_key_file_of_another_user_is_refused(keys):
    message = refused(write_key(f"{keys}/k", 0o400, uid=OTHER))
    assert f"is owned by uid {OTHER}, not by the tier's user (uid 0) or root" in message


def test_a_key_file_of_the_tiers_own_user_is_accepted(keys, monkeypatch):
    path = write_key(f"{keys}/k", 0o400, uid=OTHER)
    monkeypatch.setattr(os, "geteuid", lambda: OTHER)  # the tier runs as OTHER
    assert read_key_file(1, path).secret == SECRET


@pytest.mark.parametrize(
    ("mode", "uid"),
    [(0o777, 0), (0o770, 0), (0o757, 0), (0o755, OTHER), (0o700, OTHER)],
    ids=["0777", "0770", "0757", "owned-by-another", "0700-owned-by-another"],
)
def test_a_directory_on_the_path_others_may_change_is_refused(keys, mode, uid):
    inner = make_dir(f"{keys}/inner", mode, uid=uid)
    message = refused(write_key(f"{inner}/k"))
    if uid == OTHER:
        assert f"directory {inner!r} on its path owned by uid {OTHER}" in message
    else:
        assert f"directory {inner!r} on its path that its group or others may write" in message
        assert f"(mode {mode:04o}, owner uid 0)" in message


def test_every_directory_up_to_the_root_is_checked(keys):
    top = make_dir(f"{keys}/top", 0o777)
    deep = make_dir(f"{make_dir(f'{top}/a')}/b")
    assert f"directory {top!r}" in refused(write_key(f"{deep}/k"))


def test_the_directories_a_link_leads_through_are_checked(keys):
    loose = make_dir(f"{keys}/loose", 0o777)
    target = write_key(f"{make_dir(f'{loose}/safe')}/k")
    os.symlink(target, f"{keys}/link")
    assert f"directory {loose!r}" in refused(f"{keys}/link")


def test_a_sticky_directory_is_accepted_only_for_trusted_entries(keys):
    sticky = make_dir(f"{keys}/sticky", 0o1777)
    assert read_key_file(1, write_key(f"{sticky}/k")).secret == SECRET
    # Another user's link in it: they may replace it whenever they like.
    os.symlink("k", f"{sticky}/theirs")
    os.lchown(f"{sticky}/theirs", OTHER, OTHER)
    assert f"link {sticky + '/theirs'!r} on its path owned by uid {OTHER}" in refused(
        f"{sticky}/theirs"
    )
    # Another user's directory in it.
    theirs = make_dir(f"{sticky}/dir", 0o755, uid=OTHER)
    assert f"directory {theirs!r} on its path owned by uid {OTHER}" in refused(
        write_key(f"{theirs}/k")
    )


def test_a_sticky_directory_of_another_user_is_refused(keys):
    sticky = make_dir(f"{keys}/sticky", 0o1777, uid=OTHER)
    assert f"directory {sticky!r} on its path owned by uid {OTHER}" in refused(
        write_key(f"{sticky}/k")
    )


def secret_volume(mount: str, mode: int, gid: int = 0) -> str:
    """What kubelet makes of a Secret with the key ``key-1``: a tmpfs root
    (1777, root's; with fsGroup, setgid and that group), a timestamped
    directory holding the file, ``..data`` linking to it, and the key's name
    linking through ``..data``."""
    make_dir(mount, 0o3777 if gid else 0o1777, gid=gid)
    stamped = "..2026_11_29_10_00_00.123456789"
    make_dir(f"{mount}/{stamped}", 0o2755 if gid else 0o755, gid=gid)
    write_key(f"{mount}/{stamped}/key-1", mode, gid=gid)
    os.symlink(stamped, f"{mount}/..data")
    os.symlink("..data/key-1", f"{mount}/key-1")
    return f"{mount}/key-1"


@pytest.mark.parametrize("mode", [0o440, 0o400], ids=oct)
@pytest.mark.parametrize("gid", [0, 2000], ids=["root-group", "fsGroup"])
def test_a_kubernetes_secret_volume_is_accepted(keys, mode, gid):
    path = secret_volume(f"{keys}/llmkv", mode, gid)
    assert read_key_file(1, path).secret == SECRET
    ring = load_keyring({1: path}, None)
    assert ring is not None


def test_a_secret_volume_with_a_planted_link_is_refused(keys):
    path = secret_volume(f"{keys}/llmkv", 0o440)
    os.lchown(f"{keys}/llmkv/..data", OTHER, OTHER)
    assert "'..data'" not in refused(path)  # the full path is named
    assert f"link {keys + '/llmkv/..data'!r} on its path owned by uid {OTHER}" in refused(path)


def test_the_settings_name_the_setting(keys):
    path = write_key(f"{keys}/k", 0o620)
    with pytest.raises(TierConfigError, match=r"^llmkv_fs: seal_key_files: key id 3 "):
        load_keyring({3: path}, None)
