"""``llmkv-fs demo`` end to end, as the README runs it: a subprocess of the
real command line (``python -m llmkv_fs demo``), small sizes, on tmpfs. Each
run starts three replica processes that each import vLLM (about 10 s apiece
on an idle 2-core box).

What the damage runs prove -- the demo's hidden ``--damage`` alters a real
block file of document 0 on disk after replicas 1 and 2 exit and before the
restarted replica starts:

* ``bitflip`` (a flipped payload bit, trailer intact): the meaningful outcome
  is *not* a failing exit. The tier must detect it (bad-checksum), quarantine
  the file, answer MISS so the chunk is recomputed, and never serve it; the
  demo's own byte-for-byte check then finds nothing wrong, so it exits 0. The
  test asserts the quarantine is reported and on disk, that the restarted
  replica hit exactly one chunk fewer, and that every loaded chunk matched.
* ``trailerless`` (same flipped bit, our trailer cut off: the format vLLM's
  built-in tier writes). By default the tier refuses such a file (nothing to
  verify), quarantines it and the demo exits 0. With the opt-in
  ``accept_trailerless`` the tier cannot tell, so a wrong chunk reaches the CPU
  tier: this shows the demo's own verification is real -- it must report the
  wrong chunk and exit non-zero.
"""

import base64
import glob
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.kits.volume_kit import block_files, quarantined

# The integration lane (tests/conftest.py): plain pytest leaves it out. The
# bound is above run_demo's own (1500 s).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

pytest.importorskip("vllm")

DOCS, DOC_CHUNKS, SUFFIX, REQUESTS = 2, 4, 1, 2
SMALL = [
    "--docs",
    str(DOCS),
    "--doc-chunks",
    str(DOC_CHUNKS),
    "--suffix-chunks",
    str(SUFFIX),
    "--requests",
    str(REQUESTS),
    "--block-mib",
    "1",
    "--threads",
    "2",
]
RESTART_HITS = DOCS * DOC_CHUNKS  # the restarted replica serves every document once
TALLY = re.compile(
    r"^replica (r\d)\b.*: (\d+) requests, (\d+) chunks looked up, (\d+) hits \((\d+) from its "
    r"CPU tier, (\d+) from the volume, (\d+) of them stored by another replica\) "
    r"= ([\d.]+)% hit rate$",
    re.M,
)


@pytest.fixture
def tmpfs_root():
    path = f"/dev/shm/llmkv_fs_test_demo_{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_demo(root: str, *extra: str) -> subprocess.CompletedProcess:
    # The ``llmkv-fs`` script's main (llmkv_fs.cli:main), from the tree on the path.
    proc = subprocess.run(
        [sys.executable, "-m", "llmkv_fs", "demo", "--root", root, *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    print(proc.stdout, proc.stderr)  # shown by pytest when a test fails
    return proc


def tallies(stdout: str) -> dict[str, dict[str, float]]:
    names = ("requests", "chunks", "hits", "hit_cpu", "hit_fs", "hit_other", "rate")
    out = {}
    for m in TALLY.finditer(stdout):
        out[m.group(1)] = dict(zip(names, (*map(int, m.groups()[1:-1]), float(m.group(8)))))
    assert set(out) == {"r1", "r2", "r3"}, stdout
    return out


def test_replicas_share_prefixes_and_a_restarted_replica_finds_them(tmpfs_root):
    proc = run_demo(tmpfs_root)
    assert proc.returncode == 0
    t = tallies(proc.stdout)
    # Turn 1: both miss (different documents); later turns swap documents, so
    # each replica hits on the prefix the *other process* stored.
    assert t["r2"]["hit_other"] > 0 and t["r1"]["hit_other"] > 0
    assert t["r2"]["rate"] > 0
    for name in ("r1", "r2"):
        assert t[name]["requests"] == REQUESTS
        assert t[name]["chunks"] == REQUESTS * (DOC_CHUNKS + SUFFIX)
    # The restarted replica starts with an empty CPU tier: every document
    # chunk comes from the volume, every suffix is new.
    r3 = t["r3"]
    assert (r3["hits"], r3["hit_cpu"], r3["hit_fs"]) == (RESTART_HITS, 0, RESTART_HITS)
    assert r3["rate"] == pytest.approx(100.0 * DOC_CHUNKS / (DOC_CHUNKS + SUFFIX), abs=0.05)
    assert proc.stdout.count("loaded chunks byte-exact") == 3
    assert "WRONG" not in proc.stdout and "\nOK: every loaded byte matched" in proc.stdout
    # On disk: one file per distinct chunk (documents once, every suffix),
    # nothing quarantined, no lease left behind by the clean shutdowns.
    assert len(block_files(tmpfs_root)) == DOCS * DOC_CHUNKS + (2 * REQUESTS + DOCS) * SUFFIX
    assert quarantined(tmpfs_root) == []
    assert glob.glob(f"{tmpfs_root}/*/leases/*") == []


def test_a_damaged_file_is_quarantined_and_recomputed_never_served(tmpfs_root):
    proc = run_demo(tmpfs_root, "--damage", "bitflip")
    assert "[--damage bitflip] altered" in proc.stdout
    assert proc.returncode == 0  # no wrong byte was served: that is the point
    r3 = tallies(proc.stdout)["r3"]
    assert r3["hits"] == RESTART_HITS - 1 and r3["rate"] > 0
    assert re.search(
        r"tier: \d+ verified, 0 unverified .* 1 quarantined "
        r"\{'load_corrupt_bad-checksum': 1\}",
        proc.stdout,
    )
    assert "1 quarantined (bad-checksum 1)" in proc.stdout  # the volume summary
    assert "WRONG" not in proc.stdout and "1 damaged file(s) quarantined" in proc.stdout
    (moved,) = quarantined(tmpfs_root)
    assert ".bin.bad-checksum." in moved
    # Recomputed and stored again: as many block files as a clean run.
    assert len(block_files(tmpfs_root)) == DOCS * DOC_CHUNKS + (2 * REQUESTS + DOCS) * SUFFIX


def test_a_trailerless_file_is_not_trusted_by_default(tmpfs_root):
    proc = run_demo(tmpfs_root, "--damage", "trailerless")
    assert proc.returncode == 0 and "WRONG" not in proc.stdout
    # Not found (nothing to verify), recomputed, and stored again with a trailer.
    assert tallies(proc.stdout)["r3"]["hits"] == RESTART_HITS - 1
    assert {os.path.getsize(f) for f in block_files(tmpfs_root)} == {(1 << 20) + 4096}


def test_a_wrong_chunk_the_tier_cannot_detect_fails_the_demo(tmpfs_root):
    proc = run_demo(tmpfs_root, "--damage", "trailerless", "--accept-trailerless")
    assert proc.returncode == 1
    assert "FAILED: 1 loaded chunk(s) did not match" in proc.stdout
    assert "1 loaded chunks WRONG" in proc.stdout and "1 unverified (trailer-less)" in proc.stdout
    assert "\nOK:" not in proc.stdout


def test_a_sealed_demo_checks_every_byte_and_catches_a_flipped_bit(tmpfs_root, tmp_path):
    """``--seal-key-file``: blocks sealed (AES-256-GCM), every loaded byte
    still compared; a flipped payload bit fails authentication (bad-seal)."""
    key = tmp_path / "demo.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    key.chmod(0o400)
    proc = run_demo(tmpfs_root, "--seal-key-file", str(key), "--damage", "bitflip")
    assert proc.returncode == 0 and "WRONG" not in proc.stdout
    assert "blocks sealed (AES-256-GCM)" in proc.stdout
    assert "blocks (sealed)" in proc.stdout
    assert proc.stdout.count("loaded chunks byte-exact") == 3
    assert "1 quarantined (bad-seal 1)" in proc.stdout
    assert tallies(proc.stdout)["r3"]["hits"] == RESTART_HITS - 1
    (moved,) = quarantined(tmpfs_root)
    assert ".bin.bad-seal." in moved
