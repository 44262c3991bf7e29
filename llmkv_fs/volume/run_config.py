"""``<root>/<model>_<digest>/config.json``: written atomically, compared when
present.

vLLM's built-in writes the file in place (a concurrent reader may see half of
it); we write to a temp name and rename, with the same bytes vLLM would
write, so either tier can own a digest first.

The file is untrusted input: it is read without following a symlink or
blocking on a FIFO, and only if it is a regular file of at most
``CONFIG_FILE_LIMIT`` bytes (``read_run_config`` says why not otherwise).
The tier reads and writes it beneath the root (``volume.beneath``): a digest
directory that is a symlink is refused (LinkInTree), never written through.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Any

from llmkv_fs.layout.names import CONFIG_FILENAME
from llmkv_fs.layout.paths import CacheLayout, run_config_digest
from llmkv_fs.volume.beneath import Beneath
from llmkv_fs.volume.files import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    SMALL_FILE_LIMIT,
    UnsafeFileError,
    read_small_regular_file,
    read_small_regular_file_at,
    write_file_atomically_at,
)
from llmkv_fs.volume.pinned_root import PinnedRoot

__all__ = [
    "CONFIG_FILE_LIMIT",
    "RunConfigMismatch",
    "ensure_run_config",
    "read_run_config",
    "render_run_config",
    "run_config_proves",
]

# vLLM's config of a 200-layer model is ~10 KiB; this leaves room to spare.
CONFIG_FILE_LIMIT = SMALL_FILE_LIMIT

# A config.json that does not parse may be another replica's half-written
# file (vLLM's built-in writes in place); give it this long to complete.
_PARTIAL_WRITE_GRACE_S = 2.0


class RunConfigMismatch(RuntimeError):
    """config.json under our digest describes another run config."""


def render_run_config(run_config: dict[str, Any]) -> bytes:
    # Same serialisation as vLLM 0.33 (json.dump, indent=2, sort_keys=True).
    return json.dumps(run_config, indent=2, sort_keys=True).encode("utf-8")


def _read_json(path: str) -> Any:
    data, _st = read_small_regular_file(path, CONFIG_FILE_LIMIT)
    return json.loads(data.decode("utf-8"))


def read_run_config(path: str) -> tuple[dict[str, Any] | None, str]:
    """``(config, "")`` when ``path`` holds a JSON object, else ``(None,
    why)``: missing, not a regular file, too large, not JSON, not an
    object. Never follows a link, never blocks, never raises."""
    try:
        config = _read_json(path)
    except FileNotFoundError:
        return None, "no config.json"
    except OSError as exc:
        return None, f"config.json: {exc.strerror or exc}"
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"config.json is not JSON ({exc})"
    if not isinstance(config, dict):
        return None, f"config.json holds a JSON {type(config).__name__}, not an object"
    return config, ""


def run_config_proves(config: dict[str, Any], digest: str) -> bool:
    """Whether ``config`` hashes to ``digest`` (the directory's name says
    it): then the directory is a cache digest, ours or vLLM's built-in's."""
    try:
        return run_config_digest(config) == digest
    except (TypeError, ValueError):  # not JSON-serialisable back: not vLLM's
        return False


def ensure_run_config(
    layout: CacheLayout,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    root: PinnedRoot | None = None,
) -> str:
    """Make sure ``config.json`` of ``layout`` holds our run config.

    Returns "created", "matched" or "repaired" (an unparsable file was
    replaced). Raises RunConfigMismatch when the file parses but describes
    something else -- another tool's data under our digest must never be
    silently overwritten. The digest directory is resolved (and made)
    beneath the root, ``root`` when pinned (see volume.beneath): LinkInTree
    when it is a symlink.
    """
    below = Beneath(layout.root_dir, root)
    # Really opened (revalidate): on NFS that refetches the directory, so a
    # config.json another client replaced is read fresh (read_small_regular_file).
    dir_fd = below.open_dir(layout.digest_dir_name, create=True, dir_mode=dir_mode, revalidate=True)
    try:
        return _ensure_in(dir_fd, layout, file_mode)
    finally:
        os.close(dir_fd)


def _ensure_in(dir_fd: int, layout: CacheLayout, file_mode: int) -> str:
    path = layout.config_path
    wanted = layout.run_config
    deadline = time.monotonic() + _PARTIAL_WRITE_GRACE_S
    while True:
        try:
            data, _st = read_small_regular_file_at(dir_fd, CONFIG_FILENAME, CONFIG_FILE_LIMIT, path)
            existing = json.loads(data.decode("utf-8"))
        except FileNotFoundError:
            write_file_atomically_at(dir_fd, CONFIG_FILENAME, render_run_config(wanted), file_mode)
            return "created"
        except UnsafeFileError:
            # A symlink, FIFO, device or huge file at the name: nobody is
            # mid-write there. The rename replaces the entry itself (a link
            # is never followed, its target never touched).
            write_file_atomically_at(dir_fd, CONFIG_FILENAME, render_run_config(wanted), file_mode)
            return "repaired"
        except OSError as exc:
            # Another client of a network filesystem replaced it just now.
            if exc.errno != errno.ESTALE or time.monotonic() >= deadline:
                raise
            continue
        except (ValueError, UnicodeDecodeError):
            if time.monotonic() < deadline:
                time.sleep(0.05)  # another writer may still be mid-write
                continue
            write_file_atomically_at(dir_fd, CONFIG_FILENAME, render_run_config(wanted), file_mode)
            return "repaired"
        if existing == wanted:
            return "matched"
        if isinstance(existing, dict):
            diff = sorted(
                k for k in set(existing) | set(wanted) if existing.get(k) != wanted.get(k)
            )
        else:
            diff = [f"(the file holds a JSON {type(existing).__name__}, not an object)"]
        raise RunConfigMismatch(
            f"{path} describes a different run config than this engine "
            f"(fields differing: {', '.join(diff)}). The digest directory "
            f"{layout.base_path} belongs to another configuration; refusing to "
            f"overwrite it. Move it aside or point root_dir elsewhere."
        )
