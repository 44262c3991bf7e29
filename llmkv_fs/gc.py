"""``python -m llmkv_fs.gc ROOT [options]``: the volume gc, for images where
the ``llmkv-fs`` script is not on PATH. Imports neither vLLM nor torch.
See ``llmkv_fs.ops.gc`` and docs/gc.md."""

import sys

from llmkv_fs.ops.gc import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m llmkv_fs.gc"))
