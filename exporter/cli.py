"""Command line: the only module that exits.

kv-offload-exporter [serve] --vllm-url URL [...]   run the exporter (default)
kv-offload-exporter serve --check-config ...       validate the configuration, then exit
kv-offload-exporter whatif --events FILE ...        offload hit ratio per CPU buffer size
kv-offload-exporter replay DIR [--json] [flags]     the advice timeline of a recording
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from exporter import __version__
from exporter.config import ConfigError, add_arguments, load_config
from exporter.logs import log_event, setup_logging

log = logging.getLogger("kvoe.cli")

SUBCOMMANDS = ("serve", "advise", "whatif", "replay")


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-offload-exporter",
        description="Prometheus exporter that tells whether vLLM's CPU KV-cache offloading "
        "pays off. Every flag is also a KVOE_<FLAG> environment variable and a key of "
        "the YAML --config file.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--check-config", action="store_true", help="validate the configuration and exit"
    )
    add_arguments(parser)
    return parser


async def _serve_async(cfg_args: argparse.Namespace) -> int:
    from exporter.runtime import Exporter, build_sources
    from exporter.server import serve

    cfg = load_config(cfg_args)
    exporter = Exporter(cfg, build_sources(cfg))
    host, port = cfg.listen_address
    task = asyncio.create_task(serve(exporter, host, port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log_event(log, logging.INFO, "shutdown")
    except OSError as exc:
        log_event(log, logging.ERROR, "listen_failed", address=cfg.listen, error=str(exc))
        return 1
    return 0


def cmd_serve(argv: Sequence[str]) -> int:
    args = serve_parser().parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"kv-offload-exporter: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level)
    if args.check_config:
        print(f"configuration OK: {len(cfg.targets)} target(s), listen {cfg.listen}")
        return 0
    log_event(
        log,
        logging.INFO,
        "starting",
        version=__version__,
        listen=cfg.listen,
        targets=[t.url for t in cfg.targets],
        interval=cfg.interval,
        window=cfg.window,
    )
    return asyncio.run(_serve_async(args))


def _get_json(url: str, timeout: float) -> object:
    """GET a JSON document; OSError (refused, timeout, HTTP error) or ValueError (not JSON)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read(8 << 20))


def cmd_advise(argv: Sequence[str]) -> int:
    import json

    from exporter.render.status_page import card_from_json, render_text

    parser = argparse.ArgumentParser(
        prog="kv-offload-exporter advise",
        description="Print a running exporter's advice in a terminal: per engine the card "
        "of its status page (action, reason, configured and recommended CPU buffer, since "
        "when, pending change, the explanation, the what-if curve and the numbers).",
    )
    parser.add_argument("--url", default="http://127.0.0.1:9747", help="exporter base URL")
    parser.add_argument("--json", action="store_true", help="print the raw /advice JSON")
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each answer"
    )
    args = parser.parse_args(argv)
    base = args.url.rstrip("/")
    try:
        doc = _get_json(base + "/advice", args.timeout)
        status = _get_json(base + "/api/v1/status", args.timeout)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        print(
            f"kv-offload-exporter advise: no answer from an exporter at {base} ({reason}); "
            "is it running, and is --url its address (default port 9747)?",
            file=sys.stderr,
        )
        return 1
    if not isinstance(doc, dict) or not isinstance(status, dict):
        print(
            f"kv-offload-exporter advise: {base} did not answer like an exporter", file=sys.stderr
        )
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"kv-offload-exporter {doc.get('version', '?')} at {base}: window "
        f"{status.get('window_seconds', 0):g} s, {status.get('cycles', 0)} cycles"
    )
    for t in status.get("targets", []):
        state = "up" if t.get("up") else f"down ({t.get('error_kind')}: {t.get('error')})"
        print(f"  target {t.get('target')} ({t.get('url')}): {state}")
    items = doc.get("advice", [])
    if not items:
        print("no advice yet: no vLLM target has been scraped successfully")
        return 0
    # "since ... ago" against the exporter's clock (its last cycle), not this machine's.
    now = status.get("last_cycle")
    for item in items:
        print()
        print(render_text(card_from_json(item), now=now if isinstance(now, float) else None))
    return 0


# What a shell reports for a command killed by SIGPIPE (128 + 13).
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
    else:
        command, rest = "serve", argv
    if command == "serve":
        return cmd_serve(rest)
    try:
        return _run_printing(command, rest)
    except BrokenPipeError:
        # The reader went away (`replay ... | head`): stop quietly, as cat and grep do. Python
        # flushes stdout again at exit; pointing it at /dev/null keeps that flush from
        # raising a second time into a traceback.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run_printing(command: str, rest: list[str]) -> int:
    """The subcommands that print a report on stdout."""
    if command == "advise":
        return cmd_advise(rest)
    if command == "whatif":
        from exporter.whatif_cli import run as cmd_whatif

        return cmd_whatif(rest)
    if command == "replay":
        from exporter.replay import run as cmd_replay

        return cmd_replay(rest)
    raise AssertionError(command)
