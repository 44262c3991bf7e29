"""tools/bench/gc_events.py, the gc events cost benchmark, on a small volume:
every block is evicted with events off and on, every block is published
with events on and the router process receives batches -- the figures it
prints in docs are of real sends. (How many arrive is not asserted: a PUB
socket drops what it sends before the router's subscription reaches it.)
No timing is asserted."""

import json
import subprocess
import sys

from tests.kits import REPO


def test_gc_events_bench_evicts_all_and_the_router_hears_every_block(tmp_path):
    blocks = 300
    command = ["-m", "tools.bench.gc_events", "--blocks", str(blocks), "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, *command, "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    off, on = [json.loads(line) for line in done.stdout.splitlines()]
    assert (off["events"], on["events"]) == (False, True)
    assert off["evicted"] == on["evicted"] == blocks
    assert off["batches_received"] == 0
    assert on["sent"]["published"] == blocks and on["sent"].get("dropped", 0) == 0
    assert on["batches_received"] >= 1
    assert list(tmp_path.iterdir()) == []  # each volume removed after its run
