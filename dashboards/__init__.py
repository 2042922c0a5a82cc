"""Grafana dashboards generated from code (grafana-foundation-sdk==0.0.21).

Metric names come from exporter/catalogue.csv (the exporter's) and exporter/vllm_metrics.py
SERIES (vLLM's); advice actions from exporter/model/advisor/types.py.

spec.py      the panel-spec layer: Panel, Row, Dashboard, Query, scenarios, selectors
panels.py    the three dashboards as data, and the PENDING list
build.py     spec -> SDK builders -> JSON; fails loudly on unknown metric names
validate.py  strict validation against the Grafana JSON schemas in dashboards/schemas/
grafana.py   what Grafana does to a query before Prometheus sees it ($__rate_interval, $var)
generate.py  the generator registered in scripts/gen.py (JSON, provisioning, docs/dashboards.md)
preview.py   renders each dashboard from a Prometheus to PNG (matplotlib)
scenarios.py the Prometheus data sets the panels are proven against (live vLLM CPU, H200 replay)
"""
