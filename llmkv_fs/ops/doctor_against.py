"""``llmkv-fs doctor --against`` / ``--against-args``: a replica's own
settings, compared with every deployment of its model. Three forms:

* a run config: the ``config.json`` object the tier writes (it has
  ``model_name``): every field is known, compared whole;
* a vLLM serve config file (``vllm serve --config FILE``: a YAML or JSON
  mapping of serve arguments, ``block-size`` or ``block_size`` alike);
* the arguments an operator passes to ``vllm serve``, as one string.

From serve arguments only some run-config fields can be known (the rest
depend on the model's architecture or on what vLLM resolves at start-up):
``model_name`` (``model``, or the first positional argument), ``dtype``
(``--kv-cache-dtype`` unless ``auto``, else ``--dtype`` unless ``auto``),
the KV groups' ``tokens_per_block`` (``--block-size``, without decode
context parallelism), ``tokens_per_hash`` (the block size, for a
deployment with one KV group), ``blocks_per_file`` (from
``--kv-transfer-config``'s ``kv_connector_extra_config``:
``blocks_per_chunk``, or ``block_size`` -- the offloaded chunk in tokens --
over the block size; 1 when neither), the parallel sizes (compared only
with a deployment whose layout is not parallel-agnostic), and, from the
live replicas' leases, ``--prefix-caching-hash-algo``. What is compared is
exactly what the arguments determine; the rest is listed as not judged.

Pure but for reading the operator's file (never through a symlink, never a
FIFO, at most ``CONFIG_FILE_LIMIT`` bytes). PyYAML (a vLLM dependency) is
imported only to read a file that is not JSON, so doctor runs without vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shlex
from typing import Any

from llmkv_fs.layout.run_diff import Difference, differences
from llmkv_fs.volume.files import read_small_regular_file
from llmkv_fs.volume.run_config import CONFIG_FILE_LIMIT

__all__ = ["Against", "against_args", "against_file", "compare"]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM's choices
# vLLM's --dtype choices and the dtype each resolves to ("auto": the model's).
_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_ALIASES = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "pcp": "prefill_context_parallel_size",
    "dcp": "decode_context_parallel_size",
}
# run-config key -> the serve argument that sets it (default 1)
_PARALLEL = {
    "tp_size": "tensor_parallel_size",
    "pp_size": "pipeline_parallel_size",
    "pcp_size": "prefill_context_parallel_size",
    "dcp_size": "decode_context_parallel_size",
}
_HASH_ALGO = (
    "prefix_caching_hash_algo",
    "blocks are hashed with another algorithm, no name matches",
    "use the same --prefix-caching-hash-algo everywhere",
)
# Never known from serve arguments: what vLLM derives from the model itself.
_ALWAYS_UNJUDGED = (
    ("kv_layout", "the KV cache groups' layers come from the model's architecture"),
    ("sealing", "seal_key_files are the tier's settings, not vLLM's arguments"),
)


@dataclasses.dataclass(frozen=True)
class Against:
    """What ``--against`` gives. ``run_config``: a whole config.json (then
    nothing else is used); else ``known``: the run-config fields the serve
    arguments determine (``tokens_per_block``: the KV groups' block size),
    ``hash_algo`` and ``unjudged``: (field, why it cannot be known)."""

    option: str
    model: str
    run_config: dict[str, Any] | None = None
    known: dict[str, Any] = dataclasses.field(default_factory=dict)
    hash_algo: str | None = None
    unjudged: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        if self.run_config is not None:
            return {"option": self.option, "run_config": self.run_config}
        return {
            "option": self.option,
            "model": self.model,
            "known": self.known,
            "prefix_caching_hash_algo": self.hash_algo,
            "unjudged": [{"field": f, "why": why} for f, why in self.unjudged],
        }


def _positive(option: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        value = repr(value)
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{option}: {name} {str(value)[:40]!r} is not a positive integer")
    return number


def _transfer_extra(option: str, value: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` of a ``--kv-transfer-config`` (a JSON
    string on a command line, a mapping in a config file)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{option}: kv-transfer-config is not JSON ({exc})") from None
    extra = value.get("kv_connector_extra_config") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(extra, (dict, type(None))):
        raise ValueError(
            f"{option}: kv-transfer-config must be a JSON object with an object "
            "kv_connector_extra_config"
        )
    return extra or {}


def _dtype(option: str, settings: dict[str, Any]) -> str | None:
    """The KV cache dtype vLLM would write (None: the model's, unknown)."""
    cache_dtype = str(settings.get("kv_cache_dtype", "auto"))
    dtype = str(settings.get("dtype", "auto"))
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(
            f"{option}: --dtype {dtype[:40]!r} is not one of auto, {', '.join(_DTYPES)}"
        )
    if cache_dtype != "auto":
        return cache_dtype
    return None if dtype == "auto" else _DTYPES[dtype]


def _from_serve(option: str, settings: dict[str, Any]) -> Against:
    """What serve ``settings`` (names with '_', as vLLM's ``--config``
    keys are read) determine; ValueError naming ``option``."""
    model = settings.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{option}: no model (give --model NAME, or the model first)")
    known: dict[str, Any] = {"model_name": model}
    unjudged: list[tuple[str, str]] = []
    dtype = _dtype(option, settings)
    if dtype is not None:
        known["dtype"] = dtype
    else:
        unjudged.append(("dtype", "--dtype auto (the default) resolves from the model"))
    for key, name in _PARALLEL.items():
        known[key] = _positive(option, "--" + name.replace("_", "-"), settings.get(name, 1))
    block = settings.get("block_size")
    if block is None:
        unjudged.append(("block_size", "no --block-size: vLLM picks one for the platform"))
    elif known["dcp_size"] > 1:
        _positive(option, "--block-size", block)
        unjudged.append(("block_size", "with decode context parallelism it depends on the model"))
    else:
        known["tokens_per_block"] = _positive(option, "--block-size", block)
    transfer = settings.get("kv_transfer_config")
    if transfer is None:
        unjudged.append(("offloading_block_size", "no --kv-transfer-config"))
    else:
        extra = _transfer_extra(option, transfer)
        if extra.get("blocks_per_chunk") is not None and extra.get("block_size") is not None:
            raise ValueError(
                f"{option}: kv_connector_extra_config has both block_size and "
                "blocks_per_chunk (vLLM takes one of them)"
            )
        if extra.get("blocks_per_chunk") is not None:
            known["blocks_per_file"] = _positive(
                option, "kv_connector_extra_config blocks_per_chunk", extra["blocks_per_chunk"]
            )
        elif extra.get("block_size") is None:
            known["blocks_per_file"] = 1
        else:
            chunk = _positive(option, "kv_connector_extra_config block_size", extra["block_size"])
            tokens = known.get("tokens_per_block")
            if tokens is None:
                unjudged.append(("offloading_block_size", "the KV block size is not known"))
            elif chunk % tokens:
                raise ValueError(
                    f"{option}: kv_connector_extra_config block_size {chunk} is not a "
                    f"multiple of --block-size {tokens} (vLLM refuses it)"
                )
            else:
                known["blocks_per_file"] = chunk // tokens
    algo = str(settings.get("prefix_caching_hash_algo", "sha256"))
    if algo not in HASH_ALGOS:
        raise ValueError(
            f"{option}: prefix-caching-hash-algo {algo[:40]!r} is not one of "
            f"{', '.join(HASH_ALGOS)}"
        )
    unjudged.extend(_ALWAYS_UNJUDGED)
    return Against(option, model, None, known, algo, tuple(unjudged))


def _name(key: str) -> str:
    name = key.lstrip("-").replace("-", "_")
    return _ALIASES.get(name, name)


def against_args(text: str) -> Against:
    """``--against-args``: the arguments of ``vllm serve`` as one string
    (``vllm serve`` itself may lead). ValueError naming the option."""
    option = "--against-args"
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc} (give the arguments as a shell would)") from None
    if words[:2] == ["vllm", "serve"]:
        words = words[2:]
    settings: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or word == "-":
            settings.setdefault("model", word)
            continue
        key, eq, value = word.partition("=")
        if not eq:
            follows = i < len(words) and not words[i].startswith("--")
            if follows and words[i].startswith("-"):  # -tp 2, or a negative number
                follows = words[i][1:].replace(".", "", 1).isdigit()
            value = words[i] if follows else "true"
            i += follows
        settings[_name(key)] = value
    return _from_serve(option, settings)


def _parse_file(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as json_error:
        try:  # imported by name: vLLM installs PyYAML, not its type stubs
            yaml = importlib.import_module("yaml")
        except ImportError:
            raise ValueError(f"not JSON ({json_error}), and PyYAML is not installed") from None
        try:
            return yaml.safe_load(data)
        except (yaml.YAMLError, RecursionError, ValueError) as exc:
            first = (str(exc).splitlines() or ["nested too deeply"])[0]
            raise ValueError(f"neither JSON nor YAML ({first})") from None


def against_file(path: str) -> Against:
    """``--against FILE``: a run config (config.json) or a vLLM serve
    config file. ValueError naming the option and what is valid."""
    option = f"--against {path}"
    valid = (
        f"give a replica's config.json, or a vllm serve --config file (YAML or JSON), at "
        f"most {CONFIG_FILE_LIMIT} bytes"
    )
    try:
        data, _ = read_small_regular_file(path, CONFIG_FILE_LIMIT)
        found = _parse_file(data)
    except OSError as exc:
        raise ValueError(f"{option}: {exc.strerror or exc} ({valid})") from None
    except ValueError as exc:
        raise ValueError(f"{option}: {exc} ({valid})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{option}: holds a {type(found).__name__}, not a mapping ({valid})")
    if "model_name" in found:
        if not isinstance(found["model_name"], str):
            raise ValueError(f"{option}: model_name is not a string: not a run config")
        return Against(option, found["model_name"], run_config=found)
    return _from_serve(option, {_name(str(k)): v for k, v in found.items()})


def _shown(text: str) -> str:
    """A lease's string (untrusted), short and printable."""
    text = text.encode("ascii", "backslashreplace").decode()
    return "".join(c if c.isprintable() else "?" for c in text)[:40]


def _agnostic(config: dict[str, Any]) -> bool:
    # vLLM writes the flag only when False: absent means parallel-agnostic.
    return config.get("parallel_agnostic", True) is not False


def compare(
    against: Against, config: dict[str, Any], hash_algos: list[str]
) -> tuple[list[Difference], list[tuple[str, str]]]:
    """What keeps ``against`` from a deployment of its model whose run
    config is ``config`` and whose live replicas hash with ``hash_algos``:
    the differences, in run_diff's words, and the fields not judged."""
    if against.run_config is not None:
        return differences(against.run_config, config), []
    unjudged = list(against.unjudged)
    ours = dict(config)
    known = dict(against.known)
    tokens = known.pop("tokens_per_block", None)
    groups = config.get("kv_cache_groups")
    if tokens is not None and isinstance(groups, list):
        ours["kv_cache_groups"] = [
            {**g, "tokens_per_block": tokens} if isinstance(g, dict) else g for g in groups
        ]
        if len(groups) == 1:
            ours["tokens_per_hash"] = tokens
        else:
            unjudged.append(("hash_block_size", "several KV groups hash at their common size"))
    if _agnostic(config):
        for key in _PARALLEL:
            known.pop(key)
        unjudged.append(
            ("tensor_parallel_size", "the deployment's layout is parallel-agnostic: sizes collapse")
        )
    ours.update(known)
    found = differences(ours, config)
    theirs = sorted({_shown(a) for a in hash_algos if a != against.hash_algo})
    if theirs:
        shown = ",".join(theirs)
        found.append(Difference(_HASH_ALGO[0], str(against.hash_algo), shown, *_HASH_ALGO[1:]))
    return found, unjudged
