"""The web configuration file (--web.config.file): TLS, basic auth, headers, rate limit.

The format is the Prometheus exporter-toolkit's (docs/web-configuration.md there), so one
file serves node_exporter and this exporter alike. What Python's ssl module cannot do is
refused with a message rather than ignored: a silently dropped security setting is worse
than a failed start. Unlike the toolkit, the file is read once at startup.

bcrypt is imported lazily and only when basic_auth_users is set
(`pip install 'kv-offload-exporter[web]'`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# The toolkit's other two types accept a client certificate without verifying it: Python's
# ssl cannot do that, and the toolkit itself calls them insecure.
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
ALLOWED_HEADERS = (
    "Content-Security-Policy",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "X-XSS-Protection",
    "Strict-Transport-Security",
)
_TLS_KEYS = frozenset(
    {
        "cert",
        "key",
        "client_ca",
        "cert_file",
        "key_file",
        "client_auth_type",
        "client_ca_file",
        "client_allowed_sans",
        "min_version",
        "max_version",
        "cipher_suites",
        "prefer_server_cipher_suites",
        "curve_preferences",
    }
)
_TOP_KEYS = frozenset({"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"})
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
# Compared against when the user is unknown, so a wrong user costs as long as a wrong
# password and response times do not tell which user names exist (as the toolkit does).
_DUMMY_HASH = b"$2b$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"


class WebConfigError(ValueError):
    def __init__(self, path: str, problems: list[str]) -> None:
        super().__init__(f"--web.config.file {path}: " + "; ".join(problems))
        self.problems = [f"--web.config.file {path}: {p}" for p in problems]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_ca: str | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        ctx.maximum_version = TLS_VERSIONS[self.max_version]
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = CLIENT_AUTH_TYPES[self.client_auth_type]
        if self.client_ca_file:
            ctx.load_verify_locations(cafile=self.client_ca_file)
        if self.client_ca:
            ctx.load_verify_locations(cadata=self.client_ca)
        return ctx


@dataclass(frozen=True, slots=True)
class RateLimit:
    interval: float  # seconds between requests at the sustained rate
    burst: int


@dataclass(frozen=True, slots=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)
    rate_limit: RateLimit | None = None


def parse_duration(text: Any) -> float:
    """A Go duration ("1s", "250ms", "1m30s") or a number of seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"bad duration {text!r} (examples: 1s, 250ms, 1m30s)")
    return total


def _file(value: Any, what: str, problems: list[str], base: Path) -> str | None:
    if value is None or value == "":
        return None
    path = Path(str(value))
    if not path.is_absolute():
        path = base / path  # like the toolkit: relative to the config file's directory
    if not path.is_file():
        problems.append(f"{what}: {path} is not a readable file")
        return None
    return str(path)


def _tls(raw: Any, problems: list[str], base: Path) -> TlsConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.append("tls_server_config: expected a mapping")
        return None
    problems.extend(_tls_unsupported(raw))
    cert = _file(raw.get("cert_file"), "tls_server_config.cert_file", problems, base)
    key = _file(raw.get("key_file"), "tls_server_config.key_file", problems, base)
    if raw.get("cert_file") is None or raw.get("key_file") is None:
        problems.append("tls_server_config: cert_file and key_file are both required")
    ca_file = _file(raw.get("client_ca_file"), "tls_server_config.client_ca_file", problems, base)
    ca_inline = raw.get("client_ca") or None
    auth = raw.get("client_auth_type") or (
        "RequireAndVerifyClientCert" if ca_file or ca_inline else "NoClientCert"
    )
    problems.extend(_client_auth_problems(auth, has_ca=bool(ca_file or ca_inline)))
    sans = raw.get("client_allowed_sans") or []
    if not isinstance(sans, list) or not all(isinstance(s, str) for s in sans):
        problems.append("tls_server_config.client_allowed_sans: expected a list of strings")
        sans = []
    if sans and auth != "RequireAndVerifyClientCert":
        problems.append(
            "tls_server_config.client_allowed_sans needs client_auth_type "
            "RequireAndVerifyClientCert"
        )
    versions = _tls_versions(raw, problems)
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        problems.append("tls_server_config: min_version is above max_version")
    if cert is None or key is None:
        return None
    tls = TlsConfig(
        cert_file=cert,
        key_file=key,
        client_auth_type=auth if auth in CLIENT_AUTH_TYPES else "NoClientCert",
        client_ca_file=ca_file,
        client_ca=str(ca_inline) if ca_inline else None,
        client_allowed_sans=tuple(sans),
        min_version=versions["min_version"],
        max_version=versions["max_version"],
    )
    try:
        tls.context()  # load the certificate, key and CA now: fail at startup, not per request
    except (ssl.SSLError, OSError, ValueError) as exc:
        problems.append(f"tls_server_config: cannot load certificate/key/CA: {exc}")
        return None
    return tls


def _tls_unsupported(raw: dict[Any, Any]) -> list[str]:
    """Unknown keys, and the toolkit's keys this exporter does not take."""
    problems = [f"tls_server_config: unknown key {key!r}" for key in sorted(set(raw) - _TLS_KEYS)]
    for name in ("cert", "key"):
        if raw.get(name):
            problems.append(
                f"tls_server_config.{name}: inline PEM is not supported; use {name}_file"
            )
    for name in ("cipher_suites", "curve_preferences"):
        if raw.get(name):
            problems.append(
                f"tls_server_config.{name}: not supported (OpenSSL's defaults apply); "
                "use min_version: TLS13 to restrict ciphers"
            )
    return problems


def _client_auth_problems(auth: Any, *, has_ca: bool) -> list[str]:
    if auth in UNVERIFIED_CLIENT_AUTH:
        return [
            f"tls_server_config.client_auth_type {auth}: accepts unverified client "
            "certificates and is not supported; use RequireAndVerifyClientCert"
        ]
    if auth not in CLIENT_AUTH_TYPES:
        return [
            f"tls_server_config.client_auth_type {auth!r}: expected one of "
            f"{', '.join(CLIENT_AUTH_TYPES)}"
        ]
    if auth != "NoClientCert" and not has_ca:
        return [f"tls_server_config.client_auth_type {auth} needs client_ca_file"]
    return []


def _tls_versions(raw: dict[Any, Any], problems: list[str]) -> dict[str, str]:
    """min_version and max_version, each its default where missing or unknown."""
    versions = {}
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = raw.get(name) or default
        if value not in TLS_VERSIONS:
            problems.append(f"tls_server_config.{name} {value!r}: expected one of TLS10..TLS13")
            value = default
        versions[name] = value
    return versions


def _users(raw: Any, problems: list[str]) -> dict[str, bytes]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("basic_auth_users: expected a mapping of user: bcrypt hash")
        return {}
    users: dict[str, bytes] = {}
    for user, hashed in raw.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            problems.append(
                f"basic_auth_users.{user}: expected a bcrypt hash ($2y$...), "
                "e.g. from htpasswd -nBC 10 '' | tr -d ':\\n'"
            )
            continue
        if ":" in str(user):
            problems.append(f"basic_auth_users: user name {user!r} contains ':'")
            continue
        users[str(user)] = hashed.encode()
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            problems.append(
                "basic_auth_users needs the bcrypt package: pip install 'kv-offload-exporter[web]'"
            )
    return users


def _http(raw: Any, problems: list[str]) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("http_server_config: expected a mapping")
        return {}
    for key in sorted(set(raw) - {"http2", "headers"}):
        problems.append(f"http_server_config: unknown key {key!r}")
    if "http2" in raw and not isinstance(raw["http2"], bool):
        problems.append("http_server_config.http2: expected true or false")  # HTTP/1.1 only
    headers = raw.get("headers") or {}
    if not isinstance(headers, dict):
        problems.append("http_server_config.headers: expected a mapping")
        return {}
    out: dict[str, str] = {}
    for name, value in headers.items():
        if name not in ALLOWED_HEADERS:
            problems.append(
                f"http_server_config.headers: {name!r} is not one of {', '.join(ALLOWED_HEADERS)}"
            )
        elif value not in (None, ""):
            if any(c in str(value) for c in "\r\n"):
                problems.append(f"http_server_config.headers.{name}: contains a line break")
            else:
                out[name] = str(value)
    return out


def _rate_limit(raw: Any, problems: list[str]) -> RateLimit | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.append("rate_limit: expected a mapping with interval and burst")
        return None
    for key in sorted(set(raw) - {"interval", "burst"}):
        problems.append(f"rate_limit: unknown key {key!r}")
    try:
        interval = parse_duration(raw.get("interval", 0))
    except ValueError as exc:
        problems.append(f"rate_limit.interval: {exc}")
        return None
    burst = raw.get("burst", 0)
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
        problems.append("rate_limit.burst: expected a non-negative integer")
        return None
    if interval <= 0 or not math.isfinite(interval):
        return None  # 0 disables the limiter, as in the toolkit
    return RateLimit(interval=interval, burst=max(burst, 1))


def load_web_config(path: str | Path) -> WebConfig:
    """Read and check the whole file; every problem is listed in one WebConfigError."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise WebConfigError(str(path), [str(exc)]) from None
    if doc is None:
        return WebConfig()
    if not isinstance(doc, dict):
        raise WebConfigError(str(path), ["expected a mapping at the top level"])
    problems = [f"unknown key {k!r}" for k in sorted(set(doc) - _TOP_KEYS, key=str)]
    base = p.resolve().parent
    cfg = WebConfig(
        tls=_tls(doc.get("tls_server_config"), problems, base),
        users=_users(doc.get("basic_auth_users"), problems),
        headers=_http(doc.get("http_server_config"), problems),
        rate_limit=_rate_limit(doc.get("rate_limit"), problems),
    )
    if problems:
        raise WebConfigError(str(path), problems)
    return cfg


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes, off the event loop, cached.

    bcrypt at cost 10 takes ~70 ms of CPU: each distinct (user, password) is checked once
    in a worker thread and the outcome cached (bounded LRU), as the toolkit does. At most
    `max_parallel` checks run at once, so a flood of bad passwords cannot take every thread.
    """

    def __init__(self, users: Mapping[str, bytes], *, cache_size: int = 256, max_parallel: int = 2):
        self.users = dict(users)
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._sem = asyncio.Semaphore(max_parallel)

    def _key(self, user: str, password: bytes) -> bytes:
        hashed = self.users.get(user, _DUMMY_HASH)
        return hashlib.sha256(user.encode() + b"\0" + hashed + b"\0" + password).digest()

    def _check(self, user: str, password: bytes) -> bool:
        import bcrypt

        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password, hashed if hashed is not None else _DUMMY_HASH)
        except ValueError:
            ok = False
        return ok and hashed is not None

    async def verify(self, user: str, password: bytes) -> bool:
        key = self._key(user, password)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        async with self._sem:
            ok = await asyncio.to_thread(self._check, user, password)
        with self._lock:
            self._cache[key] = ok
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ok


class TokenBucket:
    """The toolkit's rate_limit: one token per `interval`, at most `burst` saved up."""

    def __init__(self, limit: RateLimit, clock: Any = time.monotonic) -> None:
        self.rate = 1.0 / limit.interval
        self.burst = float(limit.burst)
        self.tokens = self.burst
        self._clock = clock
        self._last = clock()

    def take(self) -> bool:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def peer_sans(peercert: Mapping[str, Any] | None) -> set[str]:
    """DNS, IP, e-mail and URI subject alternative names of a verified client certificate."""
    if not peercert:
        return set()
    return {str(v) for _, v in peercert.get("subjectAltName", ())}
