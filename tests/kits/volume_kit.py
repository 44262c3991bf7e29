"""What a test sees of a cache volume: the files under a root (or a rank
directory), sorted, by kind; one way to damage a block in place; a volume
that can be unmounted and brought back while a tier runs; a filler file.

No vLLM, no engine: plain directory walks, usable from every test.
"""

from __future__ import annotations

import os
import subprocess

import pytest


def files_under(root: str) -> list[str]:
    """Every regular name below ``root`` (symlinks included, directories not), sorted."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)


def temp_files(root: str) -> list[str]:
    return [p for p in files_under(root) if p.endswith(".tmp")]


def block_files(root: str) -> list[str]:
    """Published block files: ``.bin`` names outside the quarantine."""
    return [p for p in files_under(root) if p.endswith(".bin") and "/.quarantine/" not in p]


def quarantined(root: str) -> list[str]:
    """What was moved aside into any ``.quarantine`` directory below ``root``
    (links to directories included), sorted."""
    return sorted(
        os.path.join(d, n)
        for d, _, _ in os.walk(root)
        if os.path.basename(d) == ".quarantine"
        for n in os.listdir(d)
    )


def flip_a_bit(path: str, offset: int = 12345) -> None:
    """Damage a block in place: same size, one payload bit flipped."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


class BindVolume:
    """A tmpfs kept at ``stash`` and bind-mounted at ``mountpoint``: unmounting
    the bind and binding it again brings back the very same directory (one
    superblock), as a network volume reattached after an outage would."""

    def __init__(self, tmp_path):
        self.stash = str(tmp_path / "stash")
        self.mountpoint = str(tmp_path / "mnt")
        os.mkdir(self.stash)
        os.mkdir(self.mountpoint)
        self._run("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", self.stash, skip=True)
        self.mount()

    def _run(self, *argv: str, skip: bool = False) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            if skip:
                pytest.skip(f"cannot mount here (needs root): {done.stderr.strip()}")
            raise AssertionError(f"{argv}: {done.stderr}")

    def mount(self) -> None:
        self._run("mount", "--bind", self.stash, self.mountpoint)

    def unmount(self) -> None:
        self._run("umount", "-l", self.mountpoint)

    def close(self) -> None:
        for path in (self.mountpoint, self.stash):
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)


def write_filler(path: str, nbytes: int) -> None:
    chunk = b"\xa5" * (1 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            left -= f.write(chunk[: min(left, (1 << 20))])


@pytest.fixture
def bind_mount():
    """bind_mount(source, target): ``source`` mounted at ``target`` until teardown."""
    mounted: list[str] = []

    def mount(source: str, target: str) -> None:
        done = subprocess.run(["mount", "--bind", source, target], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.strip()}")
        mounted.append(target)

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", target], check=False)
