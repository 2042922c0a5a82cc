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
import signal
import sys
import textwrap
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


def cmd_advise(argv: Sequence[str]) -> int:
    import json
    import urllib.error
    import urllib.request

    parser = argparse.ArgumentParser(
        prog="kv-offload-exporter advise",
        description="Print the running exporter's advice (its /advice endpoint) in a terminal.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:9747", help="exporter base URL")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    url = args.url.rstrip("/") + "/advice"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        print(f"kv-offload-exporter advise: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    items = doc.get("advice", [])
    if not items:
        print("no advice yet: the exporter has not completed a collection cycle with data")
        return 0
    for item in items:
        print(f"{item['target']}  {item['model_name']}  engine {item['engine']}")
        line = f"  action: {item['action']}  ({item['reason']})"
        if item.get("recommended_buffer_bytes") is not None:
            line += (
                f"  recommended --kv-offloading-size {item['recommended_buffer_bytes'] / 2**30:g}"
            )
        if item.get("pending_action"):
            line += f"  [pending: {item['pending_action']}]"
        print(line)
        print(
            textwrap.fill(
                item["explanation"], width=96, initial_indent="  ", subsequent_indent="  "
            )
        )
        shown = {k: v for k, v in item["numbers"].items() if v is not None}
        for key, value in shown.items():
            print(f"    {key:44s} {value:,.6g}")
        print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
    else:
        command, rest = "serve", argv
    if command == "serve":
        return cmd_serve(rest)
    if command == "advise":
        return cmd_advise(rest)
    if command == "whatif":
        from exporter.whatif_cli import run as cmd_whatif

        return cmd_whatif(rest)
    if command == "replay":
        from exporter.replay import run as cmd_replay

        return cmd_replay(rest)
    raise AssertionError(command)
