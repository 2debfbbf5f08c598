"""memcached expiry times (lookup_table.core.expiry): relative up to 30 days, then absolute."""

from __future__ import annotations

import pytest

from lookup_table.core.expiry import MAX_RELATIVE_TTL_S, MAX_TTL_S, exptime

pytestmark = pytest.mark.unit

NOW = 1_780_000_000.7  # a unix time in 2026


def test_up_to_30_days_is_sent_as_seconds_from_now() -> None:
    assert exptime(1, NOW) == 1
    assert exptime(3, NOW) == 3
    assert MAX_RELATIVE_TTL_S == 2_592_000
    assert exptime(MAX_RELATIVE_TTL_S, NOW) == MAX_RELATIVE_TTL_S


def test_above_30_days_is_sent_as_the_absolute_time_it_ends() -> None:
    # sent as is, 2,592,001 would be a unix time in January 1970: expired at once
    assert exptime(MAX_RELATIVE_TTL_S + 1, NOW) == 1_780_000_000 + MAX_RELATIVE_TTL_S + 1
    assert exptime(MAX_TTL_S, NOW) == 1_780_000_000 + 365 * 86_400


def test_out_of_range() -> None:
    for bad in (0, -1, MAX_TTL_S + 1):
        with pytest.raises(ValueError, match="a TTL must be 1 .. 31536000 seconds"):
            exptime(bad, NOW)
    with pytest.raises(ValueError, match="past memcached's 32-bit expiry times"):
        exptime(MAX_TTL_S, 2**31 - 100)
