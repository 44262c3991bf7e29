"""tools/bench/doctor.py: doctor beside stats on one volume, on a small one."""

import json
import subprocess
import sys

from tests.kits import REPO


def test_the_benchmark_measures_stats_and_doctor_on_one_volume(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench.doctor", "--blocks", "40", "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    runs, summary = lines[:-1], lines[-1]
    assert [run["case"] for run in runs] == ["stats", "doctor", "doctor --walk"]
    assert runs[0]["rc"] == 0
    assert {run["rc"] for run in runs[1:]} == {1}  # two block sizes: they cannot share
    assert summary["blocks"] == 40 and set(summary["summary"]) == {
        "stats",
        "doctor",
        "doctor --walk",
    }
