"""The vllm.general_plugins entry point, exercised in fresh processes so the
global tier registry of the test process stays vLLM's own. Each fresh
process imports vLLM (~20 s of CPU on 2 cores): those tests are in the
integration lane (tests/conftest.py)."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

# A test that starts a fresh interpreter importing vLLM (~20 s of CPU each).
fresh_vllm = pytest.mark.integration

PROBE = r"""
import json, logging, sys
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as F
records = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.name.startswith("vllm.llmkv_fs"):
            records.append(record.getMessage())
logging.getLogger("vllm.llmkv_fs").addHandler(Grab())
logging.getLogger("vllm.llmkv_fs").setLevel(logging.INFO)
def resolve(name):
    try:
        cls = F.get_tier_class({"type": name})
    except ValueError:
        return None
    return f"{cls.__module__}.{cls.__name__}"
load_general_plugins()
seen = {"fs": resolve("fs"), "llmkv_fs": resolve("llmkv_fs")}
from llmkv_fs.tier.plugin import register
register()  # vLLM may call it again in the same process: must be a no-op
seen["fs_after_second_call"] = resolve("fs")
seen["logs"] = records
print(json.dumps(seen))
"""

OURS = "llmkv_fs.tier.fs_tier.FsTier"
BUILTIN = "vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager"


def probe(**env):
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("llmkv_fs") == "llmkv_fs.tier.plugin:register"


@fresh_vllm
def test_plugin_replaces_builtin_fs_and_logs_once():
    seen = probe()
    assert seen["fs"] == OURS
    assert seen["llmkv_fs"] == OURS
    assert seen["fs_after_second_call"] == OURS
    assert len(seen["logs"]) == 1 and "llmkv_fs 0.1.0" in seen["logs"][0]


@fresh_vllm
def test_opt_out_keeps_builtin_fs():
    seen = probe(LLMKV_FS_REPLACE_BUILTIN="0")
    assert seen["fs"] == BUILTIN
    assert seen["llmkv_fs"] == OURS
    assert "LLMKV_FS_REPLACE_BUILTIN=0" in seen["logs"][0]


@fresh_vllm
def test_vllm_plugins_filter_is_respected():
    seen = probe(VLLM_PLUGINS="some_other_plugin")
    assert seen["fs"] == BUILTIN
    assert seen["llmkv_fs"] is None  # vLLM never called us


def test_plugin_import_is_light():
    code = (
        "import sys, llmkv_fs, llmkv_fs.tier.plugin; "
        "heavy = [m for m in ('torch', 'vllm', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


SERVE_WITH_FS_TYPE = r"""
import glob, json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from llmkv_fs.harness.driver import Replica, make_keys, offloading_config
root = sys.argv[1]
# The operator's config, unchanged from vLLM's built-in fs tier.
tier = {"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 1,
        "enable_kv_events": False, "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}
replica = Replica(offloading_config(tiers=[tier]))
replica.store(make_keys(3))
sizes = sorted({__import__("os").path.getsize(p) for p in glob.glob(f"{root}/*_r0/*/*/*.bin")})
print(json.dumps({"tier": type(replica.tier).__name__, "sizes": sizes, "row": replica.row_bytes,
                  "bp": type(replica.tier.bp_detector).__name__}))
replica.close()
"""


@fresh_vllm
def test_builtin_fs_config_runs_on_our_tier(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SERVE_WITH_FS_TYPE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["tier"] == "FsTier"
    assert seen["bp"] == "EMABackpressureDetector"  # vLLM's factory handed it to us
    assert seen["sizes"] == [seen["row"] + 4096]


UNTESTED_VLLM = r"""
import json, logging
import llmkv_fs.tier.plugin as plugin
records = []
class Grab(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("vllm.llmkv_fs").addHandler(Grab())
logging.getLogger("vllm.llmkv_fs").setLevel(logging.INFO)
plugin._vllm_version = lambda: "0.35.1"
plugin.register()
print(json.dumps(records))
"""


@fresh_vllm
def test_an_untested_vllm_version_is_warned_about():
    result = subprocess.run(
        [sys.executable, "-c", UNTESTED_VLLM], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout.strip().splitlines()[-1])
    warnings = [msg for level, msg in records if level == "WARNING"]
    assert len(warnings) == 1 and "0.35.1" in warnings[0] and "0.33." in warnings[0]


@fresh_vllm
def test_the_tested_vllm_version_gives_no_warning():
    seen = probe()
    assert not [m for m in seen["logs"] if "tested with" in m]
