"""Installing llmkv-fs into a vLLM image must not touch vLLM or torch; the
wheel holds every module of the package and no tests; an editable install
maps the source tree."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _names(requirements):
    return {
        r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
        for r in requirements
    }


def test_core_dependencies_are_small_and_never_vllm_or_torch():
    core = _names(PYPROJECT["project"]["dependencies"])
    # cryptography: sealed blocks' AES-GCM (OpenSSL underneath, wheels wherever vLLM runs).
    assert core <= {"xxhash", "psutil", "numpy", "tqdm", "cryptography"}
    assert not core & {"vllm", "torch"}


def test_vllm_is_an_extra_pinned_to_the_tested_minors():
    from llmkv_fs.tier.plugin import TESTED_VLLM_SERIES

    (vllm,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    assert vllm.replace(" ", "") == "vllm>=0.32,<0.34"
    assert TESTED_VLLM_SERIES == ("0.32.", "0.33.")


def test_plots_are_an_extra():
    # aiofiles went with tools/gc_scale.py (docs/gc.md: threads, not aiofiles).
    assert _names(PYPROJECT["project"]["optional-dependencies"]["bench"]) == {"matplotlib"}


def test_plugin_and_cli_entry_points_are_declared():
    project = PYPROJECT["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "llmkv_fs": "llmkv_fs.tier.plugin:register"
    }
    assert project["scripts"]["llmkv-fs"] == "llmkv_fs.cli:main"


# -- building ------------------------------------------------------------------------


def _source_copy(dest: Path) -> Path:
    """The repository as a clean clone has it (setuptools writes build/ and
    egg-info next to the sources: never in the working tree)."""
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info", "dist")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def _build(src: Path, hook: str, out: Path) -> Path:
    """A PEP 517 build with the installed setuptools, as ``pip wheel
    --no-build-isolation`` runs it (offline)."""
    out.mkdir()
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return out / done.stdout.strip().splitlines()[-1]


def test_wheel_holds_every_module_and_no_tests(tmp_path):
    src = _source_copy(tmp_path / "src")
    wheel = _build(src, "build_wheel", tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(
            z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")
        )
    modules = {p.relative_to(src).as_posix() for p in (src / "llmkv_fs").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)
    assert {
        "llmkv_fs/cli.py",
        "llmkv_fs/__main__.py",
        "llmkv_fs/harness/driver.py",
        "llmkv_fs/ops/gc/sweep.py",
    } <= names
    assert not [n for n in names if n.startswith(("tests/", "tools/", "docs/"))]
    assert not [n for n in names if "/" not in n]  # nothing at the top of site-packages
    assert "llmkv-fs = llmkv_fs.cli:main" in entry_points
    assert "llmkv_fs = llmkv_fs.tier.plugin:register" in entry_points


def test_editable_install_maps_the_source_tree(tmp_path):
    src = _source_copy(tmp_path / "src")
    wheel = _build(src, "build_editable", tmp_path / "dist")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    # -S: without the environment's own site-packages (and its install of llmkv_fs).
    # find_spec imports only the parents: nothing here needs a third-party package.
    code = (
        "import importlib.util, site, sys; site.addsitedir(sys.argv[1]); "
        "[print(importlib.util.find_spec(m).origin) for m in "
        "('llmkv_fs.cli', 'llmkv_fs.harness.driver', 'llmkv_fs.ops.gc')]"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    paths = done.stdout.split()
    assert len(paths) == 3 and all(Path(p).is_relative_to(src / "llmkv_fs") for p in paths), paths
