"""Small builders shared by unit tests."""

from __future__ import annotations

from pathlib import Path

from exporter import expfmt
from exporter.vllm_metrics import WANTED, TargetSample, normalise
from exporter.window import TargetWindow


def sample_from(path: Path | str, ts: float) -> TargetSample:
    text = Path(path).read_text() if isinstance(path, Path) else path
    return normalise(expfmt.parse(text, WANTED), ts)


def window_of(*samples: TargetSample, window: float = 300.0) -> TargetWindow:
    win = TargetWindow(window)
    for s in samples:
        win.add(s)
    return win


def rename(text: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        text = text.replace(old, new)
    return text
