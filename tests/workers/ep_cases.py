"""The dispatcher cases of tests/test_expert_parallel.py, shared by the 4-rank worker
(ep_layer_worker.py) and the numpy reference. Inputs are pure functions of (name, rank), so the
test recomputes every rank's tensors.

World of 4 ranks, dp=4: ep=2 gives ep groups {0,1} {2,3}; ep=4 one group of all ranks.
"""
import zlib

import numpy as np

WORLD = 4
EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 4, 2, 8, 6, 12      # per-rank tokens of one call
CAPACITY_FACTOR = 1.0

# name -> (dispatcher, ep, capacity_factor, routing, mode). PyNative mostly: a jit compile costs
# 10-40 s on the shared 2-core machine, and the single-rank test shows jit == PyNative bitwise;
# the training runs of the test use ms.jit throughout.
CASES = {
    f"{dispatcher}-ep{ep}-{'cap' if cf else 'dropless'}-{routing}": (dispatcher, ep, cf, routing, mode)
    for dispatcher in ("alltoall", "allgather")
    for ep, cf, routing, mode in ((2, 0.0, "random", "pynative"), (2, 0.0, "skewed", "pynative"),
                                  (4, 0.0, "skewed", "jit" if dispatcher == "alltoall" else "pynative"),
                                  (2, CAPACITY_FACTOR, "skewed", "jit" if dispatcher == "allgather" else "pynative"),
                                  (4, CAPACITY_FACTOR, "random", "pynative"))
}


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
    a token, so with ep=4 rank 3 receives nothing, and rank 0 (experts 0, 1 with ep=2) nearly all."""
    rng = _rng("routing", kind, rank)
    if kind == "random":
        idx = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)])
    elif kind == "skewed":
        idx = np.tile(np.array([0, 1]), (TOKENS, 1))
        idx[rng.choice(TOKENS, 2, replace=False)] = [[0, 2], [2, 0]]
    else:
        raise ValueError(kind)
    weight = rng.uniform(0.1, 1.0, (TOKENS, TOP_K)).astype(np.float32)
    return idx.astype(np.int32), weight


def tokens(name: str, rank: int) -> np.ndarray:
    return _rng("x", name, rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)


def cotangent(name: str, rank: int) -> np.ndarray:
    """Loss = sum over ranks of <cotangent, y>."""
    return _rng("g", name, rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)


def ep_group_of(rank: int, ep: int):
    base = rank - rank % ep
    return list(range(base, base + ep))


# ---- aux-loss scope case: one MoELayer, dp=4, [B, S, H] input per rank ----------------------
AUX_BATCH, AUX_SEQ, AUX_COEFF = 2, 6, 0.01


def aux_tokens(rank: int) -> np.ndarray:
    return _rng("aux-x", rank).standard_normal((AUX_BATCH, AUX_SEQ, HIDDEN)).astype(np.float32)


def router_weight() -> np.ndarray:
    return _rng("router").standard_normal((EXPERTS, HIDDEN)).astype(np.float32) * 0.5
