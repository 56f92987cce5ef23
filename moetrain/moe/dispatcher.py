"""Token dispatchers: move routed tokens into the layout the experts compute and combine the results.

Interface shared by every dispatcher (the expert-parallel ones in `moe/ep_dispatcher.py` too):

    expert_input, state = dispatcher.dispatch(x [T, H], topk_idx [T, k], topk_weight [T, k])
    expert_output = experts(expert_input, state.get("row_expert"), state.get("group_sizes"))
    y [T, H] = dispatcher.combine(expert_output, state)

`expert_input` is either rows `[N, H]` sorted by local expert, padding after the groups
("row_expert" `[N]` int32 with L for padding, "group_sizes" `[L]`), or a capacity buffer
`[L, C, H]` (group l = local expert l), whichever `GroupedExperts.layout` asks for. `state` also
carries "tokens_per_expert" `[E]` fp32 (assignments per expert before dropping), "dropped" (fp32,
assignments dropped for lack of capacity), "expert_rows" (fp32, rows the expert GEMMs compute,
padding included) and "computed_rows" (fp32, the assignments among them: padding excluded). Summed
over an expert-parallel group, computed + dropped equals the rows dispatched into it
(`moetrain.moe.accounting` checks this every step).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from moetrain.moe.capacity import DroplessSizing
from moetrain.moe.native_ops import MoEOps
from moetrain.moe.permutation import (assignment_rows, capacity_layout, capacity_rows, expert_capacity,
                                      group_of_rows, permute, sort_by_expert, unpermute)

LAYOUTS = ("rows", "capacity")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {LAYOUTS}")
    return layout


def expert_counts(topk_idx, num_experts: int):
    """`[E]` int32 assignments per expert of `topk_idx [T, k]`."""
    one_hot = ops.one_hot(topk_idx.reshape(-1), num_experts, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    return one_hot.sum(0)


def kept_rows(counts, capacity: int):
    """fp32 assignments that fit a buffer of `capacity` rows per group, `counts [G]` per group."""
    return ops.minimum(counts.astype(ms.int32), capacity).astype(ms.float32).sum()


def rows_layout(group_sizes, num_rows: int):
    """The experts' inputs of a rows layout besides the rows: row ids (for the kernel; L for the
    rows after the groups) and the rows they compute (fp32)."""
    return group_of_rows(group_sizes, num_rows), group_sizes.astype(ms.float32).sum()


class SortDispatcher(nn.Cell, DroplessSizing):
    """Single-device dispatcher (all experts local).

    * dropless, rows layout (grouped GEMM kernel on CPU, grouped matmul on Ascend): the `T k`
      assignment rows sorted by expert (`MoEOps.permute`), no padding, every row computed once.
    * dropless, capacity layout (batched matmul: GPU, CPU without kernels): `[E, C, H]`, C =
      `expert_capacity` rows per expert, 0 meaning the bound T (an expert sees a token at most
      once); `moetrain.moe.capacity` sizes it from the counts, with a re-run on overflow.
    * capacity (`capacity_factor > 0`): `[E, C, H]` with `C = ceil(capacity_factor * T k / E)`;
      each expert keeps its first C assignments in token order and drops the rest.
    """

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float = 0.0, layout: str = "rows"):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.layout = check_layout(layout)
        self.ops = MoEOps()
        self.expert_capacity = 0

    # ---- dispatch / combine ---------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weight):
        num_tokens, hidden = x.shape
        counts = expert_counts(topk_idx, self.num_experts)
        state = {"tokens_per_expert": counts.astype(topk_weight.dtype), "topk_weight": topk_weight,
                 "dropped": ops.zeros((), ms.float32)}
        if self.capacity_factor == 0 and self.layout == "rows":
            sorted_rows, slot = self.ops.permute(x, topk_idx, self.num_experts)
            row_expert, expert_rows = rows_layout(counts, num_tokens * self.top_k)
            state["slot"] = slot
            state["group_sizes"] = counts
            state["row_expert"] = row_expert
            state["expert_rows"] = state["computed_rows"] = expert_rows
            return sorted_rows, state
        if self.capacity_factor > 0:
            capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
            order, slot_expert, slot_rank, _ = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
            slot_row, dropped = capacity_rows(slot_expert, slot_rank, capacity, self.num_experts)
            state["dropped"] = dropped
        else:
            capacity = min(self.expert_capacity or num_tokens, num_tokens)
            order, slot_row = capacity_layout(topk_idx.reshape(-1), self.num_experts, capacity)
        expert_input = permute(x, order, slot_row, self.top_k, self.num_experts * capacity)
        state["computed_rows"] = kept_rows(counts, capacity)
        state["assignment_row"] = assignment_rows(order, slot_row)
        state["expert_rows"] = ops.full((), self.num_experts * capacity, dtype=ms.float32)
        return expert_input.reshape(self.num_experts, capacity, hidden), state

    def combine(self, expert_output, state):
        if "slot" in state:
            return self.ops.unpermute(expert_output, state["slot"], state["topk_weight"])
        rows = expert_output.reshape(-1, expert_output.shape[-1])
        return unpermute(rows, state["assignment_row"], state["topk_weight"])

