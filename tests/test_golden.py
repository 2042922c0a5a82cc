"""The golden end-to-end exposition (tests/golden.py): compared exactly, linted by promtool,
and the proof that every catalogue row is emitted."""

from __future__ import annotations

import difflib
import subprocess

from exporter.catalogue import CATALOGUE
from tests.golden import EXPECTED, golden_exposition


async def test_exposition_equals_the_golden_file() -> None:
    got = await golden_exposition()
    want = EXPECTED.read_text()
    if got != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(keepends=True), got.splitlines(keepends=True), "expected", "got"
            )
        )
        raise AssertionError(
            "the exposition differs from tests/fixtures/e2e/expected.prom; if the change is "
            f"intended, run ./run gen and review the diff:\n{diff[:20000]}"
        )


def test_golden_file_is_clean_under_promtool_check_metrics(promtool: str) -> None:
    proc = subprocess.run(
        [promtool, "check", "metrics"],
        input=EXPECTED.read_bytes(),
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_every_catalogue_row_is_in_the_golden_exposition() -> None:
    emitted = {
        line.split()[2] for line in EXPECTED.read_text().splitlines() if line.startswith("# TYPE ")
    }
    assert set(CATALOGUE) - emitted == set(), "catalogue rows the golden run never emits"
    assert emitted - set(CATALOGUE) == set(), "emitted names missing from catalogue.csv"
