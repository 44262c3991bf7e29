"""The roots one engine stores on, each on its own: its prepared volume
(root pinned, config.json, rank directory), its O_DIRECT probe, its
``BlockIO``, its shared ``VolumeSignals`` page, space guard and housekeeping
thread (root check, free space, lease, access stamps). A tier with one root
has one of each, exactly as before roots could be several; with several
(``path_sharding: by_block_hash``) one root lost or full costs only the
blocks placed on it (block/step.py, ``RootPlacement``).

Threading: built on the constructing thread before any I/O thread or worker
exists; afterwards immutable apart from what each part documents (the
housekeeping thread writes its root's signals, the guard its verdict).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.io_setup import choose_o_direct, io_options
from llmkv_fs.engine.block.step import StepRoot
from llmkv_fs.engine.volume.housekeeping import Housekeeping
from llmkv_fs.engine.volume.prepare import prepare_volume
from llmkv_fs.engine.volume.signals import VolumeSignals
from llmkv_fs.engine.volume.space import SpaceGuard
from llmkv_fs.layout.fsinfo import filesystem_type
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.roots import check_roots_distinct

__all__ = ["EngineRoot", "open_roots"]


@dataclasses.dataclass(frozen=True)
class EngineRoot:
    """One root of the engine and everything that is its own."""

    layout: CacheLayout
    run_config_state: str  # "created", "matched" or "repaired": what became of config.json
    use_o_direct: bool
    blockio: BlockIO
    signals: VolumeSignals
    guard: SpaceGuard
    housekeeping: Housekeeping

    @property
    def root_dir(self) -> str:
        return self.layout.root_dir

    def step_root(self) -> StepRoot:
        return StepRoot(self.blockio, self.guard)

    def close(self) -> None:
        """Stop the housekeeping thread (removes the lease) and close the
        signals fd; the signals page stays readable."""
        self.housekeeping.stop()
        self.signals.close()


def open_roots(
    settings: TierSettings, layouts: Sequence[CacheLayout], flat: memoryview, block_size: int
) -> list[EngineRoot]:
    """Prepare every root and start its housekeeping, in list order. Raises
    RootListError when two roots are one directory or nested (checked before
    anything is created), VolumeError/EngineError/RunConfigMismatch naming the
    root that cannot be used (roots opened before it are closed again)."""
    if len(layouts) > 1:
        check_roots_distinct("root_dir", [layout.root_dir for layout in layouts])
    roots: list[EngineRoot] = []
    try:
        for layout in layouts:
            roots.append(_open_root(settings, layout, flat, block_size))
    except BaseException:
        for root in roots:
            root.close()
        raise
    return roots


def _open_root(
    settings: TierSettings, layout: CacheLayout, flat: memoryview, block_size: int
) -> EngineRoot:
    prepared = prepare_volume(
        layout, settings.file_mode, settings.dir_mode, settings.require_mounted_root
    )
    use_o_direct = choose_o_direct(settings.io_mode, flat, block_size, layout.rank_dir)
    fstype = filesystem_type(layout.root_dir)
    blockio = BlockIO(layout, io_options(settings, block_size, use_o_direct, fstype, prepared.root))
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
        layout,
        prepared.run_config_state,
        use_o_direct,
        blockio,
        signals,
        guard,
        housekeeping,
    )
