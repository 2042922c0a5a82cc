"""Serving security: TLS, mutual TLS, basic auth, request limits, fixed routes, no privileges.

TLS and auth run against the exporter as a process (`--web.config.file`), with
certificates made by the openssl CLI in the test; route and limit checks also use the
in-process app on a real 127.0.0.1 socket.
"""

from __future__ import annotations

import base64
import http.client
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import yaml
from aiohttp import web

from exporter.config import load_config
from exporter.runtime import Exporter
from exporter.server import make_app
from exporter.webconfig import load_web_config
from testbed.procs import free_port, http_get, start, stop
from testbed.replay import ReplayServer, Reply
from tests.conftest import CPU
from tests.exporter_harness import config, running
from tests.faults.common import wait_until

GOOD = (CPU / "metrics-after.prom").read_bytes()
PASSWORD = "s3cret-pa55"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # self-signed, not from the CA
    rogue_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=kvoe test CA", cwd=d)  # fmt: skip
    for name, san in (("server", "IP:127.0.0.1"), ("client", "DNS:prometheus.test")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    rogue_san = "subjectAltName=DNS:prometheus.test"
    _openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.crt", "-days", "2",
             "-subj", "/CN=rogue", "-addext", rogue_san, cwd=d)  # fmt: skip
    return Pki(
        d,
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "rogue.crt",
        d / "rogue.key",
    )


def _client_ctx(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _auth(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _https(
    port: int, path: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@dataclass
class Served:
    port: int
    log: Path
    target: ReplayServer


def _serve(tmp: Path, web_cfg: dict, ready: Callable[[int], bool]) -> Iterator[Served]:
    path = tmp / "web.yml"
    path.write_text(yaml.safe_dump(web_cfg))
    target = ReplayServer([Reply(body=GOOD)]).start()
    port = free_port()
    log = tmp / f"exporter-{port}.log"
    cmd = [sys.executable, "-m", "exporter", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--vllm-url", target.url, "--interval", "1", "--web.config.file", str(path)]
    cmd += ["--no-nvml", "--no-procfs", "--no-cgroup"]
    proc = start(cmd, log)
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return bool(ready(port))
            except (OSError, ssl.SSLError):
                return False

        wait_until("exporter answering over TLS", up, timeout=60)
        yield Served(port, log, target)
    finally:
        stop(proc)
        target.stop()


@pytest.fixture(scope="module")
def tls_auth(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()
    cfg = {
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        "basic_auth_users": {"alice": hashed.replace("$2b$", "$2y$", 1)},  # htpasswd's prefix
        "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
    }
    ctx = _client_ctx(pki)
    yield from _serve(
        tmp_path_factory.mktemp("tls"),
        cfg,
        lambda port: _https(port, "/readyz", ctx, _auth("alice", PASSWORD))[0] == 200,
    )


def test_tls_with_basic_auth_serves_metrics(tls_auth: Served, pki: Pki) -> None:
    status, headers, body = _https(
        tls_auth.port, "/metrics", _client_ctx(pki), _auth("alice", PASSWORD)
    )
    assert status == 200
    assert b"kvoffload_target_up" in body
    assert headers.get("X-Content-Type-Options") == "nosniff"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        _auth("alice", "wrong"),
        _auth("mallory", PASSWORD),
        {"Authorization": "Basic !!!not-base64"},
        {"Authorization": "Bearer abc"},
    ],
    ids=["none", "wrong_password", "unknown_user", "bad_base64", "other_scheme"],
)
@pytest.mark.parametrize("path", ["/metrics", "/", "/api/v1/status", "/healthz", "/advice"])
def test_basic_auth_rejects(tls_auth: Served, pki: Pki, headers: dict, path: str) -> None:
    status, resp_headers, body = _https(tls_auth.port, path, _client_ctx(pki), headers)
    assert status == 401
    assert resp_headers.get("WWW-Authenticate", "").startswith("Basic")
    assert b"kvoffload" not in body


def test_plain_http_to_tls_port_gets_no_metrics(tls_auth: Served) -> None:
    try:
        status, body = http_get(f"http://127.0.0.1:{tls_auth.port}/metrics", timeout=5)
    except (OSError, http.client.HTTPException):
        return  # connection refused by the TLS layer
    assert status != 200 and b"kvoffload" not in body


def test_untrusted_server_cert_is_refused_by_a_verifying_client(tls_auth: Served) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        _https(tls_auth.port, "/metrics", ssl.create_default_context(), _auth("alice", PASSWORD))


@pytest.fixture(scope="module")
def mtls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cfg = {
        "tls_server_config": {
            "cert_file": str(pki.server_cert),
            "key_file": str(pki.server_key),
            "client_auth_type": "RequireAndVerifyClientCert",
            "client_ca_file": str(pki.ca),
            "client_allowed_sans": ["prometheus.test"],
            "min_version": "TLS12",
        }
    }
    ctx = _client_ctx(pki, pki.client_cert, pki.client_key)
    yield from _serve(
        tmp_path_factory.mktemp("mtls"), cfg, lambda port: _https(port, "/readyz", ctx)[0] == 200
    )


def test_mutual_tls_accepts_a_client_cert_from_the_ca(mtls: Served, pki: Pki) -> None:
    ctx = _client_ctx(pki, pki.client_cert, pki.client_key)
    status, _, body = _https(mtls.port, "/metrics", ctx)
    assert status == 200 and b"kvoffload_target_up" in body


@pytest.mark.parametrize("client", ["none", "rogue"])
def test_mutual_tls_refuses_other_clients(mtls: Served, pki: Pki, client: str) -> None:
    ctx = _client_ctx(pki) if client == "none" else _client_ctx(pki, pki.rogue_cert, pki.rogue_key)
    # TLS 1.3 reports the refused client certificate on the first read, not in the handshake.
    with pytest.raises((ssl.SSLError, ConnectionResetError, http.client.RemoteDisconnected)):
        _https(mtls.port, "/metrics", ctx)


def test_listen_defaults_to_all_interfaces() -> None:
    cfg = load_config(None, environ={"KVOE_VLLM_URLS": "http://127.0.0.1:8000"})
    assert cfg.listen_address == ("0.0.0.0", 9747)


# --- in-process app on a real socket: routes, limits, rate limit ----------------------

EXPECTED_ROUTES = {
    ("GET", "/"),
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/api/v1/status"),
    ("GET", "/advice"),
}


def test_route_table_is_fixed_paths_only() -> None:
    app = make_app(Exporter(config("http://127.0.0.1:1"), []), run_loop=False)
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert routes == EXPECTED_ROUTES
    for r in app.router.routes():
        assert isinstance(r.resource, web.PlainResource), r  # no {variable} or static routes


async def test_no_endpoint_follows_a_url_or_path_from_the_request() -> None:
    canary = ReplayServer([Reply(body=GOOD)]).start()
    try:
        with ReplayServer([Reply(body=GOOD)]) as srv:
            async with running(config(srv.url)) as (exp, client):
                await exp.run_cycle()
                plain = await (await client.get("/metrics")).read()
                hostile = [
                    f"/metrics?target={canary.url}/metrics",
                    f"/metrics?url={canary.url}&module=x",
                    "/metrics?name[]=../../etc/passwd",
                    f"/api/v1/status?vllm_url={canary.url}",
                    f"/advice?url={canary.url}",
                    "/?file=/etc/passwd",
                ]
                for path in hostile:
                    resp = await client.get(path)
                    assert resp.status == 200, path
                    text = await resp.text()
                    assert "root:" not in text
                    if path.startswith("/metrics"):
                        assert await resp.read() == plain  # the query is ignored
                for path in ("/../../etc/passwd", "/etc/passwd", "/metrics/../../etc/passwd"):
                    resp = await client.get(path)
                    assert resp.status == 404, path
                # POST with a body is not accepted anywhere.
                resp = await client.post("/metrics", data=b"x" * 1024)
                assert resp.status == 405
        assert canary.requests == 0
    finally:
        canary.stop()


def _raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


@pytest.fixture
def plain_exporter(tmp_path: Path) -> Iterator[int]:
    target = ReplayServer([Reply(body=GOOD)]).start()
    port = free_port()
    log = tmp_path / "exporter.log"
    cmd = [sys.executable, "-m", "exporter", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--vllm-url", target.url, "--interval", "1", "--no-nvml", "--no-procfs"]
    cmd += ["--no-cgroup"]
    proc = start(cmd, log)
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return _raw_request(
                    port, b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                ).startswith(b"HTTP/1.1 200")
            except OSError:
                return False

        wait_until("exporter ready", ready, timeout=60)
        yield port
    finally:
        stop(proc)
        target.stop()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16384 + b"\r\n\r\n",
        b"GET /metrics?" + b"q" * 16384 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
        + b"\r\n",
    ],
    ids=["huge_header", "huge_request_line", "too_many_headers"],
)
def test_oversized_requests_are_rejected_and_serving_goes_on(
    plain_exporter: int, request_bytes: bytes
) -> None:
    answer = _raw_request(plain_exporter, request_bytes)
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.split(b" ")[1] in (b"400", b"413", b"414", b"431"), status_line
    status, body = http_get(f"http://127.0.0.1:{plain_exporter}/metrics")
    assert status == 200 and b"kvoffload_target_up" in body


def test_exporter_needs_no_capabilities(tmp_path: Path) -> None:
    """Started with every capability dropped (and no way to regain one), the exporter
    serves: it binds an unprivileged port and reads only what any user may read."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not available")
    target = ReplayServer([Reply(body=GOOD)]).start()
    port = free_port()
    log = tmp_path / "exporter.log"
    cmd = ["setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]
    cmd += [sys.executable, "-m", "exporter", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--vllm-url", target.url, "--interval", "1"]
    proc = start(cmd, log)
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
            except OSError:
                return False

        wait_until("exporter without capabilities ready", ready, timeout=60)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caps = {
            k: int(v, 16)
            for k, v in (line.split(":\t") for line in status.splitlines())
            if k in ("CapEff", "CapPrm", "CapBnd")
        }
        assert caps == {"CapEff": 0, "CapPrm": 0, "CapBnd": 0}
        code, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200
        assert b"kvoffload_target_up{" in body and b"} 1.0" in body
    finally:
        stop(proc)
        target.stop()


async def test_rate_limit_answers_429_past_the_burst(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"rate_limit": {"interval": "1h", "burst": 3}}))
    web_config = load_web_config(path)
    app = make_app(
        Exporter(config("http://127.0.0.1:1"), []), run_loop=False, web_config=web_config
    )
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        codes = [(await client.get("/healthz")).status for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
