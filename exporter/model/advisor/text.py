"""How the advisor writes numbers into its explanations."""

from __future__ import annotations

GIB = 1 << 30


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def gib(x: float | None) -> str:
    if x is not None and 0 < x < GIB:  # 32 MiB, not "0.03 GiB"
        return f"{x / (1 << 20):.0f} MiB"
    return "n/a" if x is None else f"{x / GIB:.2f} GiB"


def rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f} tokens/s"
