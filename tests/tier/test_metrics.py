"""Our metrics through vLLM's real metrics path, end to end.

One scenario (module scope, it is the expensive part) drives three replicas
of vLLM's real TieringOffloadingManager on one root: A stores; B stores blocks
A already wrote, then looks up good, bit-flipped, vanishing and never-stored
blocks; C's space guard refuses its stores. Each manager's ``get_stats()``
payload (which aggregates the tier's) is then checked against what
``TieringOffloadingSpec.build_metric_definitions`` declares, and rendered
by vLLM's real ``OffloadPromMetrics`` into a fresh prometheus_client registry,
as the API server would.

Also here: every counter key the engine can produce (the enums of
llmkv_fs.engine.outcomes) maps onto a declared metric and is documented, and
docs/metrics.md and docs/grafana-llmkv-fs.json name only declared metrics.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import types

import pytest
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    KV_OFFLOAD_CONFIG_INFO,
    get_connector_metric_definitions,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import llmkv_fs
from llmkv_fs import FsTier
from llmkv_fs.engine import (
    Direction,
    Failure,
    LookupAnswer,
    Outcome,
    Tally,
    all_counter_keys,
)
from llmkv_fs.layout.blockfile import Corruption
from llmkv_fs.tier.metrics import METRICS, PREFIX, counter_series
from tests.kits import REPO
from tests.kits.engine_kit import IO_WORKERS_ENV, inside
from tests.kits.metrics_kit import ENGINE_LABELS, MODEL, prom_metrics, snapshot, take_stats
from tests.kits.tier_kit import Replica, make_keys, offloading_config, ours, resolve, wait_until
from tests.kits.volume_kit import flip_a_bit

HIT, MISS = LookupResult.HIT, LookupResult.MISS
KIND_OF = {
    OffloadingCounterMetadata: "counter",
    OffloadingGaugeMetadata: "gauge",
    OffloadingHistogramMetadata: "histogram",
}


def kind_of(metadata) -> str:
    return next(kind for cls, kind in KIND_OF.items() if isinstance(metadata, cls))


# -- the scenario ----------------------------------------------------------------------


class _JobSpy:
    """Counts the transfer jobs vLLM hands a tier (independently of our
    metrics), delegating to the real methods."""

    def __init__(self, tier: FsTier):
        self.stores = self.loads = 0
        real_store, real_load = tier.submit_store, tier.submit_load

        def submit_store(job):
            self.stores += 1
            return real_store(job)

        def submit_load(job):
            self.loads += 1
            return real_load(job)

        tier.submit_store, tier.submit_load = submit_store, submit_load


@pytest.fixture(scope="module", params=["0", "1"], ids=["threads", "workers"])
def scenario(tmp_path_factory, request):
    """Once with I/O threads, once with worker processes (module scope: the
    io_mode fixture is per test, so the mode is set here for harness.ours)."""
    root = str(tmp_path_factory.mktemp("metrics_kv"))
    workers = request.param != "0"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(IO_WORKERS_ENV, request.param)
        tier = ours(root)
        # C's space guard refuses every store (it wants 1 EiB free).
        refusing = ours(root, min_free_bytes=1 << 60)
    made: list[Replica] = []
    try:
        a = Replica(offloading_config(tiers=[tier]))
        made.append(a)
        b = Replica(offloading_config(tiers=[tier]))
        made.append(b)
        c = Replica(offloading_config(tiers=[refusing]))
        made.append(c)
        for replica in made:
            assert bool(replica.tier.engine.io_workers) == workers
        spy_a, spy_b, spy_c = _JobSpy(a.tier), _JobSpy(b.tier), _JobSpy(c.tier)
        chunk = a.tier.block_size_bytes
        assert chunk == b.tier.block_size_bytes == a.spec.kv_bytes_per_chunk

        keys = make_keys(6, seed="metrics")
        a.store(keys[:4])
        a.store(keys[4:])
        flip_a_bit(a.tier.engine.roots[0].layout.block_path(keys[1]))
        b.store(keys[4:])  # A already wrote them: outcome "present"

        vanishing = keys[2]
        absent = make_keys(2, seed="metrics-never-stored")

        def remove_before_load(key):
            if key == vanishing:  # found by the lookup, gone before the load runs
                os.unlink(b.tier.engine.roots[0].layout.block_path(key))

        # Two requests, so two load jobs: a job stops at its first failed
        # block (vLLM's prefix rule), and each failure should be seen.
        final = resolve(b, [keys[0], keys[3], keys[1], *absent])
        final.update(resolve(b, [vanishing], remove_before_load))
        wait_until(
            lambda: not c.tier.engine.roots[0].guard.allows_store(), "C's space guard to trip"
        )
        c.store(make_keys(2, seed="metrics-refused"))
        replicas = (a, b, c)
        for replica in replicas:
            replica.settle()
            # Gauges carry statvfs samples: wait for the first one.
            wait_until(
                lambda r=replica: r.tier.engine.roots[0].guard.usage is not None,
                "the space guard's first sample",
            )

        # What the engines timed, before the stats take it (submit to report).
        store_seconds = [sum(r.tier.engine.job_latencies[Direction.STORE]) for r in replicas]
        first = [take_stats(r, with_info=True) for r in replicas]
        counters = [collections.Counter(r.tier.engine.counters) for r in replicas]
        second = [take_stats(r, with_info=False) for r in replicas]

        registry = CollectorRegistry()
        prom = prom_metrics(a.spec.extra_config, registry, engines=len(replicas))
        for engine, stats in enumerate(first):
            prom.observe(stats.data, engine)
        scraped_first = snapshot(registry)
        for engine, stats in enumerate(second):
            prom.observe(stats.data, engine)
        scraped_second = snapshot(registry)

        yield types.SimpleNamespace(
            a=a,
            b=b,
            c=c,
            replicas=replicas,
            root=root,
            keys=keys,
            absent=absent,
            final=final,
            chunk=chunk,
            jobs=(spy_a, spy_b, spy_c),
            first=first,
            second=second,
            counters=counters,
            store_seconds=store_seconds,
            registry=registry,
            scraped=scraped_first,
            scraped_after_idle=scraped_second,
        )
    finally:
        for replica in reversed(made):
            replica.close()


def sample(sc, name: str, engine: int, **labels) -> float | None:
    labels = {"model_name": MODEL, "engine": str(engine), TIER_LABEL: "1:FsTier", **labels}
    return sc.registry.get_sample_value(name, labels)


def series(sc, name: str, engine: int, **labels) -> dict[tuple, float]:
    """Samples of one metric family for one engine, keyed by their extra labels."""
    out = {}
    for (sname, slabels), value in sc.scraped.items():
        d = dict(slabels)
        if sname != name or d.get("engine") != str(engine):
            continue
        if any(d.get(k) != v for k, v in labels.items()):
            continue
        extra = tuple((k, v) for k, v in slabels if k not in ("model_name", "engine", TIER_LABEL))
        out[extra] = value
    return out


# -- the scenario did what the assertions below assume ---------------------------------


def test_scenario_outcomes(scenario):
    sc = scenario
    keys = sc.keys
    assert sc.final == {
        keys[0]: HIT,
        keys[1]: MISS,
        keys[2]: MISS,
        keys[3]: HIT,
        sc.absent[0]: MISS,
        sc.absent[1]: MISS,
    }
    a, b, c = sc.counters
    assert c[Direction.STORE, Failure.SPACE] == 2
    assert a[Outcome.WRITTEN] == 6
    assert b[Outcome.PRESENT] == 2
    assert b[Outcome.VERIFIED] == 2
    assert b[Corruption.BAD_CHECKSUM] == 1
    assert b[Tally.QUARANTINED] == 1
    assert b[Direction.LOAD, Failure.MISSING] == 1


# -- (a) every name in the payload is declared, with its type and label count ----------


def test_payload_names_types_and_labels_are_declared(scenario):
    sc = scenario
    ours_seen = set()
    for replica, payloads in zip(sc.replicas, zip(sc.first, sc.second)):
        declared = TieringOffloadingSpec.build_metric_definitions(replica.spec.extra_config)
        for stats in payloads:
            types_, values = stats.metric_sections()
            assert set(values) <= set(types_)
            for name, kind in types_.items():
                assert name in declared, f"{name} is emitted but not declared"
                assert kind == kind_of(declared[name]), name
                for labelvalues in values.get(name, {}):
                    assert len(labelvalues) == len(declared[name].labelnames), (
                        name,
                        labelvalues,
                        declared[name].labelnames,
                    )
                if name.startswith(PREFIX):
                    ours_seen.add(name)
                    assert name in METRICS
    # The scenario exercised the whole table but deadlines and worker deaths
    # (its replicas run threads; tests/engine/workers/test_workers.py kills workers).
    not_seen = {PREFIX + "deadline_expiries", PREFIX + "io_worker_deaths"}
    assert ours_seen == set(METRICS) - not_seen, sorted(ours_seen ^ (set(METRICS) - not_seen))


def _extra_config(root: str = "/nonexistent/kv") -> dict:
    return dict(offloading_config(tiers=[ours(root)]).extra_config)


def test_metrics_table_is_what_the_spec_declares():
    declared = TieringOffloadingSpec.build_metric_definitions(_extra_config())
    vllms_own = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": []})
    assert FsTier.build_metric_definitions({}).keys() == METRICS.keys()
    assert not set(METRICS) & set(vllms_own)  # we add names, never redefine vLLM's
    for name, metric in METRICS.items():
        assert name.startswith(PREFIX)
        assert name in declared, name
        assert kind_of(declared[name]) == metric.kind
        assert tuple(declared[name].labelnames) == (TIER_LABEL, *metric.labels)
        # vLLM prefixes its own labels; a clash would break Prometheus.
        assert not set(metric.labelnames) & {"model_name", "engine", "le"}
        # Names are unique after Prometheus' suffixes.
        assert not name.endswith(("_total", "_bucket", "_sum", "_count", "_created"))


# -- (b) vLLM's Prometheus renderer: series exist with sane values --------------------


def test_prometheus_series_values(scenario):
    sc = scenario
    spy_a, spy_b, spy_c = sc.jobs
    chunk = sc.chunk
    P = PREFIX
    # Writer: 6 new files, chunk bytes each.
    assert sample(sc, P + "written_bytes_total", 0) == 6 * chunk
    assert sample(sc, P + "stored_blocks_total", 0, outcome="written") == 6
    assert sample(sc, P + "store_job_seconds_count", 0) == spy_a.stores >= 2
    assert sample(sc, P + "store_job_seconds_bucket", 0, le="+Inf") == spy_a.stores
    # Seconds as the engine timed them (not a bound on how long they took).
    assert sample(sc, P + "store_job_seconds_sum", 0) == pytest.approx(sc.store_seconds[0])
    assert sc.store_seconds[0] > 0
    # Reader: two present stores, two verified loads, one bit flip, one vanished file.
    assert sample(sc, P + "stored_blocks_total", 1, outcome="present") == 2
    assert (sample(sc, P + "written_bytes_total", 1) or 0) == 0  # present blocks move nothing
    assert sample(sc, P + "loaded_blocks_total", 1, verification="verified") == 2
    assert (sample(sc, P + "loaded_blocks_total", 1, verification="unverified") or 0) == 0
    assert sample(sc, P + "read_bytes_total", 1) == 2 * chunk
    assert sample(sc, P + "load_failures_total", 1, reason="corrupt") == 1
    assert sample(sc, P + "load_failures_total", 1, reason="missing") == 1
    corrupt = series(sc, P + "corrupt_blocks_total", 1)
    assert sum(corrupt.values()) == 1
    ((reason,),) = list(corrupt)
    assert reason[0] == "reason" and reason[1] in ("checksum", "bad-checksum")
    assert sample(sc, P + "quarantined_files_total", 1) == 1
    assert (sample(sc, P + "deadline_expiries_total", 1) or 0) == 0
    assert sample(sc, P + "load_job_seconds_count", 1) == spy_b.loads >= 1
    assert sample(sc, P + "store_job_seconds_count", 1) == spy_b.stores >= 1
    # Lookups: 4 stored keys found by the tier, 2 never stored + 2 failed loads missed,
    # every key's first answer was RETRY (the check runs off-thread).
    assert sample(sc, P + "lookups_total", 1, result="hit") == 4
    assert sample(sc, P + "lookups_total", 1, result="miss") >= 4
    assert sample(sc, P + "lookups_total", 1, result="retry") >= 6
    assert (sample(sc, P + "lookups_total", 1, result="deadline_miss") or 0) == 0
    # Refused by the space guard: counted as failures, never observed as jobs.
    assert spy_c.stores >= 1
    assert sample(sc, P + "store_failures_total", 2, reason="space") == 2
    assert series(sc, P + "store_failures_total", 2) == {(("reason", "space"),): 2}
    assert (sample(sc, P + "written_bytes_total", 2) or 0) == 0
    assert (sample(sc, P + "store_job_seconds_count", 2) or 0) == 0
    for engine in (0, 1):
        assert series(sc, P + "store_failures_total", engine) == {}


def test_prometheus_gauges_present(scenario):
    sc = scenario
    P = PREFIX
    for engine, replica in enumerate(sc.replicas):
        for direction in ("store", "load"):
            assert sample(sc, P + "queued_blocks", engine, direction=direction) == 0
        assert sample(sc, P + "busy_places", engine) == 0
        assert sample(sc, P + "held_blocks", engine) == 0
        assert (
            sample(sc, P + "io_places", engine) == inside(replica.tier.engine).executor.capacity()
        )
        assert sample(sc, P + "stuck_blocks", engine) == 0
        tripped = 1 if replica is sc.c else 0
        root = replica.tier.settings.root_dir
        assert sample(sc, P + "space_guard_tripped", engine, root=root) == tripped
        assert sample(sc, P + "volume_failed", engine, root=root) == 0
        used = sample(sc, P + "volume_used_bytes", engine, root=root)
        free = sample(sc, P + "volume_free_bytes", engine, root=root)
        st = os.statvfs(sc.root)
        assert 0 < used <= st.f_blocks * st.f_frsize
        assert 0 < free <= st.f_blocks * st.f_frsize


def test_every_counter_reaches_prometheus_exactly(scenario):
    """Scraped counter values equal the engine's cumulative counters mapped
    through the table: nothing lost, nothing counted twice."""
    sc = scenario
    for engine, counters in enumerate(sc.counters):
        expected: collections.Counter = collections.Counter()
        for key, total in counters.items():
            expected[counter_series(key)] += total
        for (name, labels), total in expected.items():
            metric = METRICS[name]
            got = sample(sc, f"{name}_total", engine, **dict(zip(metric.labels, labels))) or 0
            assert got == total, (engine, name, labels)


def test_our_series_join_vllms_tier_label(scenario):
    sc = scenario
    for engine, replica in enumerate(sc.replicas):
        (_, tier_info) = replica.manager.config_info()
        label = tier_info[TIER_LABEL]
        ours_labels = {
            v[0]
            for name, d in sc.first[engine].metric_sections()[1].items()
            if name.startswith(PREFIX)
            for v in d
        }
        assert ours_labels == {label}
        # vLLM's own tiering series for the same tier carry the same value.
        assert (
            sample(sc, "vllm:kv_offload_tiering_active_cascade_jobs", engine, tier=label)
            is not None
        )


def test_config_info_series_carries_our_labels(scenario):
    sc = scenario
    extra_config = sc.a.spec.extra_config
    (tier_config,) = extra_config["secondary_tiers"]
    our_keys = FsTier.config_info_keys(tier_config)
    assert our_keys and all(k.startswith("llmkv_fs_") for k in our_keys)
    assert set(our_keys) <= set(TieringOffloadingSpec.config_info_keys(extra_config))
    for engine, replica in enumerate(sc.replicas):
        info = replica.tier.config_info()
        assert set(info) == set(our_keys)  # vLLM warns about (and drops) any mismatch
        rows = [
            dict(labels)
            for (name, labels), value in sc.scraped.items()
            if name == KV_OFFLOAD_CONFIG_INFO
            and value == 1
            and dict(labels).get("engine") == str(engine)
        ]
        (ours_row,) = [r for r in rows if r[TIER_LABEL] == "1:FsTier"]
        for key in our_keys:
            assert ours_row[key] == str(info[key]), key
        assert ours_row["llmkv_fs_version"] == llmkv_fs.__version__
        assert ours_row["llmkv_fs_read_threads"] == "2"
        assert ours_row["llmkv_fs_write_threads"] == "2"
        assert ours_row["llmkv_fs_io_mode"] in ("direct", "buffered")
        # The primary tier's series leaves our labels empty.
        (primary,) = [r for r in rows if r[TIER_LABEL] != "1:FsTier"]
        assert all(primary[key] == "" for key in our_keys)


# -- (c) deltas -----------------------------------------------------------------------


def test_idle_get_stats_reports_no_increments(scenario):
    sc = scenario
    for stats in sc.second:
        types_, values = stats.metric_sections()
        ours = {n: types_[n] for n in values if n.startswith(PREFIX)}
        assert {n for n, k in ours.items() if k != "gauge"} == set(), ours
        # Gauges are a snapshot, sent every time.
        assert {PREFIX + "busy_places", PREFIX + "queued_blocks"} <= set(ours)
        for name, kind in types_.items():
            if kind == "counter":
                assert all(v == 0 for v in values[name].values()), name
    # ... and the scrape did not move.
    counters = {
        k: v
        for k, v in sc.scraped.items()
        if k[0].startswith(PREFIX) and k[0].endswith(("_total", "_count", "_bucket", "_sum"))
    }
    assert counters
    assert all(sc.scraped_after_idle[k] == v for k, v in counters.items())


# -- (d) every counter key the engine can produce has a declared, documented series ------


def _check_counter_keys(keys) -> list[str]:
    bad = []
    for key in keys:
        name, labels = counter_series(key)
        metric = METRICS.get(name)
        if metric is None:
            bad.append(f"{key}: maps to undeclared {name}")
        elif metric.kind != "counter" or len(labels) != len(metric.labels):
            bad.append(f"{key}: {name}{labels} does not fit {metric}")
    return bad


def test_every_counter_key_maps_to_a_declared_metric():
    keys = list(all_counter_keys())
    assert len(set(keys)) == len(keys)
    assert _check_counter_keys(keys) == []
    # Distinct keys feed distinct series: nothing is counted twice.
    series_ = [counter_series(key) for key in keys]
    assert len(set(series_)) == len(series_)


def test_counters_of_the_scenario_are_known_keys(scenario):
    keys = set().union(*(c.keys() for c in scenario.counters))
    assert len(keys) >= 10
    assert keys <= set(all_counter_keys()), keys - set(all_counter_keys())


def _doc_label_values() -> dict[str, set[str]]:
    """The "Label values" table of docs/metrics.md: row title -> values."""
    rows = {}
    text = (REPO / "docs/metrics.md").read_text()
    table = text.split("### Label values", 1)[1].split("\n\n", 2)[1]
    for line in table.splitlines()[2:]:
        title, values = line.strip("|").split("|")[:2]
        rows[" ".join(re.findall(r"`([^`]+)`", title))] = set(re.findall(r"`([^`]+)`", values))
    return rows


def _help_words(metric: str) -> set[str]:
    """The label values a metric's HELP text lists after its colon."""
    listed = METRICS[PREFIX + metric].doc.split(":", 1)[1]
    return set(re.findall(r"[a-z][a-z_-]*[a-z]", re.sub(r"\([^)]*\)", "", listed)))


def test_every_reason_has_a_documented_label():
    """Adding a Failure, Corruption, LookupAnswer or Outcome member is one
    edit; this test then asks for its line in docs/metrics.md and its word in
    the metric's HELP text."""
    docs = _doc_label_values()
    store, load = docs["store_failures reason"], docs["load_failures reason"]
    assert store | load == {f.value for f in Failure}, (store | load) ^ {f.value for f in Failure}
    assert store <= _help_words("store_failures"), store - _help_words("store_failures")
    assert load <= _help_words("load_failures"), load - _help_words("load_failures")
    corrupt = {c.value for c in Corruption}
    assert docs["corrupt_blocks reason"] == corrupt
    assert corrupt <= _help_words("corrupt_blocks")
    assert docs["result"] == {a.value for a in LookupAnswer} <= _help_words("lookups")
    for label, direction, metric in (
        ("outcome", Direction.STORE, "stored_blocks"),
        ("verification", Direction.LOAD, "loaded_blocks"),
    ):
        values = {o.value for o in Outcome if o.direction is direction}
        assert docs[label] == values <= _help_words(metric), label
    assert docs["direction"] == {d.value for d in Direction}
    assert docs["root_blocks result"] == {"ok", "failed"} <= _help_words("root_blocks")
    assert set(docs) == {
        "root_blocks result",
        "store_failures reason",
        "load_failures reason",
        "corrupt_blocks reason",
        "result",
        "outcome",
        "verification",
        "direction",
    }


def test_tallies_have_their_own_metric():
    names = [counter_series(t)[0] for t in Tally]
    assert len(set(names)) == len(Tally) and all(METRICS[n].labels == () for n in names)


# -- docs/metrics.md and the dashboard name only declared metrics -----------------------


def _doc_rows() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The metric table of docs/metrics.md: name -> (type, labels)."""
    rows = {}
    for line in (REPO / "docs/metrics.md").read_text().splitlines():
        m = re.match(r"\|\s*`(vllm:kv_offload_llmkv_fs_[a-z_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            labels = tuple(re.findall(r"`([a-z_]+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def test_metrics_doc_lists_every_metric_with_type_and_labels():
    text = (REPO / "docs/metrics.md").read_text()
    rows = _doc_rows()
    for name, metric in METRICS.items():
        assert name in text
        assert name in rows, f"{name} has no row in the docs/metrics.md table"
        assert rows[name] == (metric.kind, metric.labelnames), name
    assert set(rows) == set(METRICS), set(rows) ^ set(METRICS)
    # config_info labels are documented too.
    for key in FsTier.config_info_keys({}):
        assert f"`{key}`" in text, key


def _load_checker():
    return importlib.import_module("tools.dashboard.check")


def _declared() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Everything vLLM's Prometheus logger would accept for our configuration:
    name -> kind and name -> label names (vLLM's own labels excluded)."""
    extra_config = _extra_config()
    declared = {
        **TieringOffloadingSpec.build_metric_definitions(extra_config),
        **get_connector_metric_definitions(),
    }
    kinds = {name: kind_of(md) for name, md in declared.items()}
    labels = {name: tuple(md.labelnames) for name, md in declared.items()}
    kinds[KV_OFFLOAD_CONFIG_INFO] = "gauge"
    labels[KV_OFFLOAD_CONFIG_INFO] = TieringOffloadingSpec.config_info_keys(extra_config)
    return kinds, labels


def test_dashboard_uses_only_declared_metrics():
    checker = _load_checker()
    dashboard = json.loads((REPO / "docs/grafana-llmkv-fs.json").read_text())
    kinds, labels = _declared()
    problems, used = checker.check(dashboard, kinds, labels, engine_labels=ENGINE_LABELS)
    assert problems == []
    ours_used = {n for n in used if n.startswith(PREFIX)}
    assert ours_used <= set(METRICS)
    # The dashboard charts every metric of the table.
    assert set(METRICS) - ours_used == set(), sorted(set(METRICS) - ours_used)


def test_metric_names_in_docs_are_declared():
    """Every vllm:... name in docs/metrics.md and docs/deployment.md (tables,
    alert rules, queries) is a declared metric, with a suffix its type has --
    or, in the tables, the declared name itself."""
    checker = _load_checker()
    kinds, _ = _declared()
    for doc in ("docs/metrics.md", "docs/deployment.md"):
        text = (REPO / doc).read_text()
        for token in set(re.findall(r"(?<![\w:])(vllm:[A-Za-z0-9_:]+)", text)):
            if token in kinds or token.endswith("_"):
                continue  # a declared name as written in a table, or a family ("..._*")
            _name, problem = checker._resolve(token, kinds)
            assert problem is None, f"{doc}: {problem}"


def test_dashboard_checker_catches_mistakes():
    checker = _load_checker()
    kinds = {m.name: m.kind for m in METRICS.values()}
    labels = {m.name: m.labelnames for m in METRICS.values()}

    def board(expr):
        return {
            "schemaVersion": 39,
            "uid": "x",
            "title": "x",
            "templating": {
                "list": [{"type": "datasource", "name": "datasource", "query": "prometheus"}]
            },
            "panels": [
                {
                    "id": 1,
                    "type": "timeseries",
                    "title": "t",
                    "gridPos": {"x": 0, "y": 0, "w": 1, "h": 1},
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "targets": [{"refId": "A", "expr": expr}],
                }
            ],
        }

    ok = f"sum(rate({PREFIX}written_bytes_total[5m]))"
    assert checker.check(board(ok), kinds, labels)[0] == []
    for wrong in (
        f"rate({PREFIX}written_bytes[5m])",  # counter without _total
        f"rate({PREFIX}writen_bytes_total[5m])",  # not declared
        f"{PREFIX}busy_threads_total",  # gauge with _total
        f"{PREFIX}store_job_seconds_total",  # histogram as counter
        f'rate({PREFIX}lookups_total{{reslt="hit"}}[5m])',
    ):  # unknown label
        assert checker.check(board(wrong), kinds, labels)[0], wrong


# -- docs/deployment.md: its YAML parses --------------------------------------------------


def test_deployment_yaml_blocks_parse():
    yaml = pytest.importorskip("yaml")
    text = (REPO / "docs/deployment.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 3
    kinds = []
    for block in blocks:
        docs = [d for d in yaml.safe_load_all(block) if d is not None]
        assert docs, block[:80]
        for doc in docs:
            assert isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc, block[:80]
            kinds.append(doc["kind"])
    assert {"PersistentVolumeClaim", "Deployment", "CronJob"} <= set(kinds)
    # The kv-transfer-config in the Deployment is valid JSON naming our tier.
    configs = [
        json.loads(arg.split("=", 1)[1]) if "=" in arg else None
        for block in blocks
        for doc in yaml.safe_load_all(block)
        if doc
        for arg in _container_args(doc)
        if arg.startswith("--kv-transfer-config")
    ]
    configs = [c for c in configs if c]
    assert configs
    for config in configs:
        extra = config["kv_connector_extra_config"]
        assert config["kv_connector"] == "OffloadingConnector"
        assert extra["spec_name"] == "TieringOffloadingSpec"
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "llmkv_fs"
        from llmkv_fs.config import TierSettings

        # vLLM's factory consumes type, module_path and backpressure; the rest is ours.
        TierSettings.from_mapping(
            {k: v for k, v in tier.items() if k not in ("type", "module_path", "backpressure")}
        )


def _container_args(doc) -> list[str]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [a for c in spec.get("containers", []) for a in c.get("args", []) or []]
