"""Every name on the volume round-trips through layout/names.py: what a
builder makes, its parser takes apart into the same parts; and each parser
refuses the look-alikes (other kinds of our names, vLLM's, near misses).
No vLLM, no I/O."""

from __future__ import annotations

import hashlib
import os

import pytest

from llmkv_fs.layout import names
from llmkv_fs.layout.names import (
    GC_LOCK_NAME,
    DigestDirName,
    LeaseName,
    QuarantineName,
    RankDirName,
    TempName,
    WriterTag,
)
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.volume.leases import Lease
from tests.kits.engine_kit import make_key
from tests.kits.names_kit import probe_path, temp_path

ROOT = "/mnt/kv cache"
DIGEST = "0123456789ab"
HOSTS = ["node-1", "node-1.cluster.local", "a_b", "x-7f3a9c"]
IDENTITY = RunIdentity(
    model_name="org/model",
    dtype="bfloat16",
    tokens_per_hash=16,
    blocks_per_file=1,
    kv_cache_groups=((16, ("l0",)),),
)


def every_name(root: str = ROOT) -> dict[str, str]:
    """One name of every kind, as the builders make them (basenames)."""
    layout = CacheLayout(root, CacheLayout.for_identity(root, IDENTITY).run_config, 3)
    block = layout.block_path(make_key(1))
    return {
        "digest": names.digest_dir_name("org/model", DIGEST),
        "rank": os.path.basename(names.rank_dir_name(f"{root}/org_model_{DIGEST}", 3)),
        "config": os.path.basename(names.config_path(layout.base_path)),
        "block": os.path.basename(block),
        "quarantined": os.path.basename(
            names.quarantine_path(layout.rank_dir, os.path.basename(block), "x", 7)
        ),
        "temp": os.path.basename(temp_path(block, "node-1", 12, "ab")),
        "config-temp": os.path.basename(temp_path(layout.config_path, "node-1", 12, "ab")),
        "probe": os.path.basename(probe_path(layout.rank_dir, "node-1", 12)),
        "lease": names.lease_file_name("node-1", 12, 34),
        "trash": os.path.basename(names.trash_path(root, DIGEST, None, 12, 34)),
        "rank-trash": os.path.basename(names.trash_path(root, DIGEST, 3, 12, 34)),
        "gc-lock": os.path.basename(names.gc_lock_path(root)),
        "vllm-temp": hashlib.sha256(b"x").hexdigest() + ".bin_123.tmp",
        "vllm-probe": ".o_direct_probe_123.tmp",
    }


def parsers_accepting(name: str) -> set[str]:
    """Which of the parsers (and recognisers) take ``name``."""
    checks = {
        "digest": names.parse_digest_dir_name(name) is not None,
        "rank": names.parse_rank_dir_name(name) is not None,
        "config": name == names.CONFIG_FILENAME,
        "block": names.is_block_name(name),
        "quarantined": names.parse_quarantine_name(name) is not None,
        "temp": names.parse_temp_name(name) is not None,
        "probe": names.parse_probe_name(name) is not None,
        "lease": names.parse_lease_file_name(name) is not None,
        "trash": names.is_trash_name(name),
        "gc-lock": name == GC_LOCK_NAME,
        "vllm-temp": names.is_vllm_temp_name(name),
    }
    return {kind for kind, accepted in checks.items() if accepted}


# Which parsers take each kind of name: its own, and no other.
EXPECTED = {
    "digest": {"digest"},
    "rank": {"rank"},
    "config": {"config"},
    "block": {"block"},
    "quarantined": {"quarantined"},
    "temp": {"temp"},
    "config-temp": {"temp"},
    "probe": {"probe"},
    "lease": {"lease"},
    "trash": {"trash"},
    "rank-trash": {"trash"},
    "gc-lock": {"gc-lock"},
    "vllm-temp": {"vllm-temp"},
    "vllm-probe": {"vllm-temp"},
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_name_is_taken_by_its_own_parser_only(kind):
    assert parsers_accepting(every_name()[kind]) == EXPECTED[kind]


def test_digest_and_rank_directories_round_trip():
    layout = CacheLayout.for_identity(ROOT, IDENTITY)
    assert names.parse_digest_dir_name(layout.digest_dir_name) == DigestDirName(
        "org_model", layout.digest
    )
    rank_dir = os.path.basename(layout.rank_dir)
    assert names.parse_rank_dir_name(rank_dir) == RankDirName(layout.digest_dir_name, 0)
    assert names.rank_dir_name(f"{ROOT}/{layout.digest_dir_name}", 0) == layout.rank_dir
    # A model name that itself ends like a digest: the last one counts.
    tricky = names.digest_dir_name(f"m_{DIGEST}", "fedcba987654")
    assert names.parse_digest_dir_name(tricky) == DigestDirName(f"m_{DIGEST}", "fedcba987654")
    assert names.parse_rank_dir_name(names.rank_dir_name(tricky, 12)) == RankDirName(tricky, 12)


@pytest.mark.parametrize(
    "name",
    [
        "model",
        f"model{DIGEST}",
        f"model_{DIGEST[:-1]}",
        f"model_{DIGEST.upper()}",
        f"_{DIGEST}",
        f"model_{DIGEST}\n",
        f"model_{DIGEST}_r",
        f"model_{DIGEST}_r1x",
        f"model_{DIGEST}_r\N{ARABIC-INDIC DIGIT THREE}",
        f"model_{DIGEST}_R1",
        f"model_{DIGEST}_r-1",
    ],
)
def test_directory_parsers_reject_look_alikes(name):
    assert names.parse_digest_dir_name(name) is None
    assert names.parse_rank_dir_name(name) is None


def test_block_paths_round_trip():
    layout = CacheLayout(ROOT, CacheLayout.for_identity(ROOT, IDENTITY).run_config, 3)
    keys = [
        make_key(1),
        make_key(2, group=7),
        bytes.fromhex("0123456789abcdef") + b"\x80\0\0\1",
        b"\0\0\1" + bytes(29) + b"\0\0\0\0",
    ]
    for k in keys:
        path = layout.block_path(k)
        assert names.parse_block_path(layout.rank_dir, path) == k
        assert names.parse_block_path(layout.rank_dir + "/", path) == k
        assert names.parse_block_rel_path(names.block_rel_path(k)) == k


def test_block_path_parser_rejects_look_alikes():
    layout = CacheLayout("/v", CacheLayout.for_identity("/v", IDENTITY).run_config, 3)
    p = layout.block_path(make_key(1))
    head, name = os.path.split(p)
    short = names.block_rel_path(b"\xab\xcd" + bytes(4))  # too short for the fan-out
    for bad in (
        p.replace("_g0", "_g00"),
        p.replace(".bin", "0.bin"),
        f"{head}/../{name}",
        f"{layout.rank_dir}/{name}",
        p.replace(layout.rank_dir, "/v/other_r3"),
        p + "\n",
        p.replace(name, name.upper()),
        p.replace("_g0", "_g4294967296"),
        f"{layout.rank_dir}/{names.block_rel_path(make_key(2))[: -len(name)]}{name}",
        f"{layout.rank_dir}/{short}",
        p.replace(".bin", ".bin.tmp"),
    ):
        assert names.parse_block_path(layout.rank_dir, bad) is None, bad


def test_quarantine_names_round_trip():
    rank_dir = f"{ROOT}/m_{DIGEST}_r0"
    block = os.path.basename(CacheLayout(ROOT, {"model_name": "m"}, 0).block_path(make_key(3)))
    path = names.quarantine_path(rank_dir, block, "bad-checksum", 1234567890123)
    assert os.path.dirname(path) == names.quarantine_dir(rank_dir)
    assert names.parse_quarantine_name(os.path.basename(path)) == QuarantineName(
        block, "bad-checksum", 1234567890123
    )
    assert names.in_quarantine(rank_dir, path)
    assert names.in_quarantine(rank_dir, names.quarantine_dir(rank_dir))
    assert not names.in_quarantine(rank_dir, f"{rank_dir}/.quarantine2/x")
    assert not names.in_quarantine(rank_dir, f"{rank_dir}/abc/de_g0/{block}")


@pytest.mark.parametrize(
    "name",
    [
        "abc.bin",
        "abc.bin.bad",
        "abc.txt.bad.1",
        "abc.bin.bad.",
        "abc.bin.bad.12x",
        "abc.bin.bad.\N{FULLWIDTH DIGIT ONE}",
        "abc.bin.bad.\N{SUPERSCRIPT TWO}",
    ],
)
def test_quarantine_parser_rejects_look_alikes(name):
    assert names.parse_quarantine_name(name) is None


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize(
    "final",
    [
        "/mnt/kv/m_abc_r0/abc/de_g0/abcdef0123.bin",
        "/mnt/kv/m_abc/config.json",
        "/mnt/kv/m_abc/leases/h.x~1~2.json",
    ],
)
def test_temp_names_round_trip(host, final):
    path = temp_path(final, host, 4194304, "1f3a")
    assert os.path.dirname(path) == os.path.dirname(final)
    parsed = names.parse_temp_name(os.path.basename(path))
    assert parsed == TempName(host, 4194304, "1f3a", os.path.basename(final))
    assert names.temp_writer(os.path.basename(path)) == WriterTag(host, 4194304)
    assert names.is_temp_name(os.path.basename(path))


@pytest.mark.parametrize("host", HOSTS)
def test_probe_names_round_trip(host):
    path = probe_path("/mnt/kv/m_abc_r0", host, 77)
    assert os.path.dirname(path) == "/mnt/kv/m_abc_r0"
    assert names.parse_probe_name(os.path.basename(path)) == WriterTag(host, 77)
    assert names.temp_writer(os.path.basename(path)) == WriterTag(host, 77)
    assert names.is_temp_name(os.path.basename(path))


@pytest.mark.parametrize(
    "name",
    [
        ".llmkv_fs_o_direct_probe.host~x",
        ".llmkv_fs_o_direct_probe.host~12\n",
        "llmkv_fs_o_direct_probe.host~12",
        ".llmkv_fs_o_direct_probe.ho/st~12",
        ".llmkv_fs_o_direct_probe.~12",
        ".llmkv_fs_o_direct_probe.host~12.tmp",
    ],
)
def test_probe_parser_rejects_look_alikes(name):
    assert names.parse_probe_name(name) is None
    assert names.temp_writer(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "abc.bin_12a.tmp",
        "ABC.bin_1.tmp",
        "abc.bin_1.tmp\n",
        ".o_direct_probe_.tmp",
        "o_direct_probe_1.tmp",
        "abc.bin.tmp",
    ],
)
def test_vllm_temp_recogniser_rejects_look_alikes(name):
    assert not names.is_vllm_temp_name(name)


@pytest.mark.parametrize("host", HOSTS)
def test_lease_names_round_trip(host):
    name = names.lease_file_name(host, 4194304, 1700000000123456789)
    assert names.parse_lease_file_name(name) == LeaseName(host, 4194304, 1700000000123456789)
    lease = Lease(host, 4194304, 1700000000123456789, "sha256", "f", 5.0)
    assert lease.file_name == name
    assert names.is_lease_name(name)
    assert names.lease_dir("/r/m_abc") == "/r/m_abc/leases"


@pytest.mark.parametrize(
    "name",
    [
        "h~1~2.json.tmp",
        "h~x~2.json",
        "h~1.json",
        "a/b~1~2.json",
        "~1~2.json",
        "h~1~2.json\n",
        "h~1~2.JSON",
        "h~1~2",
    ],
)
def test_lease_parser_rejects_look_alikes(name):
    assert names.parse_lease_file_name(name) is None


def test_trash_and_lock_names():
    for rank in (None, 0, 12):
        path = names.trash_path(ROOT, DIGEST, rank, 12, 34)
        assert os.path.dirname(path) == ROOT
        assert names.is_trash_name(os.path.basename(path))
    assert names.gc_lock_path(ROOT) == f"{ROOT}/{GC_LOCK_NAME}"
    assert not names.is_trash_name(GC_LOCK_NAME)
    assert not names.is_trash_name(names.digest_dir_name("m", DIGEST))


def test_unsafe_model_names_are_refused():
    with pytest.raises(names.LayoutError, match="NUL"):
        names.digest_dir_name("a\0b", DIGEST)
    with pytest.raises(names.LayoutError, match="too long"):
        names.digest_dir_name("m" * 250, DIGEST)
    assert names.digest_dir_name("../x", DIGEST) == f".._x_{DIGEST}"


@pytest.mark.parametrize("group", [0, 1, 7, (1 << 32) - 1])
def test_an_offload_key_is_vllms_and_its_path_gives_it_back(group):
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    block_hash = hashlib.sha256(b"chunk").digest()
    key = names.offload_key(block_hash, group)
    assert key == base.make_offload_key(block_hash, group)
    assert base.get_offload_block_hash(key) == block_hash
    assert names.block_rel_path(key).split("/")[1].endswith(f"_g{group}")
    assert names.parse_block_rel_path(names.block_rel_path(key)) == key
