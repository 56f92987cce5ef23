"""The cases of tests/test_comm.py, shared by the 4-rank worker and the numpy reference.

World of 4 ranks laid out as dp=2 x tp=2: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}.
Inputs and loss weights are pure functions of (case, rank, shape), so the test can recompute them.
Each backend phase of the worker runs every case: `PHASES` (label, MOETRAIN_COMM_BACKEND,
MOETRAIN_CONTRACT_TARGET, modes).
"""
import zlib

import numpy as np

WORLD, DP, TP = 4, 2, 2

PHASES = [
    ("emulated", "emulated", "Ascend", ("pynative", "jit")),
    ("contract", "contract", "Ascend", ("pynative", "jit")),      # the Ascend path on CPU
    ("contract_gpu", "contract", "GPU", ("pynative",)),           # the GPU path on CPU
]
TARGET_DEPENDENT_OPS = ("all_to_all", "all_to_all_v")   # the only ops whose code differs by target


def phase_cases(label):
    """The cases a phase runs: the GPU phase only those whose GPU path differs from Ascend's."""
    if label == "contract_gpu":
        return [case for case in CASES if case[1] in TARGET_DEPENDENT_OPS]
    return CASES

# all_to_all_v counts between positions in the group: COUNTS[case][src][dst] rows
A2AV_WORLD = tuple(tuple((i + j) % 3 for j in range(WORLD)) for i in range(WORLD))
A2AV_EMPTY = ((2, 0), (2, 0))   # position 1 of each tp group receives nothing


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


def position(kind: str, rank: int) -> int:
    return group_ranks(kind, rank).index(rank)


def a2av_rows(counts, kind):
    return lambda r: (sum(counts[position(kind, r)]), 2)


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
    ("all_to_all@world_no_grad", "all_to_all", "world", lambda r: (4, 2),
     {"split_axis": 0, "concat_axis": 0, "stop_gradient": True}),
    ("all_to_all_v@world", "all_to_all_v", "world", a2av_rows(A2AV_WORLD, "world"), {"counts": A2AV_WORLD}),
    ("all_to_all_v@tp_empty", "all_to_all_v", "tp", a2av_rows(A2AV_EMPTY, "tp"), {"counts": A2AV_EMPTY}),
    ("broadcast@world", "broadcast", "world", lambda r: (2, 3), {"src": 2}),
    ("broadcast@tp", "broadcast", "tp", lambda r: (2, 3), {"src": 1}),
    ("broadcast@dp", "broadcast", "dp", lambda r: (2, 3), {"src": 0}),
    ("copy_to_region@tp", "copy_to_region", "tp", lambda r: (2, 3), {}),
    ("reduce_from_region@tp", "reduce_from_region", "tp", lambda r: (2, 3), {}),
    ("scatter_to_region@tp", "scatter_to_region", "tp", lambda r: (2, 4), {"axis": -1}),
    ("gather_from_region@tp", "gather_from_region", "tp", lambda r: (2, 3), {"axis": -1}),
    ("reduce_scatter_to_sequence@tp", "reduce_scatter_to_sequence", "tp", lambda r: (4, 3), {"axis": 0}),
    ("gather_from_sequence@tp", "gather_from_sequence", "tp", lambda r: (2, 3), {"axis": 0}),
]
CASE = {case[0]: case for case in CASES}

# PairLink on each tp pair (position 0 is the lower stage): (name, lower sends, upper sends), shape
LINK_SHAPE = (2, 3)
LINK_EXCHANGES = [("two_way", True, True), ("lower_to_upper", True, False), ("upper_to_lower", False, True)]


def link_payload(exchange: str, rank: int) -> np.ndarray:
    return _rng("link", exchange, rank).standard_normal(LINK_SHAPE).astype(np.float32)


# Mutations of the native call sites (contract phase, PyNative): name -> the case it runs
MUTATIONS = {
    "alltoall_axes_swapped": "all_to_all@world",
    "broadcast_global_root": "broadcast@dp",
    "allgather_wrong_group": "gather_from_sequence@tp",
    "alltoallv_recv_reversed": "all_to_all_v@world",
    "alltoall_on_gpu": "all_to_all@world",
    "receive_wrong_shape": "link",
    "send_recv_tag_mismatch": "link",
    "both_stages_send_first": "link",
    # all_to_all_v_dynamic (Tensor counts: the exact-split MoE dispatch) with its lists swapped, or
    # block_size 1 instead of one row's elements
    "alltoallv_tensor_lists_swapped": "dynamic:all_to_all_v@tp_empty",
    "alltoallv_tensor_block_size": "dynamic:all_to_all_v@world",
    "alltoallv_empty_reshaped": "all_to_all_v@tp_empty",   # last: a failed MindSpore op can poison later ops
}

# all_to_all_v_dynamic (contract phase, PyNative): the all_to_all_v cases with Tensor counts, the
# input with a spare row (its loss weight SPARE_WEIGHT: a gradient that must not leak into dx)
DYNAMIC_CASES = ("all_to_all_v@world", "all_to_all_v@tp_empty")
SPARE_WEIGHT = 3.0

# The exact-split alltoall dispatcher on each tp pair (ep=2, contract Ascend path), every token of
# every rank routed to experts (0, 1), i.e. to position 0: position 1 receives nothing
EXACT_EXPERTS, EXACT_TOP_K, EXACT_HIDDEN, EXACT_FFN, EXACT_TOKENS = 4, 2, 8, 6, 6


def exact_weights():
    rng = _rng("exact", "experts")
    shapes = ((EXACT_EXPERTS, EXACT_HIDDEN, EXACT_FFN), (EXACT_EXPERTS, EXACT_HIDDEN, EXACT_FFN),
              (EXACT_EXPERTS, EXACT_FFN, EXACT_HIDDEN))
    return tuple((rng.standard_normal(shape) * 0.5).astype(np.float32) for shape in shapes)


def exact_inputs(rank: int):
    """x [T, H], topk_idx [T, k] (experts 0 and 1, in either order), topk_weight [T, k], cotangent [T, H]."""
    rng = _rng("exact", "inputs", rank)
    idx = np.tile(np.array([0, 1], np.int32), (EXACT_TOKENS, 1))
    idx[rng.random(EXACT_TOKENS) < 0.5] = [1, 0]
    return (rng.standard_normal((EXACT_TOKENS, EXACT_HIDDEN)).astype(np.float32), idx,
            rng.uniform(0.1, 1.0, (EXACT_TOKENS, EXACT_TOP_K)).astype(np.float32),
            rng.standard_normal((EXACT_TOKENS, EXACT_HIDDEN)).astype(np.float32))


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def case_input(name: str, rank: int, shape) -> np.ndarray:
    return _rng("x", name, rank).standard_normal(shape).astype(np.float32)


def loss_weight(name: str, rank: int, shape) -> np.ndarray:
    return _rng("w", name, rank).standard_normal(shape).astype(np.float32)
