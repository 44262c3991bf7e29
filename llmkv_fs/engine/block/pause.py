"""Pause points in the per-block path, honoured in I/O threads and worker
processes alike, so a test can hold a block at a known place instead of
catching a window by polling.

Inactive unless the engine is given a ``PausePoints``
(``FsEngine(..., pause=PausePoints(directory))``; a worker process gets it
as a field of its launch, workers/crew.WorkerLaunch); then each block asks,
at each point, whether the point is armed -- two ``stat`` calls per point.
Nothing in the product makes one: the test kits pass it in
(tests/kits/engine_kit.py, and tests/kits/paused_tier.py for a tier vLLM's
factory starts), and without one the hot path pays one ``is None``.

The protocol is files in that directory, so it crosses process boundaries:

* ``armed.<point>`` or ``armed.<point>.<op>``: blocks (of ``<op>``, ``load``
  or ``store``, only) stop at ``<point>`` (``enter``: before any I/O of the
  block; ``read``: a load past its checks, right before it opens the file;
  ``publish``: a store whose temp file is written and closed, right before
  its rename; ``exists``, op ``lookup``: an existence check of the engine's
  lookup threads, before it touches the volume -- each key of a chunk the
  compiled check takes at once, in order, then the chunk's one call);
* on stopping, a block creates ``at.<point>.<op>.<key hex>.<pid>.<thread>.<ns>``
  (what the test waits for; ``<ns>`` is CLOCK_MONOTONIC, one clock for every
  process, so markers sort in arrival order -- file times are kernel ticks,
  milliseconds apart, and tied when blocks arrive close together), then
  waits while ``open`` is missing or ``hold.<key hex>`` exists, polling
  every millisecond, at most ``MAX_PAUSE_S`` (then it goes on: a forgotten
  gate costs time, not a hang).

Threading: stateless apart from the directory; any thread or process.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["MAX_PAUSE_S", "PausePoints"]

MAX_PAUSE_S = 120.0
_POLL_S = 0.001


class PausePoints:
    """The pause points of one process (see the module doc)."""

    def __init__(self, directory: str):
        self.directory = directory

    def reached(self, point: str, op: str, key: bytes) -> None:
        """Stop here while the test says so (see the module doc)."""
        directory = self.directory
        armed = os.path.join(directory, f"armed.{point}")
        if not (os.path.exists(armed) or os.path.exists(f"{armed}.{op}")):
            return
        key_hex = key.hex()
        place = f"{os.getpid()}.{threading.get_native_id()}"
        marker = f"at.{point}.{op}.{key_hex}.{place}.{time.monotonic_ns()}"
        with open(os.path.join(directory, marker), "w"):
            pass
        opened = os.path.join(directory, "open")
        held = os.path.join(directory, f"hold.{key_hex}")
        deadline = time.monotonic() + MAX_PAUSE_S
        while (not os.path.exists(opened) or os.path.exists(held)) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
