"""Side-by-side benchmark: llmkv_fs vs vLLM's built-in fs tier vs fio.

A thin wrapper around ``llmkv_fs.tier.bench`` (also ``llmkv-fs bench``); see
docs/benchmarks.md for the method and the options.

    python tools/bench_tiers.py --dir /dev/shm/bench --dir /var/tmp/bench --threads 1 --threads 4
"""

import sys

from llmkv_fs.tier.bench import main

if __name__ == "__main__":
    sys.exit(main())
