"""Check a Grafana dashboard against the metrics the tier declares.

    python3 -m tools.dashboard.check [docs/grafana-llmkv-fs.json]

Every metric name in a PromQL expression (panel targets, template variable
queries) must be declared, with the suffix Prometheus gives its type: a
counter only as ``<name>_total``, a histogram only as ``<name>_bucket``,
``_sum`` or ``_count``, a gauge bare. Label matchers and ``by``/``without``
clauses may use only the metric's declared labels, the labels vLLM adds to
every offloading metric (``model_name``, ``engine``), ``le`` on buckets, and
scrape target labels (``instance``, ``job``, ``pod``, ``namespace``). Also
checked: schemaVersion, a Prometheus datasource variable used by every
panel, unique panel ids, a refId on every target.

Our names come from ``llmkv_fs.tier.metrics.METRICS``; with vLLM installed,
vLLM's own offloading metrics (``vllm:kv_offload_*``) are declared too, as
``TieringOffloadingSpec.build_metric_definitions`` reports them. Exit status
1 when a problem is found.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ENGINE_LABELS = ("model_name", "engine")
TARGET_LABELS = ("instance", "job", "pod", "namespace")
SCHEMA_VERSIONS = range(36, 42)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_NAME = re.compile(r"(?<![\w:])(vllm:[A-Za-z0-9_:]+)")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(vllm:[A-Za-z0-9_:]+)[^,]*,\s*([A-Za-z_]\w*)\s*\)")


def _resolve(token: str, kinds: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(declared name, problem) for a series name as it appears in PromQL."""
    if token in kinds:
        kind = kinds[token]
        if kind == "gauge":
            return token, None
        return token, f"{token}: a {kind} is scraped as {token}{_SUFFIXES[kind][0]}"
    for kind, suffixes in _SUFFIXES.items():
        for suffix in suffixes:
            if suffix and token.endswith(suffix):
                base = token[: -len(suffix)]
                if base in kinds:
                    if kinds[base] == kind:
                        return base, None
                    return base, (
                        f"{token}: {base} is a {kinds[base]}, which has no {suffix} series"
                    )
    return None, f"{token}: not a declared metric"


def _expressions(dashboard: Mapping) -> Iterable[tuple[str, str]]:
    """(where, expr) for every PromQL expression in the dashboard."""
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                yield f"panel {panel.get('id')} {panel.get('title')!r}", target["expr"]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            if isinstance(query, Mapping):
                query = query.get("query", "")
            if query:
                yield f"variable {var.get('name')!r}", query


def _panels(panels: Iterable[Mapping]) -> Iterable[Mapping]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []) or [])


def check(
    dashboard: Mapping,
    kinds: Mapping[str, str],
    labels: Mapping[str, Iterable[str]],
    engine_labels: Iterable[str] = ENGINE_LABELS,
    target_labels: Iterable[str] = TARGET_LABELS,
) -> tuple[list[str], set[str]]:
    """Returns (problems, declared metric names used)."""
    problems: list[str] = []
    used: set[str] = set()
    common = set(engine_labels) | set(target_labels)

    version = dashboard.get("schemaVersion")
    if version not in SCHEMA_VERSIONS:
        problems.append(f"schemaVersion {version!r} not in {SCHEMA_VERSIONS}")
    ds_vars = [
        v.get("name")
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("type") == "datasource" and v.get("query") == "prometheus"
    ]
    if not ds_vars:
        problems.append("no Prometheus datasource variable")
    ds_refs = {f"${name}" for name in ds_vars} | {f"${{{name}}}" for name in ds_vars}
    ids = [p.get("id") for p in _panels(dashboard.get("panels", []))]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids must be unique and present: {ids}")
    for panel in _panels(dashboard.get("panels", [])):
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        if "gridPos" not in panel:
            problems.append(f"{where}: no gridPos")
        targets = panel.get("targets", []) or []
        if targets and (panel.get("datasource") or {}).get("uid") not in ds_refs:
            problems.append(f"{where}: datasource is not the datasource variable")
        refs = [t.get("refId") for t in targets]
        if None in refs or len(refs) != len(set(refs)):
            problems.append(f"{where}: targets need distinct refIds")

    for where, expr in _expressions(dashboard):
        allowed: set[str] = set(common)
        for match in _NAME.finditer(expr):
            token = match.group(1)
            name, problem = _resolve(token, kinds)
            if problem:
                problems.append(f"{where}: {problem}")
            if name is None:
                continue
            used.add(name)
            own = set(labels.get(name, ())) | common
            if token.endswith("_bucket"):
                own.add("le")
            allowed |= own
            rest = expr[match.end() :]
            if rest.startswith("{"):
                selector = rest[1 : rest.index("}")]
                for label in _MATCHER.findall(re.sub(r'"(?:[^"\\]|\\.)*"', '""', selector)):
                    if label not in own:
                        problems.append(f"{where}: {token} has no label {label!r}")
        for clause in _GROUPING.findall(expr):
            for label in filter(None, (s.strip() for s in clause.split(","))):
                if label not in allowed:
                    problems.append(f"{where}: grouping by unknown label {label!r}")
        for name, label in _LABEL_VALUES.findall(expr):
            if name in kinds and label not in set(labels.get(name, ())) | common:
                problems.append(f"{where}: {name} has no label {label!r}")
    return problems, used


def declared_metrics() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(name -> kind, name -> labelnames): ours, plus vLLM's when importable."""
    from llmkv_fs.tier.metrics import METRICS

    kinds = {m.name: m.kind for m in METRICS.values()}
    labels = {m.name: m.labelnames for m in METRICS.values()}
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            KV_OFFLOAD_CONFIG_INFO,
            get_connector_metric_definitions,
        )
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError:
        return kinds, labels
    extra = {"secondary_tiers": [{"type": "FsTier", "module_path": "llmkv_fs", "root_dir": "/x"}]}
    for name, md in {
        **TieringOffloadingSpec.build_metric_definitions(extra),
        **get_connector_metric_definitions(),
    }.items():
        kinds[name] = (
            "counter"
            if isinstance(md, OffloadingCounterMetadata)
            else "gauge"
            if isinstance(md, OffloadingGaugeMetadata)
            else "histogram"
        )
        labels[name] = tuple(md.labelnames)
    kinds[KV_OFFLOAD_CONFIG_INFO] = "gauge"
    labels[KV_OFFLOAD_CONFIG_INFO] = TieringOffloadingSpec.config_info_keys(extra)
    return kinds, labels


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    default = Path(__file__).resolve().parent.parent / "docs/grafana-llmkv-fs.json"
    path = Path(argv[0]) if argv else default
    dashboard = json.loads(path.read_text())
    kinds, labels = declared_metrics()
    problems, used = check(dashboard, kinds, labels)
    for problem in problems:
        print(problem)
    print(f"{path}: {len(used)} metrics referenced, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
