"""The bucketed sizes of dropless dispatch buffers: pure Python and numpy (no MindSpore), so that the
trainer's capacity controller (moetrain/moe/capacity.py) and the planner (moetrain/planner/costs.py)
share one definition.

`bucket` rounds up to `m 2^e` with `m` in 8..15 (at most 12.5 % padding, 8 sizes per doubling), which
bounds how many graphs a run compiles; `sized` adds SPREAD standard deviations of a multinomial count
to a need before bucketing it."""
from __future__ import annotations

import math

import numpy as np

SPREAD = 2.0         # headroom in standard deviations of a count (~sqrt(count), multinomial routing)


def bucket(rows: float) -> int:
    """The smallest `m 2^e >= rows` with `m` in 8..15 (every size up to 16), at least 1."""
    rows = max(1, math.ceil(rows))
    if rows <= 16:
        return rows
    step = 2 ** (rows.bit_length() - 4)          # rows in [8 step, 16 step)
    return -(-rows // step) * step


def sized(needed: float) -> int:
    """The capacity chosen for a buffer that needed `needed` rows: the need plus SPREAD standard
    deviations of a multinomial count (`sqrt(needed)`), bucketed. Relative headroom shrinks as
    counts grow: 1.5x at 32 rows, 1.13x at 1024 (before the bucket's rounding)."""
    return bucket(math.ceil(needed + SPREAD * math.sqrt(needed)))


def bucketed(rows) -> np.ndarray:
    """`bucket` element-wise (rows rounded up first)."""
    rows = np.maximum(1, np.ceil(np.asarray(rows, np.float64))).astype(np.int64)
    step = 2 ** np.maximum(0, np.frexp(rows.astype(np.float64))[1] - 4)    # frexp's exponent: bit_length
    return np.where(rows <= 16, rows, -(-rows // step) * step)


def sized_array(need) -> np.ndarray:
    """`sized` element-wise."""
    need = np.asarray(need, np.float64)
    return bucketed(np.ceil(need + SPREAD * np.sqrt(need)))
