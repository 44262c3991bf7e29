"""``llmkv-fs verify`` for people: the report of ops.verify.verify_volume as
per-digest counts, the bad files (and where --repair moved them), what
could not be read, by kind, and a result line."""

from __future__ import annotations

import collections
from typing import Any, TextIO

from llmkv_fs.ops.problems import problem_lines, shorten
from llmkv_fs.units import format_bytes

__all__ = ["print_report"]


def print_report(report: dict[str, Any], out: TextIO) -> None:
    t = report["totals"]
    rate = ""
    if report["files_per_s"] is not None:
        rate = f" ({report['files_per_s']:.0f} files/s, {report['bytes_per_s'] / 1e9:.2f} GB/s)"
    print(
        f"verify {report['root']}: {t['files']} files in {len(report['digests'])} digest(s), "
        f"{format_bytes(t['bytes_read'])} read in {report['elapsed_s']:.2f} s{rate}, "
        f"listed in {report['listing_s']:.2f} s",
        file=out,
    )
    for d in report["digests"]:
        _print_digest(d, out)
    if report["bad"]:
        print(f"bad files ({len(report['bad'])}):", file=out)
        for b in report["bad"]:
            repair = ""
            if b["repair"] == "quarantined":
                repair = f"  -> {b['quarantined_to']}"
            elif b["repair"]:
                repair = f"  [not moved: {b['repair']}]"
            print(f"  {b['reason']:<13} {b['path']}  ({b['detail']}){repair}", file=out)
    if report["errors"]:
        print(f"unreadable ({len(report['errors'])}), not moved", file=out)
    if report["problems"]:
        print("could not be read or done, by kind (skipped):", file=out)
        for line in problem_lines(report["problems"]):
            print(line, file=out)
    links = report["symlinks"]
    if links["count"]:
        print(
            f"symlinks left alone (never followed): {links['count']}, "
            f"e.g. {shorten(links['examples'][0])}",
            file=out,
        )
    if t["atime_touched"]:
        print(
            f"note: {t['atime_touched']} files are not ours to read with O_NOATIME; reading "
            "them may have refreshed their atime (LRU age)",
            file=out,
        )
    outcomes = collections.Counter(b["repair"] for b in report["bad"])
    summary = "OK" if not (t["bad"] or t["errors"]) else f"{t['bad']} bad, {t['errors']} unreadable"
    if report["repair"] and report["bad"]:
        summary += " (" + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) + ")"
    print(f"result: {summary}", file=out)


def _print_digest(d: dict[str, Any], out: TextIO) -> None:
    chunk = "-" if d["chunk_bytes"] is None else format_bytes(d["chunk_bytes"])
    ranks = " ".join(f"r{r}" for r in d["ranks"]) or "no rank dirs"
    source = {"trailer": "a trailer"}.get(d["chunk_source"], d["chunk_source"])
    sealing = {True: "sealed", False: "plain"}.get(d["sealed"], "sealing unproven")
    print(f"  {d['name']}  {sealing}  chunk {chunk} (from {source})  {ranks}", file=out)
    print(
        f"    verified {d['verified']}  unverified {d['unverified']}  bad {d['bad']}  "
        f"unreadable {d['errors']}  vanished {d['vanished']}",
        file=out,
    )
    if d["sealed_unchecked"] or d["foreign_key"]:
        print(
            f"    sealed: {d['sealed_unchecked']} not authenticated (no key given: "
            f"--seal-key-file; not bad), {d['foreign_key']} of a key not given",
            file=out,
        )
