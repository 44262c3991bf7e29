"""The physical reference for ``llmkv-fs bench``: how fast the medium moves
block-sized files at the tiers' concurrency, with no tier around it.

fio (when on PATH) writes then reads ``nblocks`` files of exactly one block
each, ``numjobs`` = the tiers' concurrency, one ``pwrite``/``pread`` per file
(``psync``), O_DIRECT when the directory accepts it (probed with
``os.open(O_DIRECT)`` and one aligned write), else buffered. File creation is
fio's set-up, outside its timing, so fio measures the data path alone: the
ceiling the tiers (which create, write and rename a file per block) approach.

Without fio, the same load runs in Python threads (open, one pwrite/pread,
close per file; the GIL is released in each syscall), each file from/to its
own row of one large buffer as the tiers do. It is reported with
``tool: "python"`` so the two are never confused. fio reuses one small buffer
per job, which stays in the CPU cache: on tmpfs (a memory copy) that makes
fio's figure a ceiling the tiers cannot reach; on a disk it does not matter.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import subprocess
import threading
import time

from llmkv_fs.engine.startup.probe import probe_o_direct

__all__ = ["fio_path", "physical_reference", "supports_o_direct"]

O_DIRECT = getattr(os, "O_DIRECT", 0)


def fio_path() -> str | None:
    return shutil.which("fio")


def supports_o_direct(directory: str) -> bool:
    """os.open(O_DIRECT) plus one aligned page write, in ``directory``."""
    return probe_o_direct(directory)


def physical_reference(
    directory: str, block_bytes: int, nblocks: int, numjobs: int, direct: bool | None = None
) -> dict:
    """Write then read ``nblocks`` one-block files under ``directory`` (created
    and removed here) with ``numjobs`` concurrent workers. Returns
    ``{"tool", "direct", "numjobs", "store_gbps", "load_gbps"}``."""
    os.makedirs(directory, exist_ok=True)
    try:
        if direct is None:
            direct = supports_o_direct(directory)
        numjobs = max(1, min(numjobs, nblocks))
        files_per_job = math.ceil(nblocks / numjobs)
        if fio_path():
            store = _fio(directory, "write", block_bytes, files_per_job, numjobs, direct)
            load = _fio(directory, "read", block_bytes, files_per_job, numjobs, direct)
            tool = "fio"
        else:
            store, load = _python_reference(directory, block_bytes, files_per_job, numjobs, direct)
            tool = "python"
        return {
            "tool": tool,
            "direct": direct,
            "numjobs": numjobs,
            "files": files_per_job * numjobs,
            "store_gbps": store / 1e9,
            "load_gbps": load / 1e9,
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _fio(
    directory: str, rw: str, block_bytes: int, files_per_job: int, numjobs: int, direct: bool
) -> float:
    """Bytes per second fio reports for the whole group."""
    cmd = [
        fio_path() or "fio",
        "--name=ref",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={block_bytes}",
        f"--filesize={block_bytes}",
        f"--nrfiles={files_per_job}",
        f"--openfiles={files_per_job}",
        f"--numjobs={numjobs}",
        "--ioengine=psync",
        f"--direct={int(direct)}",
        "--group_reporting",
        "--output-format=json",
        "--file_service_type=sequential",
        "--fallocate=none",
        "--invalidate=1",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    # fio may print notices before the JSON document.
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def _python_reference(
    directory: str, block_bytes: int, files_per_job: int, numjobs: int, direct: bool
) -> tuple[float, float]:
    flag = O_DIRECT if direct else 0
    names = [[f"{directory}/ref.{j}.{i}" for i in range(files_per_job)] for j in range(numjobs)]
    # One row per file in one big buffer, as the tiers copy from/to the primary
    # region: a per-thread buffer reused for every file stays in the CPU cache
    # and overstates what a memory-speed medium (tmpfs) can do.
    region = mmap.mmap(-1, numjobs * files_per_job * block_bytes)
    seed = os.urandom(block_bytes)
    for i in range(numjobs * files_per_job):
        region[i * block_bytes : (i + 1) * block_bytes] = seed
    view = memoryview(region)

    def row(j: int, i: int) -> memoryview:
        start = (j * files_per_job + i) * block_bytes
        return view[start : start + block_bytes]

    def writer(j: int) -> None:
        for i, name in enumerate(names[j]):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
            try:
                os.pwrite(fd, row(j, i), 0)
            finally:
                os.close(fd)

    def reader(j: int) -> None:
        for i, name in enumerate(names[j]):
            fd = os.open(name, os.O_RDONLY | flag)
            try:
                os.preadv(fd, [row(j, i)], 0)
            finally:
                os.close(fd)

    errors: list[BaseException] = []

    def guarded(work, j: int) -> None:
        try:
            work(j)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    rates = []
    for work in (writer, reader):
        threads = [threading.Thread(target=guarded, args=(work, j)) for j in range(numjobs)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        rates.append(numjobs * files_per_job * block_bytes / (time.perf_counter() - started))
    view.release()
    region.close()
    return rates[0], rates[1]
