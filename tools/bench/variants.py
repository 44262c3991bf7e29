"""Variants of our engine in one benchmark run (``tools/bench/engine.py --ours``):
the same engine with one knob turned, side by side with the shipped one and
the built-in, so a change is judged by ratios from one run on one lease.

A variant is ``NAME:key=value,...`` with keys

* ``io_workers`` -- ``auto`` or a count (workers mode);
* ``hash_kib`` -- the piece hashed next to each read or write on memory
  filesystems, for I/O threads and worker processes alike
  (``engine/startup/io_setup._HASH_PIECE`` and ``_HASH_PIECE_PYTHON_THREADS``; the
  options travel to worker processes with the spec);
* ``prefault`` -- ``off`` turns the workers' page-table filler off
  (``engine/workers/prefault.py``) through a ``sitecustomize`` on the
  workers' PYTHONPATH: the engine itself has no such switch;
* ``nice`` -- the workers' nice increment (the ``io_workers_nice`` setting);
* ``compiled`` -- ``off`` for the Python byte path and presence check (the
  ``compiled_io`` setting), e.g. ``--ours c: --ours py:compiled=off``;
* ``seal`` -- a key file: blocks sealed with it (``seal_key_files``, key id
  1; layout/sealed.py), e.g. ``--ours plain: --ours sealed:seal=/tmp/k``
  for sealed against unsealed in one run;
* ``seal_kib`` -- the piece a sealed block is encrypted and decrypted in,
  for I/O threads and worker processes alike
  (``engine/startup/io_setup._SEAL_PIECE_THREADS`` and
  ``_SEAL_PIECE_WORKERS``);
* ``slice_kib`` and ``slice_max`` -- the most bytes and blocks a place
  takes of one job at once (``engine/launch._SLICE_BYTES`` and
  ``_SLICE_MAX_BLOCKS``);
* ``site`` -- a directory put first on the workers' PYTHONPATH, e.g. an
  unpacked wheel of another xxhash, so two builds of a dependency are
  compared in one run (workers mode: I/O threads hash in the benchmark's
  own process, which has imported its xxhash already). Run from a checkout:
  a worker's path starts with the package's own root (engine/workers/
  crew.py), which for an installed package is site-packages, holding the
  installed xxhash.

Threading: applied on the benchmark's main thread around an engine's
start-up (workers inherit the environment at spawn).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

__all__ = ["Variant", "applied", "parse_variant"]

_KEYS = (
    "io_workers",
    "hash_kib",
    "prefault",
    "nice",
    "site",
    "seal",
    "seal_kib",
    "compiled",
    "slice_kib",
    "slice_max",
)
_SITECUSTOMIZE = """
import os
if os.environ.get("LLMKV_BENCH_NO_PREFAULT"):
    from llmkv_fs.engine.workers import prefault as _prefault
    _init = _prefault.RowPrefault.__init__
    def _off(self, rows, row_bytes):
        _init(self, rows, row_bytes)
        self.working = False
    _prefault.RowPrefault.__init__ = _off
"""


class Variant(dict):
    """One variant's settings (str -> str) and its ``name``."""

    name: str = "shipped"


def parse_variant(text: str) -> Variant:
    name, _, spec = text.partition(":")
    variant = Variant()
    variant.name = name or "ours"
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in _KEYS or not value:
            raise ValueError(f"variant {text!r}: {item!r} is not one of {', '.join(_KEYS)}=VALUE")
        variant[key] = value
    return variant


def _put_first_on_pythonpath(directory: str) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (directory, os.environ.get("PYTHONPATH")) if p
    )


@contextlib.contextmanager
def applied(variant: Variant) -> Iterator[None]:
    """``variant``'s pieces, slices and worker environment in force for
    the engine started inside."""
    from llmkv_fs.engine import launch
    from llmkv_fs.engine.startup import io_setup

    saved_env = dict(os.environ)
    saved_chunks = io_setup._HASH_PIECE, io_setup._HASH_PIECE_PYTHON_THREADS
    saved_pieces = io_setup._SEAL_PIECE_THREADS, io_setup._SEAL_PIECE_WORKERS
    saved_slices = launch._SLICE_BYTES, launch._SLICE_MAX_BLOCKS
    site = None
    try:
        if "hash_kib" in variant:
            io_setup._HASH_PIECE = io_setup._HASH_PIECE_PYTHON_THREADS = (
                int(variant["hash_kib"]) << 10
            )
        if "seal_kib" in variant:
            piece = int(variant["seal_kib"]) << 10
            io_setup._SEAL_PIECE_THREADS = io_setup._SEAL_PIECE_WORKERS = piece
        if "slice_kib" in variant:
            launch._SLICE_BYTES = int(variant["slice_kib"]) << 10
        if "slice_max" in variant:
            launch._SLICE_MAX_BLOCKS = int(variant["slice_max"])
        if "site" in variant:
            _put_first_on_pythonpath(os.path.abspath(variant["site"]))
        if variant.get("prefault") == "off":
            site = tempfile.mkdtemp(prefix="llmkv_bench_site_")
            with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as f:
                f.write(_SITECUSTOMIZE)
            _put_first_on_pythonpath(site)
            os.environ["LLMKV_BENCH_NO_PREFAULT"] = "1"
        yield
    finally:
        io_setup._HASH_PIECE, io_setup._HASH_PIECE_PYTHON_THREADS = saved_chunks
        io_setup._SEAL_PIECE_THREADS, io_setup._SEAL_PIECE_WORKERS = saved_pieces
        launch._SLICE_BYTES, launch._SLICE_MAX_BLOCKS = saved_slices
        os.environ.clear()
        os.environ.update(saved_env)
        if site:
            shutil.rmtree(site, ignore_errors=True)
