"""Expert-parallel token dispatchers: the experts of a layer are split over the `ep` group (rank
`i` holds global experts `[i L, (i+1) L)`, `L = E / ep`) and tokens travel to them.

Both keep the `SortDispatcher` interface (`dispatch(x, topk_idx, topk_weight) -> (expert_input,
state)`, `combine(expert_output, state) -> y`; `block_expert` holds *local* expert ids) and its
stats: "tokens_per_expert" `[E]` is the routing of this rank's own tokens, before dispatch and
before dropping, and "dropped" counts this rank's own dropped assignments, so summing both over
the data-parallel group gives the one-process numbers.

* `AllToAllDispatcher` (`parallel.moe_token_dispatcher: alltoall`, Megatron's alltoall):
  - dropless (`capacity_factor == 0`): sort by expert (hence by destination rank), exchange the
    per-expert counts `[ep, L]`, then the tokens. `ms.jit` needs static shapes, so each
    destination's rows are padded to the bound `B = T min(k, L)` (a token picks k distinct
    experts, at most min(k, L) of them on one rank): nothing can overflow, whatever the routing.
    The receiver sorts the rows it got by local expert into padded blocks (as `SortDispatcher`),
    runs the experts, and the reverse exchange returns the rows to their sources.
  - capacity (`capacity_factor > 0`, GShard): each rank fills its own `[E, C, H]` buffer, dropping
    exactly as one process would with its micro-batch, then one fixed-size all-to-all of
    `[ep, L C, H]` each way.
* `AllGatherDispatcher` (`allgather`, for small ep): all-gather the tokens and their routing, run
  the local experts on the assignments routed to them, reduce-scatter the partial outputs.

Byte counters ("ep" row of `comm.CommLedger`): every exchange books the buffer it really moves,
padding included.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from moetrain.moe.dispatcher import DEFAULT_BLOCK_SIZE
from moetrain.moe.permutation import (assignment_rows, block_layout, capacity_rows, expert_capacity,
                                      num_padded_blocks, permute, sort_by_expert, unpermute)
from moetrain.dist import comm
from moetrain.dist.topology import Group


def _check_layout(name: str, num_experts: int, group: Group) -> int:
    if num_experts % group.size:
        raise ValueError(f"{name}: num_experts={num_experts} is not divisible by the {group.size} ranks of the "
                         f"{group.kind} group {group.ranks}; choose parallel.expert_parallel dividing "
                         f"model.moe.num_experts")
    return num_experts // group.size


def _block_rows(block_size: int, num_tokens: int, top_k: int, num_local: int) -> int:
    """Rows per padded block: `block_size`, capped at the average rows one local expert receives
    (`T k / L`: every rank sends T k rows, spread over the ep ranks) so tiny batches pad little."""
    return max(1, min(block_size, -(-num_tokens * top_k // num_local)))


def _local_blocks(local_expert, num_local: int, num_rows: int, block_rows: int):
    """Padded-block layout of `num_rows` candidate rows whose `local_expert` is in [0, L], L meaning
    "not for this rank" (padding or another rank's expert).

    Returns (order, slot_row, block_expert, num_blocks): slot i holds candidate `order[i]` and goes
    to buffer row `slot_row[i]` (`num_blocks * block_rows`, the dump row, for the non-local ones)."""
    order, slot_expert, slot_rank, counts = sort_by_expert(local_expert, num_local + 1)
    num_blocks = num_padded_blocks(num_rows, num_local, block_rows)
    local_counts = ops.split(counts, [num_local, 1])[0]
    segment_row, block_expert = block_layout(local_counts, block_rows, num_blocks)
    dump_row = ops.full_like(slot_rank, num_blocks * block_rows)
    start = ops.gather(segment_row, ops.minimum(slot_expert, num_local - 1), 0)
    slot_row = ops.where(slot_expert < num_local, start + slot_rank, dump_row)
    return order, slot_row, block_expert, num_blocks


def _rows_or_zero(rows, index):
    """`rows[index]`, with index `len(rows)` giving a zero row."""
    zero = ops.zeros((1, rows.shape[1]), rows.dtype)
    return ops.gather(ops.concat([rows, zero], 0), index, 0)


# ---------------------------------------------------------------------------------------------
# AllToAll
# ---------------------------------------------------------------------------------------------
class AllToAllDispatcher(nn.Cell):
    """Tokens to the ranks of their experts and back by all-to-all in the `ep` group (see module
    docstring). `expert_input` is `[G, R, H]` padded blocks with local `block_expert` (dropless)
    or `[L, ep C, H]`, local expert l's rows from every source rank (capacity)."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.num_local = _check_layout("AllToAllDispatcher", num_experts, group)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = float(capacity_factor)
        self.group, self.n, self.rank = group, group.size, group.rank_in_group
        self.block_size = block_size

    def dispatch(self, x, topk_idx, topk_weight):
        order, slot_expert, slot_rank, tokens_per_expert = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
        state = {"tokens_per_expert": tokens_per_expert.astype(topk_weight.dtype), "topk_weight": topk_weight}
        if self.capacity_factor > 0:
            return self._dispatch_capacity(x, order, slot_expert, slot_rank, state)
        return self._dispatch_dropless(x, order, slot_expert, tokens_per_expert, state)

    def combine(self, expert_output, state):
        if self.capacity_factor > 0:
            return self._combine_capacity(expert_output, state)
        return self._combine_dropless(expert_output, state)

    # ---- dropless ---------------------------------------------------------------------------
    def _dispatch_dropless(self, x, order, slot_expert, tokens_per_expert, state):
        num_tokens, hidden = x.shape
        n, num_local, top_k = self.n, self.num_local, self.top_k
        bound = num_tokens * min(top_k, num_local)
        # sender: slots are sorted by expert, so each destination's rows are one contiguous run
        counts = tokens_per_expert.reshape(n, num_local)
        send_counts = counts.sum(1)
        destination = slot_expert // num_local
        run_start = ops.gather(ops.cumsum(send_counts, 0) - send_counts, destination, 0)
        position = ops.arange(slot_expert.shape[0], dtype=ms.int32)
        send_row = destination * bound + position - run_start
        send = permute(x, order, send_row, top_k, n * bound)

        # counts first (one fp32 per local expert to each other rank; no backward), then the tokens
        recv_counts = comm.all_to_all(ops.stop_gradient(counts.astype(ms.float32)), self.group)   # [source, L]
        # the two exchanges do not depend on each other through data: order them (same on every rank)
        send = ops.depend(send, recv_counts)
        recv = comm.all_to_all(send.reshape(n, bound, hidden), self.group)

        # receiver: row p from a source belongs to local expert #(segment ends <= p); L = padding
        segment_end = ops.cumsum(recv_counts, 1).reshape(n, 1, num_local)
        row_in_source = ops.arange(bound, dtype=ms.float32).reshape(1, bound, 1)
        local_expert = (row_in_source >= segment_end).astype(ms.int32).sum(-1).reshape(-1)
        block_rows = _block_rows(self.block_size, num_tokens, top_k, num_local)
        recv_order, slot_row, block_expert, num_blocks = _local_blocks(local_expert, num_local, n * bound,
                                                                       block_rows)
        expert_input = permute(recv.reshape(n * bound, hidden), recv_order, slot_row, 1, num_blocks * block_rows)
        state["block_expert"] = block_expert
        state["dropped"] = ops.zeros((), state["topk_weight"].dtype)
        state["recv_row"] = assignment_rows(recv_order, slot_row)
        state["send_row"] = assignment_rows(order, send_row)
        return expert_input.reshape(num_blocks, block_rows, hidden), state

    def _combine_dropless(self, expert_output, state):
        hidden = expert_output.shape[-1]
        returned = _rows_or_zero(expert_output.reshape(-1, hidden), state["recv_row"])
        back = comm.all_to_all(returned.reshape(self.n, -1, hidden), self.group)
        return unpermute(back.reshape(-1, hidden), state["send_row"], state["topk_weight"])

    # ---- capacity ---------------------------------------------------------------------------
    def _dispatch_capacity(self, x, order, slot_expert, slot_rank, state):
        num_tokens, hidden = x.shape
        n, num_local = self.n, self.num_local
        capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
        slot_row, dropped = capacity_rows(slot_expert, slot_rank, capacity, self.num_experts)
        send = permute(x, order, slot_row, self.top_k, self.num_experts * capacity)
        recv = comm.all_to_all(send.reshape(n, num_local * capacity, hidden), self.group)   # [source, L C, H]
        expert_input = recv.reshape(n, num_local, capacity, hidden).transpose(1, 0, 2, 3)
        state["dropped"] = dropped
        state["send_row"] = assignment_rows(order, slot_row)
        return expert_input.reshape(num_local, n * capacity, hidden), state

    def _combine_capacity(self, expert_output, state):
        num_local, rows, hidden = expert_output.shape
        n = self.n
        per_source = expert_output.reshape(num_local, n, rows // n, hidden).transpose(1, 0, 2, 3)
        back = comm.all_to_all(per_source.reshape(n, -1, hidden), self.group)          # [E C, H] in expert order
        return unpermute(back.reshape(-1, hidden), state["send_row"], state["topk_weight"])


# ---------------------------------------------------------------------------------------------
# AllGather
# ---------------------------------------------------------------------------------------------
class AllGatherDispatcher(nn.Cell):
    """Every rank of the `ep` group sees every token: all-gather `x` and its routing, compute the
    local experts' share of each token's output, reduce-scatter the partial outputs. Moves
    `(ep - 1) T H` per gather instead of `~T k H (ep - 1) / ep` per all-to-all, but needs no
    counts and no padding to a worst case; good for small ep. Capacity mode drops on the source
    rank, as one process would, then packs `[L, ep C, H]` like `AllToAllDispatcher`."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.num_local = _check_layout("AllGatherDispatcher", num_experts, group)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = float(capacity_factor)
        self.group, self.n, self.rank = group, group.size, group.rank_in_group
        self.block_size = block_size

    def dispatch(self, x, topk_idx, topk_weight):
        num_tokens, hidden = x.shape
        n, num_local, top_k = self.n, self.num_local, self.top_k
        order, slot_expert, slot_rank, tokens_per_expert = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
        state = {"tokens_per_expert": tokens_per_expert.astype(topk_weight.dtype)}
        # one gather for the routing: weights (differentiable), expert ids and, with a capacity,
        # each assignment's slot in its expert's buffer on the source (-1: dropped there)
        routing = [topk_weight.astype(ms.float32), ops.stop_gradient(topk_idx.astype(ms.float32))]
        if self.capacity_factor > 0:
            capacity = expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)
            kept = slot_rank < capacity
            state["dropped"] = (~kept).astype(ms.float32).sum()
            slot_of_assignment = assignment_rows(order, ops.where(kept, slot_rank, ops.full_like(slot_rank, -1)))
            routing.append(ops.stop_gradient(slot_of_assignment.astype(ms.float32).reshape(num_tokens, top_k)))
        else:
            state["dropped"] = ops.zeros((), ms.float32)
        gathered = comm.all_gather(ops.concat(routing, 1), self.group)                  # [n T, 2k or 3k]
        all_tokens = comm.all_gather(x, self.group)                                      # [n T, H]
        pieces = ops.split(gathered, [top_k] * len(routing), 1)
        state["topk_weight"] = pieces[0].astype(topk_weight.dtype)
        local_expert = pieces[1].astype(ms.int32).reshape(-1) - self.rank * num_local
        is_local = ops.logical_and(local_expert >= 0, local_expert < num_local)

        if self.capacity_factor > 0:   # buffer [L, n C]: local expert, then source rank, then slot
            slot = pieces[2].astype(ms.int32).reshape(-1)
            source = ops.arange(slot.shape[0], dtype=ms.int32) // (num_tokens * top_k)
            groups, group_rows = num_local, n * capacity
            mine = ops.logical_and(is_local, slot >= 0)
            slot_row = ops.where(mine, local_expert * group_rows + source * capacity + slot,
                                 ops.full_like(slot, groups * group_rows))
            gathered_order = ops.arange(slot.shape[0], dtype=ms.int32)     # slot i holds assignment i
            assignment_row = slot_row
        else:
            local_expert = ops.where(is_local, local_expert, ops.full_like(local_expert, num_local))
            group_rows = _block_rows(self.block_size, num_tokens, top_k, num_local)
            gathered_order, slot_row, state["block_expert"], groups = _local_blocks(
                local_expert, num_local, n * num_tokens * min(top_k, num_local), group_rows)
            assignment_row = assignment_rows(gathered_order, slot_row)
        expert_input = permute(all_tokens, gathered_order, slot_row, top_k, groups * group_rows)
        state["assignment_row"] = assignment_row
        return expert_input.reshape(groups, group_rows, hidden), state

    def combine(self, expert_output, state):
        rows = expert_output.reshape(-1, expert_output.shape[-1])
        partial = unpermute(rows, state["assignment_row"], state["topk_weight"])        # [n T, H]
        return comm.reduce_scatter(partial, self.group)


def build_ep_dispatcher(name: str, num_experts: int, top_k: int, capacity_factor: float, group: Group) -> nn.Cell:
    """The expert-parallel dispatcher named by `parallel.moe_token_dispatcher`."""
    if name == "alltoall":
        return AllToAllDispatcher(num_experts, top_k, capacity_factor, group)
    if name == "allgather":
        return AllGatherDispatcher(num_experts, top_k, capacity_factor, group)
    raise ValueError(f"parallel.moe_token_dispatcher: {name!r} is not one of 'alltoall', 'allgather'")
