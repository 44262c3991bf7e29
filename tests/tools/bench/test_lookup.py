"""The latency benchmarks' own logic (issue 26): tools/bench/lookup.py (the
existence check of one long prompt, ours against vLLM's built-in lookups and
plain stat), tools/bench/latency.py (the matrix over server-side delays) and
tools/gluster/ (the loopback GlusterFS volume, loopback.py, and its delay,
delay.py).

Fast lane: the command lines, the round-trip arithmetic, the summaries and
tables, the brick's fop counts parsed, the delay's volume options, the
owner rules of stale volumes; and a small real run of the lookup benchmark on
tmpfs in which every hit must answer hit and every miss miss -- ours always,
the built-in's own lookup path where vLLM's payload is there (``.bench_payload``
or ``$LLMKV_BENCH_PAYLOAD``, made by tools/bench/builtin_payload.py; a
subprocess, as the payload brings its own ``vllm`` package). Integration
lane: a GlusterFS volume brought up by the tool, a stat timed without and
with a 2 ms delay. No timing is asserted in the fast lane."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.kits import REPO, service_kit
from tools.bench import latency, latency_report, lookup, lookup_cli, lookup_files, lookup_report
from tools.gluster import delay, glusterd, loopback

PAYLOAD = os.environ.get("LLMKV_BENCH_PAYLOAD") or str(REPO / ".bench_payload")


@pytest.fixture
def shm_dir():
    path = f"/dev/shm/llmkv_lookup_test_{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the lookup benchmark's command line and arithmetic ------------------------------------


def test_lookup_defaults_and_checks_of_the_command_line():
    args = lookup_cli.parse_args(["--dir", "/x"])
    assert args.keys == 2048
    assert args.threads == [4, 8, 16, 32, 64]
    assert args.check_dir == "/x"  # checked through the writing client unless told
    assert args.phase == "all" and args.fanout == "full"
    assert lookup_cli.parse_args(["--dir", "/x", "--keys", "8"]).single_keys == 8  # clamped
    assert lookup_cli.parse_args(["--dir", "/a", "--check-dir", "/b"]).check_dir == "/b"
    assert lookup_cli.parse_args(["--dir", "/x", "--threads", "1,16"]).threads == [1, 16]
    for bad in (["--threads", "0,4"], ["--threads", ","], ["--keys", "0"]):
        with pytest.raises(SystemExit):
            lookup_cli.parse_args(["--dir", "/x", *bad])


def test_round_trips_are_the_added_time_over_the_delay():
    # 8 ms a check at 2 ms a fop, 1.5 ms at no delay: 3.25 round trips.
    assert lookup_report.round_trips(8e-3, 2000, 1.5e-3) == pytest.approx(3.25)
    assert lookup_report.round_trips(8e-3, 2000) == pytest.approx(4.0)  # nothing subtracted
    assert lookup_report.round_trips(8e-3, 0, 1e-3) is None  # no delay: no round trips to count
    assert lookup_report.round_trips(2.4e-3, 500, 0.4e-3) == pytest.approx(4.0)


def test_single_rows_subtract_the_same_tool_and_case_at_delay_zero():
    single = {"ours": {"hit": {"per_check_s": 7e-3, "fops_per_check": {"LOOKUP": 3.0}}}}
    base = {"ours": {"hit": {"per_check_s": 1e-3}}}
    rows = lookup_report.single_rows(single, 2000, base)
    assert rows["ours"]["hit"]["round_trips"] == pytest.approx(3.0)
    assert rows["ours"]["hit"]["base_per_check_s"] == 1e-3
    assert rows["ours"]["hit"]["fops_per_check"] == {"LOOKUP": 3.0}
    assert lookup_report.single_rows(single, 2000, None)["ours"]["hit"]["round_trips"] == 3.5


def _runs():
    def case(*seconds, wrong=0, expired=0):
        return [
            {"s": s, "steps": 3, "sched_cpu_s": 1.5e-3, "wrong": wrong, "expired": expired}
            for s in seconds
        ]

    return {
        "ours/4": {"hit": case(1.0, 3.0, 2.0), "miss": case(1.0, 1.0, 1.0, wrong=2, expired=2)},
        "builtin": {"hit": case(8.0, 8.0, 8.0), "miss": case(4.0, 4.0, 4.0)},
        "plain stat/1": {"hit": case(9.0), "miss": case(5.0)},
    }


def test_summary_takes_medians_and_sums_wrong_verdicts():
    summary = lookup_report.summarize(_runs())
    assert summary["ours/4"]["hit"]["s"] == 2.0
    assert summary["ours/4"]["hit"]["samples"] == [1.0, 3.0, 2.0]
    assert summary["ours/4"]["miss"]["wrong"] == 6
    assert summary["ours/4"]["miss"]["expired"] == 6
    assert summary["plain stat/1"]["miss"]["s"] == 5.0
    speed = lookup_report.speedups(summary, [4, 16])
    assert speed == {"4": {"hit": 4.0, "miss": 4.0}}  # built-in time over ours; no ours/16
    assert lookup_report.speedups({"ours/4": summary["ours/4"]}, [4]) == {}  # no built-in


def test_the_table_shows_every_configuration_and_the_round_trips():
    summary = lookup_report.summarize(_runs())
    single = {"ours": {"hit": {"per_check_s": 7e-3, "fops_per_check": {"LOOKUP": 3.02}}}}
    single["ours"]["miss"] = {"per_check_s": 3e-3, "fops_per_check": None}
    result = {
        "args": {
            "keys": 2048,
            "delay_us": 2000.0,
            "rounds": 3,
            "dir": "/a",
            "check_dir": "/b",
            "single_keys": 256,
        },
        "summary": summary,
        "speedups": lookup_report.speedups(summary, [4]),
        "single": lookup_report.single_rows(single, 2000, None),
    }
    text = lookup_report.render(result)
    assert "one prompt of 2048 blocks, delay 2000 µs" in text
    assert "| ours/4 | 2.000 | 3 | 1.5 | 1.000 | 3 | 1.5 | 6 | 6 |" in text
    assert "| builtin | 8.000 | 3 | 1.5 | 4.000 | 3 | 1.5 | 0 | 0 |" in text
    assert "| plain stat/1 | 9.000 | 3 | 1.5 | 5.000 | 3 | 1.5 | 0 | 0 |" in text
    assert "a scheduler step every 1 ms" in text
    assert "| 4 | 4.00 | 4.00 |" in text
    assert "| ours | 7.000 | 3.50 | LOOKUP 3.02 | 3.000 | 1.50 | - |" in text


def test_steps_are_counted_until_every_key_has_a_verdict():
    answered_after = {b"a": 1, b"b": 3}
    ends = []

    def ask(key):
        return True if len(ends) >= answered_after[key] else None

    got = lookup.step_until_known(ask, lambda: ends.append(1), [b"a", b"b"], 0)
    assert got.steps == 4 and len(ends) == 3  # the step that saw the last verdict ends no step
    assert got.verdicts == [True, True] and got.s >= 0 and got.sched_cpu_s >= 0


def test_steps_are_counted_until_the_prefix_is_known_as_vllm_scans_it():
    """A RETRY does not stop a step's scan, a miss does: the prefix is known
    once every key up to the first miss is; the keys after it are then
    stepped on, untimed, until their verdicts can be checked too."""
    answered_after = {b"a": 1, b"b": 2, b"c": 4}
    ends, asked = [], []

    def ask(key):
        asked.append(key)
        if len(ends) < answered_after[key]:
            return None
        return key != b"b"

    got = lookup.step_until_known(ask, lambda: ends.append(1), [b"a", b"b", b"c"], 0)
    assert got.steps == 3  # b's miss is seen by the third scan, which does not ask c
    assert asked[6:8] == [b"a", b"b"] and asked[8] == b"a"  # then the untimed full scans
    assert got.verdicts == [True, False, True] and len(ends) == 4
    assert lookup.verdicts_wrong([True, None, False], True) == 2
    assert lookup.verdicts_wrong([False, False], False) == 0


def test_plain_stat_tells_regular_files_from_missing_names(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    paths = [str(tmp_path / n) for n in ("f", "d", "missing")]
    for threads in (1, 3):
        assert lookup.plain_stat(paths, threads)[1] == [True, False, False]


def test_fanout_names_every_first_level_directory_beside_a_block():
    dirs = lookup_files.fanout_dirs("/r/rank/abc/de_g0/abcde.bin")
    assert len(dirs) == 4096 and dirs[0] == "/r/rank/000" and dirs[-1] == "/r/rank/fff"
    assert "/r/rank/abc" in dirs


# -- a real run on tmpfs ------------------------------------------------------------------------


def _small_argv(directory, out, *extra):
    return [
        "--dir",
        directory,
        "--keys",
        "48",
        "--threads",
        "1,4",
        "--rounds",
        "1",
        "--settle-s",
        "0",
        "--single-keys",
        "8",
        "--json",
        str(out),
        *extra,
    ]


def _assert_every_verdict_right(result, labels):
    assert set(labels) <= set(result["summary"])
    for label in labels:
        for case in ("hit", "miss"):
            got = result["summary"][label][case]
            assert got["wrong"] == 0, (label, case, got)
            assert got["expired"] == 0, (label, case, got)
            assert got["s"] is not None


def test_a_small_run_answers_every_hit_hit_and_every_miss_miss(tmp_path, shm_dir):
    out = tmp_path / "lookup.json"
    assert lookup.main(_small_argv(shm_dir, out, "--fanout", "prompt")) == 0
    result = json.loads(out.read_text())
    _assert_every_verdict_right(result, ["ours/1", "ours/4", "plain stat/1", "plain stat/4"])
    for label in ("ours/1", "ours/4"):
        assert result["summary"][label]["hit"]["steps"] >= 2  # RETRY first, as vLLM sees it
    assert set(result["single"]) == {"ours", "plain stat"}
    assert result["single"]["ours"]["hit"]["round_trips"] is None  # no delay given
    assert not os.listdir(shm_dir)  # --phase all removes what it wrote


def test_prepare_then_measure_keeps_the_files_between_the_phases(tmp_path, shm_dir):
    out = tmp_path / "lookup.json"
    assert lookup.main(_small_argv(shm_dir, out, "--phase", "prepare")) == 0
    assert os.path.exists(os.path.join(shm_dir, lookup_files.SUBDIR, lookup_files.PREPARED))
    assert lookup.main(_small_argv(shm_dir, out, "--phase", "measure")) == 0
    _assert_every_verdict_right(json.loads(out.read_text()), ["ours/4"])
    with pytest.raises(SystemExit, match="prepared with"):
        lookup.main(_small_argv(shm_dir, out, "--phase", "measure", "--block-kib", "64"))
    assert os.path.exists(os.path.join(shm_dir, lookup_files.SUBDIR))  # measure keeps them


@pytest.mark.skipif(
    not os.path.exists(os.path.join(PAYLOAD, "MANIFEST.json")),
    reason="no vLLM built-in payload (python -m tools.bench.builtin_payload makes .bench_payload)",
)
@pytest.mark.timeout(900)  # above its run's own 600 s
def test_the_builtin_lookup_path_answers_every_hit_hit_and_every_miss_miss(tmp_path, shm_dir):
    out = tmp_path / "lookup.json"
    cmd = [sys.executable, "-m", "tools.bench.lookup", *_small_argv(shm_dir, out)]
    proc = subprocess.run(
        [*cmd, "--builtin", PAYLOAD], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    _assert_every_verdict_right(result, ["ours/1", "ours/4", "builtin"])
    assert result["builtin_lookup"] == "fs_io_C.batch_lookup"
    assert result["speedups"]["4"]["hit"] > 0
    assert any(tool.startswith("builtin") for tool in result["single"])


# -- the matrix runner -------------------------------------------------------------------------


def _engine(case, ours, builtin):
    def m(store, load):
        return {"store_gbps": store, "load_gbps": load}

    return {
        "case": {"name": case},
        "configs": {"threads/numa=off": m(*ours), "builtin/16+16": m(*builtin)},
    }


def _latency_result():
    summary = lookup_report.summarize(_runs())
    summary["ours/16"] = summary["ours/4"]
    single = {
        "ours": {
            "hit": {"per_check_s": 7e-3, "round_trips": 3.0, "fops_per_check": {"LOOKUP": 3.0}},
            "miss": {"per_check_s": 3e-3, "round_trips": 1.0, "fops_per_check": {"STATFS": 0.01}},
        }
    }
    args = latency.parse_args(["--out", "/o", "--builtin", "/p", "--lookup-threads", "4,16"])
    return {
        "args": vars(args),
        "machine": {
            "node": "n",
            "cpus": 2,
            "cpu_model": "cpu",
            "ram_gib": 1,
            "kernel": "k",
            "python": "3",
        },
        "load_before": [1.0, 2.0, 3.0],
        "load_after": [0.5, 0.5, 0.5],
        "headline_threads": 16,
        "gluster_version": "10.3",
        "delays": [
            {
                "us": 2000,
                "stat_p50_s": 2.4e-3,
                "stat_fops_per_call": {"LOOKUP": 1.0},
                "restart_s": 4.0,
                "lookup": {"summary": summary, "single": single},
                "engine": {
                    "rows": [
                        _engine("long", (0.2, 0.4), (0.1, 0.1)),
                        _engine("many", (1, 1), (1, 2)),
                    ]
                },
            }
        ],
    }


def test_the_matrix_table_has_ratios_of_ours_over_the_builtin():
    text = latency_report.render(_latency_result())
    assert "| 2000 | 2.40 | LOOKUP 1.00 | 4.0 |" in text
    assert "lookup_threads=16" in text
    assert "| 2000 | lookup of 2048 keys, all hits, s | 2.000 | 8.000 | 4.00 |" in text
    assert "all misses, s | 1.000 (6 wrong, 6 past the deadline) | 4.000 | 4.00 |" in text
    assert "| 2000 | one job of 256 × 2 MiB, store GB/s | 0.200 | 0.100 | 2.00 |" in text
    assert "| 2000 | one job of 256 × 2 MiB, load GB/s | 0.400 | 0.100 | 4.00 |" in text
    assert "| 2000 | 256 × 2 MiB in jobs of 8, load GB/s | 1.000 | 2.000 | 0.50 |" in text
    assert "| 2000 | hit | 2.000 (4.0×) | 2.000 (4.0×) | 8.000 | 9.000 | - |" in text
    assert "| 2000 | ours | 7.000 | 3.00 | LOOKUP 3.00 | 3.000 | 1.00 | - |" in text
    assert "Load average before 1.00 / 2.00 / 3.00, after 0.50 / 0.50 / 0.50" in text


def test_the_matrix_cells_of_missing_parts_are_empty():
    assert latency_report.engine_cells(None, "long") == {}
    assert latency_report.lookup_cells(None, 4) == {}
    cells = latency_report.engine_cells({"rows": [_engine("long", (1, 1), (2, 4))]}, "long")
    assert cells["load"] == {"ours": 1, "builtin": 4, "ratio": 0.25}
    assert latency_report.engine_cells({"rows": [_engine("long", (1, 1), (2, 4))]}, "many") == {}


def test_the_matrix_command_line():
    args = latency.parse_args(["--out", "o", "--builtin", "p"])
    assert args.delays_us == [0, 500, 2000] and args.long_blocks == 256
    assert args.server_threads == 64 and args.lookup_keys == 2048
    with pytest.raises(SystemExit):
        latency.parse_args(["--out", "o"])  # the built-in is the point
    with pytest.raises(SystemExit):  # round trips are net of delay 0, measured first
        latency.parse_args(["--out", "o", "--builtin", "p", "--delays-us", "2000"])
    assert latency.parse_args(["--render", "d"]).render == "d"
    assert latency_report.default_lookup_threads() >= 1


def test_render_only_rewrites_the_tables_of_a_saved_run(tmp_path, capsys):
    (tmp_path / "latency.json").write_text(json.dumps(_latency_result()))
    assert latency.main(["--render", str(tmp_path)]) == 0
    assert "## Latency matrix" in capsys.readouterr().out


# -- the loopback volume's pure parts ----------------------------------------------------------

_PROFILE = """Brick: vm:/var/tmp/x/brick
--------------------------------------------------
Interval 3 Stats:
 %-latency   Avg-latency   Min-Latency   Max-Latency   No. of calls         Fop
 ---------   -----------   -----------   -----------   ------------        ----
      0.00       0.00 us       0.00 us       0.00 us              4     RELEASE
     20.00 2165328.46 ns 2125689.00 ns 2499138.00 ns            201      LOOKUP
     80.00 2205918.59 ns 2143292.00 ns 2295537.00 ns             17        READ

    Duration: 3 seconds
   Data Read: 0 bytes
Data Written: 0 bytes
"""


def test_profile_counts_are_parsed_per_fop():
    assert delay.parse_profile(_PROFILE) == {"RELEASE": 4, "LOOKUP": 201, "READ": 17}
    assert delay.parse_profile("Brick: x\n Duration: 0 seconds\n") == {}


def test_delay_settings_wrap_posix_and_name_upper_case_fops():
    assert delay.delay_settings(0) == []
    got = dict(delay.delay_settings(2000, ["lookup", "READ"]))
    assert got == {
        "debug.delay-gen": "posix",
        "delay-gen.delay-duration": "2000",
        "delay-gen.delay-percentage": "100",
        "delay-gen.enable": "LOOKUP,READ",
    }
    assert "LOOKUP" in delay.DELAY_FOPS and "WRITE" in delay.DELAY_FOPS
    with pytest.raises(ValueError):
        delay.delay_settings(-1)


def test_stale_volumes_are_those_whose_owner_is_gone(tmp_path):
    me = os.getpid()
    ticks = loopback.process_start_ticks(me)
    dead = 2**22 + 7  # above pid_max's default: no such process
    names = {
        f"llmkvx_{me}_aa": f"{me} {ticks}",  # this process: alive
        f"llmkvx_{me}_bb": f"{me} 1",  # this pid, another start time: reused pid, gone
        f"llmkvx_{dead}_cc": f"{dead} 5",  # dead
        f"llmkvx_{dead}_dd": loopback.MANUAL_OWNER,  # made by the command line: kept
        f"other_{dead}_ee": f"{dead} 5",  # not this prefix
    }
    for name, owner in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner").write_text(owner + "\n")
    stale = loopback.orphans(sorted(names), "llmkvx", str(tmp_path))
    # In the order given: names sorted as text, so where this process's pid
    # falls beside ``dead`` depends on its digits (a busy machine hands out
    # high pids: 5xxxx sorts after 4194311 and failed an exact list once).
    assert sorted(stale) == sorted([f"llmkvx_{me}_bb", f"llmkvx_{dead}_cc"])


def test_a_volume_found_by_name_has_the_conventional_directories():
    vol = loopback.find("llmkvbench_1_ab", "/base")
    assert (vol.brick, vol.mount_a, vol.mount_b) == (
        "/base/llmkvbench_1_ab/brick",
        "/base/llmkvbench_1_ab/a",
        "/base/llmkvbench_1_ab/b",
    )
    assert vol.session_dir == "/base/llmkvbench_1_ab"


# -- integration: the tool's volume, with a delay ------------------------------------------------


@pytest.mark.integration
def test_a_server_side_delay_slows_a_stat_from_the_second_mount():
    from tests.kits import gluster_kit

    try:
        vol = loopback.bring_up(gluster_kit.PREFIX)
    except (glusterd.Unavailable, OSError) as exc:
        service_kit.unavailable("GlusterFS", gluster_kit.REQUIRE_ENV, str(exc))
    try:
        probe = delay.probe_dir(vol)
        delay.set_delay(vol, 0)
        without = delay.negative_stat_p50(probe, 30)
        delay.set_delay(vol, 2000, server_threads=32)  # fails itself if a mount stays away
        with_delay = delay.negative_stat_p50(probe, 30)
        options = delay.volume_options(vol, ["delay-gen.delay-duration"])
        assert options["delay-gen.delay-duration"] == "2000"
        assert with_delay > without
        assert with_delay >= 1.8e-3, (without, with_delay)  # a missing name: one LOOKUP
        delay.set_delay(vol, 0)
        assert delay.negative_stat_p50(probe, 30) < with_delay
        # Both clients answer after the restarts: a file written on A is read on B.
        Path(vol.mount_a, "x").write_bytes(b"kv")
        assert Path(vol.mount_b, "x").read_bytes() == b"kv"
    finally:
        loopback.down(vol)
    assert not os.path.exists(vol.session_dir)
