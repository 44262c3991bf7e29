"""What the volume tools share from ops/scan.py: ``--threads``, one option
with one meaning in gc, stats, verify and doctor (how many directories are
listed, and files read, at once on each root), and ``threads_for``."""

from __future__ import annotations

import pytest

from llmkv_fs import cli
from llmkv_fs.ops.scan import default_threads, threads_for

TOOLS = ("gc", "stats", "verify", "doctor")


@pytest.mark.parametrize("tool", TOOLS)
def test_threads_takes_a_count_or_auto_and_defaults_to_auto(tool, tmp_path):
    parser = cli.build_parser()
    root = str(tmp_path)
    assert parser.parse_args([tool, root]).threads == "auto"
    assert parser.parse_args([tool, root, "--threads", "auto"]).threads == "auto"
    assert parser.parse_args([tool, root, "--threads", "3"]).threads == 3
    assert parser.parse_args([tool, root, "--threads", "256"]).threads == 256


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("bad", ["0", "-1", "257", "many", "1.5"])
def test_a_bad_threads_value_names_the_option_and_what_is_valid(tool, bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args([tool, str(tmp_path), "--threads", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f'argument --threads: {bad!r} is not "auto" or an integer in [1, 256]' in err


@pytest.mark.parametrize("tool", TOOLS)
def test_threads_has_one_help_text(tool, capsys):
    with pytest.raises(SystemExit):
        cli.main([tool, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "directories listed (and files read) at once on each root, 1 to 256; default auto: "
        "16 on a network or FUSE filesystem (NFS, CephFS, Lustre, GlusterFS); on a local "
        "one 1, or 8 for verify, which reads every file"
    ) in help_text


def test_threads_for_a_root(tmp_path):
    root = str(tmp_path)
    assert threads_for(root, 5) == 5
    assert threads_for(root, "auto") == threads_for(root, None) == default_threads(root) == 1
    assert threads_for(root, "auto", reads=True) == 8  # verify reads outside the GIL


@pytest.mark.parametrize(
    ("argv", "option", "valid"),
    [
        (["doctor", "ROOT", "--idle-days", "-1"], "--idle-days", "days, a number in [0, 36500]"),
        (["events", "snapshot", "ROOT", "--rate", "0"], "--rate", "[1, 10,000,000]"),
    ],
)
def test_other_numbers_are_checked_the_same_way(argv, option, valid, tmp_path, capsys):
    argv = [str(tmp_path) if a == "ROOT" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and valid in err
