"""``python -m llmkv_fs SUBCOMMAND ...``: the ``llmkv-fs`` command line for
images where the script is not on PATH, e.g. ``python -m llmkv_fs gc ROOT``."""

import sys

from llmkv_fs.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m llmkv_fs"))
