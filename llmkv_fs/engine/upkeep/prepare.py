"""Checking and preparing the volume before the engine starts: the root
must be a real, writable directory (created with its parents when missing,
as vLLM's built-in fs tier does), and ``config.json`` must describe this
run. Runs once, on the constructing thread, before any I/O thread exists.

The root is then pinned (``PinnedRoot``): while the tier runs nothing
creates the root again, and the housekeeping thread notices when the path
stops naming that directory (see engine.py, "volume failed").
"""

from __future__ import annotations

import dataclasses
import errno
import os

from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume.beneath import Beneath, LinkInTree
from llmkv_fs.volume.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, make_dirs
from llmkv_fs.volume.fsinfo import mount_of
from llmkv_fs.volume.pinned_root import PinnedRoot
from llmkv_fs.volume.run_config import ensure_run_config

__all__ = ["EngineError", "PreparedVolume", "VolumeError", "check_root", "prepare_volume"]


class EngineError(RuntimeError):
    """The engine cannot run with these settings on this volume."""


class VolumeError(OSError, EngineError):
    """The root directory cannot hold the cache. An OSError, as the
    ``os.makedirs``/``open`` failures of vLLM's built-in fs tier are (code
    that catches those keeps working), and an EngineError; the message names
    the path and the fix (``errno``, where set, is the failure behind it)."""

    @classmethod
    def because(cls, code: int | None, message: str) -> VolumeError:
        # OSError(code, message) would prefix "[Errno N]" to our message.
        error = cls(message)
        error.errno = code
        return error


@dataclasses.dataclass(frozen=True)
class PreparedVolume:
    run_config_state: str  # "created", "matched" or "repaired": what became of config.json
    root: PinnedRoot  # the root directory the tier starts on


def _symlink_in(root: str) -> str | None:
    """The spelling of ``root`` that names a symlink the root is reached
    through as its last component ("link", "link/", "link/.") or left by
    ".." ("link/.."), or None. Symlinks further up ("/data" -> "/mnt/data"
    in "/data/kv") are the system's business and allowed."""
    stripped = root
    while len(stripped) > 1 and (stripped.endswith("/") or stripped.endswith("/.")):
        stripped = stripped[:-1] if stripped.endswith("/") else stripped[:-2]
    parts = stripped.split("/")
    suspects = ["/".join(parts[:i]) for i, part in enumerate(parts) if part == ".." and i]
    suspects.append(stripped)
    for suspect in suspects:
        if suspect and os.path.islink(suspect):
            return suspect
    return None


def _check_mounted(root: str) -> None:
    mount = mount_of(root)
    if mount is None or mount.mount_point == "/":
        where = "the mount table cannot be read" if mount is None else "it lies on '/'"
        raise VolumeError(
            f"root_dir {root!r} is not on a mounted volume ({where}) and "
            f"require_mounted_root is set. Mount the shared volume at or above "
            f"{root!r} before starting vLLM, or set require_mounted_root: false."
        )


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_root(root: str, require_mounted_root: bool = False) -> None:
    """Everything that can be known about ``root`` before anything is
    created, so that a list of roots is refused whole or prepared whole (a
    bad later entry leaves no earlier one with a new digest directory):
    reached through a symlink; not on a mounted volume
    when that is required; not a directory (a file, or a path below one);
    missing where it cannot be created (the nearest existing directory is
    not writable); on a filesystem that holds no files (``/proc``,
    ``/sys``: no blocks at all). Raises VolumeError with the fix. Reads
    only; a race after it is still caught by ``prepare_volume``."""
    link = _symlink_in(root)
    if link is not None:
        raise VolumeError(
            f"root_dir {root!r} is reached through the symlink {link!r} (to "
            f"{os.path.realpath(link)!r}). Set root_dir to the real directory: a "
            f"link can silently move the cache off the shared volume (and every "
            f"replica must agree on the path)."
        )
    if require_mounted_root:
        _check_mounted(root)
    existing = _nearest_existing(root)
    if not os.path.isdir(existing):
        raise VolumeError.because(
            errno.ENOTDIR,
            f"root_dir {root!r} is not a directory and cannot be created "
            f"({existing!r} is not a directory). Point root_dir at a directory.",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == os.path.abspath(root) else f" (nor created in {existing!r})"
        raise VolumeError.because(
            errno.EACCES,
            f"root_dir {root!r} is not writable by uid {os.getuid()}{where}. Fix its "
            f"ownership/mode or the volume's mount options (read-only?).",
        )
    try:
        holds_files = os.statvfs(existing).f_blocks > 0
    except OSError:
        holds_files = True  # unknown: creating will tell
    if not holds_files:
        raise VolumeError.because(
            errno.EINVAL,
            f"root_dir {root!r} lies on a filesystem that holds no files "
            f"({existing!r} has no blocks, like /proc or /sys). Point root_dir at "
            f"the cache volume.",
        )


def _ensure_root(root: str, dir_mode: int) -> PinnedRoot:
    check_root(root)
    if not os.path.isdir(root):
        try:
            make_dirs(root, dir_mode)  # with its parents, as vLLM's built-in does
        except OSError as exc:
            raise VolumeError.because(
                exc.errno,
                f"root_dir {root!r} is not a directory and cannot be created "
                f"({exc.strerror or exc}). Point root_dir at a directory.",
            ) from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise VolumeError.because(
            errno.EACCES,
            f"root_dir {root!r} is not writable by uid {os.getuid()}. Fix its "
            f"ownership/mode or the volume's mount options (read-only?).",
        )
    return PinnedRoot.pin(root)


def prepare_volume(
    layout: CacheLayout,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    require_mounted_root: bool = False,
) -> PreparedVolume:
    """Check (and if missing create) the root, pin it, then create or verify
    ``config.json`` and the rank directory, both resolved beneath the pinned
    root (``volume.beneath``: a digest or rank directory that is a symlink is
    refused, nothing is written through it). Raises VolumeError with the
    path and the fix; RunConfigMismatch passes through.

    A missing root is created like vLLM's built-in does; the protection
    against an unmounted volume silently becoming a cache on the container's
    own disk is ``require_mounted_root`` (checked before anything is
    created) and, while running, the pinned root.
    """
    root = layout.root_dir
    if require_mounted_root:
        _check_mounted(root)  # before anything is created
    pinned = _ensure_root(root, dir_mode)
    try:
        verdict = ensure_run_config(layout, file_mode, dir_mode, pinned)
        below = Beneath(root, pinned)
        os.close(below.open_dir(layout.rank_dir_rel, create=True, dir_mode=dir_mode))
    except LinkInTree as exc:
        raise VolumeError.because(
            exc.errno,
            f"{exc.filename} is a symlink inside root_dir {root!r}. The tier never "
            f"follows a link below the root (it could move the cache, or writes, off "
            f"the volume): replace it with the real directory, or remove it.",
        ) from exc
    except OSError as exc:
        raise VolumeError.because(
            exc.errno,
            f"cannot prepare {layout.base_path!r} under root_dir {root!r}: {exc}",
        ) from exc
    return PreparedVolume(verdict, pinned)
