"""The suite's NFS part: one guest per NFS version (tests/kits/nfs_kit.py) runs a
batch of test files inside it, their ``volume`` / ``shared_volume`` tests on
the "nfs" param (two kernel clients of one knfsd export).

Everything in the guest runs under software emulation, 5-20x slower than
here, and importing vLLM there takes ~6 minutes of it (measured: 354 s for
``vllm.v1.kv_offload.tiering.spec`` on an idle 2-core VM). So there are two
batches:

* the CI batch (``test_suite_on_nfs``, both versions): the engine, gc,
  stats and verify tests, with vLLM and torch blocked in the guest (a test
  that needs them skips there, see tests/conftest.py). It runs by default,
  like the GlusterFS tests; ``LLMKV_FS_NFS=0`` skips it, and
  ``LLMKV_FS_REQUIRE_NFS=1`` (set by CI) turns "cannot be provided here"
  into a failure.
* the vLLM batch (``test_vllm_stack_on_nfs``, both versions): the tests
  through vLLM's real manager and the fault matrix, opt-in with
  ``LLMKV_FS_NFS_VLLM=1`` (about 15 minutes a version; docs/reliability.md,
  NFS).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.kits import nfs_kit, timing_kit

# The integration lane (tests/conftest.py): plain pytest leaves it out. A
# batch is bounded by its own limits below (the guest's silence, its total),
# which scale with the guest's speed; this bound, CI's whole budget (90 min),
# is only the last resort. Inside the guest each test has the silence limit
# as its own bound (``--timeout``, pytest-timeout): a hung test fails there
# by name and the batch goes on.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(5400)]

# Test files per NFS version; -k picks their "nfs" params. v3 shares the
# client code paths for lookups and silly renames with v4.2 but not locking
# (NLM) or the open/lease model, so it gets the cross-client and gc race
# files and gc's lock across clients; v4.2 gets every file with an nfs param
# that runs without vLLM.
_COMMON = ["tests/system/test_cross_client.py", "tests/ops/gc/test_race.py"]
CI_FILES = {
    "4.2": [
        *_COMMON,
        "tests/ops/gc/test_command.py",
        "tests/engine/test_engine.py",
        "tests/ops/gc/test_rules.py",
        "tests/ops/test_stats.py",
        "tests/ops/test_verify.py",
        "tests/engine/test_roots.py::test_two_roots_shared_through_another_client",
    ],
    "3": [
        *_COMMON,
        "tests/ops/gc/test_command.py::test_gc_lock_holds_across_clients_and_dies_with_its_holder",
    ],
}
VLLM_FILES = [
    "tests/tier/test_fs_tier.py",
    # Replicas store through one client, gc announces from the other. I/O threads
    # only: in the emulated guest a worker process started after vLLM's import
    # exits 127 on ld.so's "elf_get_dynamic_info" assertion (seen 2026-11-28,
    # cause not run down); worker mode runs on tmpfs, ext4 and GlusterFS.
    "tests/ops/events/test_announcer.py::test_router_index_equals_the_volume[threads-nfs-router]",
    "tests/ops/events/test_announcer.py::"
    "test_router_index_equals_the_volume[threads-nfs-router-dropping-removals]",
    "tests/ops/test_verify.py::test_blocks_written_by_vllm_builtin_tier",
    "tests/system/test_matrix_io_errors.py",
    "tests/system/test_matrix_races.py",
    "tests/system/test_matrix_crash.py",
    "tests/system/test_matrix_stall.py",
]
# How long a batch may run is not a fixed figure: the guest is emulated, so
# its speed follows the host's load (v4.2's CI batch took 259 s on the idle
# 2-core dev VM and ran past a fixed 900 s at load 4-8). The batch runs
# verbosely -- each test's name is printed when it starts, its verdict when
# it ends -- and is killed only when the guest printed nothing for
# QUIET_LIMIT_S (one test, or the session's start, that hangs), or past
# TOTAL_LIMIT_S in all; both are multiplied by the guest's speed, measured
# when the batch starts (``_guest_slowdown``).
#
# Longest silences at reference speed: a test that starts a gc process
# (25-30 s for the start alone, tests/kits/gc_kit.py), a worker-mode cross-client
# test (30-45 s), the session's start (collection imports the suite's kits).
QUIET_LIMIT_S = 300.0
TOTAL_LIMIT_S = 3600.0  # a last resort against a batch that prints but never ends
# The probe: starting an interpreter in the guest and importing the engine
# (what every test file's collection starts with). PROBE_REFERENCE_S is its
# time in the guest at the speed the limits above were set for. Not measured
# in the guest yet: derived from the gc start figure above (25-30 s there;
# on the host `llmkv-fs gc --help` takes 1.4x this probe: 0.86-1.0 s against
# 0.5-0.7 s at load 2). Every batch prints the probe's time with its
# summary line: replace the estimate with the first idle figure. An estimate
# off either way only moves generous limits: a faster guest keeps them as
# they are (the factor is at least 1).
PROBE = "import llmkv_fs.engine"
PROBE_REFERENCE_S = 15.0
PROBE_LIMIT_S = 900.0  # a hang bound for the probe itself
# What runs in the guest: the nfs params with I/O threads only. A test that
# starts worker processes takes 30-45 s there (fresh interpreters under TCG)
# against under 1 s with threads, and the executor is not what NFS tests:
# both executors run the same BlockStep through the same kernel client (its
# attribute and lookup caches are the mount's, not the process's), and every
# test kept here runs in both modes on tmpfs, ext4 and GlusterFS. Left out as
# well: gc's "python -m runs without vLLM or torch", a property of the
# interpreter's imports, not of the volume (two gc starts, ~1 min under TCG);
# and gc's concurrent runs on one client (six gc starts, 1-2 min under TCG):
# their lock is the one the across-clients lock test holds on the server
# (gc runs as a process on NFS there and in the race tests).
GUEST_SELECTION = (
    "nfs and not workers and not test_python_m_runs_without_vllm_or_torch"
    " and not test_concurrent_gc_runs_do_not_fight"
)
# The vLLM batch: its start (importing vLLM) is one silence of ~6 minutes.
VLLM_QUIET_LIMIT_S = 900.0
VLLM_ENV = "LLMKV_FS_NFS_VLLM"


def _guest_slowdown(vm: nfs_kit.NfsGuest, env: dict[str, str]) -> tuple[float, float]:
    """(the probe's seconds in the guest, the factor the limits are
    multiplied by: how much slower than the reference, at least 1)."""
    started = time.monotonic()
    done = vm.exec([sys.executable, "-c", PROBE], env, PROBE_LIMIT_S, PROBE_LIMIT_S)
    took = time.monotonic() - started
    assert done.returncode == 0, f"the speed probe failed in the guest:\n{done.stdout[-4000:]}"
    return took, max(1.0, took / PROBE_REFERENCE_S)


def _batch(version: str, argv: list[str], env: dict[str, str], quiet_limit_s: float) -> None:
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
            **env,
        }
        probe_s, slowdown = _guest_slowdown(vm, env)
        # -v: a test's name is printed (and flushed) when it starts, so a
        # kill names the test that hung.
        pytest_argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"]
        # nfs tests are integration ones; serially, as the integration lane runs
        pytest_argv += ["-m", "", "-n", "0", "-k", GUEST_SELECTION]
        pytest_argv += ["-rs", "--durations=15"]  # what the guest's minutes went to
        # A test's bound in the guest: just inside the batch's silence limit
        # (nothing is printed while a test runs), so it fails by name first.
        pytest_argv += [f"--timeout={int(0.9 * quiet_limit_s * slowdown)}"]
        done = vm.exec(
            [*pytest_argv, *argv],
            env,
            quiet_limit_s * slowdown,
            TOTAL_LIMIT_S * slowdown,
        )
    total = time.monotonic() - started
    timing_kit.note(f"NFS v{version} guest boot", booted - started)
    timing_kit.note(f"NFS v{version} batch and shutdown", total - (booted - started))
    timing_kit.detail(
        f"NFS v{version} guest's slowest tests", timing_kit.slowest_section(done.stdout)
    )
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(
        f"NFS v{version}: guest up in {booted - started:.0f}s, probe {probe_s:.1f}s "
        f"(limits x{slowdown:.1f}), batch + down in {total - (booted - started):.0f}s: "
        f"{summary[0]}"
    )
    assert done.returncode == 0, (
        f"pytest in the NFS v{version} guest failed:\n{done.stdout[-12000:]}"
    )


@pytest.mark.skipif(
    not nfs_kit.asked_for(), reason=f"{nfs_kit.OPT_IN_ENV}=0: the NFS batch is skipped"
)
@pytest.mark.skipif(nfs_kit.in_guest(), reason="this test boots the guest; inside it, no")
@pytest.mark.parametrize("version", list(CI_FILES))
def test_suite_on_nfs(version):
    _batch(version, CI_FILES[version], {nfs_kit.NO_VLLM_ENV: "1"}, QUIET_LIMIT_S)


@pytest.mark.skipif(
    os.environ.get(VLLM_ENV) != "1",
    reason=f"the vLLM stack on NFS is opt-in ({VLLM_ENV}=1): ~6 min of emulated vLLM import",
)
@pytest.mark.skipif(nfs_kit.in_guest(), reason="this test boots the guest; inside it, no")
@pytest.mark.parametrize("version", list(CI_FILES))
def test_vllm_stack_on_nfs(version):
    _batch(version, VLLM_FILES, {}, VLLM_QUIET_LIMIT_S)
