"""exporter/lmcache.py: LMCache's per-worker series onto vLLM's engine key."""

from __future__ import annotations

import importlib.util

from exporter import expfmt
from exporter.lmcache import lmcache_samples
from exporter.vllm_metrics import WANTED
from tests.helpers import MODEL, SYNTH, gpu_metrics, raw, synth


def test_lmcache_series_map_onto_the_served_model_engine_0() -> None:
    after = synth("lmcache-v1-tp2", "after")
    mapped = lmcache_samples(expfmt.parse(after, WANTED))
    hits = [s for s in mapped if s.name == "lmcache:num_hit_tokens_total"]
    # two TP workers count the same tokens: the maximum, not the sum
    assert len(hits) == 1 and hits[0].labels == (("engine", "0"), ("model_name", MODEL))
    assert hits[0].value == raw(after, "lmcache:num_hit_tokens_total", worker_id="0")
    (usage,) = [s for s in mapped if s.name == "lmcache:local_cache_usage"]
    assert usage.value == raw(after, "lmcache:local_cache_usage")  # bytes held: summed
    (lookups,) = [s for s in mapped if s.name == "lmcache:num_lookup_tokens_total"]
    assert lookups.value == raw(after, "lmcache:num_lookup_tokens_total", role="scheduler")
    passthrough = [s for s in mapped if s.name == "vllm:prompt_tokens_total"]
    assert passthrough == [s for s in expfmt.parse(after, WANTED) if s.name == passthrough[0].name]


def test_lmcache_mapping_leaves_other_scrapes_alone() -> None:
    text = gpu_metrics("small-b", "after", "W1")
    samples = expfmt.parse(text, WANTED)
    assert lmcache_samples(samples) == samples


def test_synthesized_lmcache_fixture_is_what_its_script_writes() -> None:
    """Regenerated here (prometheus_client only); the vLLM 0.32 ones need .venv-vllm."""
    spec = importlib.util.spec_from_file_location(
        "synthesize_lmcache", SYNTH / "synthesize_lmcache.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for step in ("before", "after"):
        assert module.document(step) == (SYNTH / f"lmcache-v1-tp2.{step}.prom").read_text()
