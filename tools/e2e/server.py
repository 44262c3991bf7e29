"""One real ``vllm serve`` process with the OffloadingConnector, the tiering
spec and a secondary tier, driven over HTTP on 127.0.0.1.

Used by the end-to-end tests (tests/system/test_e2e_serve.py) and the TTFT
benchmark (tools.e2e.ttft). It imports neither vLLM nor torch: the
server runs in the e2e venv (tools.e2e.venv) and this side talks
HTTP and asks psutil about processes.

Process rules: each server runs in its own session (``start_new_session``),
so ``stop`` signals the whole group (API server, engine core, workers) and
then waits for every member to be gone. vLLM leaves its shared offload region
``/dev/shm/vllm_offload_<engine_id>*.mmap`` behind when its engine is killed,
so ``stop`` removes the regions of that server's engine id (unique per
server) and reports what it removed. Every wait polls with a deadline.
"""

from __future__ import annotations

import dataclasses
import glob
import http.client
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

SPEC_NAME = "CpuTieringOffloadingSpec"
SPEC_MODULE = "e2e_cpu_spec"  # tests/kits/e2e_cpu_spec.py, through PYTHONPATH
OUR_PREFIX = "vllm:kv_offload_llmkv_fs_"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05):
    """Poll ``check`` until it returns something truthy; raise naming
    ``what`` once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)  # polling interval, not synchronization


@dataclasses.dataclass
class ServeConfig:
    venv: Path
    model: Path
    root_dir: str
    pythonpath: list[str]  # our installed package, the spec module's directory
    tier_type: str = "fs"
    tier_options: dict = dataclasses.field(default_factory=dict)
    replace_builtin: bool = True  # LLMKV_FS_REPLACE_BUILTIN
    cpu_bytes: int = 256 << 20
    chunk_tokens: int = 128  # tokens per offloaded chunk = per block file
    # vLLM's own KV block (= its prefix-cache granularity); equal to the chunk,
    # a tier hit recomputes exactly what a prefix-cache hit recomputes.
    block_tokens: int = 128
    dtype: str = "bfloat16"
    max_model_len: int = 10240
    kv_cache_gib: int = 1
    hash_seed: str = "0"
    log_dir: str = "/tmp"
    # vLLM's --kv-events-config (enable_kv_cache_events, publisher, endpoint,
    # topic), None for none.
    kv_events: dict | None = None


class Server:
    """A ``vllm serve`` process. ``start`` returns once /health answers."""

    def __init__(self, config: ServeConfig, name: str = "server"):
        self.config = config
        self.name = name
        self.port = free_port()
        self.engine_id = f"llmkvfs-e2e-{uuid.uuid4().hex[:12]}"
        self.log_path = os.path.join(config.log_dir, f"{name}-{self.engine_id}.log")
        self.proc: subprocess.Popen | None = None
        self.removed_regions: list[str] = []

    # -- life cycle ----------------------------------------------------------

    def command(self) -> list[str]:
        c = self.config
        tier = {"type": c.tier_type, "root_dir": c.root_dir, **c.tier_options}
        transfer = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": self.engine_id,
            "kv_connector_extra_config": {
                "spec_name": SPEC_NAME,
                "spec_module_path": SPEC_MODULE,
                "cpu_bytes_to_use": c.cpu_bytes,
                "block_size": c.chunk_tokens,
                "secondary_tiers": [tier],
            },
        }
        return [
            str(c.venv / "bin" / "vllm"), "serve", str(c.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", "e2e", "--dtype", c.dtype, "--seed", "0",
            "--block-size", str(c.block_tokens),
            "--max-model-len", str(c.max_model_len), "--max-num-seqs", "4",
            # Start-up on 2 cores: no torch.compile (~45 s), no worker process
            # beside the engine core (one import of vLLM less, ~30 s).
            "--enforce-eager", "--distributed-executor-backend", "uni",
            "--kv-transfer-config", json.dumps(transfer),
        ] + (["--kv-events-config", json.dumps(c.kv_events)] if c.kv_events else [])  # fmt: skip

    def env(self) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        env.update(
            PYTHONPATH=os.pathsep.join(c.pythonpath),
            PATH=f"{c.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(c.kv_cache_gib),
            PYTHONHASHSEED=c.hash_seed,
            LLMKV_FS_REPLACE_BUILTIN="1" if c.replace_builtin else "0",
            VLLM_LOGGING_LEVEL="INFO",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        return env

    def start(self, timeout_s: float = 300) -> Server:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> Server:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 300) -> Server:
        wait_for(self._healthy, timeout_s, f"{self.name} /health (log: {self.log_path})", 0.5)
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode} while starting:\n"
                + self.log_tail()
            )
        try:
            status, _ = self._request("GET", "/health", timeout=2)
        except OSError:
            return False
        return status == 200

    def group_pids(self, zombies: bool = False) -> list[int]:
        """Processes of this server's group (group id = leader pid), zombies
        (exited, not yet reaped) only if asked."""
        if self.proc is None:
            return []
        pids = []
        for proc in psutil.process_iter(["status"]):
            try:
                in_group = os.getpgid(proc.pid) == self.proc.pid
            except OSError:
                continue  # gone meanwhile
            if in_group and (zombies or proc.info["status"] != psutil.STATUS_ZOMBIE):
                pids.append(proc.pid)
        return pids

    def regions(self) -> list[str]:
        return glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}*")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
        """Signal the whole group, wait for it (SIGKILL after ``timeout_s``),
        reap the leader, then remove this server's offload regions."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            wait_for(lambda: not self.group_pids(), timeout_s, f"{self.name} to exit", 0.1)
        except TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            wait_for(lambda: not self.group_pids(), 30, f"{self.name} to die", 0.1)
        self.proc.wait(timeout=30)
        # The engine core's zombie, reparented to init when the API server
        # died, still answers kill(pid, 0): gc would take its temp files for
        # a live writer's until init reaps it.
        wait_for(lambda: not self.group_pids(zombies=True), 60, f"{self.name} reaped", 0.1)
        for path in self.regions():
            os.unlink(path)
            self.removed_regions.append(path)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    # -- HTTP ----------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, json.dumps(body) if body else None, headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def complete(
        self, prompt: list[int], max_tokens: int = 8, salt: str | None = None, timeout: float = 300
    ):
        """Greedy completion of token ids, streamed. Returns (text, TTFT in
        seconds: request sent to first streamed chunk). A ``salt`` (vLLM's
        ``cache_salt``) changes every block hash: no cache hit, a recompute."""
        body: dict = {
            "model": "e2e",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        if salt is not None:
            body["cache_salt"] = salt
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            started = time.perf_counter()
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {response.status}: {response.read()!r}")
            ttft: float | None = None
            text: list[str] = []
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if ttft is None:
                    ttft = time.perf_counter() - started
                text.extend(choice.get("text", "") for choice in json.loads(data)["choices"])
        finally:
            conn.close()
        assert ttft is not None, f"{self.name}: no streamed chunk"
        return "".join(text), ttft

    def metrics_text(self) -> str:
        status, body = self._request("GET", "/metrics", timeout=120)
        assert status == 200
        return body.decode()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, ``name{labels}`` -> value."""
        samples = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def metric_sum(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` (exact metric name, e.g. with
        ``_total``) whose labels include ``labels``."""
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            value
            for key, value in self.metrics().items()
            if key.split("{", 1)[0] == name and all(w in key for w in want)
        )


def block_files(root: str) -> list[str]:
    """Block files under ``root`` outside quarantine (ours and vLLM's)."""
    return [
        p
        for p in glob.glob(os.path.join(root, "**", "*.bin"), recursive=True)
        if "/.quarantine/" not in p
    ]


def temp_files(root: str) -> list[str]:
    return [
        os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".tmp")
    ]
