"""``llmkv-fs verify``'s reading: block files checked on a pool of reader
threads (``ops/blockcheck.py`` does each check). ``ops/verify.py`` decides
what to read and counts what comes back.

Threading: ``check_all`` runs on the caller's thread and owns the pool. Each
reader checks one file and posts its result on a queue; the caller's thread
takes them in completion order and is the only one that calls ``on_result``
and ``tick`` (so what they fill needs no lock), keeping at most 2 x threads
files in flight.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.ops.blockcheck import ERROR, Result, check_block
from llmkv_fs.ops.progress import INTERVAL_S

__all__ = ["check_all"]


def _work(item, out: queue.SimpleQueue, keyring: Keyring | None) -> None:
    digest, rank_dir, entry, chunk, sealed = item
    try:
        result = check_block(rank_dir, entry.path, entry.st, chunk, keyring, sealed)
    except BaseException as exc:  # a bug must not hang the run
        result = Result(entry.path, ERROR, 0, "internal-error", repr(exc))
    out.put((digest, rank_dir, result))


def check_all(
    items: list,
    threads: int,
    on_result: Callable,
    tick: Callable[[], None],
    keyring: Keyring | None = None,
) -> None:
    """Check ``items`` on ``threads`` readers (sealed blocks opened with
    ``keyring``); ``on_result`` runs on this thread, in completion order.
    At most 2 x threads items are in flight."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    pending: Iterator = iter(items)
    in_flight = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmkv-verify") as pool:

        def submit_next() -> int:
            item = next(pending, None)
            if item is None:
                return 0
            pool.submit(_work, item, results, keyring)
            return 1

        for _ in range(2 * threads):
            in_flight += submit_next()
        while in_flight:
            try:
                got = results.get(timeout=INTERVAL_S)
            except queue.Empty:
                tick()
                continue
            in_flight -= 1
            on_result(*got)
            in_flight += submit_next()
            tick()
