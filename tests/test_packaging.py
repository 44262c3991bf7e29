"""Installing llmkv-fs into a vLLM image must not touch vLLM or torch."""

import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())


def _names(requirements):
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
            for r in requirements}


def test_core_dependencies_are_small_and_never_vllm_or_torch():
    core = _names(PYPROJECT["project"]["dependencies"])
    assert core <= {"xxhash", "psutil", "aiofiles", "numpy"}
    assert not core & {"vllm", "torch"}


def test_vllm_is_an_extra_pinned_to_the_tested_minor():
    (vllm,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    assert vllm.replace(" ", "") == "vllm>=0.33.0,<0.34"


def test_plugin_and_cli_entry_points_are_declared():
    project = PYPROJECT["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "llmkv_fs": "llmkv_fs.tier.plugin:register"}
    assert project["scripts"]["llmkv-fs"] == "llmkv_fs.ops.cli:main"
