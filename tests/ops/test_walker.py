"""gc, stats and verify never follow a symbolic link below the root (issue
21): an ``<hhh>`` or ``<hh>_g<g>`` directory, a rank directory, a digest
directory, ``leases/``, ``.quarantine/`` or a ``.bin`` that is a link to
something outside the root holding block files, valid and corrupt. Nothing
out there is deleted, moved, quarantined, stamped or counted; each link is
reported, and gc removes a link entry itself only with its digest. Also a
directory swapped for a link after the walk listed it."""

from __future__ import annotations

import os

import pytest

from llmkv_fs.layout.names import block_rel_path
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume.run_config import ensure_run_config
from tests.kits.gc_kit import (
    DAY,
    age,
    block_bytes,
    gc,
    identity,
    make_digest,
    put_block,
    put_lease,
)
from tests.kits.ops_fault_kit import (
    LOCAL_FILESYSTEMS,
    DirFault,
    key_in_dir,
    local_dir,
    swap_for_symlink,
    tool,
)

OLD = 8 * DAY
EVICT_AND_REMOVE = ("--high", "off", "--max-bytes", "0", "--protect", "0", "--min-age", "1d")


def tree_state(root: str) -> dict[str, tuple]:
    """Every entry below ``root`` with what any change would change (atime
    included: a read through a link would stamp it)."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (
                st.st_mode,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_atime_ns,
            )
    return out


def block_files_at(where: str, keys: list[bytes], corrupt: bytes) -> None:
    """Valid block files of ``keys`` at their block paths below ``where``
    (as if it were a rank directory) and a corrupt one for ``corrupt``."""
    for k in keys:
        path = f"{where}/{block_rel_path(k)}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(block_bytes(k))
    path = f"{where}/{block_rel_path(corrupt)}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\xff" * 5000)


def old_everything(root: str) -> None:
    """Older than anything in the volume: first in line, were it reachable."""
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            age(os.path.join(directory, name), 4 * OLD, 4 * OLD)


class Planted:
    """A volume with real digests and links out of it in every place."""

    def __init__(self, root: str, outside: str):
        self.root, self.outside = root, outside
        os.makedirs(outside)
        self.links: list[str] = []
        self.live = make_digest(root, "acme/live")[0]
        put_lease(self.live, os.getpid())
        self.live_blocks = [
            put_block(self.live, key_in_dir(0x10000 + i, f"live{i}"), DAY, DAY) for i in range(4)
        ]
        self.orphan = make_digest(root, "acme/orphan", config_age=OLD)[0]
        self.orphan_blocks = [
            put_block(self.orphan, key_in_dir(0x20000 + i, f"orphan{i}"), OLD, OLD)
            for i in range(2)
        ]
        self.leaselink = make_digest(root, "acme/leaselink", config_age=OLD)[0]
        self.leaselink_blocks = [put_block(self.leaselink, key_in_dir(0x30000, "ll"), OLD, OLD)]
        self._plant_in_live()
        self._plant_in_orphan()
        self._plant_in_root()
        self._plant_lease_link()
        old_everything(outside)
        age(self.outside_lease, 0, OLD)  # a fresh heartbeat; atime older: a read would stamp it

    def link(self, target: str, at: str) -> str:
        os.makedirs(os.path.dirname(at), exist_ok=True)
        os.symlink(target, at)
        self.links.append(at)
        return at

    def link_bin(self, rank_dir: str, k: bytes, out: str) -> None:
        """A .bin at ``k``'s block path that links to a valid block of ``k``."""
        block_files_at(out, [k], key_in_dir(0xFFFFF, f"corrupt-{k.hex()}"))
        self.link(f"{out}/{block_rel_path(k)}", f"{rank_dir}/{block_rel_path(k)}")

    def _plant_in_live(self) -> None:
        rank, out = self.live.rank_dir, f"{self.outside}/live"
        # <hhh>: a link to a tree holding blocks at this <hhh>'s own paths.
        block_files_at(f"{out}/hhh", [key_in_dir(0xF0000, "h1")], key_in_dir(0xF0001, "h2"))
        self.link(f"{out}/hhh/f00", f"{rank}/f00")
        # <hh>_g0 beside a real <hh>_g1 in a real <hhh>.
        block_files_at(f"{out}/hh", [key_in_dir(0xF0100, "g1")], key_in_dir(0xF0100, "g2"))
        self.live_blocks.append(put_block(self.live, key_in_dir(0xF0100, "g3", group=1), DAY, DAY))
        self.link(f"{out}/hh/f01/00_g0", f"{rank}/f01/00_g0")
        self.link_bin(rank, key_in_dir(0xF0200, "bin"), f"{out}/bin")
        # .quarantine/ (verify --repair moves bad files there).
        os.makedirs(f"{out}/quarantine")
        self.link(f"{out}/quarantine", f"{rank}/.quarantine")

    def _plant_in_orphan(self) -> None:
        rank, out = self.orphan.rank_dir, f"{self.outside}/orphan"
        block_files_at(f"{out}/hhh", [key_in_dir(0xF0300, "o1")], key_in_dir(0xF0301, "o2"))
        self.link(f"{out}/hhh/f03", f"{rank}/f03")
        self.link_bin(rank, key_in_dir(0xF0400, "obin"), f"{out}/bin")

    def _plant_in_root(self) -> None:
        # A rank directory of the live digest that is a link.
        out = f"{self.outside}/rank"
        block_files_at(out, [key_in_dir(0xF0500, "r1")], key_in_dir(0xF0501, "r2"))
        self.link(out, f"{self.live.base_path}_r1")
        # A digest (config) directory that is a link, beside its real rank
        # directory: provably ours by its files' names, old, so removed --
        # the link's target never.
        elsewhere = CacheLayout.for_identity(f"{self.outside}/digest", identity("acme/linked"))
        os.makedirs(elsewhere.root_dir)  # a root exists before its config.json (prepare_volume)
        ensure_run_config(elsewhere)
        put_lease(elsewhere, os.getpid())
        self.link(elsewhere.base_path, f"{self.root}/{elsewhere.digest_dir_name}")
        real = CacheLayout.for_identity(self.root, identity("acme/linked"))
        os.makedirs(real.rank_dir)
        self.linked_name, self.linked_rank = real.digest_dir_name, real.rank_dir
        put_block(real, key_in_dir(0x40000, "linked"), OLD, OLD)

    def _plant_lease_link(self) -> None:
        elsewhere = CacheLayout.for_identity(f"{self.outside}/leases", identity("acme/leaselink"))
        os.makedirs(elsewhere.base_path)
        self.outside_lease = put_lease(elsewhere, os.getpid())  # live, to whoever follows
        self.link(f"{elsewhere.base_path}/leases", f"{self.leaselink.base_path}/leases")


@pytest.fixture
def planted(volume, tmp_path):
    return Planted(volume, str(tmp_path / "outside"))


def test_stats_counts_nothing_through_a_link(planted, capsys):
    before = tree_state(planted.outside)
    status, report = tool(capsys, "stats", planted.root)
    assert status == 0
    by_name = {d["name"]: d for d in report["digests"]}
    live = by_name[planted.live.digest_dir_name]
    assert live["blocks"] == len(planted.live_blocks)
    assert set(live["ranks"]) == {"0"}
    assert {e["path"] for e in live["other"]["entries"] if e["type"] == "symlink"} == {
        p for p in planted.links if p.startswith(planted.live.rank_dir + "/")
    }
    leaselink = by_name[planted.leaselink.digest_dir_name]
    assert leaselink["leases"]["live"] == leaselink["leases"]["stale"] == []
    assert "symlink" in leaselink["leases"]["error"]
    assert report["problems"]["ELOOP"]["count"] == 1
    unexpected = {e["path"] for e in report["unexpected"] if e["type"] == "symlink"}
    assert {planted.live.base_path + "_r1", f"{planted.root}/{planted.linked_name}"} <= unexpected
    assert report["totals"]["blocks"] == (
        len(planted.live_blocks) + len(planted.orphan_blocks) + len(planted.leaselink_blocks) + 1
    )
    assert tree_state(planted.outside) == before


def test_verify_repair_reads_and_moves_nothing_through_a_link(planted, capsys):
    before = tree_state(planted.outside)
    status, report = tool(capsys, "verify", planted.root, "--repair")
    assert status == 1  # the .bin links are bad files
    real = len(planted.live_blocks) + len(planted.orphan_blocks) + len(planted.leaselink_blocks) + 1
    assert report["totals"]["verified"] == real
    bad = {b["path"]: (b["reason"], b["repair"]) for b in report["bad"]}
    bin_links = [p for p in planted.links if p.endswith(".bin")]
    assert bad == dict.fromkeys(bin_links, ("symlink", "quarantined"))
    others = {p for p in planted.links if not p.endswith(".bin") and "/leases" not in p}
    assert report["symlinks"]["count"] == len(others)
    # The link at .quarantine was replaced by a directory; the bad links
    # were moved in there as links, their targets where they were.
    assert not os.path.islink(f"{planted.live.rank_dir}/.quarantine")
    assert tree_state(planted.outside) == before


def test_gc_evicts_and_removes_nothing_through_a_link(planted, capsys):
    before = tree_state(planted.outside)
    status, report = gc(planted.root, *EVICT_AND_REMOVE, capsys=capsys)
    assert tree_state(planted.outside) == before
    assert status == 1  # leases/ of one digest is a link: reported
    assert report["problems"]["ELOOP"]["count"] == 1
    by_name = {d["name"]: d for d in report["digests"]}
    assert by_name[planted.orphan.digest_dir_name]["removed"]
    assert not os.path.lexists(planted.orphan.rank_dir)  # its links unlinked, not followed
    assert by_name[planted.linked_name]["removed"]
    assert not os.path.lexists(planted.linked_rank)
    kept = by_name[planted.leaselink.digest_dir_name]
    assert not kept["removed"] and "leases cannot be read" in kept["why"]
    evictable = planted.live_blocks + planted.leaselink_blocks
    assert report["capacity"]["evicted_blocks"] == len(evictable)
    assert not any(os.path.exists(b) for b in evictable)
    still_there = [p for p in planted.links if os.path.lexists(p)]
    assert set(still_there) == {
        p
        for p in planted.links
        if not p.startswith((planted.orphan.rank_dir + "/", planted.linked_rank))
    }
    assert set(still_there) <= set(report["symlinks"]) | {f"{planted.leaselink.base_path}/leases"}


# -- a directory swapped for a link after the walk listed it --------------------------


@pytest.fixture(params=LOCAL_FILESYSTEMS)
def local_root(request, tmp_path):
    yield from local_dir(request.param, tmp_path)


@pytest.mark.parametrize("tool_name", ["gc", "verify"])
def test_a_directory_swapped_for_a_link_after_the_walk(
    local_root, tmp_path, capsys, monkeypatch, tool_name
):
    (layout,) = make_digest(local_root, "acme/swap")
    blocks = [put_block(layout, key_in_dir(0x50000 + i, f"s{i}"), OLD, OLD) for i in range(3)]
    target = os.path.dirname(blocks[0])
    outside = str(tmp_path / "outside")
    # What the link leads to: a valid block under the very name it had.
    block_files_at(outside, [key_in_dir(0x50000, "s0")], key_in_dir(0x50000, "bad"))
    link_target = os.path.dirname(f"{outside}/{block_rel_path(key_in_dir(0x50000, 's0'))}")
    old_everything(outside)
    before = tree_state(outside)
    # Access 1 is the walk; access 2 verify's read or gc's eviction listing.
    fault = DirFault(monkeypatch, target, swap_for_symlink(link_target), on_access=2)
    if tool_name == "gc":
        status, report = gc(
            local_root, "--high", "off", "--max-bytes", "0", "--protect", "0", capsys=capsys
        )
        monkeypatch.undo()
        assert tree_state(outside) == before
        assert report["capacity"]["evicted_blocks"] == 2
    else:
        status, report = tool(capsys, "verify", local_root, "--repair")
        monkeypatch.undo()
        assert tree_state(outside) == before
        assert report["totals"]["verified"] == 2 and report["bad"] == []
    assert fault.fired
    assert status == 1
    problems = report["problems"]
    assert list(problems) == ["ELOOP"] and problems["ELOOP"]["count"] == 1
