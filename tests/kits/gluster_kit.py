"""A real shared filesystem for the tests: a one-brick GlusterFS volume on
loopback, mounted twice through FUSE (two independent clients, like two vLLM
replicas on two nodes sharing one volume). The bring-up itself is the
maintained tool tools/gluster/loopback.py (shared with the benchmarks).

The session fixture ``gluster`` installs Debian's glusterfs-server and
glusterfs-client when ``glusterd`` is missing, starts glusterd if it is not
running, creates and starts a volume with a unique name, mounts it on two mount
points and yields a ``GlusterVolume`` (``.volume``, ``.mount_a``, ``.mount_b``).
At teardown it unmounts both, stops and deletes the volume and removes the brick.

A machine that cannot provide it (not root, no /dev/fuse, no apt-get, install or
start-up failure) skips the tests that need it -- unless LLMKV_FS_REQUIRE_GLUSTER=1
(CI sets it), which turns every such skip into a failure.

Names: every session's volume, brick and mount points are ``llmkvtest_<pid>_<hex>``
under /var/tmp. At session start, volumes, mounts and brick directories of that
pattern whose owning process is gone (a crashed run) are removed; those of live
sessions (another pytest on the same machine) are left alone.

Waiting is polling with a deadline, never a bare sleep.
"""

from __future__ import annotations

import pytest

from tests.kits import service_kit, timing_kit
from tools.gluster import glusterd, loopback

REQUIRE_ENV = "LLMKV_FS_REQUIRE_GLUSTER"
PREFIX = "llmkvtest"


def _unavailable(reason: str):
    service_kit.unavailable("GlusterFS", REQUIRE_ENV, reason)


@pytest.fixture(scope="session")
def gluster():
    """One GlusterFS volume for the whole session, mounted twice (two clients)."""
    try:
        with timing_kit.timed("GlusterFS volume up"):
            vol = loopback.bring_up(PREFIX)
    except (glusterd.Unavailable, OSError) as exc:
        _unavailable(str(exc))
    try:
        yield vol
    finally:
        loopback.down(vol)
