"""exporter/webconfig.py: --web.config.file (exporter-toolkit's format) checked as a whole,
durations, the rate limiter, basic auth's cache and client certificate names. Serving with
it (TLS, mutual TLS, auth over HTTP) is tested in tests/faults/test_serving_security.py."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from pathlib import Path

import bcrypt
import pytest
import yaml

from exporter.cli import serve_parser
from exporter.config import ConfigError, load_config
from exporter.webconfig import (
    BasicAuth,
    RateLimit,
    TokenBucket,
    WebConfig,
    WebConfigError,
    load_web_config,
    parse_duration,
    peer_sans,
)


def test_load_web_config_lists_every_problem_together(tmp_path: Path) -> None:
    key = tmp_path / "server.key"
    key.write_text("a key file that exists (not read while the certificate is missing)\n")
    path = tmp_path / "web.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {
                    "cert_file": str(tmp_path / "missing.crt"),
                    "key_file": str(key),
                    "client_auth_type": "RequireAnyClientCert",
                    "cipher_suites": ["TLS_AES_128_GCM_SHA256"],
                    "min_version": "TLS14",
                },
                "basic_auth_users": {"bob": "plaintext"},
                "http_server_config": {"headers": {"Set-Cookie": "x=1"}},
                "rate_limit": {"interval": "soon", "burst": 1},
                "tls_config": {},
            }
        )
    )
    with pytest.raises(WebConfigError) as exc:
        load_web_config(path)
    text = str(exc.value)
    for needle in (
        "unknown key 'tls_config'",
        "missing.crt is not a readable file",
        "RequireAnyClientCert",
        "cipher_suites",
        "TLS14",
        "basic_auth_users.bob",
        "Set-Cookie",
        "rate_limit.interval",
    ):
        assert needle in text, needle
    # The same problems make the configuration invalid at startup (exit 2 in the CLI).
    args: argparse.Namespace = serve_parser().parse_args(
        ["--vllm-url", "http://127.0.0.1:1", "--web.config.file", str(path)]
    )
    with pytest.raises(ConfigError) as cerr:
        load_config(args, environ={})
    assert any("TLS14" in p for p in cerr.value.problems)


def test_durations_and_token_bucket() -> None:
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("250ms") == 0.25
    with pytest.raises(ValueError):
        parse_duration("1 minute")
    t = [0.0]
    bucket = TokenBucket(RateLimit(interval=1.0, burst=2), clock=lambda: t[0])
    assert [bucket.take(), bucket.take(), bucket.take()] == [True, True, False]
    t[0] = 1.0
    assert bucket.take() and not bucket.take()


async def test_basic_auth_caches_and_does_not_tell_users_apart() -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4))
    auth = BasicAuth({"alice": hashed})
    assert await auth.verify("alice", b"pw")
    assert not await auth.verify("alice", b"nope")
    assert not await auth.verify("nobody", b"pw")
    assert len(auth._cache) == 3


def _load(tmp_path: Path, doc: object) -> WebConfig:
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(doc))
    return load_web_config(path)


def test_load_web_config_of_an_empty_file_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "web.yml").write_text("")
    assert load_web_config(tmp_path / "web.yml") == WebConfig()
    with pytest.raises(WebConfigError, match="expected a mapping at the top level"):
        _load(tmp_path, ["tls_server_config"])
    with pytest.raises(WebConfigError) as exc:
        load_web_config(tmp_path / "missing.yml")
    assert exc.value.problems and "missing.yml" in exc.value.problems[0]


def test_load_web_config_resolves_files_next_to_the_config(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", "s.key", "-out", "s.crt", "-days", "1", "-subj", "/CN=t"],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    cfg = _load(tmp_path, {"tls_server_config": {"cert_file": "s.crt", "key_file": "s.key"}})
    assert cfg.tls is not None
    assert (cfg.tls.cert_file, cfg.tls.key_file) == (
        str(tmp_path.resolve() / "s.crt"),
        str(tmp_path.resolve() / "s.key"),
    )
    assert (cfg.tls.client_auth_type, cfg.tls.min_version, cfg.tls.max_version) == (
        "NoClientCert",
        "TLS12",
        "TLS13",
    )
    assert cfg.tls.context().verify_mode == ssl.CERT_NONE


def test_load_web_config_headers_users_and_rate_limit(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    cfg = _load(
        tmp_path,
        {
            "basic_auth_users": {"alice": hashed},
            "http_server_config": {"headers": {"X-Frame-Options": "deny", "X-XSS-Protection": ""}},
            "rate_limit": {"interval": "100ms", "burst": 0},
        },
    )
    assert cfg.users == {"alice": hashed.encode()}
    assert cfg.headers == {"X-Frame-Options": "deny"}  # an empty value sets nothing
    assert cfg.rate_limit == RateLimit(interval=0.1, burst=1)  # a burst of at least one
    # interval 0 turns the limiter off, as in the toolkit
    assert _load(tmp_path, {"rate_limit": {"interval": 0, "burst": 5}}).rate_limit is None


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"http_server_config": {"headers": {"X-Frame-Options": "a\r\nb"}}}, "line break"),
        ({"basic_auth_users": {"a:b": "$2y$10$x"}}, "contains ':'"),
        ({"rate_limit": {"interval": "1s", "burst": -1}}, "rate_limit.burst"),
        ({"http_server_config": {"http2": "yes"}}, "http2"),
        ({"tls_server_config": {"cert_file": "x"}}, "tls_server_config"),
    ],
)
def test_load_web_config_rejects(tmp_path: Path, doc: dict, needle: str) -> None:
    with pytest.raises(WebConfigError) as exc:
        _load(tmp_path, doc)
    assert needle in str(exc.value)
    assert all(p.startswith("--web.config.file ") for p in exc.value.problems)


def test_parse_duration_takes_numbers_and_compound_go_durations() -> None:
    assert parse_duration(2) == 2.0
    assert parse_duration(0.5) == 0.5
    assert parse_duration("0") == 0.0
    assert parse_duration("1h2m3s") == 3723.0
    assert parse_duration("1.5s") == 1.5
    for bad in ("", "s", "1s 2s", "-1s", True):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_peer_sans_lists_every_subject_alternative_name() -> None:
    cert = {"subjectAltName": (("DNS", "prometheus.test"), ("IP Address", "10.0.0.1"))}
    assert peer_sans(cert) == {"prometheus.test", "10.0.0.1"}
    assert peer_sans(None) == set() == peer_sans({})
