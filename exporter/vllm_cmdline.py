"""How a vLLM server was launched, from its command line: connector, spec, policy, tiers.

vLLM exports little of its KV-transfer configuration: `vllm:cache_config_info` has the
offload size and backend, `vllm:kv_offload_config_info` (0.33+) the CPU tier's size, but
no release exports the eviction policy, the store threshold, the tiering spec or the
connector class. The API server's command line has them all (`--kv-transfer-config`,
`--kv-offloading-size/-backend`), and its environment says whether the native backend is
the SimpleCPUOffloadConnector (`VLLM_USE_SIMPLE_KV_OFFLOAD=1`) and which UCX transports
NIXL may use (`UCX_TLS`).

`launch_config(argv, environ)` is pure: tests run it on the recorded `cmd.txt` files of
the H200 runs. It mirrors vLLM's own resolution (`VllmConfig._post_init_kv_transfer_config`,
0.26 to 0.33): a `--kv-offloading-size` sets the connector from `--kv-offloading-backend`
(native: OffloadingConnector, or SimpleCPUOffloadConnector with the environment switch;
lmcache: LMCacheMPConnector) and keeps the user's `kv_connector_extra_config`.

Every label value it produces is bounded: connector and spec names outside the known
set become "other", policies outside lru/arc "other", tier types are kept only when
they are identifiers of at most 24 characters (at most 4 tiers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONNECTORS = frozenset(
    {
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "NixlConnector",
        "MultiConnector",
        "P2pNcclConnector",
        "MooncakeConnector",
        "ExampleConnector",
    }
)
SPECS = frozenset({"CPUOffloadingSpec", "TieringOffloadingSpec"})
POLICIES = frozenset({"lru", "arc"})
OFFLOADING_CONNECTORS = frozenset({"OffloadingConnector"})
MAX_TIERS = 4
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """The KV-transfer configuration of one vLLM server, as far as its launch shows it.

    Empty strings mean "not applicable" (no connector, no spec), never "unknown": an
    unknown configuration is no LaunchConfig at all.
    """

    connector: str = ""  # "" = no KV connector configured
    spec: str = ""  # OffloadingConnector spec ("" for other connectors)
    eviction_policy: str = ""  # lru | arc | other ("" without an OffloadingConnector)
    store_threshold: int = 0  # as configured; below 2 means off
    tiers: tuple[str, ...] = ()  # secondary tier types in order (TieringOffloadingSpec)
    kv_role: str = ""
    offloading_size_gib: float | None = None
    offloading_backend: str = ""  # native | lmcache | ""
    cpu_bytes_to_use: float | None = None
    blocks_per_chunk: int | None = None
    ucx_tls: str | None = None  # UCX transports NIXL may use (environment), None unknown
    environ_read: bool = False  # the environment was readable (simple-offload switch known)
    # False where the command line turns CUDA graphs off (`_cuda_graphs`): such an engine
    # launches every kernel of every step from its one thread, and on the H200/H100 matrix
    # a CPU tier paid less there than the what-if predicts, or cost (docs/advisor.md).
    cuda_graphs: bool = True

    @property
    def tiers_label(self) -> str:
        """Tier label value: the primary and each secondary tier, as vLLM names them."""
        if self.spec != "TieringOffloadingSpec":
            return ""
        return ",".join(["0:primary", *(f"{i + 1}:{t}" for i, t in enumerate(self.tiers))])

    @property
    def threshold_active(self) -> int:
        """The threshold vLLM applies: values below 2 disable it (0)."""
        return self.store_threshold if self.store_threshold >= 2 else 0


def _bounded(value: object, allowed: frozenset[str]) -> str:
    text = str(value) if value is not None else ""
    return text if text in allowed else ("other" if text else "")


def _tier_type(cfg: object) -> str | None:
    if not isinstance(cfg, Mapping):
        return None
    raw = cfg.get("type")
    if not isinstance(raw, str):
        return None
    # Out-of-tree tiers are named by a class path: keep its last component.
    name = raw.rsplit(".", 1)[-1]
    if name.isidentifier() and len(name) <= 24:
        return name
    return "other"


def _flag_values(argv: Sequence[str]) -> dict[str, list[str]]:
    """--flag value / --flag=value pairs, flags normalised to dashes (vLLM accepts both)."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            name = name.replace("_", "-")
            if eq:
                out.setdefault(name, []).append(value)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.setdefault(name, []).append(argv[i + 1])
                i += 1
            else:
                out.setdefault(name, []).append("")
        i += 1
    return out


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _float(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _transfer_config(flags: Mapping[str, list[str]]) -> dict[str, Any]:
    """--kv-transfer-config JSON, plus vLLM's dotted form (--kv-transfer-config.key v)."""
    cfg: dict[str, Any] = {}
    for text in flags.get("kv-transfer-config", []):
        doc = _json_object(text)
        if doc is not None:
            cfg.update(doc)
    prefix = "kv-transfer-config."
    for name, values in flags.items():
        if name.startswith(prefix) and values:
            key = name[len(prefix) :].replace("-", "_")
            value: Any = _json_object(values[-1]) if values[-1].startswith("{") else values[-1]
            cfg[key] = value
    return cfg


def _cuda_graphs(argv: Sequence[str], flags: Mapping[str, list[str]]) -> bool:
    """Whether the engine captures CUDA graphs: not with `--enforce-eager` (the last of it and
    `--no-enforce-eager` wins), nor with cudagraph_mode NONE in `--compilation-config` /
    `-cc` (JSON, or the dotted `--compilation-config.cudagraph_mode NONE`)."""
    eager = False
    modes: list[str] = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--enforce-eager", "--enforce_eager"):
            eager = not eq or value.strip().lower() in _TRUE
        elif name in ("--no-enforce-eager", "--no_enforce_eager"):
            eager = False
        elif name == "-cc" or name.startswith("-cc."):
            text = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            key = name[4:].replace("-", "_")
            if name == "-cc":
                doc = _json_object(text) or {}
                modes.append(str(doc.get("cudagraph_mode", "")))
            elif key == "cudagraph_mode":
                modes.append(text)
    for text in flags.get("compilation-config", []):
        modes.append(str((_json_object(text) or {}).get("cudagraph_mode", "")))
    modes += flags.get("compilation-config.cudagraph-mode", [])
    return not eager and not any(m.strip().upper() == "NONE" for m in modes)


def is_vllm_server(argv: Sequence[str]) -> bool:
    """A command line that can carry vLLM serving flags (not a setproctitle title)."""
    return any(a.startswith("--") for a in argv)


def launch_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The KV-transfer configuration of a vLLM server from its argv (and environment)."""
    flags = _flag_values(argv)
    cfg = _transfer_config(flags)
    extra = cfg.get("kv_connector_extra_config")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    connector = str(cfg.get("kv_connector") or "")
    role = str(cfg.get("kv_role") or "")
    size = _float((flags.get("kv-offloading-size") or [""])[-1])
    backend = (flags.get("kv-offloading-backend") or [""])[-1]
    env = environ or {}
    if size is not None:
        backend = backend or "native"
        if backend == "native":
            simple = env.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0").strip().lower() in _TRUE
            connector = "SimpleCPUOffloadConnector" if simple else "OffloadingConnector"
            extra["cpu_bytes_to_use"] = size * (1 << 30)
        elif backend == "lmcache":
            connector = "LMCacheMPConnector"
        role = "kv_both"
    connector = _bounded(connector, CONNECTORS)
    spec = policy = ""
    threshold = 0
    tiers: tuple[str, ...] = ()
    if connector in OFFLOADING_CONNECTORS:
        spec = _bounded(extra.get("spec_name") or "CPUOffloadingSpec", SPECS)
        policy = _bounded(str(extra.get("eviction_policy") or "lru").lower(), POLICIES)
        threshold = max(_int(extra.get("store_threshold")) or 0, 0)
        if spec == "TieringOffloadingSpec":
            raw = extra.get("secondary_tiers")
            names = [_tier_type(t) for t in raw] if isinstance(raw, list) else []
            tiers = tuple(n for n in names if n is not None)[:MAX_TIERS]
    cpu_bytes = extra.get("cpu_bytes_to_use")
    bpc = _int(extra.get("blocks_per_chunk"))
    return LaunchConfig(
        connector=connector,
        spec=spec,
        eviction_policy=policy,
        store_threshold=threshold,
        tiers=tiers,
        kv_role=_bounded(role, frozenset({"kv_both", "kv_producer", "kv_consumer"})),
        offloading_size_gib=size,
        offloading_backend=_bounded(backend, frozenset({"native", "lmcache"})),
        cpu_bytes_to_use=float(cpu_bytes) if isinstance(cpu_bytes, int | float) else None,
        blocks_per_chunk=bpc if bpc and bpc > 0 else None,
        ucx_tls=env.get("UCX_TLS") if environ is not None else None,
        environ_read=environ is not None,
        cuda_graphs=_cuda_graphs(argv, flags),
    )


def parse_environ(data: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated KEY=VALUE entries."""
    out: dict[str, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out
