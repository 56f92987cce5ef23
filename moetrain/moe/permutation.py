"""Token permutation to an expert-major buffer and back, as pure functions with static shapes.

Vocabulary: an *assignment* is one (token, choice) pair, numbered `a = token * top_k + choice`
(`N = T * top_k` of them). A stable sort by expert id puts the assignments in *slots*; slot `i`
holds assignment `order[i]`, so each expert's assignments are contiguous and, within an expert,
in position order. The buffer the experts read is expert-major: `rows[r]` is the token of the
assignment placed at row `r`, or zeros for a padding row. Every row index is static-shape
friendly: a `rows`-long buffer plus one extra zero/dump row at index `num_rows`.
"""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import ops

_batched_matmul = ops.BatchMatMul()


def sort_by_expert(flat_expert, num_experts: int):
    """Stable sort of the assignments by expert id.

    flat_expert: `[N]` int32 expert of each assignment.
    Returns `order [N]` (slot -> assignment), `slot_expert [N]` (expert of each slot),
    `slot_rank [N]` (index of the slot within its expert's segment) and `tokens_per_expert [E]`
    int32. Sorting `expert * N + position` makes the keys unique, so any sort is stable here.
    """
    num_assignments = flat_expert.shape[0]
    if num_assignments * num_experts >= 2 ** 31:
        raise ValueError(f"sort_by_expert: {num_assignments} assignments x {num_experts} experts overflows the "
                         f"int32 sort key; route fewer tokens per call (smaller micro-batch)")
    position = ops.arange(num_assignments, dtype=ms.int32)
    _, order = ops.sort(flat_expert * num_assignments + position)
    one_hot = ops.one_hot(flat_expert, num_experts, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    tokens_per_expert = one_hot.sum(0)
    segment_start = ops.cumsum(tokens_per_expert, 0) - tokens_per_expert
    slot_expert = ops.gather(flat_expert, order, 0)
    slot_rank = position - ops.gather(segment_start, slot_expert, 0)
    return order, slot_expert, slot_rank, tokens_per_expert


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """`ceil(capacity_factor * T * k / E)` rows per expert, at most T (an expert sees each token once)."""
    return max(1, min(math.ceil(capacity_factor * num_tokens * top_k / num_experts), num_tokens))


def capacity_rows(slot_expert, slot_rank, capacity: int, num_experts: int):
    """Buffer row of each slot in an `[E, capacity]` layout.

    Slots past an expert's capacity go to the dump row `E * capacity`; slots are in position
    order, so each expert keeps its earliest tokens and drops the latest ones.
    Returns `(slot_row [N] int32, dropped)`, `dropped` the fp32 count of dropped assignments."""
    kept = slot_rank < capacity
    dump_row = ops.full_like(slot_rank, num_experts * capacity)
    slot_row = ops.where(kept, slot_expert * capacity + slot_rank, dump_row)
    dropped = (~kept).astype(ms.float32).sum()
    return slot_row, dropped


def capacity_layout(ids, num_groups: int, capacity: int):
    """Placement of `N` candidate rows in a group-major `[num_groups, capacity]` buffer.

    ids: `[N]` int32 in `[0, G]`, `G = num_groups` meaning "not for this buffer". Within a group the
    candidates keep their order. Returns `(order, slot_row)`: slot i holds candidate `order[i]` and
    goes to buffer row `slot_row[i]`; candidates of id G and those past a group's capacity go to the
    dump row `G * capacity` (a caller that must not drop makes `capacity` large enough)."""
    order, slot_id, slot_rank, _ = sort_by_expert(ids, num_groups + 1)
    kept = ops.logical_and(slot_id < num_groups, slot_rank < capacity)
    dump_row = ops.full_like(slot_rank, num_groups * capacity)
    return order, ops.where(kept, slot_id * capacity + slot_rank, dump_row)


def group_of_rows(group_sizes, num_rows: int):
    """`[num_rows]` int32: the group of each row of a buffer whose first `sum(group_sizes)` rows
    are the groups in order, `G = len(group_sizes)` for the rows after them."""
    ends = ops.cumsum(group_sizes.astype(ms.int32), 0).reshape(1, -1)
    row = ops.arange(num_rows, dtype=ms.int32).reshape(-1, 1)
    return (row >= ends).astype(ms.int32).sum(1)


def permute_by_id(rows, ids, num_ids: int):
    """`rows [T, H]`, `ids [T, k]` int32 in `[0, num_ids)` -> `(sorted [T k, H], slot [T k] int32)`:
    the assignments `a = t k + j` grouped by ascending id (stable), `sorted[slot[a]] = rows[a // k]`.
    The `moe_token_permute` semantics (moetrain.moe.native_ops) from a sort and a gather."""
    order, slot = _order_and_slot(ids, num_ids)
    return ops.gather(rows, order // ids.shape[1], 0), slot


def slots_by_id(ids, num_ids: int):
    """The `slot [T k]` of `permute_by_id` alone (for a kernel that moves the rows itself)."""
    return _order_and_slot(ids, num_ids)[1]


def _order_and_slot(ids, num_ids: int):
    order, _, _, _ = sort_by_expert(ids.reshape(-1), num_ids)
    return order, assignment_rows(order, ops.arange(order.shape[0], dtype=ms.int32))


def permute(x, order, slot_row, top_k: int, num_rows: int):
    """Gathers token rows into the expert-major buffer `[num_rows, H]`.

    Row `slot_row[i]` receives the token of assignment `order[i]`; rows nobody writes are zero;
    `slot_row == num_rows` marks a dropped assignment. Differentiable w.r.t. `x` (the backward is
    a scatter-add over the token's copies)."""
    num_tokens = x.shape[0]
    source = ops.full((num_rows + 1,), num_tokens, dtype=ms.int32)  # num_tokens: the zero row
    # Dropped slots all write to the dump entry `num_rows`; which one wins does not matter, it is cut off.
    source = ops.tensor_scatter_update(source, slot_row.reshape(-1, 1), order // top_k)
    x_with_zero_row = ops.concat([x, ops.zeros((1, x.shape[1]), x.dtype)], 0)
    source_rows = ops.split(source, [num_rows, 1])[0]
    return ops.gather(x_with_zero_row, source_rows, 0)


def assignment_rows(order, slot_row):
    """Inverse permutation: the buffer row of each assignment, `[N]`."""
    return ops.scatter_nd(order.reshape(-1, 1), slot_row, slot_row.shape)


def unpermute(expert_rows, assignment_row, topk_weight):
    """`y[t] = sum_j topk_weight[t, j] * expert_rows[assignment_row[t * k + j]]`, with rows at index
    `len(expert_rows)` (dropped assignments) contributing zero. Returns `[T, H]`."""
    num_tokens, top_k = topk_weight.shape
    hidden = expert_rows.shape[1]
    rows_with_zero = ops.concat([expert_rows, ops.zeros((1, hidden), expert_rows.dtype)], 0)
    picked = ops.gather(rows_with_zero, assignment_row, 0).reshape(num_tokens, top_k, hidden)
    weight = topk_weight.astype(expert_rows.dtype).reshape(num_tokens, 1, top_k)
    return _batched_matmul(weight, picked).reshape(num_tokens, hidden)
