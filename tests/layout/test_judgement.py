"""One judgement of a block file (layout/judgement.py): a table of planted
files, each with the one verdict it must get, and each row judged both by
the engine's load (both I/O modes) and by ``llmkv-fs verify``'s whole run
(config.json read, chunk size inferred, the key given as an operator
would). A sealed namespace's and a plain one's rules are the namespace's,
never a file's own trailer's word."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.layout.blockfile import TRAILER_SIZE, Corruption, pack_trailer
from llmkv_fs.layout.judgement import BlockRules
from llmkv_fs.layout.sealed import Keyring, SealKey, begin_seal, end_seal
from llmkv_fs.ops.verify import verify_volume
from llmkv_fs.volume.keyfiles import keyring_from_args
from tests.kits.engine_kit import BS, fill, make_key, store_blocks, wait_jobs
from tests.kits.seal_kit import flip_bit, forge_plain, key_file, sealed_trailer

EVIL = b"\x66" * BS  # what a forger wants the model to read
OTHER_PLACE = b"m_0123456789ab_r1"  # another rank directory's name
ANCHOR = 10_000  # a good block always there: verify infers the chunk size from it
_GOOD = ("verified", "unverified", "foreign_key", "sealed_unchecked")


class Volume:
    """One namespace of a started engine: plants rows, judges them."""

    def __init__(self, engine, primary, keyring: Keyring | None):
        self.engine, self.primary, self.keyring = engine, primary, keyring
        self.layout = engine.roots[0].layout
        self.place = os.path.basename(self.layout.rank_dir).encode()
        self.jobs = 100
        self.store(ANCHOR)

    def path(self, i: int) -> str:
        return self.layout.block_path(make_key(i))

    def store(self, i: int) -> str:
        self.jobs += 1
        store_blocks(self.engine, self.primary, self.jobs, [i], [0])
        return self.path(i)

    def write(self, i: int, data: bytes) -> str:
        path = self.path(i)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def engine_verdict(self, i: int) -> str:
        before = dict(self.engine.counters)
        fill(self.primary, 0, b"\xaa" * BS)
        self.jobs += 1
        assert self.engine.submit_load(self.jobs, [make_key(i)], [0])
        wait_jobs(self.engine, [self.jobs])
        after = self.engine.counters
        moved = {k for k in after if after[k] != before.get(k, 0)}
        named = {
            Outcome.VERIFIED: "verified",
            Outcome.UNVERIFIED: "unverified",
            (Direction.LOAD, Failure.FOREIGN_KEY): "foreign_key",
            (Direction.LOAD, Failure.NO_CHECKSUM): "no_checksum",
        }
        verdicts = {str(k) for k in moved if isinstance(k, Corruption)}
        verdicts |= {named[k] for k in moved if k in named}
        assert len(verdicts) == 1, moved
        return verdicts.pop()

    def store_outcome(self, i: int) -> str:
        """What a store of block ``i`` over the planted file did."""
        before = dict(self.engine.counters)
        self.store(i)
        after = self.engine.counters
        (outcome,) = [
            k.value
            for k in (Outcome.PRESENT, Outcome.REPLACED, Outcome.WRITTEN)
            if after[k] != before.get(k, 0)
        ]
        return outcome

    def verify_verdict(self, path: str) -> str:
        report = verify_volume(self.layout.root_dir, keyring=self.keyring)
        t = report["totals"]
        assert t["errors"] == 0, report["errors"]
        bad = {b["path"]: b["reason"] for b in report["bad"]}
        if bad:
            assert list(bad) == [path], bad
            return bad[path]
        t["verified"] -= 1  # the anchor
        (good,) = [k for k in _GOOD if t[k]]
        return good


def seal(volume: Volume, i: int, keyring: Keyring, place: bytes | None = None) -> str:
    """A block sealed with ``keyring``'s write key at ``place`` (default:
    where it lies), made with the package's own sealing code."""
    trailer = memoryview(bytearray(TRAILER_SIZE))
    encryptor, tag_at = begin_seal(
        keyring, volume.place if place is None else place, trailer, make_key(i), BS, 1
    )
    body = encryptor.update(EVIL)
    end_seal(encryptor, trailer, tag_at)
    return volume.write(i, body + bytes(trailer))


def forged(volume: Volume, i: int) -> str:
    """A plain block with a valid xxh3: what anyone could write."""
    path = volume.write(i, b"")
    forge_plain(path, make_key(i), EVIL)
    return path


def no_checksum(volume: Volume, i: int) -> str:
    """A plain block as a writer with checksum: false writes it."""
    trailer = memoryview(bytearray(TRAILER_SIZE))
    pack_trailer(trailer, make_key(i), BS, None, 1)
    return volume.write(i, EVIL + bytes(trailer))


def another_blocks_file(volume: Volume, i: int) -> str:
    theirs = volume.store(i + 5000)
    path = volume.write(i, b"")
    os.replace(theirs, path)
    return path


def truncated(volume: Volume, i: int) -> str:
    path = volume.store(i)
    os.truncate(path, BS // 2)
    return path


def longer(volume: Volume, i: int) -> str:
    path = volume.store(i)
    with open(path, "ab") as f:
        f.write(b"\0")
    return path


def altered(volume: Volume, i: int) -> str:
    path = volume.store(i)
    flip_bit(path, 100)
    return path


def other_key(key_id: int) -> Keyring:
    return Keyring([SealKey(key_id, os.urandom(32))], key_id)


Row = tuple[str, Callable[[Volume, int], str], str]

SEALED_ROWS: list[Row] = [
    ("good sealed block", lambda v, i: v.store(i), "verified"),
    ("plain trailer with a valid xxh3", forged, "bad-version"),
    ("trailer-less, chunk-sized", lambda v, i: v.write(i, EVIL), "bad-length"),
    ("plain trailer without checksum", no_checksum, "bad-version"),
    ("sealed under a key id not held", lambda v, i: seal(v, i, other_key(2)), "foreign_key"),
    ("another key under our key id", lambda v, i: seal(v, i, other_key(1)), "foreign_key"),
    ("sealed for another place", lambda v, i: seal(v, i, v.keyring, OTHER_PLACE), "bad-seal"),
    ("ciphertext altered", altered, "bad-seal"),
    ("another block's file (wrong key in trailer)", another_blocks_file, "wrong-key"),
    ("truncated", truncated, "truncated"),
    ("one byte longer", longer, "bad-length"),
]

PLAIN_ROWS: list[Row] = [
    ("good plain block", lambda v, i: v.store(i), "verified"),
    ("trailer-less, chunk-sized", lambda v, i: v.write(i, EVIL), "unverified"),
    ("written with checksum: false", no_checksum, "unverified"),
    ("sealed trailer", lambda v, i: seal(v, i, other_key(1)), "bad-version"),
    ("payload altered", altered, "bad-checksum"),
    ("another block's file (wrong key in trailer)", another_blocks_file, "wrong-key"),
    ("truncated", truncated, "truncated"),
    ("one byte longer", longer, "bad-length"),
]


def judge_table(volume: Volume, rows: list[Row]) -> None:
    """Plant each row alone beside the anchor, judge it by verify, then by
    the engine's load (which may move it aside), then clear it away."""
    expected, got = {}, {}
    for i, (name, plant, verdict) in enumerate(rows):
        path = plant(volume, i)
        by_verify = volume.verify_verdict(path)
        by_engine = volume.engine_verdict(i)
        expected[name], got[name] = (verdict, verdict), (by_engine, by_verify)
        if os.path.lexists(path):
            os.remove(path)
    assert got == expected  # (engine, verify) per row


# What only the payload shows: a store judges a file it finds by its size
# and trailer page, so these are kept (present), and quarantined by the load.
_PAYLOAD_FAULTS = frozenset(("bad-seal", "bad-checksum"))


def store_table(volume: Volume, rows: list[Row]) -> None:
    """Plant each row alone and store its block over it: a store keeps a
    file the load would serve (present) and writes over one the load would
    refuse or call bad by its trailer (replaced)."""
    expected, got = {}, {}
    for i, (name, plant, verdict) in enumerate(rows):
        path = plant(volume, i)
        keep = verdict in ("verified", "unverified") or verdict in _PAYLOAD_FAULTS
        expected[name], got[name] = ("present" if keep else "replaced"), volume.store_outcome(i)
        os.remove(path)
    assert got == expected


def test_sealed_namespace_one_verdict(engines, tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    path = key_file(secrets)
    engine, _, primary = engines(str(tmp_path / "v"), n_blocks=2, seal_key_files=((1, path),))
    volume = Volume(engine, primary, keyring_from_args([path]))
    sealed_trailer(volume.path(ANCHOR))
    judge_table(volume, SEALED_ROWS)
    store_table(volume, SEALED_ROWS)


def test_plain_namespace_one_verdict(engines, tmp_path):
    engine, _, primary = engines(str(tmp_path / "v"), n_blocks=2, accept_trailerless=True)
    judge_table(Volume(engine, primary, None), PLAIN_ROWS)
    store_table(Volume(engine, primary, None), PLAIN_ROWS)


def test_rules_refuse_what_no_namespace_is():
    with pytest.raises(ValueError, match="accept_trailerless is for plain namespaces"):
        BlockRules(BS, sealed=True, accept_trailerless=True)
    with pytest.raises(ValueError, match="for a plain namespace"):
        BlockRules(BS, sealed=False, keyring=other_key(1))


def test_sealed_namespace_without_a_key(engines, tmp_path):
    """verify without --seal-key-file cannot authenticate a sealed block,
    yet one that is not sealed is bad all the same (the engine, which
    always holds a key, refuses it)."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    key = key_file(secrets)
    engine, _, primary = engines(str(tmp_path / "v"), n_blocks=2, seal_key_files=((1, key),))
    volume = Volume(engine, primary, None)
    volume.store(1)
    seal(volume, 2, other_key(2))
    bad = {forged(volume, 3): "bad-version", volume.write(4, EVIL): "bad-length"}
    report = verify_volume(volume.layout.root_dir)
    assert {b["path"]: b["reason"] for b in report["bad"]} == bad
    assert report["totals"]["sealed_unchecked"] == 3  # the anchor, 1 and 2
