"""memcached expiry times from TTLs in seconds (pure).

memcached reads an expiry time (the `T` flag of `mg` / `ms` / `ma`, `N` of `ma`, the
`exptime` of `touch`) as seconds from now only up to 30 days (2,592,000 s); a larger
number is an absolute unix time, so a TTL of 31 days sent as is would mean a date in
January 1970: the item would expire at once. `exptime` sends longer TTLs as the
absolute time they end (the client's clock: a skew of seconds is nothing next to a TTL
of more than 30 days). memcached keeps expiry times in 32 bits, hence `MAX_TTL_S`.
"""

from __future__ import annotations

__all__ = ["MAX_RELATIVE_TTL_S", "MAX_TTL_S", "exptime"]

MAX_RELATIVE_TTL_S = 60 * 60 * 24 * 30
"""The longest expiry time memcached reads as seconds from now (30 days)."""
MAX_TTL_S = 60 * 60 * 24 * 365
"""The longest TTL accepted (365 days): now + MAX_TTL_S fits in 32 bits until 2037."""
_INT32_MAX = 2**31 - 1


def exptime(ttl_s: int, now: float) -> int:
    """The memcached expiry time of an item that must live `ttl_s` seconds from `now`.

    Args:
        ttl_s: seconds, 1 .. MAX_TTL_S (0 is memcached's "never", not a TTL).
        now: the current unix time (`time.time()`), used only above 30 days.

    Raises:
        ValueError: a TTL out of range, or an end past memcached's 32-bit times.
    """
    if not 1 <= ttl_s <= MAX_TTL_S:
        raise ValueError(f"a TTL must be 1 .. {MAX_TTL_S} seconds, got {ttl_s}")
    if ttl_s <= MAX_RELATIVE_TTL_S:
        return ttl_s
    end = int(now) + ttl_s
    if end > _INT32_MAX:
        raise ValueError(
            f"a TTL of {ttl_s} s from unix time {int(now)} ends after 2038-01-19, past "
            f"memcached's 32-bit expiry times; use a TTL of at most {MAX_RELATIVE_TTL_S} s"
        )
    return end
