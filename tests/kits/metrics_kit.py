"""Our metrics as an operator sees them: a tier's ``get_stats`` payload
rendered by vLLM's real ``OffloadPromMetrics`` into a prometheus_client
registry (as the API server's ``/metrics`` would show it), and the alert
rules of docs/metrics.md evaluated on what was scraped.

``evaluate`` understands the PromQL the documented rules use, no more:
selectors with ``=``/``=~`` matchers, ``rate``/``increase`` of a counter over
two scrapes (before, after), ``sum``/``max``/``min`` ``by``,
``histogram_quantile``, ``*`` and the comparisons, ``and``. A rule it cannot
parse fails the test that reads it, so a new rule needs its words here first.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)

from tests.kits import REPO

MODEL = "acme/llama-test"  # offloading_config's default
ENGINE_LABELS = ["model_name", "engine"]  # what vLLM's PrometheusStatLogger passes

Labels = frozenset[tuple[str, str]]
Scrape = dict[tuple[str, Labels], float]  # (sample name, labels) -> value
Vector = dict[Labels, float]


def take_stats(replica, with_info: bool = False) -> OffloadingConnectorStats:
    """What vLLM's OffloadingConnectorScheduler.get_stats sends: the
    manager's payload, plus (first time only) the manager's config_info."""
    with replica.manager.lock:
        stats = replica.manager.get_stats()
    if with_info:
        stats = stats or OffloadingConnectorStats()
        stats.set_info(replica.manager.config_info())
    return stats


def prom_metrics(extra_config: dict, registry: CollectorRegistry, engines: int):
    """vLLM's real OffloadPromMetrics for an OffloadingConnector with
    TieringOffloadingSpec + our tier, on real prometheus_client classes bound
    to a fresh registry."""
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig

    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", **extra_config},
    )
    # device="cpu": this machine has no accelerator vLLM could detect.
    vllm_config = VllmConfig(
        kv_transfer_config=kv_transfer_config, device_config=DeviceConfig(device="cpu")
    )
    bound = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return OffloadPromMetrics(
        vllm_config,
        bound,
        list(ENGINE_LABELS),
        {e: [MODEL, str(e)] for e in range(engines)},
    )


def snapshot(registry: CollectorRegistry) -> dict:
    """Every sample of the registry: (name, sorted label items) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


class Scraper:
    """One replica's metrics as Prometheus scrapes them: ``scrape()`` takes
    the replica's stats (through vLLM's manager) into the registry and
    returns every sample."""

    def __init__(self, replica):
        self._replica = replica
        self._registry = CollectorRegistry()
        self._prom = prom_metrics(replica.spec.extra_config, self._registry, engines=1)

    def scrape(self) -> Scrape:
        stats = take_stats(self._replica)
        if stats is not None:
            self._prom.observe(stats.data, 0)
        return {
            (name, frozenset(labels)): value
            for (name, labels), value in snapshot(self._registry).items()
        }


# -- the documented rules ------------------------------------------------------------------


def documented_alerts() -> dict[str, str]:
    """Alert name -> PromQL expression, from docs/metrics.md's rule file."""
    text = (REPO / "docs" / "metrics.md").read_text()
    section = text.split("## Alerting rules", 1)[1]
    block = section.split("```", 2)[1]
    groups = yaml.safe_load(block)["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def firing(expressions: dict[str, str], before: Scrape, after: Scrape) -> set[str]:
    """The alerts whose expression has a result on the scrape ``after``
    (range functions: from ``before`` to ``after``)."""
    return {name for name, expr in expressions.items() if evaluate(expr, before, after)}


def evaluate(expr: str, before: Scrape, after: Scrape) -> Vector:
    parser = _Parser(expr, before, after)
    value = parser.expression()
    parser.expect(None)
    assert isinstance(value, dict), f"{expr!r} is a scalar, not an alert"
    return value


_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<duration>\[\d+[smh]\])|(?P<string>\"[^\"]*\")"
    r"|(?P<op>>=|<=|==|!=|=~|[-+*/<>(){},=])|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*))"
)
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_AGGREGATE: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}
_SECONDS = {"s": 1, "m": 60, "h": 3600}

Value = float | Vector


class _Parser:
    """Recursive descent over the token list; evaluates as it parses."""

    def __init__(self, expr: str, before: Scrape, after: Scrape):
        self.expr, self.before, self.after = expr, before, after
        self.tokens: list[str] = []
        at = 0
        while expr[at:].strip():
            match = _TOKEN.match(expr, at)
            assert match, f"cannot read {expr[at:]!r} in {expr!r}"
            self.tokens.append(match.group().strip())
            at = match.end()
        self.at = 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        assert token is not None, f"{self.expr!r} ends early"
        self.at += 1
        return token

    def expect(self, token: str | None) -> None:
        assert self.peek() == token, f"expected {token!r} at {self.peek()!r} in {self.expr!r}"
        if token is not None:
            self.at += 1

    def expression(self) -> Value:
        left = self.comparison()
        while self.peek() == "and":
            self.take()
            right = self.comparison()
            assert isinstance(left, dict) and isinstance(right, dict)
            left = {labels: v for labels, v in left.items() if labels in right}
        return left

    def comparison(self) -> Value:
        left = self.product()
        if self.peek() in _COMPARE:
            test = _COMPARE[self.take()]
            right = self.product()
            return _binary(left, right, lambda a, b: a if test(a, b) else None)
        return left

    def product(self) -> Value:
        left = self.primary()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.primary()
            left = _binary(left, right, (lambda a, b: a * b) if op == "*" else (lambda a, b: a / b))
        return left

    def primary(self) -> Value:
        token = self.take()
        if re.fullmatch(r"\d+(?:\.\d+)?", token):
            return float(token)
        if token == "(":
            value = self.expression()
            self.expect(")")
            return value
        if token in _AGGREGATE:
            return self.aggregate(_AGGREGATE[token])
        if token in ("rate", "increase"):
            self.expect("(")
            name, matchers = self.selector()
            seconds = self.duration()
            self.expect(")")
            now, then = _select(self.after, name, matchers), _select(self.before, name, matchers)
            grown = {labels: v - then.get(labels, 0.0) for labels, v in now.items()}
            return grown if token == "increase" else {k: v / seconds for k, v in grown.items()}
        if token == "histogram_quantile":
            self.expect("(")
            q = float(self.take())
            self.expect(",")
            buckets = self.expression()
            self.expect(")")
            assert isinstance(buckets, dict)
            return _quantile(q, buckets)
        self.at -= 1
        name, matchers = self.selector()
        return _select(self.after, name, matchers)

    def aggregate(self, combine: Callable[[list[float]], float]) -> Vector:
        keep: tuple[str, ...] = ()
        if self.peek() == "by":
            self.take()
            keep = tuple(self.labels())
        self.expect("(")
        inner = self.expression()
        self.expect(")")
        assert isinstance(inner, dict)
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            groups.setdefault(frozenset((k, v) for k, v in labels if k in keep), []).append(value)
        return {labels: combine(values) for labels, values in groups.items()}

    def labels(self) -> list[str]:
        self.expect("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.expect(")")
        return names

    def selector(self) -> tuple[str, list[tuple[str, str, str]]]:
        name = self.take()
        assert name.startswith("vllm:"), f"{name!r} is not a metric in {self.expr!r}"
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), self.take()
                matchers.append((label, op, value.strip('"')))
                if self.peek() == ",":
                    self.take()
            self.expect("}")
        return name, matchers

    def duration(self) -> float:
        token = self.take()
        assert token.startswith("["), f"a range function needs a range in {self.expr!r}"
        return float(token[1:-2]) * _SECONDS[token[-2]]


def _select(scrape: Scrape, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
    out: Vector = {}
    for (sample, labels), value in scrape.items():
        if sample != name:
            continue
        got = dict(labels)
        if all(
            (got.get(label, "") == want)
            if op == "="
            else bool(re.fullmatch(want, got.get(label, "")))
            for label, op, want in matchers
        ):
            out[labels] = value
    return out


def _binary(left: Value, right: Value, op: Callable[[float, float], float | None]) -> Value:
    """Scalar with scalar, vector with scalar, or vector with vector
    matched on identical label sets (the metric name is not a label here)."""
    if not isinstance(left, dict) and not isinstance(right, dict):
        result = op(left, right)
        return math.nan if result is None else result
    if not isinstance(left, dict):
        assert isinstance(right, dict)
        pairs = {labels: (left, v) for labels, v in right.items()}
    elif not isinstance(right, dict):
        pairs = {labels: (v, right) for labels, v in left.items()}
    else:
        pairs = {labels: (v, right[labels]) for labels, v in left.items() if labels in right}
    out: Vector = {}
    for labels, (a, b) in pairs.items():
        result = op(a, b)
        if result is not None:
            out[labels] = result
    return out


def _quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' histogram_quantile: per series (labels but ``le``),
    linear interpolation inside the bucket the rank falls in."""
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels)["le"]
        rest = frozenset((k, v) for k, v in labels if k != "le")
        series.setdefault(rest, []).append((float(le), count))
    out: Vector = {}
    for labels, points in series.items():
        points.sort()
        total = points[-1][1]
        if not total:
            continue  # no observation: no result (NaN)
        rank = q * total
        lower, below = 0.0, 0.0
        for upper, count in points:
            if count >= rank:
                if math.isinf(upper):
                    out[labels] = lower
                else:
                    out[labels] = lower + (upper - lower) * (rank - below) / max(
                        count - below, 1e-12
                    )
                break
            lower, below = upper, count
    return out
