"""Which MoE code path runs, and Ascend's MoE operators behind one indirection with CPU contracts.

Paths (`platform()`): "ascend", "gpu" or "cpu", from MindSpore's device target, or forced with
`MOETRAIN_MOE_PLATFORM` so that the Ascend and GPU paths run in CI on CPU. What each one runs:

    path    permutation                     experts (`expert_compute()`)         ep dispatcher
    ascend  ops.moe_token_permute/unpermute  grouped_matmul_v4 ("gmm", rows)      alltoall (exact splits) / allgather
    gpu     sort + gather (permutation.py)   batched matmul over [L, C, H] ("bmm") allgather only
    cpu     sort + gather (permutation.py)   GroupedMatmul kernel ("kernel", rows) alltoall / allgather
                                             or "bmm" without the kernels

Implementations of the Ascend ops (`implementation()`): "native" calls MindSpore; "contract" is a
CPU reference of the op's DOCUMENTED semantics (MindSpore 2.10 docstrings), used wherever the native
op cannot run (device target CPU), or when forced with `MOETRAIN_MOE_OPS=contract` or
`use_contract(True)` (what a contract backend calls). The contracts check what the docs require
(ranks, dtypes, list lengths) with errors at trace time, and poison (NaN) every value the docs leave
unspecified, so code that relies on one fails its tests instead of passing by luck.

    moe_token_permute(tokens [T, H], indices [T, k] int32)     ops.moe_token_permute
        -> permuted [T k, H], sorted_indices [T k] int32
        Assignments (t, j), flattened as a = t k + j, grouped by ascending index value:
        permuted[sorted_indices[a]] = tokens[a // k] (CANN: sorted_indices = argsort(argsort(indices))).
        The order inside one index value is not relied on (the contract sorts stably).
    moe_token_unpermute(permuted [T k, H], sorted_indices [T k] int32, probs [T, k] | None)
        -> [T, H]                                               ops.moe_token_unpermute
        out[t] = sum_j probs[t, j] permuted[sorted_indices[t k + j]]; without probs k = 1 and
        out = permuted[sorted_indices] (rows T k). sorted_indices: int32 only, no duplicates.
    grouped_matmul_v4(x [M, K], w [G, K, N], group_list [G] int64, group_list_type)
        -> [M, N]            ops.auto_generate.grouped_matmul_v4(split_item=3, group_type=0)
        group_list_type 1: group sizes n_g; 0: cumulative ends. Rows [s_g, s_g + n_g) use w[g];
        the groups may end before row M ("sum <= length of x"): those rows are not computed, so
        their output, and their input gradient in the backward, are unspecified (contract: NaN).
        fp32/fp32, fp16/fp16, bf16/bf16; differentiable in this mode.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.auto_generate import grouped_matmul_v4 as _native_grouped_matmul_v4

from moetrain import kernels
from moetrain.env import env_choice
from moetrain.kernels.ops import PermuteRows, UnpermuteRows, shared
from moetrain.moe import permutation

PLATFORMS = ("cpu", "ascend", "gpu")
IMPLEMENTATIONS = ("native", "contract")
_forced_contract: Optional[bool] = None


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------
def platform() -> str:
    """The MoE code path: `MOETRAIN_MOE_PLATFORM` (cpu, ascend, gpu) or the device target."""
    forced = env_choice("MOETRAIN_MOE_PLATFORM", PLATFORMS)
    if forced != "auto":
        return forced
    target = ms.get_context("device_target").lower()
    return target if target in PLATFORMS else "cpu"


def use_contract(enabled: Optional[bool]) -> None:
    """Force the contract implementations (True), the native ones (False), or back to automatic (None)."""
    global _forced_contract
    _forced_contract = enabled


def implementation() -> str:
    """"native" (MindSpore's Ascend op) or "contract" (CPU reference of its documented semantics)."""
    if _forced_contract is not None:
        return "contract" if _forced_contract else "native"
    forced = env_choice("MOETRAIN_MOE_OPS", IMPLEMENTATIONS)
    if forced != "auto":
        return forced
    return "native" if ms.get_context("device_target") == "Ascend" else "contract"


def expert_compute(path: Optional[str] = None) -> str:
    """How the routed experts compute on `path` (default `platform()`): "gmm" (Ascend grouped
    matmul over rows sorted by expert), "kernel" (moetrain's CPU grouped GEMM over the same rows)
    or "bmm" (a batched matmul over a per-expert capacity buffer `[L, C, H]`: GPU, and CPU without
    the kernels)."""
    path = path or platform()
    if path == "ascend":
        return "gmm"
    if path == "cpu" and kernels.available():
        return "kernel"
    return "bmm"


class MoEOps(nn.Cell):
    """The permutation and grouped-matmul ops of one code path, chosen once at construction (a
    graph reads only the constants, never the environment).

        sorted_rows, slot = ops.permute(rows [T, H], ids [T, k] int32 in [0, num_ids), num_ids)
        out = ops.unpermute(sorted_rows [T k, H], slot, probs [T, k] or None)    # [T, H] / [T k, H]
        y = ops.grouped_matmul(x [M, K], w [G, K, N], group_sizes [G])

    `permute`/`unpermute` have the `moe_token_permute`/`moe_token_unpermute` semantics on every path: the
    Ascend ops on "ascend", a sort and gathers (moetrain.moe.permutation) elsewhere."""

    def __init__(self, path: Optional[str] = None):
        super().__init__()
        self.path = path or platform()
        if self.path not in PLATFORMS:
            raise ValueError(f"MoEOps: path {self.path!r} is not one of {PLATFORMS}")
        self.native = implementation() == "native"
        self.compute = expert_compute(self.path)
        self.rows_kernels = None
        if self.compute == "kernel":   # moetrain's CPU kernels: one pass each way for fp32 rows
            self.rows_kernels = (shared(PermuteRows), shared(UnpermuteRows))

    def permute(self, rows, ids, num_ids: int):
        if self.path == "ascend":
            return moe_token_permute(rows, ids, self.native)
        if self.rows_kernels is not None and rows.dtype == ms.float32:
            slot = permutation.slots_by_id(ids, num_ids)
            return self.rows_kernels[0](rows, slot), slot
        return permutation.permute_by_id(rows, ids, num_ids)

    def unpermute(self, sorted_rows, slot, probs=None):
        if self.path == "ascend":
            return moe_token_unpermute(sorted_rows, slot, probs, self.native)
        if probs is None:
            return ops.gather(sorted_rows, slot, 0)
        if self.rows_kernels is not None and sorted_rows.dtype == ms.float32 and probs.dtype == ms.float32:
            return self.rows_kernels[1](sorted_rows, slot, probs)
        return permutation.unpermute(sorted_rows, slot, probs)

    def grouped_matmul(self, x, w, group_sizes):
        return grouped_matmul_v4(x, w, group_sizes.astype(ms.int64), 1, self.native)


# ---------------------------------------------------------------------------------------------
# The Ascend ops (native or contract)
# ---------------------------------------------------------------------------------------------
def moe_token_permute(tokens, indices, native: bool):
    """`ops.moe_token_permute(tokens, indices)`; see the module notes."""
    if native:
        return ops.moe_token_permute(tokens, indices)
    return _contract_token_permute(tokens, indices)


def moe_token_unpermute(permuted, sorted_indices, probs, native: bool):
    """`ops.moe_token_unpermute(permuted, sorted_indices, probs)`; see the module notes."""
    if native:
        return ops.moe_token_unpermute(permuted, sorted_indices, probs)
    return _contract_token_unpermute(permuted, sorted_indices, probs)


def grouped_matmul_v4(x, w, group_list, group_list_type: int, native: bool):
    """`grouped_matmul_v4([x], [w], group_list=..., split_item=3, group_type=0, group_list_type=...)[0]`."""
    if native:
        return _native_grouped_matmul_v4([x], [w], group_list=group_list, split_item=3, group_type=0,
                                          group_list_type=group_list_type)[0]
    return _contract_grouped_matmul(x, w, group_list, group_list_type)


# ---------------------------------------------------------------------------------------------
# Contracts (CPU references of the documented semantics)
# ---------------------------------------------------------------------------------------------
_FLOATS = (ms.float32, ms.float16, ms.bfloat16)


def _require(ok: bool, op: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{op} (contract of the Ascend op): {why}")


def _contract_token_permute(tokens, indices):
    op = "moe_token_permute"
    _require(tokens.ndim == 2, op, f"tokens must be 2-D [num_tokens, hidden], got shape {tokens.shape}")
    _require(tokens.dtype in _FLOATS, op, f"tokens must be bfloat16, float16 or float32, got {tokens.dtype}")
    _require(indices.dtype in (ms.int32, ms.int64), op, f"indices must be int32 or int64, got {indices.dtype}")
    _require(indices.ndim in (1, 2), op, f"indices must be 1-D or 2-D, got shape {indices.shape}")
    _require(indices.shape[0] == tokens.shape[0], op,
             f"tokens ({tokens.shape[0]}) and indices ({indices.shape[0]}) differ in their first dimension")
    top_k = 1 if indices.ndim == 1 else indices.shape[1]
    _require(top_k <= 512, op, f"the second dimension of indices must be <= 512, got {top_k}")
    flat = indices.reshape(-1).astype(ms.int64)
    count = flat.shape[0]
    # stable: ties keep assignment order (the int64 key is unique)
    _, order = ops.sort(flat * count + ops.arange(count, dtype=ms.int64))
    order = order.astype(ms.int32)
    sorted_indices = ops.scatter_nd(order.reshape(-1, 1), ops.arange(count, dtype=ms.int32), (count,))
    return ops.gather(tokens, order // top_k, 0), sorted_indices


def _contract_token_unpermute(permuted, sorted_indices, probs=None):
    op = "moe_token_unpermute"
    _require(permuted.ndim == 2, op, f"permuted_tokens must be 2-D, got shape {permuted.shape}")
    _require(sorted_indices.dtype == ms.int32, op, f"sorted_indices must be int32, got {sorted_indices.dtype}")
    _require(sorted_indices.shape == (permuted.shape[0],), op,
             f"sorted_indices must be [{permuted.shape[0]}] (one per permuted row), got {sorted_indices.shape}")
    rows = ops.gather(permuted, sorted_indices, 0)
    if probs is None:
        return rows
    _require(probs.ndim == 2 and probs.shape[0] * probs.shape[1] == permuted.shape[0], op,
             f"probs must be [num_tokens, topk] with num_tokens * topk = {permuted.shape[0]}, got {probs.shape}")
    num_tokens, top_k = probs.shape
    picked = rows.reshape(num_tokens, top_k, -1)
    weight = probs.astype(permuted.dtype).reshape(num_tokens, 1, top_k)
    return ops.BatchMatMul()(weight, picked).reshape(num_tokens, -1)


class _Unspecified(nn.Cell):
    """Marks rows the grouped matmul does not compute (`valid` False) as unspecified: NaN in the
    output (`output=True`; the gradient arriving there is ignored, as the real op ignores it), or
    NaN in the gradient of an input (`output=False`; identity forward). Primitives only: the
    functional forms fail inside a custom bprop under ms.jit in MindSpore 2.10."""

    def __init__(self, output: bool):
        super().__init__()
        self.output = output
        self.select = ops.Select()
        self.cast = ops.Cast()
        self.zeros_like = ops.ZerosLike()
        self.nan = Tensor(np.array(np.nan, np.float32))

    def _where(self, valid, x, other):
        mask = ops.BroadcastTo(x.shape)(self.cast(valid, ms.bool_))     # valid: fp32 0/1 (a bool input
        return self.select(mask, x, ops.BroadcastTo(x.shape)(other))   # would get a bool gradient)

    def construct(self, x, valid):
        if self.output:
            return self._where(valid, x, self.cast(self.nan, x.dtype))
        return x

    def bprop(self, x, valid, out, dout):
        if self.output:
            return self._where(valid, dout, self.zeros_like(dout)), self.zeros_like(valid)
        return self._where(valid, dout, self.cast(self.nan, dout.dtype)), self.zeros_like(valid)


@functools.lru_cache(maxsize=None)
def _unspecified(output: bool) -> _Unspecified:
    """One cached cell per kind: built in Python, also when first met while ms.jit parses a graph."""
    return _Unspecified(output)


def _contract_grouped_matmul(x, w, group_list, group_list_type: int):
    op = "grouped_matmul_v4(split_item=3, group_type=0)"
    _require(x.ndim == 2, op, f"x must hold one 2-D tensor, got shape {x.shape}")
    _require(w.ndim == 3, op, f"weight must hold one 3-D tensor [G, K, N], got shape {w.shape}")
    _require(x.shape[1] == w.shape[1], op, f"x {x.shape} and weight {w.shape} differ in K")
    _require(x.dtype == w.dtype and x.dtype in _FLOATS, op,
             f"x and weight must share a dtype among float32, float16, bfloat16; got {x.dtype} and {w.dtype}")
    _require(group_list.dtype == ms.int64, op, f"group_list must be int64, got {group_list.dtype}")
    _require(group_list.shape == (w.shape[0],), op,
             f"group_list must be 1-D with one entry per weight group ({w.shape[0]}), got shape {group_list.shape}")
    _require(group_list_type in (0, 1), op, f"group_list_type must be 0 (cumulative) or 1 (sizes), got {group_list_type}")
    num_rows, num_groups = x.shape[0], w.shape[0]
    ends = group_list if group_list_type == 0 else ops.cumsum(group_list, 0)
    starts = ops.concat([ops.zeros((1,), ms.int64), ends[:-1]])
    row = ops.arange(num_rows, dtype=ms.int64).reshape(-1, 1)
    computed = (row < ends[num_groups - 1]).astype(ms.float32)
    x = _unspecified(False)(x, computed)
    y = ops.zeros((num_rows, w.shape[2]), x.dtype)
    for g in range(num_groups):     # G = local experts: few
        in_group = ops.logical_and(row >= starts[g], row < ends[g])
        y = y + ops.matmul(ops.where(in_group, x, ops.zeros((), x.dtype)), w[g])
    return _unspecified(True)(y, computed)
