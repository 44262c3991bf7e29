"""Several roots for the volume tools (``llmkv-fs gc|stats|verify``): a tier
sharded with ``path_sharding: "by_block_hash"`` keeps a whole, ordinary
cache on each of its roots, so each tool runs on each root on its own, with
all its guarantees there (gc's lock, leases and capacity limits are per
root), and one root that is missing, busy or failing costs only its own
report.

The roots are given as several ``ROOT`` arguments or as one argument that
lists them exactly as the tier's ``root_dir`` does (comma-separated:
``/mnt/a/kv,/mnt/b/kv``), or both. They are split and checked here -- an
empty entry, the same directory twice (by spelling, through a symlink or a
bind mount), a root inside another: exit status 2 naming the entry, before
any root is touched -- with the tier's own checks (``rootlist``), so the
tools and the tier agree on a list.

One root prints exactly what the tool always printed. Several: a section
per root headed by its path, then a section over all of them (totals where
they add up, and each root's status); ``--json`` gives
``{"roots": [{"root": ..., "status": ..., <the root's report>}, ...],
"status": ..., "totals": {...}}``. The exit status is the worst of the
roots' (see ``worst``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from llmkv_fs.rootlist import MAX_ROOTS, RootListError, check_roots_distinct, split_root_list

__all__ = [
    "EXIT_BAD_ROOT",
    "RootOutcome",
    "add_root_argument",
    "parse_roots",
    "roots_from_args",
    "run_listed_roots",
    "run_roots",
    "sum_totals",
    "worst",
]

EXIT_BAD_ROOT = 2  # bad arguments: a bad root list, a root that is not a directory
_KEY = "roots"  # how the list's errors name it
# Exit statuses from least to most severe: another gc holds a root's lock
# (try again later) < entries could not be read or acted on < a root is
# not a directory (or --digest matched nothing there) < anything else (a
# signal: 143).
_SEVERITY = {0: 0, 75: 1, 1: 2, EXIT_BAD_ROOT: 3}


def add_root_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "root",
        nargs="+",
        metavar="ROOT",
        help=f"{help_text}; several roots (a tier with path_sharding by_block_hash): "
        "several ROOT arguments, or one comma-separated list as in root_dir "
        "(/mnt/a/kv,/mnt/b/kv); each root is handled on its own",
    )


def parse_roots(given: str | Sequence[str]) -> tuple[str, ...]:
    """The roots named by the ``ROOT`` arguments, in their order. Raises
    RootListError naming the entry: an empty one, more than MAX_ROOTS, two
    that are one directory (by spelling, through a symlink or a bind mount:
    device and inode) or one inside another. Touches nothing but
    ``stat``/``realpath``.

    One argument without a comma is that root, unchecked (as ever: the tool
    says if it is not a directory). An argument that names an existing
    directory as a whole is that directory even with commas in its name
    (``root_dir`` with ``path_sharding: none`` may contain them), unless its
    entries are directories too: that is ambiguous and refused."""
    args = [given] if isinstance(given, str) else list(given)
    if len(args) == 1 and "," not in args[0]:
        return (args[0],)
    literal = [arg for arg in args if "," in arg and os.path.isdir(arg)]
    for arg in literal:
        pieces = [piece.strip() for piece in arg.split(",")]
        if all(piece and os.path.isdir(piece) for piece in pieces):
            raise RootListError(
                f"llmkv_fs: {_KEY}: {arg!r} is a directory, and so is each of its "
                "comma-separated entries: one root or a list? Rename the directory or "
                "give the entries as separate arguments"
            )
    if not literal:
        # One list over all arguments: entries are numbered across them.
        entries = list(split_root_list(_KEY, ",".join(args)))
    else:
        entries = []
        for arg in args:
            entries.extend([arg] if arg in literal else split_root_list(_KEY, arg))
        if len(entries) > MAX_ROOTS:
            raise RootListError(
                f"llmkv_fs: {_KEY} lists {len(entries)} directories; at most {MAX_ROOTS} "
                "are allowed"
            )
    check_roots_distinct(_KEY, entries)
    return tuple(entries)


def worst(statuses: Sequence[int]) -> int:
    """The most severe of ``statuses`` (0 when there are none): 0 < 75
    (busy) < 1 (errors) < 2 (bad root) < any other (a signal)."""
    return max(statuses, key=lambda s: (_SEVERITY.get(s, len(_SEVERITY)), s), default=0)


@dataclasses.dataclass
class RootOutcome:
    """What a tool did on one root: its exit status there; its report (the
    single-root JSON object; None when it did not run there) and that
    report for people (``text``, lines ending in newlines); ``error``: why
    it did not run or stopped early, printed on stderr after the report."""

    status: int
    report: dict[str, Any] | None = None
    text: str = ""
    error: str = ""


def sum_totals(reports: Sequence[dict[str, Any]], key: str = "totals") -> dict[str, Any]:
    """The numbers of every report's ``key`` dict, added up per name."""
    out: dict[str, Any] = {}
    for report in reports:
        for name, value in report.get(key, {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[name] = out.get(name, 0) + value
    return out


# (root, outcome) of every root -> (the totals object of --json, its lines
# for people)
Totals = Callable[[Sequence[tuple[str, RootOutcome]]], tuple[dict[str, Any], list[str]]]


def run_roots(
    tool: str,
    roots: Sequence[str],
    one_root: Callable[[str], RootOutcome],
    *,
    as_json: bool,
    dumps: Callable[[Any], str],
    totals: Totals,
    stop: Callable[[], bool] | None = None,
    stopped_status: int = 0,
    out: TextIO | None = None,
) -> int:
    """Run ``one_root`` on each root in turn and print what it did; the
    worst status. One root: its report as the tool always printed it (and
    an exception propagates, as ever). Several: an exception on one root is
    printed and counts as status 1 there; the others still run. ``stop``
    (a signal) leaves the roots not begun undone, with ``stopped_status``.
    ``dumps`` turns a report (or the several-root object) into JSON."""
    out = sys.stdout if out is None else out
    if len(roots) == 1:
        outcome = one_root(roots[0])
        if outcome.report is not None:
            out.write(dumps(outcome.report) + "\n" if as_json else outcome.text)
            out.flush()
        _print_error(tool, outcome.error)
        return outcome.status
    done: list[tuple[str, RootOutcome]] = []
    for number, root in enumerate(roots, 1):
        if stop is not None and stop():
            outcome = RootOutcome(stopped_status, error="not run: stopped by a signal")
        else:
            outcome = _guarded(tool, root, one_root)
        done.append((root, outcome))
        if not as_json:
            _print_section(out, number, len(roots), root, outcome)
        _print_error(tool, outcome.error)
    status = worst([outcome.status for _, outcome in done])
    total, lines = totals(done)
    if as_json:
        entries = [_entry(root, outcome) for root, outcome in done]
        out.write(dumps({"roots": entries, "status": status, "totals": total}) + "\n")
    else:
        out.write(f"== all {len(roots)} roots ==\n")
        out.writelines(f"{line}\n" for line in lines)
        for root, outcome in done:
            state = "ok" if outcome.status == 0 else f"exit status {outcome.status}"
            why = f": {outcome.error}" if outcome.error else ""
            out.write(f"  {root}: {state}{why}\n")
        out.write(f"exit status {status} (the worst of the roots')\n")
    out.flush()
    return status


def _guarded(tool: str, root: str, one_root: Callable[[str], RootOutcome]) -> RootOutcome:
    try:
        return one_root(root)
    except Exception as exc:  # one root failing must not stop the others
        print(f"llmkv-fs {tool}: {root}: failed:", file=sys.stderr)
        traceback.print_exc()
        return RootOutcome(1, error=f"failed: {exc!r}")


def _entry(root: str, outcome: RootOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {"root": root, "status": outcome.status}
    if outcome.error:
        entry["error"] = outcome.error
    entry.update({k: v for k, v in (outcome.report or {}).items() if k != "root"})
    return entry


def _print_section(out: TextIO, number: int, count: int, root: str, outcome: RootOutcome) -> None:
    out.write(f"== root {number} of {count}: {root} ==\n")
    if outcome.report is not None:
        out.write(outcome.text)
    else:
        out.write(f"not done: {outcome.error}\n")
    out.write("\n")
    out.flush()


def _print_error(tool: str, error: str) -> None:
    if error:
        print(f"llmkv-fs {tool}: {error}", file=sys.stderr, flush=True)


def roots_from_args(tool: str, given: str | Sequence[str]) -> tuple[str, ...] | None:
    """``parse_roots``, or None after printing why the list is refused (the
    tool then exits with EXIT_BAD_ROOT, having touched nothing)."""
    try:
        return parse_roots(given)
    except RootListError as exc:
        message = str(exc).removeprefix("llmkv_fs: ")
        print(f"llmkv-fs {tool}: {message}", file=sys.stderr, flush=True)
        return None


def run_listed_roots(
    tool: str, given: str | Sequence[str], one_root: Callable[[str], RootOutcome], **options: Any
) -> int:
    """A tool's whole run over its ROOT arguments: ``roots_from_args``
    (EXIT_BAD_ROOT for a refused list), then ``run_roots`` with ``options``."""
    roots = roots_from_args(tool, given)
    if roots is None:
        return EXIT_BAD_ROOT
    return run_roots(tool, roots, one_root, **options)
