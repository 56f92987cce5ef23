"""The dispatcher cases of tests/test_expert_parallel.py, shared by the 4-rank worker
(ep_layer_worker.py) and the numpy reference. Inputs are pure functions of (name, rank), so the
test recomputes every rank's tensors.

World of 4 ranks, dp=4: ep=2 gives ep groups {0,1} {2,3}; ep=4 one group of all ranks.
"""
import zlib
from collections import namedtuple

import numpy as np

WORLD = 4
EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 4, 2, 8, 6, 12      # per-rank tokens of one call
CAPACITY_FACTOR = 1.0

# name -> Case. PyNative mostly: a jit compile costs 10-40 s on the shared 2-core machine, and the
# single-rank test shows jit == PyNative bitwise; the training runs of the test use ms.jit throughout.
#   path: the MoE code path (moetrain.moe.native_ops): "cpu" (grouped GEMM kernel, or "bmm" experts
#         over a capacity layout when compute="bmm"), "ascend" (moe_token_permute/unpermute and
#         grouped_matmul_v4, their CPU contracts here), "gpu" (alltoall falls back to allgather; bmm)
#   capacity: "tight" sets the dropless buffers to exactly the rows the routing of all ranks needs,
#         "bound" leaves them at the worst case
#   data: the key of the inputs, so cases of different paths see the same tokens and can be compared
Case = namedtuple("Case", "dispatcher ep capacity_factor routing mode path compute capacity data")


def _case(dispatcher, ep, cf, routing, mode="pynative", path="cpu", compute=None, capacity="tight"):
    data = f"{dispatcher}-ep{ep}-{'cap' if cf else 'dropless'}-{routing}"
    return Case(dispatcher, ep, cf, routing, mode, path, compute, capacity, data)


CASES = {
    "alltoall-ep2-dropless-random": _case("alltoall", 2, 0.0, "random"),
    "alltoall-ep2-dropless-skewed": _case("alltoall", 2, 0.0, "skewed", capacity="bound"),
    "alltoall-ep4-dropless-skewed": _case("alltoall", 4, 0.0, "skewed", "jit"),
    "alltoall-ep4-dropless-one": _case("alltoall", 4, 0.0, "one"),
    "alltoall-ep2-cap-skewed": _case("alltoall", 2, CAPACITY_FACTOR, "skewed"),
    "alltoall-ep4-cap-random": _case("alltoall", 4, CAPACITY_FACTOR, "random"),
    "allgather-ep2-dropless-random": _case("allgather", 2, 0.0, "random"),
    "allgather-ep2-dropless-skewed": _case("allgather", 2, 0.0, "skewed"),
    "allgather-ep4-dropless-skewed": _case("allgather", 4, 0.0, "skewed"),
    "allgather-ep2-cap-skewed": _case("allgather", 2, CAPACITY_FACTOR, "skewed", "jit"),
    "allgather-ep4-cap-random": _case("allgather", 4, CAPACITY_FACTOR, "random"),
    # the capacity layout (bmm experts: GPU, CPU without kernels) with tight [L, C_e] buffers
    "bmm-alltoall-ep4-dropless-skewed": _case("alltoall", 4, 0.0, "skewed", compute="bmm"),
    "bmm-allgather-ep2-dropless-one": _case("allgather", 2, 0.0, "one", compute="bmm"),
    # the Ascend and GPU code paths at dp2 x ep2 (two ep groups of the 4 ranks), same data as the CPU path
    "ascend-alltoall-ep2-dropless-random": _case("alltoall", 2, 0.0, "random", path="ascend"),
    "ascend-alltoall-ep4-dropless-skewed": _case("alltoall", 4, 0.0, "skewed", path="ascend"),
    "ascend-allgather-ep2-dropless-skewed": _case("allgather", 2, 0.0, "skewed", path="ascend"),
    "gpu-alltoall-ep2-dropless-random": _case("alltoall", 2, 0.0, "random", path="gpu"),
}


def runs_here(*names: str) -> bool:
    """Whether the worker runs these cases with this MindSpore: an ep=2 case needs AllReduce in CPU
    sub-groups, which 2.7 lacks (moetrain/compat.py); ep=4 groups are the world."""
    from moetrain import compat

    return compat.cpu_subgroup_collectives() or all(CASES[n].ep == WORLD for n in names)


def cpu_twin(name: str) -> str:
    """The CPU-path case with the same data (what the Ascend and GPU paths must reproduce)."""
    case = CASES[name]
    return next(n for n, c in CASES.items() if c.data == case.data and c.path == "cpu" and c.compute is None
                and c.capacity == "tight" and c.dispatcher == case.dispatcher)


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def expert_weights():
    """Full `w_gate [E,H,F]`, `w_up [E,H,F]`, `w_down [E,F,H]`, the same on every rank."""
    rng = _rng("experts")
    return (rng.standard_normal((EXPERTS, HIDDEN, FFN)).astype(np.float32) * 0.5,
            rng.standard_normal((EXPERTS, HIDDEN, FFN)).astype(np.float32) * 0.5,
            rng.standard_normal((EXPERTS, FFN, HIDDEN)).astype(np.float32) * 0.5)


def routing(kind: str, rank: int):
    """`topk_idx [T, k]` int32 (distinct experts per token) and `topk_weight [T, k]` fp32.

    "skewed": 10 of 12 tokens pick experts (0, 1), the others (0, 2) or (2, 0); expert 3 never gets
    a token, so with ep=4 rank 3 receives nothing, and rank 0 (experts 0, 1 with ep=2) nearly all.
    "one": every token picks experts (0, 1): all routed rows go to rank 0 with ep=2, to ranks 0 and
    1 with ep=4."""
    rng = _rng("routing", kind, rank)
    if kind == "random":
        idx = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)])
    elif kind == "one":
        idx = np.tile(np.array([0, 1]), (TOKENS, 1))
        idx[rng.random(TOKENS) < 0.5] = [1, 0]
    elif kind == "skewed":
        idx = np.tile(np.array([0, 1]), (TOKENS, 1))
        idx[rng.choice(TOKENS, 2, replace=False)] = [[0, 2], [2, 0]]
    else:
        raise ValueError(kind)
    weight = rng.uniform(0.1, 1.0, (TOKENS, TOP_K)).astype(np.float32)
    return idx.astype(np.int32), weight


def tokens(data: str, rank: int) -> np.ndarray:
    return _rng("x", data, rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)


def cotangent(data: str, rank: int) -> np.ndarray:
    """Loss = sum over ranks of <cotangent, y>."""
    return _rng("g", data, rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)


def loads(routing_kind: str, ranks) -> np.ndarray:
    """`[len(ranks), EXPERTS]` assignments per expert of each rank of an ep group."""
    return np.stack([np.bincount(routing(routing_kind, r)[0].reshape(-1), minlength=EXPERTS) for r in ranks])


def ep_group_of(rank: int, ep: int):
    base = rank - rank % ep
    return list(range(base, base + ep))


# ---- aux-loss scope case: one MoELayer, dp=4, [B, S, H] input per rank ----------------------
AUX_BATCH, AUX_SEQ, AUX_COEFF = 2, 6, 0.01


def aux_tokens(rank: int) -> np.ndarray:
    return _rng("aux-x", rank).standard_normal((AUX_BATCH, AUX_SEQ, HIDDEN)).astype(np.float32)


def router_weight() -> np.ndarray:
    return _rng("router").standard_normal((EXPERTS, HIDDEN)).astype(np.float32) * 0.5
