"""Static-shape buckets: the padded sizes an XLA executor compiles for."""

from __future__ import annotations

from mmzoo.errors import MmzooError


def doubling(start: int, stop: int, *, linear_after: int | None = None, step: int | None = None) -> list[int]:
    """``start, 2*start, ...`` up to ``stop`` (always included); past ``linear_after``, steps of ``step``."""
    if start <= 0 or stop < start:
        raise ValueError(f"bucket range needs 0 < start <= stop, got start={start} stop={stop}")
    out, n = [], start
    while n < stop:
        out.append(n)
        if linear_after is not None and n >= linear_after:
            n += step or linear_after
        else:
            n *= 2
    out.append(stop)
    return out


def pick(buckets: list[int], n: int, what: str) -> int:
    """The smallest bucket that holds ``n``."""
    for b in buckets:
        if n <= b:
            return b
    raise MmzooError(f"{what} is {n}, more than the largest bucket {buckets[-1]}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
