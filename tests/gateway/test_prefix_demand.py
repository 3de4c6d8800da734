"""PrefixDemand: decayed per-prefix request counts, bounded in size."""

from __future__ import annotations

import math

import pytest

from gateway.routing.prefix_demand import PrefixDemand


def test_demand_counts_requests_and_decays_with_time() -> None:
    d = PrefixDemand(tau_s=10.0)
    assert d.observe(7, now=0.0) == 1.0  # nobody else wanted it
    assert d.observe(7, now=0.0) == 2.0
    assert d.observe(7, now=0.0) == 3.0
    # ten seconds later the three earlier requests count e^-1 each
    assert d.observe(7, now=10.0) == pytest.approx(1 + 3 * math.exp(-1))
    assert d.observe(8, now=10.0) == 1.0  # another prefix has its own count
    assert d.wanted(8, now=10.0) == 1.0 and d.wanted(9, now=10.0) == 0.0  # reading counts none
    # a clock that steps back never inflates the count
    assert d.observe(8, now=5.0) == 2.0


def test_the_least_recently_wanted_prefixes_are_forgotten_past_the_bound() -> None:
    d = PrefixDemand(max_keys=2)
    d.observe(1, 0.0)
    d.observe(2, 0.0)
    d.observe(1, 0.0)  # 1 is now the most recently wanted
    d.observe(3, 0.0)  # 2 goes
    assert len(d) == 2
    assert d.observe(1, 0.0) == 3.0
    assert d.observe(2, 0.0) == 1.0  # forgotten: counts as new


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixDemand(tau_s=0)
    with pytest.raises(ValueError):
        PrefixDemand(max_keys=0)
