"""The machine a measurement ran on, said once: CPUs, NUMA, memory, kernel,
Python, vLLM, the load average, and each measured directory's filesystem
(mount table; a loop device's backing file). ``llmkv-fs bench`` and every
benchmark under ``tools/`` record it with their results and print it with
``describe_machine``; a saved result is re-described without re-measuring."""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any

from llmkv_fs.volume.fsinfo import mount_of

__all__ = ["describe_machine", "describe_medium", "fs_of", "loop_backing", "machine_info"]


def loop_backing(device: str) -> str | None:
    """The file behind a loop device (/dev/loopN), else None."""
    name = os.path.basename(device)
    if not name.startswith("loop"):
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def fs_of(path: str) -> dict[str, str]:
    """Mount point, filesystem type and device of ``path`` (the mount table);
    for a loop device also the file behind it (``backing``)."""
    mount = mount_of(path)
    if mount is None:
        return {"mount": "/", "fstype": "?", "device": "?"}
    out = {"mount": mount.mount_point, "fstype": mount.fstype, "device": mount.device}
    backing = loop_backing(mount.device)
    if backing:
        out["backing"] = f"{backing} ({fs_of(backing)['fstype']})"
    return out


def describe_medium(fs: dict[str, str]) -> str:
    """``fs_of``'s answer in one phrase: "tmpfs (tmpfs on /dev/shm)"."""
    backed = f", backed by {fs['backing']}" if fs.get("backing") else ""
    return f"{fs['fstype']} ({fs['device']} on {fs['mount']}{backed})"


def _first_value(path: str, prefix: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith(prefix))
    except (OSError, StopIteration):
        return None


def machine_info(dirs: list[str]) -> dict[str, Any]:
    """Everything ``describe_machine`` says, as plain JSON values."""
    from importlib.metadata import PackageNotFoundError, version

    from llmkv_fs.engine.startup.numa import format_cpulist, read_topology

    try:
        vllm_version: str | None = version("vllm")
    except PackageNotFoundError:
        vllm_version = None
    try:  # the built-in tier's native batch I/O; without it, a Python loop
        fsio_c = importlib.util.find_spec("vllm.fs_io_C") is not None
    except ImportError:
        fsio_c = False
    topo = read_topology()
    mem_kib = _first_value("/proc/meminfo", "MemTotal")
    nodes = {str(n): format_cpulist(c) for n, c in sorted(topo.nodes.items()) if c}
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": _first_value("/proc/cpuinfo", "model name") or "?",
        "allowed_cpus": len(topo.allowed_cpus),
        "allowed_cpulist": format_cpulist(topo.allowed_cpus),
        "numa_nodes": len(nodes),
        "numa_cpus": nodes,
        "ram_gib": round(int(mem_kib.split()[0]) / (1 << 20), 1) if mem_kib else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm": vllm_version,
        "vllm_fs_io_C": fsio_c,
        "media": {d: fs_of(d) for d in dirs},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def describe_machine(m: dict[str, Any]) -> str:
    """One paragraph for a report; older saved results lack the newer keys."""
    media = "; ".join(f"`{d}` {describe_medium(fs)}" for d, fs in m["media"].items())
    model = f" ({m['cpu_model']})" if m.get("cpu_model") else ""
    load = f" Load average {m['load_average']}." if m.get("load_average") else ""
    return (
        f"Machine `{m['node']}`: {m['cpus']} CPUs{model} ({m['allowed_cpus']} allowed), "
        f"{m['numa_nodes']} NUMA node(s), {m['ram_gib']} GiB RAM, Linux {m['kernel']}, "
        f"Python {m['python']}, vLLM {m['vllm']} "
        f"(fs_io_C {'loaded' if m['vllm_fs_io_C'] else 'absent'}). "
        f"Media: {media}.{load}"
    )
