"""The suite's NFS part: one guest per NFS version (tests/nfs_kit.py) runs a
batch of test files inside it, their ``volume`` / ``shared_volume`` tests on
the "nfs" param (two kernel clients of one knfsd export).

Everything in the guest runs 5-10x slower than here, so the batch is the
engine, gc, stats and verify tests plus a few through vLLM's real stack
(importing vLLM in the guest costs about a minute of emulated CPU).

Opt-in for now: the batch runs only with LLMKV_FS_NFS=1 (or
LLMKV_FS_REQUIRE_NFS=1), because it does not yet finish within CI's time
(docs/reliability.md, NFS). Asked for, it skips where the guest cannot be
provided, or fails with LLMKV_FS_REQUIRE_NFS=1.
"""

from __future__ import annotations

import os
import sys
import time

import nfs_kit
import pytest

# Test files run inside the guest, per NFS version; -k picks their "nfs"
# params. v3 shares the client code paths for lookups and silly renames with
# v4.2 but not locking (NLM) or the open/lease model, so it gets the
# cross-client and gc race files; v4.2 gets everything that has an nfs param.
_COMMON = [
    "tests/test_cross_client.py",
    "tests/test_gc_race.py",
]
GUEST_FILES = {
    "4.2": [
        *_COMMON,
        "tests/test_engine_io.py",
        "tests/test_gc_rules.py",
        "tests/test_ops_stats.py",
        "tests/test_ops_verify.py",
        # Not yet: collecting tests/test_tier_vllm.py imports vLLM, which in
        # the emulated guest did not finish within the batch's 540 s at load
        # ~5 (measured); a vLLM test needs its own budget or a lighter import.
    ],
    "3": _COMMON,
}
# Measured at load average ~10 on 2 shared cores: v3's batch 228 s, v4.2's
# larger one did not finish in 420 s; on an idle CI machine a few times less.
GUEST_TIMEOUT_S = 540.0


@pytest.mark.skipif(
    not nfs_kit.asked_for(),
    reason=f"NFS batch is opt-in until it fits CI's time: set {nfs_kit.OPT_IN_ENV}=1 to run it",
)
@pytest.mark.skipif(nfs_kit.in_guest(), reason="this test boots the guest; inside it, no")
@pytest.mark.parametrize("version", list(GUEST_FILES))
def test_suite_on_nfs(version):
    started = time.monotonic()
    with nfs_kit.guest(version) as vm:
        booted = time.monotonic()
        env = {
            nfs_kit.MOUNT_A_ENV: vm.mount_a,
            nfs_kit.MOUNT_B_ENV: vm.mount_b,
            nfs_kit.VERSION_ENV: version,
            # The guest's own tmpfs: pytest's capture files on the host's /tmp
            # (9p) failed to truncate once unlinked, crashing the session.
            "TMPDIR": "/var/tmp",
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "nfs"]
        argv += ["--durations=10"]  # what the guest's minutes went to
        done = vm.exec([*argv, *GUEST_FILES[version]], env, GUEST_TIMEOUT_S)
    total = time.monotonic() - started
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(
        f"NFS v{version}: guest up in {booted - started:.0f}s, batch + down in "
        f"{total - (booted - started):.0f}s: {summary[0]}"
    )
    assert done.returncode == 0, (
        f"pytest in the NFS v{version} guest failed:\n{done.stdout[-12000:]}"
    )
