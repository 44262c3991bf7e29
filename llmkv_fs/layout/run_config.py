"""``<root>/<model>_<digest>/config.json``: written atomically, compared when
present.

vLLM's built-in writes the file in place (a concurrent reader may see half of
it); we write to a temp name and rename, with the same bytes vLLM would
write, so either tier can own a digest first.
"""

from __future__ import annotations

import errno
import json
import time
from typing import Any

from llmkv_fs.layout.files import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    read_revalidated,
    write_file_atomically,
)
from llmkv_fs.layout.paths import CacheLayout

__all__ = ["RunConfigMismatch", "ensure_run_config", "render_run_config"]

# A config.json that does not parse may be another replica's half-written
# file (vLLM's built-in writes in place); give it this long to complete.
_PARTIAL_WRITE_GRACE_S = 2.0


class RunConfigMismatch(RuntimeError):
    """config.json under our digest describes another run config."""


def render_run_config(run_config: dict[str, Any]) -> bytes:
    # Same serialisation as vLLM 0.33 (json.dump, indent=2, sort_keys=True).
    return json.dumps(run_config, indent=2, sort_keys=True).encode("utf-8")


def _read_json(path: str) -> Any:
    data, _ = read_revalidated(path)
    return json.loads(data.decode("utf-8"))


def ensure_run_config(
    layout: CacheLayout, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE
) -> str:
    """Make sure ``config.json`` of ``layout`` holds our run config.

    Returns "created", "matched" or "repaired" (an unparsable file was
    replaced). Raises RunConfigMismatch when the file parses but describes
    something else -- another tool's data under our digest must never be
    silently overwritten.
    """
    path = layout.config_path
    wanted = layout.run_config
    deadline = time.monotonic() + _PARTIAL_WRITE_GRACE_S
    while True:
        try:
            existing = _read_json(path)
        except FileNotFoundError:
            write_file_atomically(path, render_run_config(wanted), file_mode, dir_mode)
            return "created"
        except OSError as exc:
            # Another client of a network filesystem replaced it just now.
            if exc.errno != errno.ESTALE or time.monotonic() >= deadline:
                raise
            continue
        except (ValueError, UnicodeDecodeError):
            if time.monotonic() < deadline:
                time.sleep(0.05)  # another writer may still be mid-write
                continue
            write_file_atomically(path, render_run_config(wanted), file_mode, dir_mode)
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
