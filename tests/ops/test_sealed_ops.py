"""The ops tools on sealed blocks (layout/sealed.py): stats counts them by
their trailers without a key, verify authenticates them with the key and
without one says it cannot (never "bad"), yet a block that is not sealed
in a sealed namespace is bad to both, as to a replica; gc sweeps them
needing no key. Blocks are written by a sealed engine, in both I/O modes."""

from __future__ import annotations

import json
import os

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.layout.sealed import NAMESPACE_FIELD, SCHEME
from llmkv_fs.ops.stats import volume_stats
from llmkv_fs.ops.verify import verify_volume
from llmkv_fs.volume.keyfiles import keyring_from_args
from tests.kits.engine_kit import BS, fill, make_key, pattern, wait_jobs
from tests.kits.gc_kit import age, gc
from tests.kits.seal_kit import flip_bit, forge_plain, key_file, sealed_trailer

N = 3


@pytest.fixture
def sealed_volume(engines, tmp_path):
    """A root holding N blocks sealed with key id 1; (root, key path, engine)."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    path = key_file(secrets)
    root = str(tmp_path / "v")
    engine, _, primary = engines(root, n_blocks=N, seal_key_files=((1, path),))
    for i in range(N):
        fill(primary, i, pattern(i))
    assert engine.submit_store(1, [make_key(i) for i in range(N)], list(range(N)))
    assert wait_jobs(engine, [1])[1].success
    sealed_trailer(engine.roots[0].layout.block_path(make_key(0)))
    return root, path, engine


def test_stats_counts_sealed_blocks_without_a_key(sealed_volume):
    root, _, _ = sealed_volume
    report = volume_stats(root)
    (digest,) = report["digests"]
    assert digest["sealing"] == SCHEME
    assert digest["sealed_blocks"] == digest["blocks"] == N
    assert digest["chunk_bytes"] == BS and digest["chunk_source"] == "trailer"
    assert report["totals"]["sealed_blocks"] == N


def test_verify_without_the_key_says_it_cannot(sealed_volume, capsys):
    root, _, engine = sealed_volume
    flip_bit(engine.roots[0].layout.block_path(make_key(0)), 100)  # only the key can tell
    totals = verify_volume(root)["totals"]
    assert (totals["sealed_unchecked"], totals["bad"], totals["verified"]) == (N, 0, 0)
    assert cli_main(["verify", root]) == 0
    assert "3 not authenticated (no key given" in capsys.readouterr().out


def test_verify_with_the_key_authenticates_and_finds_tampering(sealed_volume, capsys):
    root, path, engine = sealed_volume
    keyring = keyring_from_args([path])
    assert verify_volume(root, keyring=keyring)["totals"]["verified"] == N
    flip_bit(engine.roots[0].layout.block_path(make_key(0)), 100)
    report = verify_volume(root, keyring=keyring)
    assert (report["totals"]["verified"], report["totals"]["bad"]) == (N - 1, 1)
    assert report["bad"][0]["reason"] == "bad-seal"
    assert cli_main(["verify", root, "--seal-key-file", f"1={path}"]) == 1
    assert "bad-seal" in capsys.readouterr().out


def test_verify_with_another_key_counts_them_foreign_not_bad(sealed_volume, tmp_path):
    root, _, _ = sealed_volume
    other = key_file(tmp_path, "other")
    totals = verify_volume(root, keyring=keyring_from_args([other]))["totals"]
    assert (totals["foreign_key"], totals["bad"], totals["verified"]) == (N, 0, 0)


def test_verify_refuses_a_bad_key_file_naming_the_option(sealed_volume, tmp_path, capsys):
    root, _, _ = sealed_volume
    loose = key_file(tmp_path, "loose", mode=0o644)
    assert cli_main(["verify", root, "--seal-key-file", loose]) == 2
    err = capsys.readouterr().err
    assert "--seal-key-file" in err and "readable by everyone" in err


def test_gc_sweeps_sealed_blocks_without_a_key(sealed_volume, capsys):
    root, _, engine = sealed_volume
    paths = [engine.roots[0].layout.block_path(make_key(i)) for i in range(N)]
    for path in paths:
        age(path, 3600)
    status, _ = gc(root, "--max-bytes", "0", "--protect", "1m", capsys=capsys)
    assert status == 0
    assert not any(os.path.exists(p) for p in paths)


def _plant_unsealed(engine) -> dict[str, str]:
    """A forgery with a valid xxh3 trailer over block 1 and a trailer-less
    file over block 2: neither is sealed; {path: the reason a replica
    refuses it}."""
    layout = engine.roots[0].layout
    forged, bare = layout.block_path(make_key(1)), layout.block_path(make_key(2))
    forge_plain(forged, make_key(1), pattern(7))
    with open(bare, "wb") as f:
        f.write(pattern(8))
    return {forged: "bad-version", bare: "bad-length"}


def test_verify_repair_quarantines_unsealed_blocks_in_a_sealed_namespace(sealed_volume, capsys):
    """What a replica refuses and quarantines, verify calls bad: never OK."""
    root, path, engine = sealed_volume
    planted = _plant_unsealed(engine)
    assert cli_main(["verify", root, "--repair", "--seal-key-file", f"1={path}"]) == 1
    out = capsys.readouterr().out
    assert "result: 2 bad, 0 unreadable (2 quarantined)" in out
    assert "bad-version" in out and "bad-length" in out
    assert not any(os.path.exists(p) for p in planted)
    totals = verify_volume(root, keyring=keyring_from_args([path]))["totals"]
    assert (totals["verified"], totals["bad"], totals["files"]) == (1, 0, 1)


def test_verify_without_the_key_still_finds_unsealed_blocks(sealed_volume):
    root, _, engine = sealed_volume
    planted = _plant_unsealed(engine)
    report = verify_volume(root)
    assert {b["path"]: b["reason"] for b in report["bad"]} == planted
    assert report["totals"]["sealed_unchecked"] == N - 2


def test_stats_counts_sealed_blocks_by_their_trailers(sealed_volume, capsys):
    """config.json's word makes no block sealed: a plain or trailer-less
    file there is counted as what it is."""
    root, _, engine = sealed_volume
    _plant_unsealed(engine)
    report = volume_stats(root)
    (digest,) = report["digests"]
    assert (digest["blocks"], digest["sealed_blocks"]) == (N, 1)
    assert digest["not_sealed"] == {"bad-length": 1, "bad-version": 1}
    assert report["totals"]["not_sealed_blocks"] == 2
    assert cli_main(["stats", root]) == 0
    out = capsys.readouterr().out
    assert "1 blocks (aes-256-gcm/1); not sealed: bad-length 1, bad-version 1" in out
    assert "2 block files of sealed" in out


def test_verify_says_an_unproven_sealing_is_not_ok(sealed_volume, capsys):
    """config.json altered to say nothing of sealing (it no longer hashes
    to the digest): verify cannot know the blocks must be sealed, and says
    so instead of calling a forgery verified."""
    root, path, engine = sealed_volume
    _plant_unsealed(engine)
    config = engine.roots[0].layout.config_path
    with open(config) as f:
        fields = json.load(f)
    del fields[NAMESPACE_FIELD]
    with open(config, "w") as f:
        json.dump(fields, f)
    assert cli_main(["verify", root, "--seal-key-file", f"1={path}"]) == 1
    out = capsys.readouterr().out
    assert "sealing unproven" in out and "result: 0 bad, 1 unreadable" in out
    (error,) = verify_volume(root)["errors"]
    assert error["reason"] == "unproven-config" and error["path"] == config
