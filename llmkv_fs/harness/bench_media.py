"""What ``llmkv-fs bench`` compares and where: the kinds of tier (ours,
vLLM's built-in) and the roots of a ``--dir`` value. Light (no vLLM), so
the command line's parser and the driver share it."""

from __future__ import annotations

from llmkv_fs.rootlist import RootListError, split_root_list

__all__ = ["KINDS", "roots_of"]

KINDS = ("ours", "builtin")


def roots_of(medium: str) -> list[str]:
    """The roots of a --dir value: its comma-separated entries, by the
    tier's own rules for root_dir (an empty, repeated or nested entry stops
    the run, naming it)."""
    try:
        return list(split_root_list("--dir", medium))
    except RootListError as exc:
        raise SystemExit(str(exc)) from None
