"""Generated Grafana dashboards: committed = generated, strict schemas, names, layout, links.

The queries themselves are run against real Prometheus data in
tests/integration/test_dashboard_queries.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import build, grafana, scenarios, validate
from dashboards.generate import JSON_DIR, generate
from dashboards.panels import (
    DASHBOARDS,
    DATASOURCE_UID,
    LOCAL_STEPS,
    PENDING,
    RUNBOOKS_URL,
    VARIABLES,
)
from dashboards.spec import Dashboard, Panel, Query, Row, Scenario, metric_names
from exporter.catalogue import CATALOGUE, MetricDef
from exporter.thresholds import DEFAULT as THRESHOLDS
from exporter.vllm_metrics import SERIES, family_of
from testbed import backfill

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "tests" / "fixtures"


def committed(dash: Dashboard) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / JSON_DIR / dash.file).read_text())
    return data


def graph_panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in validate.panels_of(doc) if p["type"] != "row"]


IDS = [d.uid for d in DASHBOARDS]


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return generate(quiet=True)


# ----------------------------------------------------------------------------- drift


def test_committed_artefacts_equal_generator_output(generated: dict[str, str]) -> None:
    stale = [
        rel
        for rel, content in generated.items()
        if not (REPO / rel).exists() or (REPO / rel).read_text(encoding="utf-8") != content
    ]
    assert not stale, f"out of date, run ./run gen: {stale}"


def test_generator_is_registered_in_scripts_gen() -> None:
    from scripts.gen import GENERATORS

    outputs = {rel for gen in GENERATORS for rel in gen()}
    assert {f"{JSON_DIR}/{d.file}" for d in DASHBOARDS} <= outputs
    assert "docs/dashboards.md" in outputs


def test_sdk_is_the_pinned_release() -> None:
    from importlib.metadata import version

    assert version("grafana-foundation-sdk").lstrip("v") == "0.0.21"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"grafana-foundation-sdk==0.0.21"' in pyproject


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_dashboard_passes_grafana_schemas_strictly(dash: Dashboard) -> None:
    doc = committed(dash)
    assert validate.problems(doc) == []
    assert doc["schemaVersion"] >= 42


def test_validator_reports_each_kind_of_breakage() -> None:
    doc = copy.deepcopy(committed(DASHBOARDS[0]))
    stat = next(p for p in doc["panels"] if p["type"] == "stat")
    series = next(p for p in doc["panels"] if p["type"] == "timeseries")
    stat["options"]["colorMode"] = "rainbow"
    series["gridPos"]["w"] = "12"
    series["targets"][0]["exprr"] = "up"
    series["fieldConfig"]["defaults"]["unit"] = "furlongs"
    series["fieldConfig"]["defaults"]["custom"]["lineWidht"] = 2
    doc["schemaVersion"] = 30
    doc["styles"] = "dark"
    text = "\n".join(validate.problems(doc))
    for expected in (
        "'rainbow' is not one of",
        "'12' is not of type 'integer'",
        "'exprr' was unexpected",
        "unit 'furlongs'",
        "'lineWidht' was unexpected",
        "schemaVersion: 30 < 36",
        "'styles' was unexpected",
    ):
        assert expected in text


def test_schema_copies_equal_the_shared_schemas() -> None:
    shared = SHARED / "schemas" / "grafana"
    if not shared.is_dir():
        pytest.skip("../shared is not present (a clean clone); the copies are what CI uses")
    for path in sorted(validate.SCHEMAS.glob("*.jsonschema.json")):
        assert path.read_bytes() == (shared / path.name).read_bytes(), path.name
    assert "f178d5a42a8915fdda9235e97ad93881e3f94fef" in (validate.SCHEMAS / "SOURCE").read_text()


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_ids_ref_ids_and_titles_unique(dash: Dashboard) -> None:
    doc = committed(dash)
    ids = [p["id"] for p in validate.panels_of(doc)]
    assert len(ids) == len(set(ids)) and all(i > 0 for i in ids)
    titles = [p["title"] for p in graph_panels(doc)]
    assert len(titles) == len(set(titles))
    for p in graph_panels(doc):
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
    assert len({d.uid for d in DASHBOARDS}) == len(DASHBOARDS)


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_grid_fits_24_columns_without_overlap(dash: Dashboard) -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in validate.panels_of(committed(dash)):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells.get((x, y))}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_every_panel_uses_the_datasource_variable(dash: Dashboard) -> None:
    doc = committed(dash)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == DATASOURCE_UID
    for p in graph_panels(doc):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    for v in VARIABLES:
        q = variables[v.name]
        assert q["type"] == "query" and q["datasource"]["uid"] == "${datasource}"
        assert q["includeAll"] and q["multi"] and q["allValue"] == ".*"
    assert [v["name"] for v in doc["templating"]["list"]] == [
        "datasource",
        "job",
        "target",
        "instance",
        "model_name",
        "engine",
    ]


def test_provisioned_datasource_uid_and_dashboard_path() -> None:
    ds = yaml.safe_load((REPO / "dashboards/provisioning/datasources/kv-offload.yaml").read_text())
    assert ds["datasources"][0]["uid"] == DATASOURCE_UID
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((REPO / "dashboards/provisioning/dashboards/kv-offload.yaml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/kv-offload"


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_every_panel_has_a_unit_and_a_description(dash: Dashboard) -> None:
    for p in graph_panels(committed(dash)):
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit and validate.unit_ok(unit), p["title"]
        assert len(p.get("description", "")) >= 60, p["title"]


def test_threshold_values_come_from_thresholds_py() -> None:
    shared = {f.name: getattr(THRESHOLDS, f.name) for f in dataclasses.fields(THRESHOLDS)}
    allowed = set(shared.values()) | set(LOCAL_STEPS.values())
    for dash in DASHBOARDS:
        for p in graph_panels(committed(dash)):
            for step in p["fieldConfig"]["defaults"]["thresholds"]["steps"]:
                assert step["value"] is None or step["value"] in allowed, (p["title"], step)
    # the numbers the alert rules and the advisor use, on the panels that show them
    steps = {
        p.key: [s.value for s in p.steps if s.value is not None]
        for d in DASHBOARDS
        for p in d.panels()
    }
    assert steps["decision.hit_ratios"] == [THRESHOLDS.offload_hit_ratio_material]
    assert steps["decision.speedup"] == [THRESHOLDS.transfer_speedup_min]
    assert steps["decision.reuse"] == [THRESHOLDS.reuse_ratio_low]
    assert steps["decision.wasted_store_share"] == [THRESHOLDS.wasted_store_share_high]
    assert steps["decision.kv_usage"] == [THRESHOLDS.kv_usage_high, THRESHOLDS.kv_usage_critical]
    assert steps["decision.memory_usage_ratio"] == [THRESHOLDS.memory_usage_high]
    assert steps["transfers.pcie_utilization"] == [THRESHOLDS.pcie_utilization_high]


# ----------------------------------------------------------------------------- names


def _all_exprs(doc: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in graph_panels(doc) for t in p["targets"]]
    return exprs + [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_every_metric_name_is_catalogued(dash: Dashboard) -> None:
    names = set()
    for expr in _all_exprs(committed(dash)):
        names |= metric_names(expr)
    assert names, "no metric names found: the extractor is broken"
    for name in names:
        if name.startswith("kvoffload_"):
            assert name in CATALOGUE, f"{name} is not in exporter/catalogue.csv"
        else:
            assert family_of(name) is not None, f"{name} is not in exporter/vllm_metrics.py SERIES"


def test_metric_name_extractor_finds_every_name_form() -> None:
    expr = (
        'sum(rate(vllm:kv_offload_load_bytes_total{a=~"$x"}[$__rate_interval])) / '
        'kvoffload_offload_hit_ratio and on (instance) kvoffload_target_up{job="j"} '
        'label_values({__name__=~"kvoffload_build_info|vllm:cache_config_info"}, job)'
    )
    assert metric_names(expr) == {
        "vllm:kv_offload_load_bytes_total",
        "kvoffload_offload_hit_ratio",
        "kvoffload_target_up",
        "kvoffload_build_info",
        "vllm:cache_config_info",
    }


def test_vllm_names_are_in_the_shared_vllm_catalogue() -> None:
    notes = SHARED / "notes" / "vllm-metrics-and-kv-events.md"
    if not notes.exists():
        pytest.skip("../shared is not present (a clean clone)")
    text = notes.read_text()
    used = build.vllm_series()
    assert "vllm:time_to_first_token_seconds" in used, "vllm_series() finds too little"
    for name in used:
        bare = name.removesuffix("_total")
        assert f"`{name}`" in text or f"`{bare}`" in text or f"{bare}_" in text, name


def test_vllm_names_appear_in_recorded_expositions() -> None:
    recorded = "".join(
        p.read_text()
        for p in [
            *(FIXTURES / "vllm-0.26.0-h200" / "b_offload").glob("metrics_*.txt"),
            *(FIXTURES / "vllm-0.32.0-cpu").glob("*.prom"),
        ]
    )
    for name, series in SERIES.items():
        if series.condition:
            continue
        assert re.search(re.escape(name) + r"[ {_]", recorded), name


def test_generator_fails_on_an_unknown_name_unless_pending(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bogus = Panel(
        key="test.bogus",
        title="Bogus",
        kind="timeseries",
        unit="short",
        description="x" * 60,
        queries=(Query("kvoffload_no_such_metric"),),
        scenarios=frozenset({Scenario.LIVE}),
    )
    good = dataclasses.replace(
        bogus, key="test.good", title="Good", queries=(Query("kvoffload_target_up"),)
    )
    dash = Dashboard("t", "T", "d", "t.json", (Row("r", (bogus, good)),))
    with pytest.raises(build.GeneratorError, match="kvoffload_no_such_metric"):
        build.select(dash, pending={})
    sel = build.select(dash, pending={"test.bogus": "a test"})
    assert [p.key for p in sel.panels] == ["test.good"]
    build.warn(sel)
    assert "test.bogus" in capsys.readouterr().err
    vllm_typo = dataclasses.replace(good, queries=(Query("vllm:kv_offload_lod_bytes_total"),))
    with pytest.raises(build.GeneratorError, match=r"vllm_metrics\.py SERIES"):
        build.select(Dashboard("t", "T", "d", "t.json", (Row("r", (vllm_typo,)),)), pending={})


def test_pending_panels_are_real_and_valid_once_their_rows_exist() -> None:
    keys = {p.key for d in DASHBOARDS for p in d.panels()}
    assert set(PENDING) <= keys
    needed = {n for d in DASHBOARDS for p in d.panels() for n in p.metrics}
    full = dict(CATALOGUE)
    for n in needed:
        if n.startswith("kvoffload_") and n not in full:
            full[n] = MetricDef(n, "gauge", "", (), "derive", "placeholder for the test")
    for dash in DASHBOARDS:
        sel = build.select(dash, catalogue=full)
        assert not sel.skipped
        assert len(sel.panels) == len(dash.panels())
        assert validate.problems(build.build(sel)) == []


def test_every_panel_declares_a_scenario() -> None:
    for d in DASHBOARDS:
        for p in d.panels():
            assert p.scenarios, p.key


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("dash", DASHBOARDS, ids=IDS)
def test_dashboards_link_to_each_other_and_to_the_runbooks(dash: Dashboard) -> None:
    doc = committed(dash)
    kinds = {(link["type"], tuple(link.get("tags", ()))) for link in doc["links"]}
    assert ("dashboards", ("kv-offload",)) in kinds
    assert any(link.get("url") == RUNBOOKS_URL for link in doc["links"])
    assert "kv-offload" in doc["tags"]
    uids = {d.uid for d in DASHBOARDS}
    linked = set()
    for p in graph_panels(doc):
        for link in p.get("links", []):
            if link["title"].startswith("Runbook: "):
                alert = link["title"].removeprefix("Runbook: ")
                assert link["url"] == f"{RUNBOOKS_URL}#{alert.lower()}"
            else:
                m = re.fullmatch(
                    r"/d/([\w-]+)\?\$\{__url_time_range\}&\$\{__all_variables\}", link["url"]
                )
                assert m and m.group(1) in uids - {dash.uid}, link
                linked.add(m.group(1))
    assert linked, f"{dash.uid}: no panel links to another dashboard"


def test_runbook_links_name_existing_alerts() -> None:
    rules = list((REPO / "alerts").glob("*.y*ml"))
    if not rules:
        pytest.skip("no alert rules in alerts/ yet")
    defined = set()
    for path in rules:
        for doc in yaml.safe_load_all(path.read_text()):
            for group in (doc or {}).get("groups", []):
                defined |= {r["alert"] for r in group.get("rules", []) if "alert" in r}
    used = {a for d in DASHBOARDS for p in d.panels() for a in p.runbooks}
    assert used <= defined, f"runbook links to alerts that do not exist: {used - defined}"


# ----------------------------------------------------------------------------- Grafana emulation


def test_intervals_follow_grafana() -> None:
    # 1 h at 15 s scrape on a 12-column panel (960 px): 3.75 s -> 5 s, below the scrape floor
    t = grafana.timing(0, 3600, 15, 960)
    assert (t.step, t.builtins["__interval"], t.builtins["__rate_interval"]) == (15, "15s", "1m0s")
    assert t.builtins["__range"] == "3600s" and t.builtins["__range_ms"] == "3600000"
    # 24 h on 960 px: 90 s -> rounds to 1m; rate = 1m + 15s
    t = grafana.timing(0, 86400, 15, 960)
    assert (t.step, t.builtins["__rate_interval"]) == (60, "1m15s")
    # 2 min at 1 s scrape: floor of 1 s, rate 4 x scrape
    t = grafana.timing(100, 220, 1, 960)
    assert (t.builtins["__interval"], t.builtins["__rate_interval"]) == ("1s", "4s")
    assert grafana.go_duration(3_600_000) == "1h0m0s" and grafana.go_duration(500) == "500ms"
    # the range is aligned down to the step
    t = grafana.timing(1007, 4607, 15, 960)
    assert t.start == 1005 and t.end == 4605


def test_variables_are_escaped_like_grafana() -> None:
    var = {"name": "target", "multi": True, "includeAll": True, "allValue": ".*"}
    assert grafana.format_variable(var, ["$__all"]) == ".*"
    assert grafana.format_variable(var, ["127.0.0.1:8000"]) == "127\\\\.0\\\\.0\\\\.1:8000"
    assert grafana.format_variable(var, ["a", "b(c)"]) == "(a|b\\\\(c\\\\))"
    expr = 'x{target=~"$target"}[$__rate_interval]'
    out = grafana.interpolate(expr, [var], {"target": ["a.b"]}, {"__rate_interval": "4s"})
    assert out == 'x{target=~"a\\\\.b"}[4s]'
    with pytest.raises(KeyError):
        grafana.interpolate("$nope", [var], {})


def test_every_query_is_valid_promql_after_substitution(promtool: str, tmp_path: Path) -> None:
    """promtool parses each substituted expression as a recording rule."""
    rules = []
    for dash in DASHBOARDS:
        doc = committed(dash)
        variables = [v for v in doc["templating"]["list"] if v["type"] == "query"]
        for chosen in (
            {v["name"]: ["$__all"] for v in variables},
            {v["name"]: ["a.b:80", "c|d"] for v in variables},
        ):
            for p in graph_panels(doc):
                t = grafana.timing(0, 3600, 15, grafana.max_data_points(p))
                for target in p["targets"]:
                    expr = grafana.interpolate(target["expr"], variables, chosen, t.builtins)
                    rules.append({"record": f"r{len(rules)}", "expr": expr})
            for v in variables:
                selector, _ = grafana.parse_label_values(v["query"])
                if selector:
                    expr = grafana.interpolate(selector, variables, chosen)
                    rules.append({"record": f"r{len(rules)}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(rules)} rules found" in proc.stdout


# ----------------------------------------------------------------------------- backfill


def test_interpolation_ends_on_the_recordings_and_keeps_counters_monotonic() -> None:
    d = FIXTURES / "vllm-0.26.0-h200" / "b_offload"
    before, after = (d / "metrics_before.txt").read_text(), (d / "metrics_after.txt").read_text()
    texts = backfill.interpolate(before, after, 4)
    assert len(texts) == 5
    key = 'vllm:kv_offload_load_bytes_total{engine="0",model_name="qwen3-dummy"}'
    values = [backfill._samples(t)[1].get(key) for t in texts]
    assert values[0] is None  # created lazily by vLLM: absent before the workload
    assert values[1:] == sorted(values[1:]) and values[-1] == 8.4410368e08
    hits = 'vllm:prefix_cache_hits_total{engine="0",model_name="qwen3-dummy"}'
    assert backfill._samples(texts[0])[1][hits] == backfill._samples(before)[1][hits]
    assert backfill._samples(texts[-1])[1] == backfill._samples(after)[1]


def test_openmetrics_output_is_accepted_by_promtool(promtool: str, tmp_path: Path) -> None:
    d = FIXTURES / "vllm-0.26.0-h200" / "b_offload"
    texts = backfill.interpolate(
        (d / "metrics_before.txt").read_text(), (d / "metrics_after.txt").read_text(), 2
    )
    series = backfill.Series("vllm", "h:1", backfill.evenly(texts, 1_800_000_000, 15))
    om = backfill.openmetrics([series])
    assert om.endswith("# EOF\n")
    assert "# TYPE vllm:kv_offload_load_bytes counter" in om and "_created" not in om
    backfill.create_blocks(om, tmp_path / "data", promtool)
    assert any((tmp_path / "data").iterdir())


def test_gpu_scenario_exporter_is_the_current_code_over_the_recording() -> None:
    """At every scrape time of the recorded exporter: the current exporter's families (the
    KV-event evidence among them, from the recorded events), and the recorded exporter's
    families that need the H200 host (NVML here)."""
    recorded = scenarios._recorded(scenarios.GPU_RUN, "exporter")
    merged = scenarios.current_exporter(scenarios.GPU_RUN)
    assert [t for t, _ in merged] == [t for t, _ in recorded]
    first_event = min(
        m.batch.ts for m in scenarios.read_kv_events(scenarios.GPU_RUNS / scenarios.GPU_RUN)
    )
    for (t, body), (_, old) in zip(merged, recorded, strict=True):
        families = scenarios._families(body)
        then = scenarios._families(old)
        assert set(then) <= set(families)  # every recorded family, from one side or the other
        rx = "kvoffload_gpu_pcie_rx_bytes_total"  # NVML: the recorded exporter's
        assert families.get(rx) == then.get(rx)
        samples = [line.rpartition(" ")[0] for line in body.splitlines() if line[:1] != "#"]
        assert len(samples) == len(set(samples)), "a family came from both sides"
        if t > first_event + 5:
            assert rx in families
            assert "kvoffload_offload_wasted_store_ratio" in families
            assert "kvoffload_reuse_gap_bytes" in families
    # the run's exporter flags: its what-if sizes and its shorter evidence window
    settings = scenarios.recorded_settings(scenarios.GPU_RUN)
    assert settings.whatif_sizes[0] == 134217728 and settings.thresholds.min_window_seconds == 15
    assert settings.targets[0].kv_bytes_per_token == 114688


def test_gpu_scenario_large_run_starts_from_its_engine_before_offload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """large-b's exporter starts from large-a's remembered TTFT fit (the state file keyed to
    large-b's target), so what enabling delivered and the TTFT the tier adds to a request
    are exported; without that state neither is."""
    delivered = "kvoffload_offload_delivered_ttft_saved_seconds_per_second"
    cost = "kvoffload_offload_request_ttft_cost_seconds"

    def values(family: str, bodies: list[tuple[float, str]]) -> list[float]:
        return [
            float(line.rsplit(" ", 1)[1])
            for _, body in bodies
            for line in body.splitlines()
            if line.startswith(family + "{")
        ]

    remembered = scenarios.current_exporter(scenarios.GPU_RUN_LARGE)
    assert values(delivered, remembered) and values(cost, remembered)
    assert all(math.isfinite(v) for v in values(cost, remembered))
    monkeypatch.setattr(scenarios, "GPU_RUN_STATE", {})
    forgotten = scenarios.current_exporter(scenarios.GPU_RUN_LARGE)
    assert not values(delivered, forgotten) and not values(cost, forgotten)


def test_merged_exposition_takes_each_family_whole_from_one_side() -> None:
    current = "# HELP a x\n# TYPE a gauge\na 1\n# HELP b x\n# TYPE b gauge\n"
    recorded = '# TYPE a gauge\na{x="old"} 2\n# TYPE b gauge\nb 3\n# TYPE c gauge\nc 4\n'
    assert scenarios.merged(current, recorded) == (
        "# HELP a x\n# TYPE a gauge\na 1\n# TYPE b gauge\nb 3\n# TYPE c gauge\nc 4\n"
    )
