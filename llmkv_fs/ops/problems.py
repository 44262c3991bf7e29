"""Entries a volume tool could not read or act on, tallied by kind.

A tool walks a tree that live tiers, other tools and people change under it,
on filesystems that fail one entry at a time (a directory it may not list,
an NFS handle gone stale, a disk sector that reads EIO). The rule: one bad
entry costs that entry. It is recorded here, skipped, and the pass goes on
and reports in full. The kind is the errno's name (``EACCES``, ``ESTALE``,
...) or one of ours (``too-deep``); per kind the report keeps a count and
the first few examples, so a million unreadable files cost a number, not a
million lines.
"""

from __future__ import annotations

import dataclasses
import errno
import threading
from typing import Any

__all__ = [
    "EXAMPLES_PER_KIND",
    "MAX_DEPTH",
    "TOO_DEEP",
    "Problem",
    "Problems",
    "TooDeep",
    "kind_of",
    "problem_lines",
    "shorten",
]

EXAMPLES_PER_KIND = 5
TOO_DEEP = "too-deep"

# How deep below a top the tools descend. The layout goes 2 levels down
# (<hhh>/<hh>_g<g>); anything deeper is foreign, and each level read costs an
# open fd while its children are read.
MAX_DEPTH = 32


class TooDeep(OSError):
    """A directory below the nesting limit the tools descend to (far below
    anything the layout makes): not read, reported."""


def kind_of(exc: BaseException) -> str:
    """``EACCES``, ``ENAMETOOLONG``, ... for an OSError; ``too-deep``; else
    the exception's class name."""
    if isinstance(exc, TooDeep):
        return TOO_DEEP
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno-{exc.errno}")
    return type(exc).__name__


def _detail(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str
    op: str  # what was being done: "list", "stat", "unlink", ...
    path: str
    detail: str

    def line(self) -> str:
        return f"{self.op} {self.path}: {self.detail} ({self.kind})"


class Problems:
    """The tally. Safe to add to from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._examples: dict[str, list[Problem]] = {}

    def add(self, exc: BaseException, path: str, op: str) -> Problem:
        return self.add_kind(kind_of(exc), path, op, _detail(exc))

    def add_kind(self, kind: str, path: str, op: str, detail: str) -> Problem:
        problem = Problem(kind, op, path, detail)
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            examples = self._examples.setdefault(kind, [])
            if len(examples) < EXAMPLES_PER_KIND:
                examples.append(problem)
        return problem

    def extend(self, other: Problems) -> None:
        with other._lock:
            counts = dict(other._counts)
            examples = {k: list(v) for k, v in other._examples.items()}
        with self._lock:
            for kind, n in counts.items():
                self._counts[kind] = self._counts.get(kind, 0) + n
                mine = self._examples.setdefault(kind, [])
                mine.extend(examples[kind][: EXAMPLES_PER_KIND - len(mine)])

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def __bool__(self) -> bool:
        return self.count > 0

    def examples(self) -> list[Problem]:
        """The kept examples, kind by kind (most frequent kind first)."""
        with self._lock:
            kinds = sorted(self._counts, key=lambda k: (-self._counts[k], k))
            return [p for k in kinds for p in self._examples[k]]

    def as_dict(self) -> dict[str, Any]:
        """``{kind: {"count": n, "examples": [{"op", "path", "detail"}]}}``."""
        with self._lock:
            return {
                kind: {
                    "count": self._counts[kind],
                    "examples": [
                        {"op": p.op, "path": p.path, "detail": p.detail}
                        for p in self._examples[kind]
                    ],
                }
                for kind in sorted(self._counts)
            }

    def summary_lines(self, indent: str = "  ") -> list[str]:
        return problem_lines(self.as_dict(), indent)


def problem_lines(problems: dict[str, Any], indent: str = "  ") -> list[str]:
    """For people, from ``Problems.as_dict()`` (or a report holding it): one
    line per kind with its count, then its examples (a path too long to read
    is cut in the middle; --json has it whole)."""
    lines = []
    for kind, found in problems.items():
        lines.append(f"{indent}{kind}: {found['count']}")
        lines.extend(
            f"{indent}  {e['op']} {shorten(e['path'])}: {e['detail']}" for e in found["examples"]
        )
    return lines


def shorten(path: str, keep: int = 160) -> str:
    """``path``, or its two ends around how much was left out."""
    if len(path) <= 2 * keep:
        return path
    return f"{path[:keep]}...({len(path) - 2 * keep} chars)...{path[-keep:]}"
