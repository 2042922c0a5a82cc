"""Every dashboard query, run as Grafana would, against real Prometheus data.

Scenarios (dashboards/scenarios.py): `live` is a real vLLM CPU server with the seed
workload, the exporter beside it and a Prometheus scraping both; `offload` is the
recorded H200 offload run replayed through the exporter's code and backfilled with
promtool; `gpu` is two recorded H200 runs (tests/fixtures/gpu/small-b-graphs-long, large-b):
vLLM's /metrics, the current exporter run over each recording (its /metrics and KV events)
and the recorded exporter's real NVML, /proc and cgroup data, backfilled at their recorded
1 s spacing.

The queries come from the committed JSON, so these tests prove what users import.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dashboards import preview, scenarios
from dashboards.grafana import Emulator, TargetResult
from dashboards.panels import DASHBOARDS
from dashboards.scenarios import Data
from dashboards.spec import Dashboard, Panel, Scenario
from exporter.recording import read_scrapes
from exporter.thresholds import DEFAULT as THRESHOLDS

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS_BY_UID = {d.uid: d for d in DASHBOARDS}
DOCS = {d.uid: json.loads((REPO / "dashboards" / "json" / d.file).read_text()) for d in DASHBOARDS}
NOTHING = "no-such-value-anywhere"


def specs(dash: Dashboard) -> dict[str, Panel]:
    return {p.title: p for p in dash.panels()}


def graph_panels(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


@pytest.fixture(scope="module")
def offload_data(
    tmp_path_factory: pytest.TempPathFactory, prometheus_available: None, promtool: str
) -> Iterator[Data]:
    with scenarios.offload(tmp_path_factory.mktemp("offload")) as data:
        yield data


@pytest.fixture(scope="module")
def live_data(
    tmp_path_factory: pytest.TempPathFactory, vllm_server: Any, prometheus_available: None
) -> Iterator[Data]:
    with scenarios.live(tmp_path_factory.mktemp("live"), vllm_server) as data:
        yield data


@pytest.fixture(scope="module")
def gpu_data(
    tmp_path_factory: pytest.TempPathFactory, prometheus_available: None, promtool: str
) -> Iterator[Data]:
    with scenarios.gpu(tmp_path_factory.mktemp("gpu")) as data:
        yield data


@pytest.fixture(
    params=[
        pytest.param(Scenario.LIVE, id="live", marks=pytest.mark.vllm),
        pytest.param(Scenario.OFFLOAD, id="offload"),
        pytest.param(Scenario.GPU, id="gpu"),
    ]
)
def data(request: pytest.FixtureRequest) -> Data:
    return request.getfixturevalue(f"{request.param.value}_data")


def emulator(data: Data, doc: Mapping[str, Any]) -> Emulator:
    return Emulator(data.api, doc, data.scrape_interval, data.start, data.end)


def chosen_first(emu: Emulator) -> dict[str, list[str]]:
    """Each variable narrowed to its first option, in order, as a user would click."""
    chosen: dict[str, list[str]] = emu.all_chosen()
    for v in emu.variables:
        options = emu.variable_options(v, chosen)
        assert options, f"variable {v['name']} has no options with {chosen}"
        chosen[v["name"]] = [options[0]]
    return chosen


def describe(results: Sequence[TargetResult]) -> str:
    return "; ".join(f"{r.ref_id}: {r.finite_points()} points for {r.expr}" for r in results)


@pytest.mark.parametrize("dash", DASHBOARDS, ids=[d.uid for d in DASHBOARDS])
def test_variables_have_options(dash: Dashboard, data: Data) -> None:
    emu = emulator(data, DOCS[dash.uid])
    chosen = emu.all_chosen()
    for v in emu.variables:
        assert emu.variable_options(v, chosen), f"{v['name']} is empty in {data.scenario}"
    # chained: options of later variables exist under the earlier ones' first values
    chosen_first(emu)


@pytest.mark.parametrize("dash", DASHBOARDS, ids=[d.uid for d in DASHBOARDS])
def test_panels_show_data_in_their_scenarios(dash: Dashboard, data: Data) -> None:
    doc = DOCS[dash.uid]
    emu = emulator(data, doc)
    by_title = specs(dash)
    mine = [p for p in graph_panels(doc) if data.scenario in by_title[p["title"]].scenarios]
    assert mine, f"no panel of {dash.uid} is meant for {data.scenario}"
    selections = {"All": emu.all_chosen(), "one value each": chosen_first(emu)}
    empty = []
    for label, chosen in selections.items():
        for panel in mine:
            results = emu.run_panel(panel, chosen)
            if not any(r.finite_points() for r in results):
                empty.append(f"{panel['title']} [{label}]: {describe(results)}")
    assert not empty, f"empty panels in {data.scenario}:\n" + "\n".join(empty)


@pytest.mark.parametrize("dash", DASHBOARDS, ids=[d.uid for d in DASHBOARDS])
def test_barchart_x_axis_is_a_label_of_every_bar(dash: Dashboard, data: Data) -> None:
    """Grafana draws a bar per row of x_field: the label must exist, and be a number where
    the panel converts it to one to sort (a text label would become null)."""
    doc = DOCS[dash.uid]
    emu = emulator(data, doc)
    by_title = specs(dash)
    bad = []
    for panel in graph_panels(doc):
        spec = by_title[panel["title"]]
        if panel["type"] != "barchart" or data.scenario not in spec.scenarios:
            continue
        x = panel["options"]["xField"]
        for result in emu.run_panel(panel, emu.all_chosen()):
            for series in result.series:
                value = series["metric"].get(x)
                if value is None:
                    bad.append(f"{panel['title']}: no label {x} in {series['metric']}")
                elif spec.x_numeric:
                    try:
                        float(value)
                    except ValueError:
                        bad.append(f"{panel['title']}: {x}={value!r} is sorted as a number")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dash", DASHBOARDS, ids=[d.uid for d in DASHBOARDS])
def test_panels_honour_the_variables(dash: Dashboard, data: Data) -> None:
    """Variables that match nothing empty every panel: no query ignores them."""
    doc = DOCS[dash.uid]
    emu = emulator(data, doc)
    nothing = {v["name"]: [NOTHING] for v in emu.variables}
    leaking = []
    for panel in graph_panels(doc):
        results = emu.run_panel(panel, nothing)
        if any(r.series for r in results):
            leaking.append(f"{panel['title']}: {describe(results)}")
    assert not leaking, "panels ignore the variables:\n" + "\n".join(leaking)
    # and narrowing one variable at a time to nothing empties every query that uses it
    for v in emu.variables:
        chosen = {**emu.all_chosen(), v["name"]: [NOTHING]}
        for panel in graph_panels(doc):
            for target, result in zip(panel["targets"], emu.run_panel(panel, chosen), strict=True):
                if f"${v['name']}" in target["expr"] and result.series:
                    leaking.append(f"{panel['title']} {target['refId']} ignores ${v['name']}")
    assert not leaking, "\n".join(leaking)


def test_all_means_every_value(offload_data: Data) -> None:
    """All (allValue .*) and the explicit list of every option give the same series."""
    doc = DOCS["kvoe-decision"]
    emu = emulator(offload_data, doc)
    listed: dict[str, list[str]] = {}
    for v in emu.variables:
        listed[v["name"]] = emu.variable_options(v, {**emu.all_chosen(), **listed})
    panel = next(p for p in graph_panels(doc) if p["title"].startswith("Offload hit ratio"))
    with_all = emu.run_panel(panel, emu.all_chosen())
    with_list = emu.run_panel(panel, listed)
    assert [len(r.series) for r in with_all] == [len(r.series) for r in with_list]
    assert sum(len(r.series) for r in with_all) > 0


def test_offload_scenario_numbers_are_the_recorded_run(offload_data: Data) -> None:
    """The backfilled exporter series carry the run's ratios (fixtures README)."""
    doc = DOCS["kvoe-decision"]
    emu = emulator(offload_data, doc)
    panel = next(p for p in graph_panels(doc) if p["title"].startswith("Reuse ratio"))
    (result,) = emu.run_panel(panel, emu.all_chosen())
    last = float(result.series[0]["values"][-1][1])
    # loaded 0.844e9 of 2.826e9 stored bytes over the whole run
    assert last == pytest.approx(8.4410368e08 / 2.82591232e09, rel=1e-6)
    assert result.series[0]["metric"]["target"] == scenarios.H200_TARGET


def test_every_panel_has_a_scenario_that_proves_it() -> None:
    proven = {Scenario.LIVE, Scenario.OFFLOAD, Scenario.GPU, Scenario.BACKENDS}
    unproven = [
        f"{d.uid}: {p.title}" for d in DASHBOARDS for p in d.panels() if not p.scenarios & proven
    ]
    assert not unproven, unproven


def test_gpu_scenario_is_the_recorded_run(gpu_data: Data) -> None:
    """PCIe traffic and pinned memory come back as the H200 recorded them."""
    doc = DOCS["kvoe-memory"]
    emu = emulator(gpu_data, doc)
    by_title = specs(DASHBOARDS_BY_UID["kvoe-memory"])
    panel = next(
        p for p in graph_panels(doc) if by_title[p["title"]].key == "memory.process_pinned"
    )
    results = emu.run_panel(panel, emu.all_chosen())
    pinned = {
        s["metric"].get("role"): max(float(v) for _, v in s["values"]) for s in results[0].series
    }
    # 0.5 GiB of offload + vLLM's own pinned staging on the EngineCore, none on the API server
    assert pinned["engine_core"] >= 2**29
    assert pinned["api_server"] == 0
    last = scenarios.gpu_series(gpu_data.end)[0].scrapes[-1][1]
    recorded = sum(
        float(line.rsplit(" ", 1)[1])
        for line in last.splitlines()
        if line.startswith("kvoffload_gpu_pcie_rx_bytes_total{")
    )
    (rx,) = gpu_data.api(
        "query",
        query=f'sum(kvoffload_gpu_pcie_rx_bytes_total{{instance="{scenarios.GPU_EXPORTER_INSTANCE}"}})',
        time=str(gpu_data.end),
    )["result"]
    assert float(rx["value"][1]) == pytest.approx(recorded, rel=1e-9)
    assert recorded > 0


EVIDENCE_PANELS = (
    "decision.wasted_store_share",
    "decision.wasted_store_bytes",
    "decision.reuse_gap_bytes",
    "decision.reuse_gap_seconds",
)


def _last(data: Data, query: str) -> dict[str, float]:
    """target -> the query's value at the end of the scenario (one series per target)."""
    result = data.api("query", query=query, time=str(data.end))["result"]
    return {r["metric"]["target"]: float(r["value"][1]) for r in result}


def test_kv_event_evidence_panels_show_every_query(gpu_data: Data) -> None:
    """Each query of the store-threshold and buffer-size panels has data in the GPU runs
    (the recommended buffer from large-b, where the advisor says grow_buffer)."""
    doc = DOCS["kvoe-decision"]
    emu = emulator(gpu_data, doc)
    by_title = specs(DASHBOARDS_BY_UID["kvoe-decision"])
    panels = [p for p in graph_panels(doc) if by_title[p["title"]].key in EVIDENCE_PANELS]
    assert len(panels) == len(EVIDENCE_PANELS)
    empty = []
    for panel in panels:
        results = emu.run_panel(panel, emu.all_chosen())
        for target, result in zip(panel["targets"], results, strict=True):
            if not result.finite_points():
                empty.append(f"{panel['title']} {target['refId']}: {result.expr}")
    assert not empty, "\n".join(empty)


def test_kv_event_evidence_agrees_with_the_recorded_runs(gpu_data: Data) -> None:
    """The evidence the current exporter rebuilt from the recorded KV events, as Prometheus
    serves it, against what vLLM and the advisor say about the same runs."""
    small, large = "small-b", "large-b"
    wasted = _last(gpu_data, "kvoffload_offload_wasted_store_bytes_total")
    stored = _last(
        gpu_data,
        'label_replace(vllm:kv_offload_store_bytes_total, "target", "$1", "instance", "(.*)")',
    )
    for target in (small, large):
        # never more dropped unused than vLLM says it stored, and a good part of it
        assert 0.5 * stored[target] < wasted[target] <= stored[target]
    share = _last(gpu_data, "kvoffload_offload_wasted_store_ratio")
    assert share[small] > THRESHOLDS.wasted_store_share_high
    buffer = _last(gpu_data, "kvoffload_offload_buffer_bytes")
    half = _last(gpu_data, 'kvoffload_reuse_gap_bytes{share="0.5"}')
    most = _last(gpu_data, 'kvoffload_reuse_gap_bytes{share="0.9"}')
    for target in (small, large):
        # returning prefixes were computed further back than the configured buffer reaches
        assert buffer[target] < half[target] <= most[target]
    recommended = _last(gpu_data, "kvoffload_advice_recommended_buffer_bytes")
    assert set(recommended) == {large}
    assert buffer[large] < recommended[large]
    # the latest advice (backfilled series have no staleness markers: earlier ones linger)
    query = f'last_over_time(kvoffload_advice_info{{target="{large}"}}[2s])'
    (advice,) = gpu_data.api("query", query=query, time=str(gpu_data.end))["result"]
    assert advice["metric"]["action"] == "grow_buffer"
    seconds = _last(gpu_data, 'kvoffload_reuse_gap_seconds{share="0.9"}')
    assert set(seconds) == {small, large} and all(s > 0 for s in seconds.values())


def test_previews_render_from_the_same_data(
    offload_data: Data, live_data: Data, gpu_data: Data, tmp_path: Path
) -> None:
    data = {Scenario.LIVE: live_data, Scenario.OFFLOAD: offload_data, Scenario.GPU: gpu_data}
    drawn = preview.render_all(data, tmp_path)
    for dash in DASHBOARDS:
        png = tmp_path / f"{dash.uid}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        generated = {p["title"] for p in graph_panels(DOCS[dash.uid])}
        by_title = specs(dash)
        for title in generated:
            panel = by_title[title]
            if panel.scenarios & data.keys():
                assert drawn[dash.uid][panel.key] is not None, f"{title} drawn empty"
            else:
                assert drawn[dash.uid][panel.key] is None


# --- KV transfer backends (docs/backends.md) ------------------------------------------------
# Each backend's row only has data while that backend runs, so its panels are proven against
# their own scenario: recorded vLLM 0.26 runs and synthesized vLLM 0.32 / LMCache expositions,
# replayed through the exporter and backfilled (dashboards/scenarios.py `backends`).

BACKEND_DASHBOARDS = [
    d for d in DASHBOARDS if any(Scenario.BACKENDS in p.scenarios for p in d.panels())
]


@pytest.fixture(scope="module")
def backends_data(
    tmp_path_factory: pytest.TempPathFactory, prometheus_available: None, promtool: str
) -> Iterator[Data]:
    with scenarios.backends(tmp_path_factory.mktemp("backends")) as data:
        yield data


def test_some_dashboard_has_backend_rows() -> None:
    assert BACKEND_DASHBOARDS


@pytest.mark.parametrize("dash", BACKEND_DASHBOARDS, ids=[d.uid for d in BACKEND_DASHBOARDS])
def test_backend_panels_show_data(dash: Dashboard, backends_data: Data) -> None:
    doc = DOCS[dash.uid]
    emu = emulator(backends_data, doc)
    chosen = emu.all_chosen()
    for v in emu.variables:
        assert emu.variable_options(v, chosen), f"{v['name']} is empty in the backends scenario"
    by_title = specs(dash)
    mine = [p for p in graph_panels(doc) if Scenario.BACKENDS in by_title[p["title"]].scenarios]
    empty = []
    for panel in mine:
        results = emu.run_panel(panel, chosen)
        if not any(r.finite_points() for r in results):
            empty.append(f"{panel['title']}: {describe(results)}")
        # every query of a backend panel returns something in its scenario
        for target, result in zip(panel["targets"], results, strict=True):
            if not result.finite_points():
                empty.append(f"{panel['title']} {target['refId']}: {result.expr}")
    assert not empty, "empty backend panels:\n" + "\n".join(empty)


@pytest.mark.parametrize("dash", BACKEND_DASHBOARDS, ids=[d.uid for d in BACKEND_DASHBOARDS])
def test_backend_panels_honour_the_variables(dash: Dashboard, backends_data: Data) -> None:
    doc = DOCS[dash.uid]
    emu = emulator(backends_data, doc)
    nothing = {v["name"]: [NOTHING] for v in emu.variables}
    by_title = specs(dash)
    leaking = []
    for panel in graph_panels(doc):
        if Scenario.BACKENDS not in by_title[panel["title"]].scenarios:
            continue
        results = emu.run_panel(panel, nothing)
        if any(r.series for r in results):
            leaking.append(f"{panel['title']}: {describe(results)}")
    assert not leaking, "panels ignore the variables:\n" + "\n".join(leaking)


def test_backend_rows_stay_empty_without_their_backend(offload_data: Data) -> None:
    """The H200 offload run uses none of these backends: their panels show nothing there."""
    shown = []
    for dash in BACKEND_DASHBOARDS:
        doc = DOCS[dash.uid]
        emu = emulator(offload_data, doc)
        by_title = specs(dash)
        for panel in graph_panels(doc):
            spec = by_title[panel["title"]]
            if Scenario.BACKENDS not in spec.scenarios or spec.key == "transfers.backend_config":
                continue
            if any(r.series for r in emu.run_panel(panel, emu.all_chosen())):
                shown.append(panel["title"])
    assert not shown, f"backend panels with data although no engine runs the backend: {shown}"


def _panel(dash: Dashboard, key: str) -> Mapping[str, Any]:
    title = next(p.title for p in dash.panels() if p.key == key)
    return next(p for p in graph_panels(DOCS[dash.uid]) if p["title"] == title)


def _last_by_target(results: Sequence[TargetResult]) -> dict[str, float]:
    out = {}
    for r in results:
        for s in r.series:
            value = s["value"][1] if "value" in s else s["values"][-1][1]
            out[s["metric"]["target"]] = float(value)
    return out


def test_nixl_panels_show_the_real_h200_runs(backends_data: Data) -> None:
    """The NIXL row on the two real 32B prefill/decode pairs of one H200
    (scenarios.NIXL_TARGETS): the bandwidth panel shows, for the engine that counted the
    transfers, vLLM's delta bytes over delta transfer time of the recording (its first and
    last scrapes are in the scenario); no failure; one KV path per engine; and the speedup
    panel puts the pair whose KV went over TCP emulation below 1 and the cuda_ipc pair
    above, as the UCX tables of the runs say (tests/test_nixl_h200.py checks the
    speedup's value)."""
    (dash,) = [
        d for d in BACKEND_DASHBOARDS if any(p.key.startswith("transfers.nixl") for p in d.panels())
    ]
    emu = emulator(backends_data, DOCS[dash.uid])
    chosen = emu.all_chosen()
    shown = {
        key: _last_by_target(emu.run_panel(_panel(dash, f"transfers.nixl_{key}"), chosen))
        for key in ("bandwidth", "speedup", "failures")
    }
    links = {
        s["metric"]["target"]
        for r in emu.run_panel(_panel(dash, "transfers.nixl_link"), chosen)
        for s in r.series
    }
    for target, recording in scenarios.NIXL_TARGETS.items():
        bodies = [s.body for s in read_scrapes(recording) if s.body]

        def total(body: str, name: str) -> float:
            return sum(
                float(x.rpartition(" ")[2]) for x in body.splitlines() if x.startswith(name + "{")
            )

        moved = total(bodies[-1], "vllm:nixl_bytes_transferred_sum") - total(
            bodies[0], "vllm:nixl_bytes_transferred_sum"
        )
        seconds = total(bodies[-1], "vllm:nixl_xfer_time_seconds_sum") - total(
            bodies[0], "vllm:nixl_xfer_time_seconds_sum"
        )
        assert target in links and shown["failures"].get(target) == 0.0, target
        if seconds == 0:
            assert target not in shown["bandwidth"], target  # the prefill engine of a pull pair
            continue
        assert shown["bandwidth"][target] == pytest.approx(moved / seconds, rel=1e-6), target
        ucx = (recording.parent / "ucx.txt").read_text()
        kv_read = ucx.split("remote memory read by ucp_get*(multi) into cuda", 1)[1]
        row = next(x for x in kv_read.splitlines() if x.startswith("| 0..inf"))
        assert (shown["speedup"][target] < 1) == ("software emulation" in row), target
