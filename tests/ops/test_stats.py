"""``llmkv-fs stats`` on a real volume: blocks stored by the engine's BlockIO
in two rank directories, a block the engine itself quarantined, leases, a
leftover temp file and unexpected entries."""

from __future__ import annotations

import json
import mmap
import os
import socket
import time

import pytest

from llmkv_fs import cli
from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume.leases import Lease, seed_fingerprint, write_lease
from tests.kits.engine_kit import BS, make_key, write_blocks
from tests.kits.names_kit import temp_path

FILE = BS + TRAILER_SIZE
DAY = 86400.0


def lease(host: str, seed: str, pid: int = 4242, algo: str = "sha256") -> Lease:
    return Lease(
        host=host,
        pid=pid,
        started_ns=time.time_ns(),
        hash_algo=algo,
        seed_fingerprint=seed_fingerprint(algo, seed),
        interval_s=10.0,
        vllm_version="0.33.1",
        llmkv_fs_version="0.1.0",
    )


def stale(path: str) -> None:
    old = time.time() - 3600
    os.utime(path, (old, old))


def stats_json(capsys, root: str) -> dict:
    assert cli.main(["stats", root, "--json", "--threads", "2"]) == 0
    return json.loads(capsys.readouterr().out)


def populate(root: str) -> tuple[CacheLayout, CacheLayout]:
    r0, blockio = write_blocks(root, range(6), rank=0)
    r1, _ = write_blocks(root, range(10, 14), rank=1)
    now = time.time()
    for i, age in ((0, 2 * 3600), (1, 2 * DAY), (2, 30 * DAY)):
        t = now - age
        os.utime(r0.block_path(make_key(i)), (t, t))
    # A bad block the engine quarantines itself on load.
    with open(r0.block_path(make_key(5)), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(BlockFileError):
        blockio.load(make_key(5), memoryview(mmap.mmap(-1, BS)))
    # A writer that died mid-store, an hour ago.
    tmp = temp_path(r0.block_path(make_key(99)), "node-z", 31337, "7f")
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(b"x" * 1000)
    stale(tmp)
    # vLLM's built-in tier names its temp files "<hash>.bin_<random>.tmp".
    with open(r1.block_path(make_key(10)) + "_8123456789.tmp", "wb") as f:
        f.write(b"y" * 24)
    # Unexpected entries: a symlink named like a block, a stray file.
    link = r1.block_path(make_key("link"))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink("/etc/hostname", link)
    with open(f"{r1.rank_dir}/notes.txt", "w") as f:
        f.write("hi")
    with open(f"{root}/README", "w") as f:
        f.write("not a digest")
    os.symlink("/tmp", f"{root}/elsewhere")
    # Leases: two live replicas hashing differently, a stale one, and one on
    # this host whose process is gone.
    write_lease(r0.base_path, lease("node-a", "0"))
    write_lease(r0.base_path, lease("node-b", "1"))
    stale(write_lease(r0.base_path, lease("node-c", "2")))
    write_lease(r0.base_path, lease(socket.gethostname(), "0", pid=(1 << 22) + 7))
    return r0, r1


def test_stats_counts_leases_and_entries(volume, capsys):
    r0, _r1 = populate(volume)
    report = stats_json(capsys, volume)
    (d,) = report["digests"]
    assert d["name"] == r0.digest_dir_name and d["digest"] == r0.digest
    assert d["model"] == "m/x" and d["config_digest_ok"] is True
    assert d["config"]["dtype"] == "bfloat16" and d["config"]["tp_size"] == 1
    assert d["config"]["kv_cache_groups"] == [{"tokens_per_block": 16, "layers": 1}]
    assert d["ranks"] == {
        "0": {"blocks": 5, "bytes": 5 * FILE},
        "1": {"blocks": 4, "bytes": 4 * FILE},
    }
    assert (d["blocks"], d["bytes"]) == (9, 9 * FILE)
    assert (d["chunk_bytes"], d["chunk_source"]) == (BS, "trailer")
    assert d["file_sizes"] == {str(FILE): 9}
    lu = d["last_used"]
    assert lu["buckets"] == {"<1h": 6, "<1d": 1, "<7d": 1, "older": 1}
    assert 30 * DAY - 60 < lu["oldest_age_s"] < 30 * DAY + 60 and lu["newest_age_s"] < 600

    live, gone = d["leases"]["live"], d["leases"]["stale"]
    assert sorted(x["host"] for x in live) == ["node-a", "node-b"]
    assert sorted(x["host"] for x in gone) == sorted(["node-c", socket.gethostname()])
    assert live[0]["vllm_version"] == "0.33.1" and live[0]["llmkv_fs_version"] == "0.1.0"
    assert d["seed_fingerprints"] == sorted(
        {seed_fingerprint("sha256", "0"), seed_fingerprint("sha256", "1")}
    )
    assert d["seed_mismatch"] is True
    assert any("replicas will not share cache" in w for w in d["warnings"])

    assert (d["temp"]["count"], d["temp"]["bytes"]) == (2, 1024)
    assert 3500 < d["temp"]["oldest_age_s"] < 4000
    assert d["quarantined"] == {"count": 1, "bytes": FILE, "reasons": {"bad-checksum": 1}}
    assert d["other"]["count"] == 2
    assert sorted(e["type"] for e in d["other"]["entries"]) == ["file", "symlink"]
    assert report["unexpected"] == [
        {"path": f"{volume}/README", "type": "file"},
        {"path": f"{volume}/elsewhere", "type": "symlink"},
    ]

    t = report["totals"]
    assert (
        t["digests"],
        t["blocks"],
        t["bytes"],
        t["temp_files"],
        t["quarantined_files"],
        t["live_leases"],
        t["stale_leases"],
        t["other"],
    ) == (1, 9, 9 * FILE, 2, 1, 2, 2, 2)
    fs = report["filesystem"]
    assert fs["size_bytes"] > 0 and 0 <= fs["available_bytes"] <= fs["size_bytes"]
    assert fs["used_bytes"] + fs["free_bytes"] == fs["size_bytes"]
    assert report["warnings"] == d["warnings"]


def test_human_output_warns_loudly_on_seed_mismatch(volume, capsys):
    populate(volume)
    assert cli.main(["stats", volume]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == [
        "DIGEST",
        "MODEL",
        "RANKS",
        "BLOCKS",
        "BYTES",
        "LIVE",
        "STALE",
        "TEMP",
        "QUAR",
        "OTHER",
    ]
    # 9 files of BS + a 4 KiB trailer: 9 x 260 KiB
    assert out.splitlines()[2].split()[4:] == ["9", "2.3", "MiB", "2", "2", "2", "1", "2"]
    loud = [line for line in out.splitlines() if "replicas will not share cache" in line]
    assert loud and all(line.lstrip().startswith("!!!") for line in loud)
    assert "live  node-a pid 4242  vllm 0.33.1" in out
    assert "quarantine 1 files" in out and "bad-checksum 1" in out
    assert "<1h 6  <1d 1  <7d 1  older 1" in out
    assert any(line.startswith("filesystem ") for line in out.splitlines())


def test_files_verify_quarantined_count_as_quarantined(volume, capsys):
    populate(volume)
    assert cli.main(["verify", volume, "--repair", "--json"]) == 1  # the planted symlink
    capsys.readouterr()
    (d,) = stats_json(capsys, volume)["digests"]
    assert d["quarantined"]["reasons"] == {"bad-checksum": 1, "symlink": 1}
    assert [e["type"] for e in d["other"]["entries"]] == ["file"]
    assert d["blocks"] == 9


def test_agreeing_replicas_and_a_random_seed(volume, capsys):
    layout, _ = write_blocks(volume, range(2))
    write_lease(layout.base_path, lease("node-a", "42"))
    write_lease(layout.base_path, lease("node-b", "42"))
    (d,) = stats_json(capsys, volume)["digests"]
    assert len(d["seed_fingerprints"]) == 1 and d["seed_mismatch"] is False
    assert d["warnings"] == []
    random_lease = Lease(
        host="node-c",
        pid=1,
        started_ns=1,
        hash_algo="sha256",
        seed_fingerprint=seed_fingerprint("sha256", None),
        interval_s=10.0,
    )
    write_lease(layout.base_path, random_lease)
    (d,) = stats_json(capsys, volume)["digests"]
    assert d["seed_mismatch"] is True and "replicas will not share cache" in d["warnings"][0]


def test_stats_changes_nothing_on_the_volume(volume, capsys):
    populate(volume)

    def snapshot():
        out = {}
        for parent, dirs, names in os.walk(volume):
            for n in dirs + names:
                st = os.lstat(os.path.join(parent, n))
                # A block's atime is its LRU age; config.json and leases are
                # read (atime) but only their mtime means something.
                atime = st.st_atime_ns if n.endswith(".bin") else None
                out[os.path.join(parent, n)] = (st.st_ino, st.st_size, st.st_mtime_ns, atime)
        return out

    old = time.time() - 3 * DAY  # atimes relatime would bump on a read
    for parent, _, names in os.walk(volume):
        for n in names:
            p = os.path.join(parent, n)
            if not os.path.islink(p):
                os.utime(p, (old + 60, old))
    before = snapshot()
    stats_json(capsys, volume)
    assert snapshot() == before


def test_odd_volumes(volume, capsys):
    assert stats_json(capsys, volume)["digests"] == []
    layout, _ = write_blocks(volume, [])  # config.json, no blocks
    os.makedirs(f"{volume}/m_x_0123456789ab_r3")  # a rank dir with no config dir
    report = stats_json(capsys, volume)
    by_name = {d["name"]: d for d in report["digests"]}
    orphan = by_name["m_x_0123456789ab"]
    assert orphan["has_config"] is False and orphan["ranks"] == {"3": {"blocks": 0, "bytes": 0}}
    assert by_name[layout.digest_dir_name]["chunk_source"] == "no block files"
    assert cli.main(["stats", volume]) == 0  # renders without blocks or config
    capsys.readouterr()
    assert cli.main(["stats", f"{volume}/nope"]) == 2


def test_stats_and_gc_print_the_same_use_of_a_volume_with_a_root_reserve(
    volume, capsys, monkeypatch
):
    """One definition of "used" (df's: the root reserve excluded): stats
    once divided by the whole size and said 20 % where gc said 50.4 %."""
    from llmkv_fs.ops.gc.rules import volume_usage
    from llmkv_fs.volume import fsinfo

    real = os.statvfs(volume)
    reserved = os.statvfs_result(
        (4096, 4096, 1000, 500, 400, real.f_files, real.f_ffree, real.f_favail, 0, 255)
    )  # 500 of 1000 blocks used, 100 of the 500 free ones reserved for root
    monkeypatch.setattr(fsinfo.os, "statvfs", lambda path: reserved)
    populate(volume)
    assert cli.main(["stats", volume, "--json"]) == 0
    stats_percent = json.loads(capsys.readouterr().out)["filesystem"]["used_percent"]
    gc_percent = volume_usage(volume, 0).used_percent
    assert stats_percent == pytest.approx(gc_percent, abs=0.01)
    assert gc_percent == pytest.approx(100 * 500 / 900)  # not 500 / 1000
    assert cli.main(["stats", volume]) == 0
    assert f"({gc_percent:.1f}%, as df and gc count it)" in capsys.readouterr().out
