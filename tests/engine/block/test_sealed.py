"""Sealed blocks (seal_key_files) through the engine, in both I/O modes: a
round trip stores neither plaintext nor key, and every attack of issue 31
-- a forgery with a valid xxh3 trailer, swapped files, another rank's block
replayed, a truncated, extended or altered file, another deployment's key
-- costs a miss and never puts a byte into the CPU tier. Each attack first
asserts the block it attacks is sealed, so a run with sealing bypassed
fails there or at the refusal."""

from __future__ import annotations

import mmap
import os
import pickle
import shutil

import pytest

from llmkv_fs.engine import Direction, Failure, Outcome, Tally, prepare_volume
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.block.sealed import SealedBytes
from llmkv_fs.engine.workers.crew import WorkerLaunch
from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError, Corruption
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.sealed import NAMESPACE_FIELD, SCHEME
from llmkv_fs.volume.keyfiles import load_keyring
from llmkv_fs.volume.run_config import read_run_config
from tests.kits.engine_kit import BS, fill, inside, make_key, pattern, row, wait_jobs
from tests.kits.seal_kit import flip_bit, forge_plain, key_file, rekey_trailer, sealed_trailer

EVIL = b"\x66" * BS  # what an attacker wants the model to read
SENTINEL = b"\xaa" * BS  # the row before a load: a refused load leaves zeros


@pytest.fixture
def keys(tmp_path):
    directory = tmp_path / "secrets"
    directory.mkdir()
    return lambda name="key": key_file(directory, name)


def sealed(engines, root, *files: str, write: int | None = None, **settings):
    """A sealed engine over ``files`` (ids 1, 2, ... in order)."""
    key_files = tuple((i, path) for i, path in enumerate(files, start=1))
    return engines(root, n_blocks=4, seal_key_files=key_files, seal_write_key_id=write, **settings)


def store(engine, primary, *ids: int) -> None:
    for chunk, i in enumerate(ids):
        fill(primary, chunk, pattern(i))
    job_id = store.next = getattr(store, "next", 1000) + 1
    assert engine.submit_store(job_id, [make_key(i) for i in ids], list(range(len(ids))))
    assert wait_jobs(engine, [job_id])[job_id].success


def load(engine, primary, i: int) -> tuple[bool, bytes]:
    """Load block ``i`` into row 0 (first filled with SENTINEL): whether it
    succeeded, and what the row holds afterwards."""
    fill(primary, 0, SENTINEL)
    job_id = load.next = getattr(load, "next", 2000) + 1
    assert engine.submit_load(job_id, [make_key(i)], [0])
    return wait_jobs(engine, [job_id])[job_id].success, row(primary, 0)


def block_path(engine, i: int) -> str:
    return engine.roots[0].layout.block_path(make_key(i))


def assert_refused(
    engine, primary, i: int, reason: Corruption | Failure, zeroed: bool = True
) -> None:
    """The load of ``i`` fails for ``reason`` and the row holds zeros (a
    file was read: not a byte of it, ciphertext, forged or unauthenticated,
    stays in the CPU tier) or is untouched (no file). An unsealed reader
    (``zeroed`` False) leaves what it read in a failed row, never delivered."""
    key = reason if isinstance(reason, Corruption) else (Direction.LOAD, reason)
    before = engine.counters[key]
    ok, got = load(engine, primary, i)
    assert not ok
    if zeroed:
        assert got == (SENTINEL if reason is Failure.MISSING else bytes(BS))
    assert engine.counters[key] == before + 1, dict(engine.counters)


def test_round_trip_stores_neither_plaintext_nor_key(engines, tmp_path, keys):
    path = keys()
    engine, plain_layout, primary = sealed(engines, str(tmp_path / "v"), path)
    store(engine, primary, 0, 1)
    layout = engine.roots[0].layout
    assert layout.digest_dir_name != plain_layout.digest_dir_name
    config, _ = read_run_config(layout.config_path)
    assert config is not None and config[NAMESPACE_FIELD] == SCHEME
    with open(path, "rb") as f:
        secret_text = f.read().strip()
    for dirpath, _, names in os.walk(str(tmp_path / "v")):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            assert secret_text not in data
            assert pattern(0)[:64] not in data and pattern(1)[:64] not in data
    assert sealed_trailer(block_path(engine, 0)).seal.key_id == 1
    for i in (0, 1):
        ok, got = load(engine, primary, i)
        assert ok and got == pattern(i)
    assert engine.counters[Outcome.VERIFIED] == 2


def test_forged_block_with_valid_xxh3_trailer_is_served_unsealed(engines, tmp_path):
    """The hole sealing closes: whoever writes the volume can plant KV."""
    engine, _, primary = engines(str(tmp_path / "v"), n_blocks=4)
    store(engine, primary, 0)
    forge_plain(block_path(engine, 0), make_key(0), EVIL)
    ok, got = load(engine, primary, 0)
    assert ok and got == EVIL


def test_forged_block_with_valid_xxh3_trailer_is_refused_sealed(engines, tmp_path, keys):
    engine, _, primary = sealed(engines, str(tmp_path / "v"), keys())
    store(engine, primary, 0)
    path = block_path(engine, 0)
    sealed_trailer(path)
    forge_plain(path, make_key(0), EVIL)
    assert_refused(engine, primary, 0, Corruption.BAD_VERSION)
    assert engine.counters[Tally.QUARANTINED] == 1


def test_swapped_files_fail_authentication(engines, tmp_path, keys):
    """Two valid sealed blocks swapped, each trailer rewritten to claim the
    key of the path it now sits at (trailer checksum recomputed)."""
    engine, _, primary = sealed(engines, str(tmp_path / "v"), keys())
    store(engine, primary, 0, 1)
    a, b = block_path(engine, 0), block_path(engine, 1)
    sealed_trailer(a), sealed_trailer(b)
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)
    rekey_trailer(a, make_key(0))
    rekey_trailer(b, make_key(1))
    assert_refused(engine, primary, 0, Corruption.BAD_SEAL)
    assert_refused(engine, primary, 1, Corruption.BAD_SEAL)


def _blockio_at_rank(engine, rank: int, key_path: str) -> BlockIO:
    layout = engine.roots[0].layout
    at_rank = CacheLayout(layout.root_dir, layout.run_config, rank)
    prepare_volume(at_rank)
    options = IoOptions(
        block_size=BS,
        use_o_direct=False,
        fsync_file=False,
        fsync_dir=False,
        checksum=True,
        sealed=True,
    )
    return BlockIO(at_rank, options, keyring=load_keyring({1: key_path}, None))


@pytest.mark.parametrize("rank", [0, 1])
def test_block_replayed_from_another_rank_fails(engines, tmp_path, keys, rank):
    """Rank 1 sealed this very block with our key; copied to rank 0's path it
    fails (its place is in the associated data). Rank 0's own copy is the
    control: it loads."""
    path = keys()
    engine, _, primary = sealed(engines, str(tmp_path / "v"), path)
    other = _blockio_at_rank(engine, rank, path)
    other.store(make_key(0), memoryview(bytearray(EVIL)))
    source = other.layout.block_path(make_key(0))
    sealed_trailer(source)
    if rank == 0:
        ok, got = load(engine, primary, 0)
        assert ok and got == EVIL
        return
    os.makedirs(os.path.dirname(block_path(engine, 0)), exist_ok=True)
    shutil.copy(source, block_path(engine, 0))
    assert_refused(engine, primary, 0, Corruption.BAD_SEAL)


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


def _extend(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 100)


def _short(path: str) -> None:
    os.truncate(path, BS // 2)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, Corruption.BAD_LENGTH),  # the payload whole, the trailer not
        (_short, Corruption.TRUNCATED),
        (_extend, Corruption.BAD_LENGTH),
        (lambda p: flip_bit(p, BS // 3), Corruption.BAD_SEAL),  # the payload
        (lambda p: flip_bit(p, BS + 60), Corruption.BAD_TRAILER),  # the trailer's key
    ],
    ids=["truncated-trailer", "truncated-payload", "extended", "payload-bit", "trailer-bit"],
)
def test_damaged_block_is_refused(engines, tmp_path, keys, damage, reason):
    engine, _, primary = sealed(engines, str(tmp_path / "v"), keys())
    store(engine, primary, 0)
    path = block_path(engine, 0)
    sealed_trailer(path)
    damage(path)
    assert_refused(engine, primary, 0, reason)
    assert engine.counters[Tally.QUARANTINED] == 1


def test_altered_tag_or_nonce_fails_authentication(engines, tmp_path, keys):
    engine, _, primary = sealed(engines, str(tmp_path / "v"), keys())
    store(engine, primary, 0, 1)
    for i, field in ((0, "tag"), (1, "nonce")):
        path = block_path(engine, i)
        seal = sealed_trailer(path).seal
        at = seal.tag_at if field == "tag" else seal.tag_at - 20
        flip_bit(path, BS + at, seal.tag_at)
        assert_refused(engine, primary, i, Corruption.BAD_SEAL)


def test_another_deployments_key_is_a_miss_left_in_place(engines, tmp_path, keys):
    """Same key id, another key (another deployment on the volume), and a key
    id we do not hold: foreign_key, never quarantined, the file stays."""
    root = str(tmp_path / "v")
    ours, _, primary = sealed(engines, root, keys("ours"))
    theirs, _, their_primary = sealed(engines, root, keys("theirs"))
    store(theirs, their_primary, 0)
    path = block_path(ours, 0)
    assert path == block_path(theirs, 0)  # one namespace: the digest names no key
    sealed_trailer(path)
    assert_refused(ours, primary, 0, Failure.FOREIGN_KEY)
    unknown_id, _, unknown_primary = sealed(engines, root, keys("x"), keys("y"), write=2)
    store(unknown_id, unknown_primary, 1)  # sealed under id 2, which `ours` lacks
    assert_refused(ours, primary, 1, Failure.FOREIGN_KEY)
    assert ours.counters[Tally.QUARANTINED] == 0
    assert os.path.exists(path) and os.path.exists(block_path(ours, 1))


def test_rotation_reads_old_keys_and_writes_the_new_one(engines, tmp_path, keys):
    root = str(tmp_path / "v")
    old, new = keys("old"), keys("new")
    first, _, first_primary = sealed(engines, root, old)
    store(first, first_primary, 0)
    both, _, primary = sealed(engines, root, old, new, write=2)
    ok, got = load(both, primary, 0)
    assert ok and got == pattern(0)
    store(both, primary, 1)
    assert sealed_trailer(block_path(both, 1)).seal.key_id == 2
    retired, _, retired_primary = engines(
        root, n_blocks=4, seal_key_files=((2, new),), seal_write_key_id=2
    )
    assert_refused(retired, retired_primary, 0, Failure.FOREIGN_KEY)
    ok, got = load(retired, retired_primary, 1)
    assert ok and got == pattern(1)


def test_sealed_and_unsealed_deployments_never_load_each_others_blocks(engines, tmp_path, keys):
    root = str(tmp_path / "v")
    plain, _, plain_primary = engines(root, n_blocks=4)
    seal, _, seal_primary = sealed(engines, root, keys())
    store(plain, plain_primary, 0)
    store(seal, seal_primary, 1)
    assert not seal.roots[0].blockio.exists(make_key(0))
    assert not plain.roots[0].blockio.exists(make_key(1))
    assert_refused(seal, seal_primary, 0, Failure.MISSING)
    assert_refused(plain, plain_primary, 1, Failure.MISSING, zeroed=False)
    # A sealed file copied where unsealed blocks live is not read as KV.
    os.makedirs(os.path.dirname(block_path(plain, 1)), exist_ok=True)
    shutil.copy(block_path(seal, 1), block_path(plain, 1))
    assert_refused(plain, plain_primary, 1, Corruption.BAD_VERSION, zeroed=False)


def test_keys_never_travel_pickled_nor_on_a_workers_command_line(engines, tmp_path, keys):
    path = keys()
    engine, _, primary = sealed(engines, str(tmp_path / "v"), path)
    store(engine, primary, 0)  # workers (in that mode) are up and sealing
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(inside(engine).step_spec)
    secret = load_keyring({1: path}, None).write.secret
    assert secret.hex() not in repr(inside(engine).step_spec) + repr(
        inside(engine).step_spec.keyring
    )
    launches = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(b"llmkv_fs.engine.workers.child" in a for a in argv):
            assert secret not in environ and secret.hex().encode() not in environ
            launch = WorkerLaunch.decoded(argv[-2].decode() if not argv[-1] else argv[-1].decode())
            if launch.parent == os.getpid():
                launches.append(launch)
    assert bool(launches) == bool(engine.io_workers)
    for launch in launches:
        assert launch.step.keyring is None and launch.keys_fd >= 0
        assert secret not in pickle.dumps(launch)


PIECES_SIZE, PIECE = 40 << 10, 16 << 10  # two pieces and a half


def _page_aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))


def _sealer(keyring, seal_piece: int) -> SealedBytes:
    options = IoOptions(PIECES_SIZE, False, False, False, True, sealed=True, seal_piece=seal_piece)
    return SealedBytes(options, keyring, "m_0123_r0")


def _seal_to(path: str, sealer: SealedBytes, payload: bytes) -> None:
    source, trailer = _page_aligned(PIECES_SIZE), _page_aligned(TRAILER_SIZE)
    source[:] = payload
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        sealer.write(fd, make_key(1), source, trailer)
    finally:
        os.close(fd)
    assert source.tobytes() == payload  # the CPU tier's row is not changed


def _open_from(path: str, sealer: SealedBytes, into: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        sealer.read(fd, make_key(1), into, _page_aligned(2 * TRAILER_SIZE))
    finally:
        os.close(fd)


def test_a_block_sealed_in_pieces_opens_whole_and_the_reverse(tmp_path, keys):
    """I/O threads seal a block in one cipher call, worker processes in
    pieces (engine/startup/io_setup.py): the file is the same format either
    way, and a last piece shorter than the others is sealed and opened."""
    keyring = load_keyring({1: keys()}, None)
    payload = os.urandom(PIECES_SIZE)
    for writer, reader in ((PIECE, 0), (0, PIECE), (PIECE, PIECE)):
        path = str(tmp_path / f"block_{writer}_{reader}")
        _seal_to(path, _sealer(keyring, writer), payload)
        with open(path, "rb") as f:
            assert payload[: 4 << 10] not in f.read()
        into = _page_aligned(PIECES_SIZE)
        _open_from(path, _sealer(keyring, reader), into)
        assert into.tobytes() == payload


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: os.truncate(p, PIECES_SIZE + 100), Corruption.BAD_LENGTH),
        (lambda p: os.truncate(p, PIECES_SIZE - 100), Corruption.TRUNCATED),
        (_extend, Corruption.BAD_LENGTH),
        (lambda p: flip_bit(p, PIECE + 5), Corruption.BAD_SEAL),  # the second piece
    ],
    ids=["truncated-trailer", "truncated-payload", "extended", "payload-bit"],
)
@pytest.mark.parametrize("reader", [0, PIECE], ids=["whole", "in-pieces"])
def test_a_damaged_block_is_refused_whole_and_in_pieces(tmp_path, keys, damage, reason, reader):
    """Opened as I/O threads open it (one piece) and as worker processes do
    (several, the last one short), a damaged file is refused for the same
    reason and leaves zeros in the row."""
    keyring = load_keyring({1: keys()}, None)
    path = str(tmp_path / "block")
    _seal_to(path, _sealer(keyring, 0), os.urandom(PIECES_SIZE))
    damage(path)
    into = _page_aligned(PIECES_SIZE)
    into[:] = b"\xaa" * PIECES_SIZE
    with pytest.raises(BlockFileError) as refused:
        _open_from(path, _sealer(keyring, reader), into)
    assert refused.value.reason == reason
    assert into.tobytes() == bytes(PIECES_SIZE)
