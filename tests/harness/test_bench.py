"""``llmkv-fs bench``'s and ``demo``'s numbers are checked as they are
parsed, the way every option is (``checks.option``): a tier setting's option
by that setting's own check, naming the option and what is valid."""

from __future__ import annotations

import pytest

from llmkv_fs import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "--dir", "/x", "--threads", "0"],
            "argument --threads: '0' is not an integer in [1, 512]",
        ),
        (
            ["bench", "--dir", "/x", "--jobs", "0"],
            "argument --jobs: '0' is not an integer in [1, 1048576]",
        ),
        (
            ["bench", "--dir", "/x", "--io-workers", "many"],
            "argument --io-workers: 'many' is not \"auto\" or an integer in [0, 256]",
        ),
        (["demo", "--docs", "0"], "argument --docs: '0' is not an integer in [1, 1048576]"),
        (
            ["demo", "--suffix-chunks", "-1"],
            "argument --suffix-chunks: '-1' is not an integer in [0, 1048576]",
        ),
        (["demo", "--threads", "513"], "argument --threads: '513' is not an integer in [1, 512]"),
    ],
)
def test_a_bad_number_names_the_option_and_what_is_valid(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_good_numbers_parse_to_what_the_tier_takes():
    args = cli.build_parser().parse_args(
        ["bench", "--dir", "/x", "--threads", "2", "--threads", "4", "--io-workers", "auto"]
    )
    assert (args.threads, args.io_workers) == ([2, 4], "auto")
    args = cli.build_parser().parse_args(["bench", "--dir", "/x", "--io-workers", "0"])
    assert args.io_workers == 0
