"""Our tier with pause points, for tests that start it through vLLM's
factory: in this process (tests/kits/tier_kit.py names the module
``tests.kits.paused_tier``) or in a ``vllm serve`` with this directory on
its PYTHONPATH (tests/system/test_e2e_serve.py names ``paused_tier``).

Selected by the tier config ``{"type": "FsTier", "module_path": ...,
"pause_dir": ...}``: ``pause_dir`` is this class's own key, taken before
the product's settings see the rest; the engine gets
``PausePoints(pause_dir)`` as its constructor argument
(llmkv_fs/engine/block/pause.py has the protocol). The class keeps our
tier's name, so metrics and logs read as they do for ``llmkv_fs.FsTier``.
"""

from __future__ import annotations

from typing import Any

from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.tier import fs_tier

MODULE = __name__  # in-process; a server imports it as ``paused_tier``


class FsTier(fs_tier.FsTier):
    def __init__(self, *args: Any, pause_dir: str, **tier_config: Any):
        self._pause = PausePoints(pause_dir)
        super().__init__(*args, **tier_config)

    def _start_engine(self, layouts: list[CacheLayout], primary_kv_view: memoryview) -> FsEngine:
        return FsEngine(
            self.settings, layouts, primary_kv_view, self.block_size_bytes, pause=self._pause
        )


def paused(config: dict[str, Any], pause_dir: str, module: str = MODULE) -> dict[str, Any]:
    """``config`` (a tier config of ours) with pause points in ``pause_dir``."""
    return {**config, "type": "FsTier", "module_path": module, "pause_dir": pause_dir}
