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


def with_top(values, top: int, name: str, top_name: str) -> list[int]:
    """An explicit bucket list ``name``: sorted, without repeats, each in ``[1, top]``, and ``top``
    always one of them (added if missing)."""
    out = sorted({int(x) for x in values})
    if not out or out[0] < 1 or out[-1] > top:
        raise ValueError(f"{name}={out} must lie in [1, {top_name}={top}]")
    return out if out[-1] == top else out + [top]


def pick(buckets: list[int], n: int, what: str) -> int:
    """The smallest bucket that holds ``n``."""
    for b in buckets:
        if n <= b:
            return b
    raise MmzooError(f"{what} is {n}, more than the largest bucket {buckets[-1]}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
