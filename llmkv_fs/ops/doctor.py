"""Why don't these replicas share? Every deployment (``<model>_<digest>``)
on the volume -- its model, its digest, the run-config fields that made it,
its live replicas (from their leases: host, hash algorithm, seed
fingerprint, versions, root list, sealing keys by id and key check) and
whether it is sealed -- and every reason its replicas miss each other's
blocks, in plain words with the fix:

* two deployments of one model: the exact run-config fields that differ
  (``block_size 16 vs 32: a prompt is cut into other blocks ...``);
* ``--against FILE`` / ``--against-args ARGS``: a replica's own settings
  -- its run config (config.json), its ``vllm serve --config`` file, or
  its serve arguments (``ops/doctor_against.py``: what arguments can tell)
  -- against every deployment of its model;
* inside one deployment: live replicas hashing with different (or random)
  seeds, a replica sealing with a key another does not hold, replicas
  placing blocks over different root lists, a space guard refusing stores
  (the volume is past a live replica's limit), a digest holding blocks
  with no replica for ``--idle-days``, and (``--walk``) sealed blocks under
  a key no live replica announces (each block's trailer page names it).

Fast on a large volume: it reads the root's listing, each digest's
config.json and leases, and one directory entry of each rank directory; it
walks every block only with ``--walk`` (blocks, bytes, newest store and use,
the walk of ``llmkv-fs stats``). Read-only, never follows a symlink; what
it cannot read is reported and skipped. Exit status 0 when nothing stops
replicas from sharing, 1 when something does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from llmkv_fs.checks import number_between, option
from llmkv_fs.layout.run_diff import Difference, differences
from llmkv_fs.layout.sealed import NAMESPACE_FIELD
from llmkv_fs.ops import scan
from llmkv_fs.ops.blockcheck import infer_chunk_size, sealed_with
from llmkv_fs.ops.doctor_against import Against, against_args, against_file, compare
from llmkv_fs.ops.per_root import RootOutcome, add_root_argument, run_listed_roots, worst
from llmkv_fs.ops.problems import Problems, problem_lines
from llmkv_fs.ops.stats import lease_json, seed_warnings
from llmkv_fs.ops.stats_walk import DigestFiles, walk_digest
from llmkv_fs.volume.fsinfo import volume_usage
from llmkv_fs.volume.leases import Lease, LeaseDir

__all__ = ["add_arguments", "diagnose", "run"]

EXIT_SHARING, EXIT_NOT_SHARING, EXIT_BAD_INPUT = 0, 1, 2
_DAY_S = 86400.0
MAX_IDLE_DAYS = 36500  # a century: beyond it, a typo
_SHOWN = 80  # characters of a string from the volume, in the text report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser, "cache root directory (the tier's root_dir)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--walk",
        action="store_true",
        help="also walk every block file: blocks, bytes, newest store and use per "
        "deployment (as long as llmkv-fs stats takes)",
    )
    scan.add_threads_argument(parser)
    mine = parser.add_mutually_exclusive_group()
    mine.add_argument(
        "--against",
        metavar="FILE",
        help="a replica's own settings: its run config (config.json, as the tier writes "
        "it) or its vllm serve --config file (YAML or JSON): which fields keep it from "
        "each deployment of its model",
    )
    mine.add_argument(
        "--against-args",
        metavar="ARGS",
        help="a replica's own vllm serve arguments as one string "
        '("--model M --dtype float16 --block-size 32 ..."): which fields they '
        "determine keep it from each deployment of its model, and which they cannot tell",
    )
    parser.add_argument(
        "--idle-days",
        type=option(number_between(0, MAX_IDLE_DAYS, "days"), float),
        default=3.0,
        metavar="D",
        help="a deployment holding blocks with no sign of a replica for D days is "
        "reported (default 3)",
    )


def _clean(text: Any, limit: int = _SHOWN) -> str:
    """A string from the volume, safe to print: non-UTF-8 bytes and control
    characters escaped, at most ``limit`` characters."""
    if not isinstance(text, str):
        text = repr(text)
    shown = os.fsencode(text).decode("utf-8", "backslashreplace")
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _finding(
    kind: str, stops: bool, where: Sequence[str], message: str, **extra: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "stops_sharing": stops,
        "deployments": list(where),
        "message": message,
        **extra,
    }


def _lease_json(lease: Lease, now: float) -> dict[str, Any]:
    """stats' lease entry and what a lease announces for sharing."""
    return {
        **lease_json(lease, now),
        "roots": list(lease.roots),
        "seal_keys": list(lease.seal_keys),
        "max_usage_percent": lease.max_usage_percent,
        "min_free_bytes": lease.min_free_bytes,
    }


def _has_blocks(rank_dir: str) -> tuple[bool, float | None]:
    """Whether a rank directory holds anything (one entry read, never a
    walk; a symlink there is not followed) and its mtime. Raises OSError."""
    fd = os.open(rank_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mtime = os.fstat(fd).st_mtime
        with os.scandir(fd) as entries:
            for entry in entries:
                if not entry.name.startswith("."):
                    return True, mtime
    finally:
        os.close(fd)
    return False, mtime


def _deployment(
    d: scan.Digest, now: float, this_host: str, walk: bool, threads: int, problems: Problems
) -> dict[str, Any]:
    config, why = d.config_status()
    if config is None:
        problems.add(OSError(why), f"{d.config_dir}/config.json", "read config.json")
    try:
        found, lease_error = d.lease_dir(), None
    except OSError as exc:
        problems.add(exc, exc.filename or d.config_dir, "read leases")
        found, lease_error = LeaseDir([], []), exc.strerror or str(exc)
    live = [x for x in found.leases if x.is_live(now, this_host)]
    seen = [x.refreshed for x in found.leases] + [b.mtime for b in found.bad if b.mtime]
    holds = False
    for path in d.rank_dirs.values():
        try:
            has, mtime = _has_blocks(path)
        except OSError as exc:
            problems.add(exc, path, "open rank directory")
            continue
        holds = holds or has
        if mtime is not None:
            seen.append(mtime)
    entry: dict[str, Any] = {
        "name": d.name,
        "digest": d.digest,
        "model": (config or {}).get("model_name", d.model),
        "config": config,
        "config_error": why or None,
        "sealed": isinstance((config or {}).get(NAMESPACE_FIELD), str),
        "ranks": sorted(d.rank_dirs),
        "holds_blocks": holds,
        "live": [_lease_json(x, now) for x in live],
        "stale_leases": len(found.leases) - len(live),
        "bad_leases": [{"path": b.path, "why": b.why} for b in found.bad],
        "lease_error": lease_error,
        "last_sign_age_s": round(now - max(seen), 3) if seen else None,
        "walk": None,
    }
    if walk:
        files = walk_digest(d, now, threads, problems, keep_blocks=entry["sealed"])
        blocks = sum(r["blocks"] for r in files.ranks.values())
        entry["holds_blocks"] = blocks > 0
        entry["walk"] = {
            "blocks": blocks,
            "bytes": sum(r["bytes"] for r in files.ranks.values()),
            "newest_store_age_s": None
            if files.newest_mtime is None
            else round(now - files.newest_mtime, 3),
            "newest_use_age_s": None if files.newest is None else round(now - files.newest, 3),
            "sealed_with": _sealed_with(files, threads) if entry["sealed"] else None,
        }
        if files.newest is not None:
            used = round(now - files.newest, 3)
            sign = entry["last_sign_age_s"]
            entry["last_sign_age_s"] = used if sign is None else min(sign, used)
    return entry


def _sealed_with(files: DigestFiles, threads: int) -> dict[str, int]:
    """A sealed digest's blocks by the key they were sealed with, as leases
    announce keys ("<key id>:<key check hex>"), from each block's trailer
    page (read on ``threads`` threads); blocks that are not sealed ones are
    not counted (``llmkv-fs stats`` and ``verify`` name them)."""
    chunk = infer_chunk_size(files.probe).payload
    if not chunk or not files.blocks:
        return {}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmkv-doctor") as pool:
        keys = collections.Counter(
            key
            for _, key in pool.map(lambda b: sealed_with(b[0], b[1], b[2], chunk), files.blocks)
            if key is not None
        )
    return dict(sorted(keys.items()))


def _unheld_keys(dep: dict[str, Any]) -> list[dict[str, Any]]:
    """Blocks of a sealed deployment (counted by ``--walk``) sealed with a
    key no live replica announces: every live replica misses them. Said
    only when some live replica announces its keys (older versions do not)."""
    counts = (dep["walk"] or {}).get("sealed_with") or {}
    held = {k for x in dep["live"] for k in x["seal_keys"]}
    if not counts or not held:
        return []
    held_ids = {k.split(":", 1)[0] for k in held}
    by_id: collections.Counter[str] = collections.Counter()
    for key, n in counts.items():
        if key not in held:
            by_id[key.split(":", 1)[0]] += n
    found = []
    for key_id, n in sorted(by_id.items(), key=lambda item: (len(item[0]), item[0])):
        how = (
            "another key under that id than the live replicas hold"
            if key_id in held_ids
            else "which no live replica holds"
        )
        found.append(
            _finding(
                "unheld_key",
                False,
                [dep["name"]],
                f"{n} blocks of {_clean(dep['name'])} sealed with key id {key_id}, {how}: "
                "they are foreign_key misses (lookup_misses and load_failures "
                "reason foreign_key); a replica that recomputes one writes over it "
                '(stored_blocks{outcome="replaced"}) (add the key to seal_key_files, '
                "or let them age out)",
                key_id=int(key_id),
                blocks=n,
            )
        )
    return found


def _inside(dep: dict[str, Any], usage: Any, idle_days: float) -> list[dict[str, Any]]:
    """What keeps the replicas of one deployment from sharing."""
    name, live = dep["name"], dep["live"]
    found = []
    fingerprints = sorted({x["seed_fingerprint"] for x in live})
    for line in seed_warnings(_clean(name), len(live), fingerprints):
        found.append(_finding("hash_seed", True, [name], line.removeprefix("WARNING: ")))
    if dep["sealed"]:
        found.extend(_sealing(dep))
        found.extend(_unheld_keys(dep))
    roots = {tuple(x["roots"]) for x in live if x["roots"]}
    if len(roots) > 1:
        lists = " vs ".join(
            ",".join(_clean(r, 40) for r in sorted_roots) for sorted_roots in sorted(roots)
        )
        found.append(
            _finding(
                "root_list",
                True,
                [name],
                f"live replicas of {_clean(name)} place blocks over different root lists "
                f"({lists}): a block is looked for on another root than it was stored on "
                "(give every replica the same root_dir list, mounted at the same paths)",
            )
        )
    if usage is not None:
        for lease in live:
            limit, floor = lease["max_usage_percent"], lease["min_free_bytes"]
            over = (limit and usage.used_percent > limit) or (floor and usage.free_bytes < floor)
            if over:
                found.append(
                    _finding(
                        "space_guard",
                        True,
                        [name],
                        f"the volume is {usage.used_percent:.1f}% used, "
                        f"{usage.free_bytes} bytes free: the space guard of "
                        f"{_clean(lease['host'])} pid {lease['pid']} (max_usage_percent "
                        f"{limit:g}, min_free_bytes {floor}) refuses every store, so nothing "
                        "new is shared (run llmkv-fs gc, or grow the volume)",
                    )
                )
                break
    age = dep["last_sign_age_s"]
    if dep["holds_blocks"] and not live and age is not None and age > idle_days * _DAY_S:
        found.append(
            _finding(
                "idle",
                False,
                [name],
                f"{_clean(name)} holds blocks but no replica has used it for "
                f"{age / _DAY_S:.1f} days: replicas of its model now write elsewhere, or "
                "none runs (gc evicts it once its blocks are old enough)",
            )
        )
    return found


def _sealing(dep: dict[str, Any]) -> list[dict[str, Any]]:
    """Live replicas of a sealed deployment that seal with a key (id and
    key check) another live replica does not hold: it misses their blocks."""
    found = []
    name = dep["name"]
    announced = [x for x in dep["live"] if x["seal_keys"]]
    for writer in announced:
        write_key = writer["seal_keys"][0]
        for reader in announced:
            if reader is writer or write_key in reader["seal_keys"]:
                continue
            key_id = write_key.split(":", 1)[0]
            held = [k for k in reader["seal_keys"] if k.split(":", 1)[0] == key_id]
            how = "holds another key under that id" if held else "does not hold that key id"
            found.append(
                _finding(
                    "sealing_key",
                    True,
                    [name],
                    f"{_clean(writer['host'])} pid {writer['pid']} seals blocks of "
                    f"{_clean(name)} with key id {_clean(key_id)}; "
                    f"{_clean(reader['host'])} pid {reader['pid']} {how}: it misses "
                    "them (load_failures reason foreign_key) (give every replica every "
                    "key the others write with, in seal_key_files)",
                )
            )
    return found


def _between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    found: list[Difference] = differences(a["config"], b["config"])
    if not found:  # equal objects under two digest names: one of them lies
        sentence = (
            "the same run config under two digests (one config.json does not hash to its name)"
        )
    else:
        sentence = "; ".join(d.sentence() for d in found)
    return _finding(
        "run_config",
        True,
        [a["name"], b["name"]],
        f"{_clean(a['name'])} and {_clean(b['name'])} never share: {sentence}",
        fields=[d.field for d in found],
        differences=[d.as_json() for d in found],
    )


def _against(against: Against, dep: dict[str, Any]) -> dict[str, Any] | None:
    """What keeps the replica ``against`` describes from ``dep`` (None:
    nothing it tells)."""
    found, unjudged = compare(against, dep["config"], [x["hash_algo"] for x in dep["live"]])
    if not found:
        return None
    sentence = "; ".join(d.sentence() for d in found)
    return _finding(
        "against",
        True,
        [dep["name"]],
        f"{against.option.split(' ', 1)[0]} and {_clean(dep['name'])} never share: {sentence}",
        fields=[d.field for d in found],
        differences=[d.as_json() for d in found],
        unjudged=[{"field": f, "why": why} for f, why in unjudged],
    )


def _pairs(deployments: list[dict[str, Any]], against: Against | None) -> list[dict[str, Any]]:
    """Deployments of one model against each other (and ``against``)."""
    found = []
    readable = [d for d in deployments if d["config"] is not None]
    for i, a in enumerate(readable):
        for b in readable[i + 1 :]:
            if a["model"] == b["model"]:
                found.append(_between(a, b))
    if against is not None:
        for dep in readable:
            if dep["model"] == against.model:
                finding = _against(against, dep)
                if finding is not None:
                    found.append(finding)
    return found


def diagnose(
    root: str,
    walk: bool = False,
    threads: int | str | None = None,
    against: Against | None = None,
    idle_days: float = 3.0,
    now: float | None = None,
) -> dict[str, Any]:
    """The report of one root (see the module doc). Raises OSError only
    when ``root`` itself cannot be listed."""
    now = time.time() if now is None else now
    listing = scan.list_root(root)
    problems = listing.problems
    this_host = socket.gethostname()
    threads = scan.threads_for(root, threads) if walk else 1
    deployments = [_deployment(d, now, this_host, walk, threads, problems) for d in listing.digests]
    try:
        usage = volume_usage(root)
    except OSError as exc:
        problems.add(exc, root, "statvfs")
        usage = None
    findings = _pairs(deployments, against)
    for dep in deployments:
        findings.extend(_inside(dep, usage, idle_days))
    unexpected = listing.symlinks + listing.other
    return {
        "root": root,
        "time": now,
        "sharing": not any(f["stops_sharing"] for f in findings),
        "deployments": deployments,
        "findings": findings,
        "against": None if against is None else against.as_json(),
        "unexpected": unexpected,
        "problems": problems.as_dict(),
    }


def _cannot_tell(against: dict[str, Any] | None) -> str:
    """The line naming what ``--against``'s serve arguments cannot tell."""
    if against is None or not against.get("unjudged"):
        return ""
    told = "; ".join(f"{u['field']} ({u['why']})" for u in against["unjudged"])
    return f"{_clean(against['option'], 200)} cannot tell: {told}\n"


def _print(report: dict[str, Any], out: TextIO) -> None:
    deployments = report["deployments"]
    out.write(f"{len(deployments)} deployment(s) on {_clean(report['root'], 200)}\n")
    for dep in deployments:
        config = dep["config"] or {}
        sizes = [
            g.get("tokens_per_block")
            for g in config.get("kv_cache_groups") or []
            if isinstance(g, dict)
        ]
        facts = (
            f"block_size {_clean(sizes[0] if len(set(map(str, sizes))) == 1 else sizes)}  "
            f"dtype {_clean(config.get('dtype'))}  tp {_clean(config.get('tp_size'))}"
            if config
            else f"config.json unreadable: {_clean(dep['config_error'])}"
        )
        sealed = "sealed" if dep["sealed"] else "plain"
        out.write(f"  {_clean(dep['name'])}  model {_clean(dep['model'])}  {facts}  {sealed}\n")
        blocks = dep["walk"]
        if blocks is not None:
            newest = blocks["newest_store_age_s"]
            out.write(
                f"    {blocks['blocks']} blocks, {blocks['bytes']} bytes"
                + (f", newest stored {newest / 3600:.1f} h ago" if newest is not None else "")
                + "\n"
            )
        elif dep["holds_blocks"]:
            out.write("    holds blocks (--walk counts them)\n")
        out.write(f"    {len(dep['live'])} live replica(s), {dep['stale_leases']} stale lease(s)\n")
        for lease in dep["live"]:
            keys = ",".join(k.split(":", 1)[0] for k in lease["seal_keys"])
            out.write(
                f"      {_clean(lease['host'])} pid {lease['pid']}  {_clean(lease['hash_algo'])} "
                f"seed {_clean(lease['seed_fingerprint'])}  vLLM {_clean(lease['vllm_version'])}  "
                f"llmkv_fs {_clean(lease['llmkv_fs_version'])}"
                + (f"  roots {len(lease['roots'])}" if lease["roots"] else "")
                + (f"  key ids {keys}" if keys else "")
                + "\n"
            )
        for bad in dep["bad_leases"][:5]:
            out.write(f"      unreadable lease {_clean(bad['path'], 200)}: {_clean(bad['why'])}\n")
    findings = report["findings"]
    for f in findings:
        label = "DOES NOT SHARE" if f["stops_sharing"] else "note"
        out.write(f"{label}: {f['message']}\n")
    out.write(_cannot_tell(report["against"]))
    if report["unexpected"]:
        out.write(
            f"{len(report['unexpected'])} entries in the root are no deployment "
            "(left alone, never followed)\n"
        )
    for line in problem_lines(report["problems"]):
        out.write(f"{line}\n")
    if report["sharing"]:
        out.write("nothing stops these replicas from sharing\n")


def _one_root(args: argparse.Namespace, root: str, against: Against | None) -> RootOutcome:
    if not os.path.isdir(root):
        return RootOutcome(EXIT_BAD_INPUT, error=f"{root}: not a directory")
    report = diagnose(root, args.walk, args.threads, against, args.idle_days)
    text = io.StringIO()
    _print(report, text)
    status = EXIT_SHARING if report["sharing"] else EXIT_NOT_SHARING
    # A name that is not UTF-8 (kept by Python as surrogates) printed escaped.
    shown = text.getvalue().encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    models = sorted({d["model"] for d in report["deployments"] if d["config"] is not None})
    if against is not None and against.model not in models:
        there = ", ".join(_clean(m, 60) for m in models[:10]) or "none"
        error = (
            f"{against.option.split(' ', 1)[0]}: no deployment of model "
            f"{_clean(against.model)} on {_clean(root, 200)} to compare with (models there: "
            f"{there}); give the model name as vLLM was served with it"
        )
        return RootOutcome(EXIT_BAD_INPUT, report, shown, error)
    return RootOutcome(status, report, shown)


def _totals(done: Sequence[tuple[str, RootOutcome]]) -> tuple[dict[str, Any], list[str]]:
    reports = [o.report for _, o in done if o.report is not None]
    total = {
        "deployments": sum(len(r["deployments"]) for r in reports),
        "stops_sharing": sum(f["stops_sharing"] for r in reports for f in r["findings"]),
    }
    status = worst([o.status for _, o in done])
    verdict = "nothing stops sharing" if status == 0 else "something stops sharing"
    return total, [f"{total['deployments']} deployment(s); {verdict}"]


def run(args: argparse.Namespace) -> int:
    against = None
    try:
        if args.against is not None:
            against = against_file(args.against)
        elif args.against_args is not None:
            against = against_args(args.against_args)
    except ValueError as exc:
        print(f"llmkv-fs doctor: {_clean(str(exc), 400)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return run_listed_roots(
        "doctor",
        args.root,
        lambda root: _one_root(args, root, against),
        as_json=args.json,
        dumps=lambda obj: json.dumps(obj, indent=1),
        totals=_totals,
    )
