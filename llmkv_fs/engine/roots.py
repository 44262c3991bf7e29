"""The roots one engine stores on, each on its own: its prepared volume
(root pinned, config.json, rank directory), its O_DIRECT probe, its
``BlockIO``, its shared ``VolumeSignals`` page, space guard and housekeeping
thread (root check, free space, lease, access stamps). A tier with one root
has one of each, exactly as before roots could be several; with several
(``path_sharding: by_block_hash``) one root lost or full costs only the
blocks placed on it (block/blockio.py, ``RootPlacement``).

Threading: built on the constructing thread before any I/O thread or worker
exists; afterwards immutable apart from what each part documents (the
housekeeping thread writes its root's signals, the guard its verdict).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.bytepath import BytePathKind
from llmkv_fs.engine.block.spec import RootSpec
from llmkv_fs.engine.startup.io_setup import choose_o_direct, io_options
from llmkv_fs.engine.upkeep.housekeeping import STOP_WAIT_S, Housekeeping
from llmkv_fs.engine.upkeep.prepare import check_root, prepare_volume
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.upkeep.space import SpaceGuard
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.rootlist import check_roots_distinct
from llmkv_fs.volume.fsinfo import filesystem_type

__all__ = ["EngineRoot", "close_roots", "open_roots"]


@dataclasses.dataclass(frozen=True)
class EngineRoot:
    """One root of the engine and everything that is its own."""

    spec: RootSpec  # its layout and I/O options, as every block step gets them
    run_config_state: str  # "created", "matched" or "repaired": what became of config.json
    fstype: str  # the filesystem holding it, from the mount table
    blockio: BlockIO  # the engine's own: I/O threads, lookups, access stamps
    signals: VolumeSignals  # the one place that says whether the root is lost
    guard: SpaceGuard
    housekeeping: Housekeeping

    @property
    def lost(self) -> bool:
        """The root is missing or another directory, as of its housekeeping
        thread's last check (its signals page, which I/O workers read too;
        never touches the filesystem)."""
        return self.signals.root_lost

    @property
    def layout(self) -> CacheLayout:
        return self.spec.layout

    @property
    def root_dir(self) -> str:
        return self.spec.layout.root_dir

    @property
    def use_o_direct(self) -> bool:
        return self.spec.options.use_o_direct

    def close(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop the housekeeping thread (it removes the lease), waiting at
        most ``wait_s`` for it, close the calling thread's root descriptor
        (I/O and lookup threads close theirs as they end) and the signals
        fd; the signals page
        stays readable. A housekeeping thread left behind inside a call on
        the volume (logged by ``Housekeeping.stop``) keeps the page open:
        it may still write there (root check, space guard) until it ends,
        and the page goes with the process."""
        if self.housekeeping.stop(wait_s):
            self.signals.close()
        self.blockio.release()  # the calling thread's root descriptor


def close_roots(roots: Sequence[EngineRoot], wait_s: float) -> None:
    """Close every root, waiting for their housekeeping threads together:
    at most ``wait_s`` in all, however many roots hang."""
    for root in roots:
        root.housekeeping.stop_soon()
    deadline = time.monotonic() + wait_s
    for root in roots:
        root.close(max(0.0, deadline - time.monotonic()))


def open_roots(
    settings: TierSettings,
    layouts: Sequence[CacheLayout],
    flat: memoryview,
    block_size: int,
    byte_path: BytePathKind,
    keyring: Keyring | None = None,
) -> list[EngineRoot]:
    """Prepare every root and start its housekeeping, in list order. Raises
    RootListError when two roots are one directory or nested, VolumeError
    naming an entry that cannot be a root (a file, a symlink, /proc, ...):
    both checked for every entry before anything is created in any of them.
    Then VolumeError/EngineError/RunConfigMismatch naming the root that
    cannot be used (roots opened before it are closed again)."""
    if len(layouts) > 1:
        check_roots_distinct("root_dir", [layout.root_dir for layout in layouts])
    for layout in layouts:
        check_root(layout.root_dir, settings.require_mounted_root)
    roots: list[EngineRoot] = []
    try:
        for layout in layouts:
            roots.append(_open_root(settings, layout, flat, block_size, byte_path, keyring))
    except BaseException:
        close_roots(roots, STOP_WAIT_S)
        raise
    return roots


def _open_root(
    settings: TierSettings,
    layout: CacheLayout,
    flat: memoryview,
    block_size: int,
    byte_path: BytePathKind,
    keyring: Keyring | None,
) -> EngineRoot:
    prepared = prepare_volume(
        layout, settings.file_mode, settings.dir_mode, settings.require_mounted_root
    )
    use_o_direct = choose_o_direct(settings.io_mode, flat, block_size, layout.rank_dir)
    fstype = filesystem_type(layout.root_dir)
    options = io_options(settings, block_size, use_o_direct, fstype, prepared.root)
    spec = RootSpec(layout, options)
    blockio = spec.blockio(byte_path, keyring)
    signals = VolumeSignals.create()
    guard = SpaceGuard(
        layout.root_dir,
        settings.max_usage_percent,
        settings.min_free_bytes,
        headroom_bytes=0,  # set once the executor exists (the blocks it holds)
        signals=signals,
    )
    housekeeping = Housekeeping(
        guard,
        layout.base_path,
        settings.lease_interval_s,
        settings.file_mode,
        settings.dir_mode,
        stamp=blockio.apply_access_stamps,
        root=prepared.root,
    )
    return EngineRoot(
        spec,
        prepared.run_config_state,
        fstype,
        blockio,
        signals,
        guard,
        housekeeping,
    )
