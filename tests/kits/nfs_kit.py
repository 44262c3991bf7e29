"""Real Linux NFS for the tests: knfsd and two kernel NFS clients, in a guest.

Most shared volumes replicas really use are NFS, but the machines the suite
runs on may have no NFS client or server in their kernel (no modules at all
here). ``tools/nfs/loopback.sh`` boots Debian's stock kernel (fetched with
``apt-get download``, unpacked, never installed) under QEMU software
emulation with the host's ``/`` shared read-only over 9p and ``/tmp`` plus
the checkout read-write, so the host's venv runs unchanged inside. In the
guest knfsd exports a tmpfs, mounted twice: client A on 127.0.0.1 with
``nosharecache``, client B in its own network namespace with its own NFSv4
client id (two nodes). The mount points exist only inside the guest.

Everything in the guest runs 5-10x slower, so the suite boots ONE guest per
NFS version and runs a batch of test files inside it: a pytest session
re-invoked in the guest with the two mounts in ``LLMKV_FS_NFS_A`` /
``LLMKV_FS_NFS_B`` (tests/conftest.py then gives ``volume`` and
``shared_volume`` an "nfs" param). tests/system/test_nfs.py drives that.

The batch runs unless LLMKV_FS_NFS=0 (``asked_for``); where the machine
cannot provide it (not root, no apt-get, install or boot failure) it skips,
or fails with LLMKV_FS_REQUIRE_NFS=1, which CI sets.

Names: a guest is ``llmkv<pid>v<version>``; its state lives under
/run/llmkv-fs-nfs/<name>. Guests whose pytest process is gone (a killed run)
are shut down at the next start; waiting is polling with deadlines (in the
script, and the subprocess timeouts here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import time

from tests.kits import REPO, service_kit

OPT_IN_ENV = "LLMKV_FS_NFS"
REQUIRE_ENV = "LLMKV_FS_REQUIRE_NFS"
MOUNT_A_ENV = "LLMKV_FS_NFS_A"
MOUNT_B_ENV = "LLMKV_FS_NFS_B"
VERSION_ENV = "LLMKV_FS_NFS_VERS"
NO_VLLM_ENV = "LLMKV_FS_NO_VLLM"  # set in the guest's CI batch (tests/conftest.py)
SCRIPT = os.path.join(str(REPO), "tools", "nfs", "loopback.sh")
STATE_ROOT = "/run/llmkv-fs-nfs"
# First start installs qemu + nfs userspace and fetches a 70 MB kernel package.
UP_TIMEOUT_S = 900.0
BOOT_TIMEOUT_S = 600.0  # of that, the boot alone (the script's default is 300 s)
DOWN_TIMEOUT_S = 90.0

_NAME_RE = re.compile(r"^llmkv(\d+)v[0-9]+$")


class NfsUnavailable(service_kit.ServiceUnavailable):
    """This machine cannot provide the NFS guest (the reason says why)."""


@dataclasses.dataclass
class NfsGuest(service_kit.TwoClients):
    name: str
    version: str

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "NFS_VERS": self.version,
            "NFS_LOOPBACK_STATE": STATE_ROOT,
            # The script's own wait for the guest to boot: a hang bound, as
            # long as ours (a boot took 78 s at load 4-8 on 2 cores).
            "NFS_LOOPBACK_BOOT_TIMEOUT": str(int(BOOT_TIMEOUT_S)),
        }

    def up(self) -> None:
        start = time.monotonic()
        done = _run([SCRIPT, "up", self.name], UP_TIMEOUT_S, self._env())
        if done.returncode != 0:
            raise NfsUnavailable(
                f"guest {self.name} did not come up: {done.stderr.strip()[-3000:]}"
            )
        fields = done.stdout.split()
        if len(fields) != 2:
            raise NfsUnavailable(f"unexpected `up` output: {done.stdout!r}")
        self.mount_a, self.mount_b = fields
        self.startup_s = time.monotonic() - start

    def exec(
        self, argv: list[str], env: dict[str, str], quiet_limit_s: float, total_limit_s: float
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in the guest (same cwd, ``env`` exported); stdout and
        stderr merged, streamed. Killed -- the host side only: ``down`` stops
        the guest and what ran in it -- when it printed nothing for
        ``quiet_limit_s`` or ran ``total_limit_s`` (service_kit.run_watched:
        rc 124, the output so far and what it printed last)."""
        return service_kit.run_watched(
            [SCRIPT, "exec", self.name, "--", *argv],
            {**self._env(), **env},
            quiet_limit_s=quiet_limit_s,
            total_limit_s=total_limit_s,
        )

    def down(self) -> None:
        _run([SCRIPT, "down", self.name], DOWN_TIMEOUT_S, self._env())


def _run(argv: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    return service_kit.run(argv, timeout, env, NfsUnavailable)


def reap_stale() -> list[str]:
    """Shut down guests whose pytest process is gone; returns their names."""
    try:
        names = os.listdir(STATE_ROOT)
    except FileNotFoundError:
        return []
    reaped = service_kit.orphans(names, _NAME_RE)
    for name in reaped:
        with contextlib.suppress(NfsUnavailable):
            NfsGuest(name, "4.2").down()
    return reaped


def preflight() -> None:
    if os.geteuid() != 0:
        raise NfsUnavailable("needs root (qemu's 9p passthrough, apt-get)")
    if not shutil.which("qemu-system-x86_64") and not shutil.which("apt-get"):
        raise NfsUnavailable("no qemu-system-x86_64 and no apt-get to install it")
    if not os.access(SCRIPT, os.X_OK):
        raise NfsUnavailable(f"{SCRIPT} is missing or not executable")


def unavailable(reason: str):
    service_kit.unavailable("NFS", REQUIRE_ENV, reason)


def asked_for() -> bool:
    """Whether this run wants the NFS batch: yes unless OPT_IN_ENV=0 (and
    always with REQUIRE_ENV=1)."""
    return os.environ.get(OPT_IN_ENV) != "0" or os.environ.get(REQUIRE_ENV) == "1"


def in_guest() -> bool:
    """Whether this process runs inside the guest with the two mounts."""
    return bool(os.environ.get(MOUNT_A_ENV) and os.environ.get(MOUNT_B_ENV))


@contextlib.contextmanager
def guest(version: str):
    """Boot a guest serving NFS ``version`` (4.2, 4.1, 4.0 or 3); yields the
    NfsGuest, always shut down on exit. Skips (or fails, see REQUIRE_ENV)
    when this machine cannot provide it."""
    vm = NfsGuest(f"llmkv{os.getpid()}v{version.replace('.', '')}", version)
    try:
        preflight()
        reap_stale()
        vm.up()
    except (NfsUnavailable, OSError) as exc:
        with contextlib.suppress(NfsUnavailable, OSError):
            vm.down()
        unavailable(str(exc))
    try:
        yield vm
    finally:
        vm.down()
