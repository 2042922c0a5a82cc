"""Configuration: one option table drives flags, KVOE_* environment variables and YAML keys.

Precedence: flag, then environment, then the YAML file, then the default. Every
problem found is reported together in one ConfigError; nothing here exits.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from exporter.options import Option, TargetConfig
from exporter.sources.registry import REGISTRATIONS
from exporter.thresholds import DEFAULT as DEFAULT_THRESHOLDS
from exporter.thresholds import Thresholds
from exporter.webconfig import WebConfigError, load_web_config

DEFAULT_PORT = 9747
# CPU buffer sizes the what-if simulates by default, up to 32 GiB. Up to 16 GiB (until
# session 15) the held-out 14B shape on RAG traffic was told offload would not pay, where 30
# GiB paid 5.5 % (docs/gpu-acceptance.md, "a shape held out"). 32 GiB pins ~56 GiB on vLLM
# 0.26, the largest the H200 host (128 GiB) can verify; larger hosts add sizes with
# --whatif-sizes. Sizes above the headroom under a container memory limit, where there is
# one, are never recommended.
DEFAULT_WHATIF_SIZES: tuple[int, ...] = tuple(
    int(g * (1 << 30)) for g in (0.25, 0.5, 1, 2, 4, 8, 16, 32)
)


class ConfigError(ValueError):
    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))
        self.problems = list(problems)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.I)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KI": 1 << 10,
    "KIB": 1 << 10,
    "M": 1000**2,
    "MB": 1000**2,
    "MI": 1 << 20,
    "MIB": 1 << 20,
    "G": 1000**3,
    "GB": 1000**3,
    "GI": 1 << 30,
    "GIB": 1 << 30,
    "T": 1000**4,
    "TB": 1000**4,
    "TI": 1 << 40,
    "TIB": 1 << 40,
}


def parse_bytes(text: str | float | int) -> int:
    """'0.5GiB' -> 536870912; plain numbers are bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"bad size {text!r}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r} (examples: 1048576, 512MiB, 0.5GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT or :PORT")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--listen {text!r}: port is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--listen {text!r}: port out of range")
    return host.strip("[]") or "0.0.0.0", number


CORE_OPTIONS: tuple[Option, ...] = (
    Option(
        "vllm-url",
        "list",
        [],
        "vLLM API server base URL to scrape (repeatable; "
        "KVOE_VLLM_URLS takes a comma-separated list)",
        "URL",
    ),
    Option(
        "listen",
        "str",
        f":{DEFAULT_PORT}",
        "HOST:PORT to serve /metrics on (default all interfaces, like other exporters)",
        "HOST:PORT",
    ),
    Option(
        "interval",
        "float",
        1.0,
        "seconds between collections; the advisor's fits take one point per interval, and "
        "on the H200 recordings a coarser interval decided fewer runs (docs/advisor.md)",
        "SECONDS",
    ),
    Option("window", "float", 300.0, "sliding window for ratios and rates, seconds", "SECONDS"),
    Option(
        "scrape-timeout",
        "float",
        0.0,
        "timeout per vLLM scrape, seconds (0: the smaller of interval and 10 s)",
        "SECONDS",
    ),
    Option(
        "max-body-bytes",
        "bytes",
        16 << 20,
        "largest vLLM /metrics body read (e.g. 16MiB); larger bodies count as too_large",
        "SIZE",
    ),
    Option(
        "kv-bytes-per-token",
        "float",
        0.0,
        "KV cache bytes per token of the model, when "
        "vLLM's metrics cannot tell (no offload, --num-gpu-blocks-override)",
        "BYTES",
    ),
    Option(
        "assumed-load-bandwidth",
        "bytes",
        0,
        "bytes/s a CPU->GPU reload would reach, "
        "for engines without offload (0: estimate from the PCIe link)",
        "SIZE",
    ),
    Option(
        "model-weight-bytes",
        "bytes",
        0,
        "the model's weights per GPU, as vLLM logs them at start (\"Model loading took X "
        "GiB\"): with the GPU's peak they bound what a computed token costs from below "
        "(docs/advisor.md; 0: unknown)",
        "SIZE",
    ),
    Option(
        "gpu-peak-flops",
        "float",
        0.0,
        "the GPU's dense BF16 peak in FLOP/s, for a GPU the exporter's table does not list "
        "(0: from the table by NVML's GPU name)",
        "FLOPS",
    ),
    Option(
        "advice-confirm-cycles",
        "int",
        3,
        "evaluations a new advice must win in a row "
        "before it replaces the current one (hysteresis)",
        "N",
    ),
    Option(
        "advice-confirm-seconds",
        "float",
        30.0,
        "seconds a new advice must also have been the evaluations' answer before it replaces "
        "a standing decision, whatever the interval (hysteresis; leaving insufficient_data "
        "takes the evaluations only; 0: count evaluations only)",
        "SECONDS",
    ),
    Option(
        "threshold",
        "list",
        [],
        "override an advisor/alert threshold, NAME=VALUE "
        "(repeatable; YAML: a thresholds: mapping); names in docs/advisor.md",
        "NAME=VALUE",
    ),
    Option("log-format", "str", "text", "log line format", choices=("text", "json")),
    Option("log-level", "str", "info", "log level", choices=("debug", "info", "warning", "error")),
    Option("path.procfs", "str", "/proc", "procfs mount point", "PATH"),
    Option(
        "vllm-pid",
        "int",
        None,
        "pid of the vLLM API server, for a single target (else targets[].pid; "
        "default: the process listening on the target's port)",
        "PID",
    ),
    Option(
        "max-engines-per-target",
        "int",
        64,
        "most (model_name, engine) label sets kept per vLLM target and scrape; the series "
        "of the others are dropped and counted in kvoffload_target_series_dropped_total",
        "N",
    ),
    Option(
        "web.config.file",
        "str",
        "",
        "exporter-toolkit web config file: TLS, basic auth, headers, rate limit (docs/security.md)",
        "FILE",
    ),
    Option(
        "record",
        "str",
        "",
        "record what each target shows (its /metrics every cycle, its KV events, meta.json) "
        "under DIR, one folder per target with several; replay with "
        "`kv-offload-exporter replay DIR` (docs/advisor.md)",
        "DIR",
    ),
    Option(
        "state-file",
        "str",
        "",
        "keep each engine's TTFT fit with offload off in FILE, read at start and rewritten "
        "when it changes, so that the advice after the restart that enables offload can say "
        "what enabling delivered even when the exporter restarted too (a sidecar restarts "
        "with vLLM's pod: put FILE on a volume that outlives it; docs/advisor.md)",
        "FILE",
    ),
    Option(
        "whatif-sizes",
        "bytes_list",
        list(DEFAULT_WHATIF_SIZES),
        "CPU offload buffer sizes to simulate (comma-separated, e.g. 0.5GiB,1GiB)",
        "SIZES",
    ),
    Option(
        "whatif-policy",
        "str",
        "lru",
        "eviction policy of the simulated CPU tier (vLLM's eviction_policy)",
        choices=("lru", "arc"),
    ),
    Option(
        "whatif-store-threshold",
        "int",
        0,
        "vLLM's store_threshold for the simulated tier (a block is offloaded once looked up "
        "that many times; below 2 every block is)",
        "N",
    ),
    Option(
        "whatif-model",
        "str",
        "vllm",
        "vllm: replay vLLM 0.26's CPU offload manager exactly, one simulator per size; "
        "stack: one-pass LRU stack distances for all sizes (approximate ordering, can sample)",
        choices=("vllm", "stack"),
    ),
    Option(
        "whatif-sample-rate",
        "float",
        1.0,
        "SHARDS spatial sampling rate of block hashes for --whatif-model stack "
        "(1.0 = exact; 0.01 tracks 1%% of the blocks)",
        "RATE",
    ),
)
# The flags of the optional sources come from their registrations (exporter/sources/).
OPTIONS: tuple[Option, ...] = CORE_OPTIONS + tuple(
    opt for reg in REGISTRATIONS for opt in (reg.switch, *reg.options)
)
OPTION_BY_KEY: Mapping[str, Option] = {o.key: o for o in OPTIONS}


@dataclass(frozen=True, slots=True)
class Config:
    targets: tuple[TargetConfig, ...] = ()
    listen: str = f":{DEFAULT_PORT}"
    interval: float = 1.0
    window: float = 300.0
    scrape_timeout: float = 0.0
    max_body_bytes: int = 16 << 20
    kv_bytes_per_token: float = 0.0
    assumed_load_bandwidth: int = 0
    model_weight_bytes: int = 0
    gpu_peak_flops: float = 0.0
    advice_confirm_cycles: int = 3
    advice_confirm_seconds: float = 30.0
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    log_format: str = "text"
    log_level: str = "info"
    nvml: bool = True
    nvml_poll_interval: float = 0.0
    procfs: bool = True
    cgroup: bool = True
    path_procfs: str = "/proc"
    path_cgroup: str = "/sys/fs/cgroup"
    path_shm: str = "/dev/shm"
    vllm_pid: int | None = None
    memory_limit: int = 0
    max_engines_per_target: int = 64
    web_config_file: str = ""
    kv_events: bool = True
    kv_events_endpoint: Sequence[str] = ()
    kv_events_bind: Sequence[str] = ()
    kv_events_replay_endpoint: Sequence[str] = ()
    kv_events_replay_timeout: float = 2.0
    kv_events_queue: int = 10000
    record_events: str = ""
    record: str = ""
    state_file: str = ""
    whatif_sizes: Sequence[int] = DEFAULT_WHATIF_SIZES
    whatif_policy: str = "lru"
    whatif_store_threshold: int = 0
    whatif_model: str = "vllm"
    whatif_sample_rate: float = 1.0
    # target label -> {kv_events_endpoint|kv_events_bind|kv_events_replay_endpoint: [..]}
    kv_events_targets: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def effective_scrape_timeout(self) -> float:
        return self.scrape_timeout or min(self.interval, 10.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (keys as the flags, with _ for - and .)",
        default=os.environ.get("KVOE_CONFIG"),
    )
    for opt in OPTIONS:
        kw: dict[str, Any] = {"dest": opt.key, "default": None, "help": opt.help}
        if opt.metavar:
            kw["metavar"] = opt.metavar
        if opt.choices:
            kw["choices"] = opt.choices
        if opt.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif opt.kind == "list":
            kw["action"] = "append"
        parser.add_argument("--" + opt.flag, **kw)


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list):
        return [str(v) for v in value]
    raise ValueError("expected a list")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _as_float(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number


def _as_bytes_list(value: Any) -> list[int]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [parse_bytes(v) for v in items if str(v).strip()]


# Option.kind -> converter; any other kind is text, checked against the option's choices.
_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "list": _as_list,
    "bool": _as_bool,
    "float": _as_float,
    "int": int,
    "bytes": parse_bytes,
    "bytes_list": _as_bytes_list,
}


def _coerce(opt: Option, value: Any, where: str, problems: list[str]) -> Any:
    try:
        convert = _CONVERTERS.get(opt.kind)
        if convert is not None:
            return convert(value)
        text = str(value)
        if opt.choices and text not in opt.choices:
            raise ValueError(f"expected one of {', '.join(opt.choices)}")
        return text
    except (TypeError, ValueError) as exc:
        problems.append(f"{where}: {exc}")
        return None


def _targets_from(values: dict[str, Any], problems: list[str]) -> tuple[TargetConfig, ...]:
    out: list[TargetConfig] = []
    for url in values.get("vllm_url") or []:
        out.append(TargetConfig(url=url))
    for i, item in enumerate(values.get("targets") or []):
        where = f"targets[{i}]"
        if not isinstance(item, dict) or "url" not in item:
            problems.append(f"{where}: expected a mapping with url")
            continue
        keys = {"url", "name", "pid", "kv_bytes_per_token", "model_weight_bytes"}
        unknown = set(item) - keys - set(KV_EVENTS_TARGET_KEYS)
        if unknown:
            problems.append(f"{where}: unknown keys {sorted(unknown)}")
        try:
            pid = int(item["pid"]) if item.get("pid") is not None else None
            bpt = float(item["kv_bytes_per_token"]) if item.get("kv_bytes_per_token") else None
            weights = (
                parse_bytes(item["model_weight_bytes"]) if item.get("model_weight_bytes") else None
            )
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        out.append(
            TargetConfig(
                url=str(item["url"]),
                name=str(item.get("name") or ""),
                pid=pid,
                kv_bytes_per_token=bpt,
                model_weight_bytes=weights,
            )
        )
    for t in out:
        parts = urlsplit(t.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            problems.append(
                f"target {t.url!r}: expected an http(s) URL such as http://127.0.0.1:8000"
            )
    labels = [t.label for t in out]
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        problems.append(f"targets: duplicate target labels {dupes}; give them distinct names")
    return tuple(out)


def _split_all(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(p.strip() for item in items for p in str(item).split(",") if p.strip())


KV_EVENTS_TARGET_KEYS = ("kv_events_endpoint", "kv_events_bind", "kv_events_replay_endpoint")


def _kv_events_targets(
    items: Any, targets: Sequence[TargetConfig], problems: list[str]
) -> dict[str, dict[str, tuple[str, ...]]]:
    """Per-target KV-event endpoints from YAML targets[] (string or list, one per DP rank)."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    if not isinstance(items, list):
        return out
    by_url = {t.url: t for t in targets}
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "url" not in item:
            continue
        target = by_url.get(str(item["url"]))
        if target is None:
            continue
        for key in KV_EVENTS_TARGET_KEYS:
            raw = item.get(key)
            if raw is None:
                continue
            if isinstance(raw, str):
                raw = [raw]
            if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
                problems.append(f"targets[{i}].{key}: expected an endpoint or a list of them")
                continue
            out.setdefault(target.label, {})[key] = _split_all(raw)
    return out


def _thresholds_from(mapping: Any, pairs: list[str] | None, problems: list[str]) -> Thresholds:
    overrides: dict[str, Any] = {}
    if mapping is not None:
        if isinstance(mapping, dict):
            overrides.update({str(k): v for k, v in mapping.items()})
        else:
            problems.append("thresholds: expected a mapping of name: value")
    for item in pairs or []:
        name, sep, value = item.partition("=")
        if not sep:
            problems.append(f"--threshold {item!r}: expected NAME=VALUE")
            continue
        overrides[name.strip()] = value.strip()
    known = set(Thresholds.__dataclass_fields__)
    clean: dict[str, float] = {}
    for name, value in overrides.items():
        if name not in known:
            problems.append(f"threshold {name!r}: unknown (known: {', '.join(sorted(known))})")
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            problems.append(f"threshold {name}: {value!r} is not a number")
            continue
        if not math.isfinite(number) or number < 0:
            problems.append(f"threshold {name}: must be a finite non-negative number")
            continue
        clean[name] = number
    return replace(DEFAULT_THRESHOLDS, **clean)


def load_config(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    require_targets: bool = True,
) -> Config:
    """Merge flag, environment, YAML and defaults into a frozen Config."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    values: dict[str, Any] = {o.key: o.default for o in OPTIONS}
    path = getattr(args, "config", None) if args is not None else environ.get("KVOE_CONFIG")
    file_values = _read_file(path, values, problems) if path else {}
    _read_environ(environ, values, problems)
    if args is not None:
        _read_flags(args, values, problems)
    cfg = _build(values, file_values, problems, require_targets=require_targets)
    problems.extend(_value_problems(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def _read_file(path: str, values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The YAML file's keys, normalised; its plain options are coerced into `values`
    (targets and thresholds are structured: _build() reads them from the returned dict)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"--config {path}: {exc}"]) from None
    if not isinstance(loaded, dict):
        raise ConfigError([f"--config {path}: expected a mapping at the top level"])
    file_values = {str(k).replace("-", "_").replace(".", "_"): v for k, v in loaded.items()}
    for key, raw in file_values.items():
        if key in ("targets", "thresholds"):
            continue
        opt = OPTION_BY_KEY.get(key)
        if opt is None:
            problems.append(f"{path}: unknown key {key!r}")
            continue
        values[key] = _coerce(opt, raw, f"{path}: {key}", problems)
    return file_values


def _read_environ(environ: Mapping[str, str], values: dict[str, Any], problems: list[str]) -> None:
    for opt in OPTIONS:
        names = [opt.env] + (["KVOE_VLLM_URLS"] if opt.key == "vllm_url" else [])
        for name in names:
            if name in environ and environ[name] != "":
                values[opt.key] = _coerce(opt, environ[name], name, problems)


def _read_flags(args: argparse.Namespace, values: dict[str, Any], problems: list[str]) -> None:
    for opt in OPTIONS:
        raw = getattr(args, opt.key, None)
        if raw is not None:
            values[opt.key] = _coerce(opt, raw, "--" + opt.flag, problems)


def _build(
    values: dict[str, Any],
    file_values: dict[str, Any],
    problems: list[str],
    *,
    require_targets: bool,
) -> Config:
    """The Config from the merged values, with the file's targets and thresholds."""
    values["targets"] = file_values.get("targets")
    targets = _targets_from(values, problems)
    thresholds = _thresholds_from(file_values.get("thresholds"), values.get("threshold"), problems)
    if require_targets and not targets:
        problems.append(
            "no vLLM target: give --vllm-url URL (or KVOE_VLLM_URLS, or targets: in --config)"
        )

    known = {f.name for f in fields(Config)}
    skip = ("targets", "thresholds", "threshold", "vllm_url")
    kwargs = {k: v for k, v in values.items() if k in known and k not in skip and v is not None}
    extra = {k: v for k, v in values.items() if k not in known and k not in skip}
    cap = kwargs.get("max_engines_per_target", 64)
    targets = tuple(replace(t, max_engines=cap) for t in targets)
    cfg = Config(targets=targets, thresholds=thresholds, extra=extra, **kwargs)
    return replace(
        cfg,
        kv_events_targets=_kv_events_targets(file_values.get("targets"), targets, problems),
        # Repeated flags and comma-separated lists both give one endpoint per DP rank.
        kv_events_endpoint=_split_all(cfg.kv_events_endpoint),
        kv_events_bind=_split_all(cfg.kv_events_bind),
        kv_events_replay_endpoint=_split_all(cfg.kv_events_replay_endpoint),
    )


def _hysteresis_problems(cfg: Config) -> list[str]:
    problems = []
    if cfg.advice_confirm_cycles < 1:
        problems.append("--advice-confirm-cycles must be at least 1")
    if not 0 <= cfg.advice_confirm_seconds < math.inf:
        problems.append("--advice-confirm-seconds must be finite seconds, not negative")
    return problems


def _value_problems(cfg: Config) -> list[str]:
    """Values out of range, and combinations that do not go together."""
    problems: list[str] = []
    if cfg.interval <= 0:
        problems.append("--interval must be positive")
    if cfg.window < 2 * cfg.interval:
        problems.append("--window must be at least twice --interval")
    if cfg.scrape_timeout < 0:
        problems.append("--scrape-timeout must not be negative")
    if cfg.max_body_bytes < 1024:
        problems.append("--max-body-bytes must be at least 1KiB")
    problems.extend(_hysteresis_problems(cfg))
    if cfg.kv_bytes_per_token < 0:
        problems.append("--kv-bytes-per-token must not be negative")
    if not 0 <= cfg.gpu_peak_flops < math.inf:
        problems.append("--gpu-peak-flops must be a finite FLOP/s, not negative")
    if not 0 <= cfg.nvml_poll_interval <= 1:
        problems.append("--nvml-poll-interval must be in [0, 1] seconds (0: from the link)")
    if cfg.vllm_pid is not None and cfg.vllm_pid <= 0:
        problems.append("--vllm-pid must be a positive pid")
    if cfg.vllm_pid is not None and len(cfg.targets) > 1:
        problems.append("--vllm-pid applies to a single target; give targets[].pid instead")
    try:
        parse_listen(cfg.listen)
    except ValueError as exc:
        problems.append(str(exc))
    if cfg.max_engines_per_target < 1:
        problems.append("--max-engines-per-target must be at least 1")
    problems.extend(_kv_events_problems(cfg))
    problems.extend(_web_config_problems(cfg.web_config_file))
    return problems


def _web_config_problems(path: str) -> list[str]:
    if not path:
        return []
    try:
        load_web_config(path)
    except WebConfigError as exc:
        return list(exc.problems)
    return []


def _kv_events_problems(cfg: Config) -> list[str]:
    problems: list[str] = []
    flags = cfg.kv_events_endpoint or cfg.kv_events_bind or cfg.kv_events_replay_endpoint
    if flags and len(cfg.targets) > 1:
        problems.append(
            "--kv-events-endpoint/--kv-events-bind/--kv-events-replay-endpoint apply to a single "
            "target; give targets[].kv_events_endpoint (or _bind) in --config instead"
        )
    named = [
        ("--kv-events-endpoint", cfg.kv_events_endpoint),
        ("--kv-events-bind", cfg.kv_events_bind),
        ("--kv-events-replay-endpoint", cfg.kv_events_replay_endpoint),
    ]
    for label, per in cfg.kv_events_targets.items():
        named.extend((f"target {label} {key}", values) for key, values in per.items())
    for where, endpoints in named:
        for e in endpoints:
            if not re.match(r"^(tcp|ipc)://\S+$", e):
                problems.append(f"{where} {e!r}: expected tcp://HOST:PORT or ipc://PATH")
    if cfg.kv_events_endpoint and cfg.kv_events_bind:
        problems.append("give --kv-events-endpoint (vLLM binds) or --kv-events-bind, not both")
    if cfg.kv_events_queue < 1:
        problems.append("--kv-events-queue must be at least 1")
    if not 0 < cfg.kv_events_replay_timeout <= 60:
        problems.append("--kv-events-replay-timeout must be in (0, 60] seconds")
    return problems + _whatif_problems(cfg)


def _whatif_problems(cfg: Config) -> list[str]:
    problems: list[str] = []
    if not cfg.whatif_sizes or any(b <= 0 for b in cfg.whatif_sizes):
        problems.append("--whatif-sizes must list positive sizes")
    if cfg.whatif_store_threshold < 0:
        problems.append("--whatif-store-threshold must not be negative")
    if not 0 < cfg.whatif_sample_rate <= 1:
        problems.append("--whatif-sample-rate must be in (0, 1]")
    if cfg.whatif_sample_rate < 1 and cfg.whatif_model != "stack":
        problems.append("--whatif-sample-rate below 1 needs --whatif-model stack")
    if cfg.whatif_model == "stack" and (
        cfg.whatif_policy != "lru" or cfg.whatif_store_threshold >= 2
    ):
        problems.append("--whatif-model stack is plain LRU: use vllm for arc or a store threshold")
    return problems
