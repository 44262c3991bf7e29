"""The roots one engine stores on, each on its own: its prepared volume
(root pinned, config.json, rank directory), its O_DIRECT probe, its
``BlockIO``, its shared ``VolumeSignals`` page, space guard and housekeeping
thread (root check, free space, lease, access stamps). A tier with one root
has one of each; with several
(``path_sharding: by_block_hash``) one root lost or full costs only the
blocks placed on it (block/blockio.py, ``RootPlacement``).

Presence: whether a key's block is on the roots, for the lookups
(engine/lookup.py), is ``RootsPresence``, given to them at start-up: on its
home root, else -- with several roots -- on its second choice, where it was
written before its home was added (layout/placement.py). A lost root is not
touched; one found lost meanwhile (RootLost: lost since its housekeeping
last looked) is as if lost. A key not found on its other roots then
answers None, not False: nobody looked where its file may be
(engine/lookup_checks.py, ``Found``). ``on_their_roots`` is the one
answer, for one key or a batch: each root is asked once for all the keys
it is first asked about (``BlockIO.exists_many``: the compiled check where
it runs), the second choices only for the keys their home did not have.

Threading: built on the constructing thread before any I/O thread or worker
exists; afterwards immutable apart from what each part documents (the
housekeeping thread writes its root's signals, the guard its verdict).
``RootsPresence`` runs on lookup threads: it reads each root's ``lost``
flag and calls its BlockIO, whose descriptors are per thread.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.spec import RootSpec
from llmkv_fs.engine.lookup_checks import Found
from llmkv_fs.engine.startup.io_setup import choose_o_direct, io_options
from llmkv_fs.engine.upkeep.housekeeping import STOP_WAIT_S, Housekeeping
from llmkv_fs.engine.upkeep.prepare import check_root, prepare_volume
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.upkeep.space import SpaceGuard
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.rootlist import check_roots_distinct
from llmkv_fs.volume.fsinfo import filesystem_type
from llmkv_fs.volume.pinned_root import RootLost

__all__ = [
    "EngineRoot",
    "RootsPresence",
    "at_once",
    "close_roots",
    "each_key",
    "on_their_roots",
    "open_roots",
]


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
    primary: memoryview,
    block_size: int,
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
            roots.append(_open_root(settings, layout, primary, block_size, keyring))
    except BaseException:
        close_roots(roots, STOP_WAIT_S)
        raise
    return roots


def _open_root(
    settings: TierSettings,
    layout: CacheLayout,
    primary: memoryview,
    block_size: int,
    keyring: Keyring | None,
) -> EngineRoot:
    prepared = prepare_volume(
        layout, settings.file_mode, settings.dir_mode, settings.require_mounted_root
    )
    use_o_direct = choose_o_direct(settings.io_mode, primary, block_size, layout.rank_dir)
    fstype = filesystem_type(layout.root_dir)
    options = io_options(settings, block_size, use_o_direct, fstype, prepared.root)
    spec = RootSpec(layout, options)
    blockio = spec.blockio(keyring)
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


# -- presence ------------------------------------------------------------------------------


class RootsPresence:
    """Whether keys' blocks are on ``roots`` (the module doc), as the lookup
    threads ask it: ``one`` key, or ``many`` in one compiled call per root
    where every root can (``batched``). ``pause``: the lookups' pause points
    ("exists", reached per key before it is checked; tests)."""

    def __init__(
        self,
        roots: Sequence[EngineRoot],
        placement: RootPlacement,
        pause: PausePoints | None = None,
    ):
        self._roots = tuple(roots)
        self._placement = placement
        self._pause = pause
        # Chunks are checked in one compiled call: every root can.
        self.batched = all(root.blockio.checks_in_batches for root in self._roots)

    def one(self, key: bytes) -> Found:
        """The key's home root, then (several roots) its second choice."""
        if self._pause is not None:  # a check held as in a stalled mount
            self._pause.reached("exists", "lookup", key)
        return on_their_roots(self._roots, self._placement, [key], each_key)[0]

    def many(self, keys: list[bytes], budget_s: float) -> list[Found]:
        """``one`` for each key, at once (the compiled check), of the first
        keys only if ``budget_s`` is spent first. Pause points stop at each
        key before the chunk's one call."""
        if self._pause is not None:  # a check held as in a stalled mount
            for key in keys:
                self._pause.reached("exists", "lookup", key)
        check = functools.partial(at_once, budget_s=budget_s)
        return on_their_roots(self._roots, self._placement, keys, check)


def each_key(blockio: BlockIO, keys: list[bytes]) -> list[bool]:
    """A root's check of ``keys`` one ``exists`` at a time."""
    return [blockio.exists(key) for key in keys]


def at_once(blockio: BlockIO, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
    """A root's check of ``keys`` in one call (compiled where it runs);
    with ``budget_s``, possibly of the first keys only."""
    return blockio.exists_many(keys, budget_s)


def on_their_roots(
    roots: Sequence[EngineRoot],
    placement: RootPlacement,
    keys: list[bytes],
    check: Callable[[BlockIO, list[bytes]], list[bool]] = at_once,
) -> list[Found]:
    """Whether each key's block is on its roots (the module doc), in order,
    each root asked through ``check``; raises what a root's check raises
    other than RootLost. A check that answers fewer keys than asked (its
    time budget spent) makes this answer the keys before the first one it
    left, one at least."""
    if len(roots) == 1:  # every key's only choice: no per-key placement (8,192-key prompts)
        answers = _asked(roots[0], keys, check)
        return [None] * len(keys) if answers is None else list(answers)
    found: list[Found] = [False] * len(keys)
    unasked: set[int] = set()  # keys one of whose roots was lost
    answered = len(keys)
    choices = [placement.choices(key) for key in keys]
    for rank in range(max(map(len, choices), default=0)):
        asked: dict[int, list[int]] = collections.defaultdict(list)
        for at, chosen in enumerate(choices[:answered]):
            if rank < len(chosen) and not found[at]:
                asked[chosen[rank]].append(at)
        for index, members in asked.items():
            answers = _asked(roots[index], [keys[at] for at in members], check)
            if answers is None:
                unasked.update(members)
                continue
            for at, hit in zip(members, answers):
                found[at] = hit
            if len(answers) < len(members):
                answered = min(answered, members[len(answers)])
    for at in unasked:
        if not found[at]:
            found[at] = None
    return found[:answered]


def _asked(
    root: EngineRoot, keys: list[bytes], check: Callable[[BlockIO, list[bytes]], list[bool]]
) -> list[bool] | None:
    """``root``'s answers for ``keys``; None where it is lost, or found lost during the check."""
    if root.lost:
        return None
    try:
        return check(root.blockio, keys)
    except RootLost:
        return None
