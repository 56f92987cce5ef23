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


def num_padded_blocks(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Static upper bound on `sum_e ceil(count_e / block_size)` over all routings."""
    return (num_assignments + num_experts * (block_size - 1)) // block_size


def block_layout(tokens_per_expert, block_size: int, num_blocks: int):
    """Pads each expert's segment to whole blocks of `block_size` rows.

    Returns `segment_row [E]` (first buffer row of each expert) and `block_expert [num_blocks]`
    int32 (the expert whose weights each block uses; trailing unused blocks, all zeros, reuse the
    last expert, which leaves its gradient unchanged).
    """
    num_experts = tokens_per_expert.shape[0]
    blocks_per_expert = (tokens_per_expert + (block_size - 1)) // block_size
    block_end = ops.cumsum(blocks_per_expert, 0)
    block_index = ops.arange(num_blocks, dtype=ms.int32).reshape(-1, 1)
    block_expert = (block_index >= block_end.reshape(1, -1)).astype(ms.int32).sum(1)
    block_expert = ops.minimum(block_expert, num_experts - 1)
    return (block_end - blocks_per_expert) * block_size, block_expert


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
