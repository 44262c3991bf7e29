"""The timing kit's reading of another pytest run's ``--durations`` section."""

from tests.kits import timing_kit

OUTPUT = """\
tests/a.py::test_x PASSED
============================= slowest 3 durations ==============================
12.31s call     tests/a.py::test_x[nfs-threads]
3.02s setup    tests/b.py::test_y[nfs]

(1 durations < 0.005s hidden.  Use -vv to show these durations.)
=========================== 2 passed in 16.10s ===========================
"""


def test_slowest_section_is_the_durations_lines_only():
    assert timing_kit.slowest_section(OUTPUT) == [
        "12.31s call     tests/a.py::test_x[nfs-threads]",
        "3.02s setup    tests/b.py::test_y[nfs]",
    ]


def test_no_durations_section_is_no_lines():
    assert timing_kit.slowest_section("2 passed in 1.0s\n") == []


def test_a_detail_follows_the_fixtures_in_the_summary(monkeypatch):
    monkeypatch.setattr(timing_kit, "SLOW", {"guest boot": [20.4]})
    monkeypatch.setattr(timing_kit, "DETAILS", {})
    timing_kit.detail("guest's slowest tests", ["12.31s call t"])
    assert timing_kit.summary() == [
        "guest boot: 1x, 20s (20)",
        "guest's slowest tests:",
        "    12.31s call t",
    ]
