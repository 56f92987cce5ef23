"""Token dispatchers: move routed tokens into an expert-major buffer and combine the results back.

Interface shared by every dispatcher (the expert-parallel ones in `moe/ep_dispatcher.py` too):

    expert_input, state = dispatcher.dispatch(x [T, H], topk_idx [T, k], topk_weight [T, k])
    expert_output = experts(expert_input, state.get("block_expert"))
    y [T, H] = dispatcher.combine(expert_output, state)

`expert_input` is `[G, R, H]`: G groups of R rows, group g computed by expert
`state["block_expert"][g]`, or by expert g when the state has no "block_expert".
`state` also carries "tokens_per_expert" `[E]` fp32 (assignments per expert before dropping) and
"dropped" (fp32 scalar, assignments dropped for lack of capacity).
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from moetrain import kernels
from moetrain.moe.permutation import (assignment_rows, block_layout, capacity_rows, expert_capacity,
                                      num_padded_blocks, permute, sort_by_expert, unpermute)

# Rows per block of the dropless layout; chosen with tools/bench_moe_layer.py (docs/moe.md).
DEFAULT_BLOCK_SIZE = 128


class SortDispatcher(nn.Cell):
    """Single-device dispatcher: stable sort by expert id, then one of three static-shape layouts.

    * exact dropless (`capacity_factor == 0`, `block_size == 1`): the `T k` assignment rows sorted
      by expert, `[T k, 1, H]` with `block_expert` the expert of each row; the experts run one
      grouped GEMM per expert (`moetrain.kernels`), so there is no padding at all.
    * dropless blocks (`capacity_factor == 0`, `block_size > 1`): each expert's tokens are padded
      to whole blocks of `block_size` rows; `G = floor((T k + E (block_size - 1)) / block_size)`
      blocks always suffice, so nothing is ever dropped, for at most E blocks of padding.
    * capacity (`capacity_factor > 0`): `[E, C, H]` with `C = ceil(capacity_factor * T k / E)`;
      each expert keeps its first C assignments in token order and drops the rest.

    `block_size=None` picks 1 where the grouped GEMM kernel is available (CPU with a C++
    compiler) and `DEFAULT_BLOCK_SIZE` otherwise.
    """

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float = 0.0,
                 block_size: Optional[int] = None):
        super().__init__()
        if block_size is None:
            block_size = 1 if kernels.available() else DEFAULT_BLOCK_SIZE
        if block_size < 1:
            raise ValueError(f"SortDispatcher: block_size must be >= 1, got {block_size}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.block_size = block_size

    def dispatch(self, x, topk_idx, topk_weight):
        num_tokens, hidden = x.shape
        order, slot_expert, slot_rank, tokens_per_expert = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
        state = {"tokens_per_expert": tokens_per_expert.astype(topk_weight.dtype), "topk_weight": topk_weight}
        if self.capacity_factor == 0 and self.block_size == 1:
            # Slot i is buffer row i: a plain gather in, the inverse permutation out.
            state["block_expert"] = slot_expert
            state["dropped"] = ops.zeros((), topk_weight.dtype)
            state["assignment_row"] = assignment_rows(order, ops.arange(order.shape[0], dtype=ms.int32))
            return ops.gather(x, order // self.top_k, 0).reshape(-1, 1, hidden), state
        if self.capacity_factor > 0:
            capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
            num_groups, group_rows = self.num_experts, capacity
            slot_row, dropped = capacity_rows(slot_expert, slot_rank, capacity, self.num_experts)
            state["dropped"] = dropped
        else:
            group_rows = self.dropless_block_size(num_tokens)
            num_groups = num_padded_blocks(num_tokens * self.top_k, self.num_experts, group_rows)
            segment_row, block_expert = block_layout(tokens_per_expert, group_rows, num_groups)
            state["block_expert"] = block_expert
            slot_row = ops.gather(segment_row, slot_expert, 0) + slot_rank
            state["dropped"] = ops.zeros((), topk_weight.dtype)
        expert_input = permute(x, order, slot_row, self.top_k, num_groups * group_rows)
        state["assignment_row"] = assignment_rows(order, slot_row)
        return expert_input.reshape(num_groups, group_rows, hidden), state

    def combine(self, expert_output, state):
        expert_rows = expert_output.reshape(-1, expert_output.shape[-1])
        return unpermute(expert_rows, state["assignment_row"], state["topk_weight"])

    def dropless_block_size(self, num_tokens: int) -> int:
        """`block_size`, capped at the average rows per expert `ceil(T k / E)` so that tiny batches
        are not padded to mostly-empty blocks."""
        average_share = -(-num_tokens * self.top_k // self.num_experts)
        return max(1, min(self.block_size, average_share))
