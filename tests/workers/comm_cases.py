"""The cases of tests/test_comm.py, shared by the 4-rank worker and the numpy reference.

World of 4 ranks laid out as dp=2 x tp=2: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}.
Inputs and loss weights are pure functions of (case, rank, shape), so the test can recompute them.
"""
import zlib

import numpy as np

WORLD, DP, TP = 4, 2, 2


def a2av_counts(src: int, dst: int) -> int:
    """Rows rank `src` sends to rank `dst` in the all_to_all_v case (zeros included)."""
    return (src + dst) % 3


# name, op, group kind, per-rank input shape (a function of the rank), op keyword arguments
CASES = [
    ("all_reduce@world", "all_reduce", "world", lambda r: (3, 4), {}),
    ("all_reduce@tp", "all_reduce", "tp", lambda r: (3, 4), {}),
    ("all_gather@world", "all_gather", "world", lambda r: (2, 3), {"axis": 0}),
    ("all_gather@dp", "all_gather", "dp", lambda r: (2, 3), {"axis": 1}),
    ("reduce_scatter@world", "reduce_scatter", "world", lambda r: (8, 3), {"axis": 0}),
    ("reduce_scatter@tp", "reduce_scatter", "tp", lambda r: (3, 4), {"axis": 1}),
    ("all_to_all@world", "all_to_all", "world", lambda r: (4, 2), {"split_axis": 0, "concat_axis": 1}),
    ("all_to_all@dp", "all_to_all", "dp", lambda r: (3, 4), {"split_axis": 1, "concat_axis": 0}),
    ("all_to_all_v@world", "all_to_all_v", "world",
     lambda r: (sum(a2av_counts(r, j) for j in range(WORLD)), 2), {}),
    ("broadcast@world", "broadcast", "world", lambda r: (2, 3), {"src": 2}),
    ("broadcast@tp", "broadcast", "tp", lambda r: (2, 3), {"src": 1}),
    ("copy_to_region@tp", "copy_to_region", "tp", lambda r: (2, 3), {}),
    ("reduce_from_region@tp", "reduce_from_region", "tp", lambda r: (2, 3), {}),
    ("scatter_to_region@tp", "scatter_to_region", "tp", lambda r: (2, 4), {"axis": -1}),
    ("gather_from_region@tp", "gather_from_region", "tp", lambda r: (2, 3), {"axis": -1}),
    ("reduce_scatter_to_sequence@tp", "reduce_scatter_to_sequence", "tp", lambda r: (4, 3), {"axis": 0}),
    ("gather_from_sequence@tp", "gather_from_sequence", "tp", lambda r: (2, 3), {"axis": 0}),
]


def group_ranks(kind: str, rank: int):
    """Member ranks (ascending) of `rank`'s group, from the Megatron layout rank = tp_rank + tp*dp_rank."""
    if kind == "world":
        return list(range(WORLD))
    if kind == "tp":
        base = rank - rank % TP
        return list(range(base, base + TP))
    if kind == "dp":
        return list(range(rank % TP, WORLD, TP))
    raise ValueError(kind)


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def case_input(name: str, rank: int, shape) -> np.ndarray:
    return _rng("x", name, rank).standard_normal(shape).astype(np.float32)


def loss_weight(name: str, rank: int, shape) -> np.ndarray:
    return _rng("w", name, rank).standard_normal(shape).astype(np.float32)
