"""The housekeeping thread at shutdown, through the engine in both I/O
modes: a volume whose every call hangs never holds ``shutdown``. The hang
is in-process and held still: each call the housekeeping makes on the
volume (the root check, the lease's write, refresh, read and removal)
waits on an Event the test holds, as a stalled mount would."""

from __future__ import annotations

import logging
import os
import threading

from llmkv_fs.engine.upkeep import housekeeping as housekeeping_module
from llmkv_fs.volume.leases import STALE_AFTER_INTERVALS, lease_for
from llmkv_fs.volume.pinned_root import PinnedRoot
from tests.kits.engine_kit import DEADLINE_S, wait_until

LEASE_INTERVAL_S = 30.0
HANG_LIMIT_S = 120.0  # a hung call gives up only after the test has failed


def test_shutdown_returns_while_every_volume_call_hangs(engines, tmp_path, monkeypatch, caplog):
    # The bound shutdown waits is the lookup deadline, min(job_timeout_s, 5 s):
    # set small so the test does not wait 5 s; nothing below measures it.
    engine, _layout, _primary = engines(str(tmp_path / "vol"), job_timeout_s=0.5)
    keeper = engine.roots[0].housekeeping
    engine.set_lease(lease_for("sha256", "f" * 16, LEASE_INTERVAL_S, "", ""))
    wait_until(lambda: keeper.lease_path and os.path.exists(keeper.lease_path), "the lease")
    lease_path = keeper.lease_path

    answers = threading.Event()  # set: the volume answers again
    held: list[str] = []  # the calls that reached the stalled volume

    def hangs(call):
        def stalled(*args, **kwargs):
            held.append(call.__name__)
            answers.wait(HANG_LIMIT_S)
            return call(*args, **kwargs)

        return stalled

    monkeypatch.setattr(PinnedRoot, "is_current", hangs(PinnedRoot.is_current))
    for name in ("write_lease", "refresh_lease", "read_leases", "remove_lease"):
        monkeypatch.setattr(housekeeping_module, name, hangs(getattr(housekeeping_module, name)))

    returned = threading.Event()
    try:
        # The housekeeping thread's next round is inside the volume.
        wait_until(lambda: held, "the housekeeping thread inside a stalled call")
        caplog.set_level(logging.WARNING, logger="vllm.llmkv_fs.housekeeping")

        def shut_down():
            engine.shutdown()
            returned.set()

        threading.Thread(target=shut_down, name="vllm_shutdown", daemon=True).start()
        assert returned.wait(DEADLINE_S), "shutdown waited for the stalled volume"
        assert not answers.is_set()
        # Nothing was removed, and the log says what was left and for how long.
        assert os.path.exists(lease_path)
        stale_s = f"{STALE_AFTER_INTERVALS * LEASE_INTERVAL_S:.0f}s"
        assert f"lease file {lease_path} (gc takes it for dead once it is {stale_s} old" in (
            caplog.text
        )
    finally:
        answers.set()
    # Once the volume answers, the thread left behind finishes its way out.
    wait_until(lambda: not os.path.exists(lease_path), "the lease removed when the volume answers")
