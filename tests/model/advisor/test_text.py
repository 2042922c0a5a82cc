"""exporter/model/advisor/text.py: how numbers read in the advisor's explanations."""

from __future__ import annotations

from exporter.model.advisor.text import GIB, gib, pct, rate


def test_pct_is_a_percentage_with_one_decimal():
    assert pct(0.184) == "18.4%"
    assert pct(0.0) == "0.0%"
    assert pct(1.0) == "100.0%"
    assert pct(0.00049) == "0.0%"


def test_gib_is_gibibytes_with_two_decimals_and_mib_below_one():
    assert GIB == 1 << 30
    assert gib(GIB) == "1.00 GiB"
    assert gib(1536 * (1 << 20)) == "1.50 GiB"
    # Below 1 GiB in whole MiB: the demo's 32 MiB tier would read "0.03 GiB".
    assert gib(0.5 * GIB) == "512 MiB"
    assert gib(32 << 20) == "32 MiB"
    assert gib(10**9) == "954 MiB"  # binary units, not GB
    assert gib(0) == "0.00 GiB" and gib(None) == "n/a"


def test_rate_is_whole_tokens_per_second_with_thousands_separators():
    assert rate(23_000.4) == "23,000 tokens/s"
    assert rate(110_000.0) == "110,000 tokens/s"
    assert rate(0.4) == "0 tokens/s"


def test_unknown_values_read_n_a():
    assert pct(None) == gib(None) == rate(None) == "n/a"
