"""Checking and preparing the volume before the engine starts: the root
must be a real, writable directory, and ``config.json`` must describe this
run. Runs once, on the constructing thread, before any I/O thread exists."""

from __future__ import annotations

import os

from llmkv_fs.layout.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, make_dirs
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.run_config import ensure_run_config

__all__ = ["EngineError", "prepare_volume"]


class EngineError(RuntimeError):
    """The engine cannot run with these settings on this volume."""


def prepare_volume(
    layout: CacheLayout, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE
) -> str:
    """Check the root, then create or verify ``config.json`` and the rank
    directory. Returns ensure_run_config's verdict. Raises EngineError with
    the path and the fix; RunConfigMismatch passes through.

    A missing root is an error, not something to create: an unmounted
    volume must not silently become a cache on the container's own disk.
    """
    root = layout.root_dir
    if os.path.islink(root):
        raise EngineError(
            f"root_dir {root!r} is a symlink to {os.path.realpath(root)!r}. Set "
            f"root_dir to the real directory: a link can silently move the cache "
            f"off the shared volume (and every replica must agree on the path)."
        )
    if not os.path.exists(root):
        raise EngineError(
            f"root_dir {root!r} does not exist. Mount the shared volume there "
            f"(or create the directory) before starting vLLM."
        )
    if not os.path.isdir(root):
        raise EngineError(f"root_dir {root!r} is not a directory. Point root_dir at a directory.")
    if not os.access(root, os.W_OK | os.X_OK):
        raise EngineError(
            f"root_dir {root!r} is not writable by uid {os.getuid()}. Fix its "
            f"ownership/mode or the volume's mount options (read-only?)."
        )
    try:
        verdict = ensure_run_config(layout, file_mode, dir_mode)
        make_dirs(layout.rank_dir, dir_mode)
    except OSError as exc:
        raise EngineError(f"cannot prepare {layout.base_path!r} under root_dir: {exc}") from exc
    return verdict
