"""Headless Chromium (Debian's `chromium`) on the status page, and the page of a recorded run.

`dump_dom(url)` is the DOM after Chromium parsed and laid out the page (`--dump-dom`);
`screenshot(url, path, dark=...)` renders it, light or dark (`--force-dark-mode` makes
`prefers-color-scheme: dark` match). `served_replay()` serves the real exporter's pages
over a recorded H200 run (testbed.gpu_replay) on 127.0.0.1.

    python -m testbed.browser [--out docs/img/status]

writes the screenshots the docs show (light.png, dark.png).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html.parser import HTMLParser
from pathlib import Path

from aiohttp import web

from testbed.gpu_replay import DECIDED_RUN, Replayed, replayed_exporter
from testbed.procs import free_port

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT_DIR = REPO / "docs" / "img" / "status"
# Root in a container needs --no-sandbox; no GPU, no first-run or network extras.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def _chromium(args: list[str], timeout: float) -> str:
    proc = subprocess.run(
        [CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"chromium {args} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def dump_dom(url: str, timeout: float = 60.0) -> str:
    return _chromium(["--dump-dom", url], timeout)


def screenshot(
    url: str, path: Path, *, dark: bool = False, size: tuple[int, int] = (1280, 1600)
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    args = [f"--window-size={size[0]},{size[1]}", f"--screenshot={path}"]
    if dark:
        args.insert(0, "--force-dark-mode")
    _chromium([*args, url], 60.0)
    return path


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag = tag
        self.attrs = attrs
        self.parent = parent
        self.children: list[Element] = []
        self.content: list[str | Element] = []  # text and children in document order

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        """The text content, one space between elements, whitespace collapsed."""
        parts = (c if isinstance(c, str) else c.text() for c in self.content)
        return " ".join(" ".join(parts).split())

    def iter(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        out = []
        for c in self.children:
            if (tag is None or c.tag == tag) and (cls is None or cls in c.classes):
                out.append(c)
            out.extend(c.iter(tag, cls))
        return out


VOID = {"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr", "area", "base"}


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(el)
        self.cur.content.append(el)
        if tag not in VOID:
            self.cur = el

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(el)
        self.cur.content.append(el)

    def handle_endtag(self, tag: str) -> None:
        el: Element | None = self.cur
        while el is not None and el.tag != tag:
            el = el.parent
        if el is not None and el.parent is not None:
            self.cur = el.parent

    def handle_data(self, data: str) -> None:
        self.cur.content.append(data)


def parse(html: str) -> Element:
    tree = _Tree()
    tree.feed(html)
    tree.close()
    return tree.root


@asynccontextmanager
async def served_replay(name: str = DECIDED_RUN) -> AsyncIterator[tuple[str, Replayed]]:
    """The exporter's HTTP app over a recorded run, every recorded cycle already run."""
    from exporter.server import make_app

    replayed = replayed_exporter(name)
    runner = web.AppRunner(make_app(replayed.exporter, run_loop=False), access_log=None)
    await runner.setup()  # starts the exporter's sources
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await replayed.run_cycles()
        yield f"http://127.0.0.1:{port}/", replayed
    finally:
        await runner.cleanup()
        replayed.server.stop()


async def write_screenshots(out: Path) -> list[Path]:
    async with served_replay() as (url, _):
        return [
            await asyncio.to_thread(screenshot, url, out / "light.png"),
            await asyncio.to_thread(screenshot, url, out / "dark.png", dark=True),
        ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SCREENSHOT_DIR)
    for p in asyncio.run(write_screenshots(parser.parse_args().out)):
        print(p)
