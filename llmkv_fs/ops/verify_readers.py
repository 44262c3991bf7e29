"""``llmkv-fs verify``'s reading: block files checked on a pool of reader
threads (``ops/blockcheck.py`` does each check), and the progress bar of the
run. ``ops/verify.py`` decides what to read and counts what comes back.

Threading: ``check_all`` runs on the caller's thread and owns the pool. Each
reader checks one file and posts its result on a queue; the caller's thread
takes them in completion order and is the only one that calls ``on_result``
and ``tick`` (so what they fill needs no lock), keeping at most 2 x threads
files in flight. A ``Progress`` is used from that thread only.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.ops.blockcheck import ERROR, Result, check_block
from llmkv_fs.units import format_bytes

__all__ = ["PROGRESS_INTERVAL_S", "Progress", "check_all"]

PROGRESS_INTERVAL_S = 0.2


class Progress:
    """A tqdm bar on stderr (files checked, bytes read, bad so far), only when
    it is a terminal; cleared when done. Called from the collecting thread."""

    def __init__(self, total_files: int, total_bytes: int, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total_bytes = total_bytes
        self.bar = tqdm(
            total=total_files,
            desc="verify",
            unit=" files",
            file=self.stream,
            mininterval=PROGRESS_INTERVAL_S,
            leave=False,
            disable=not self.enabled,
        )

    def update(self, files: int, nbytes: int, bad: int, force: bool = False) -> None:
        if not self.enabled:
            return
        self.bar.set_postfix_str(
            f"{format_bytes(nbytes)}/{format_bytes(self.total_bytes)}, bad {bad}", refresh=False
        )
        self.bar.update(files - self.bar.n)  # redraws once PROGRESS_INTERVAL_S has passed
        if force:
            self.bar.refresh()

    def done(self) -> None:
        self.bar.close()


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
                got = results.get(timeout=PROGRESS_INTERVAL_S)
            except queue.Empty:
                tick()
                continue
            in_flight -= 1
            on_result(*got)
            in_flight += submit_next()
            tick()
