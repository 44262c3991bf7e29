"""What a block step is built from, declared once for both executors: each
root's layout and I/O options (``RootSpec``), where a key lives among the
roots (``RootPlacement``) and the sealing keys. The engine builds one
``StepSpec``; its I/O threads turn it into their ``BlockStep`` in the
engine's process, and each worker process receives the same object
(pickled, in its launch spec: workers/crew.py) and turns it into its own
with ``build_step`` -- the one place a step is assembled.

Immutable values; any thread or process may use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llmkv_fs.engine.block.blockio import BlockIO, BlockStep, StepRoot
from llmkv_fs.engine.block.bytes_c import compiled_slices
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.layout.sealed import Keyring

__all__ = ["RootSpec", "StepSpec", "build_step"]


@dataclasses.dataclass(frozen=True)
class RootSpec:
    """One root as a block step moves blocks there: its layout and the
    options its ``BlockIO`` is built with (the pinned root among them)."""

    layout: CacheLayout
    options: IoOptions

    def blockio(self, keyring: Keyring | None = None) -> BlockIO:
        """A fresh BlockIO for this root: the owner's (lookups, stamps) and
        each I/O place's are built here alike, each process its own
        (descriptors and per-thread scratch are not shared)."""
        return BlockIO(self.layout, self.options, keyring)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Every root of the engine in list order, the placement over them, and
    the sealing keys when blocks are sealed. The keys never travel pickled (``Keyring`` refuses): a
    worker's spec goes without them (``without_keys``) and its keys through
    a pipe (workers/crew.py)."""

    roots: tuple[RootSpec, ...]
    placement: RootPlacement
    keyring: Keyring | None = dataclasses.field(default=None, repr=False)

    def blockio(self, index: int) -> BlockIO:
        """A fresh BlockIO for root ``index`` (``RootSpec.blockio``)."""
        return self.roots[index].blockio(self.keyring)

    def without_keys(self) -> StepSpec:
        """The spec to pickle; ``with_keys`` puts them back."""
        return dataclasses.replace(self, keyring=None)

    def with_keys(self, keyring: Keyring | None) -> StepSpec:
        return dataclasses.replace(self, keyring=keyring)

    def with_options(self, options: Sequence[IoOptions]) -> StepSpec:
        """The same spec with other options per root (worker processes hash
        in smaller pieces: startup/io_setup.py)."""
        roots = tuple(
            dataclasses.replace(root, options=opts)
            for root, opts in zip(self.roots, options, strict=True)
        )
        return dataclasses.replace(self, roots=roots)


def build_step(
    spec: StepSpec,
    rows: memoryview,
    blockios: Sequence[BlockIO],
    signals: Sequence[VolumeSignals],
    pause: PausePoints | None,
) -> BlockStep:
    """The BlockStep of one process: ``blockios`` and ``signals`` per root
    of ``spec`` (the engine's own for its I/O threads; a worker's built from
    the spec and its inherited signals fds)."""
    roots = [StepRoot(b, s) for b, s in zip(blockios, signals, strict=True)]
    if len(roots) != len(spec.roots):
        raise ValueError(f"{len(roots)} roots given for a spec of {len(spec.roots)}")
    return BlockStep(
        roots, rows, spec.placement, pause, compiled_slices(roots, rows, spec.placement, pause)
    )
