"""``verify --repair``'s one action: move a bad block file aside, only if
its path still names the inode judged bad (safe while tiers are live), and
with KV events on, announce it removed first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmkv_fs.layout.names import parse_block_path
from llmkv_fs.ops.blockcheck import Result
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.quarantine import move_to_quarantine

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["quarantine"]


def quarantine(
    rank_dir: str,
    result: Result,
    problems: Problems | None = None,
    announce: Announcer | None = None,
) -> tuple[str, str | None]:
    """Move a bad file aside if its path still names the inode judged bad.
    Returns (outcome, new path): "quarantined", "replaced" (another file is
    there now: left alone), "vanished", "skipped" or "failed: ..." (also
    recorded in ``problems``). ``announce`` hears of the move before it,
    and of a file still at the path after all (stored again)."""
    key = parse_block_path(rank_dir, result.path) if announce is not None else None
    if announce is not None and key is not None:
        announce.removed(key)
        announce.flush()
    outcome = _quarantine(rank_dir, result, problems)
    if announce is not None and key is not None and outcome[0] not in ("quarantined", "vanished"):
        announce.stored(key)
        announce.flush()
    return outcome


def _quarantine(rank_dir: str, result: Result, problems: Problems | None) -> tuple[str, str | None]:
    if result.ident is None:
        return "skipped", None
    try:
        target = move_to_quarantine(result.path, rank_dir, result.reason, result.ident)
    except IsADirectoryError:  # never move a tree aside
        return "skipped", None
    except FileNotFoundError:
        return "vanished", None
    except OSError as exc:
        if problems is not None:
            problems.add(exc, result.path, "quarantine")
        return f"failed: {exc}", None
    return ("quarantined", target) if target is not None else ("replaced", None)
