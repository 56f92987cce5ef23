"""Expert-parallel token dispatchers: the experts of a layer are split over the `ep` group (rank
`i` holds global experts `[i L, (i+1) L)`, `L = E / ep`) and tokens travel to them.

Both keep the `SortDispatcher` interface and stats (moe/dispatcher.py; "row_expert" and
"group_sizes" are in local expert ids): "tokens_per_expert" `[E]` is the routing of this rank's own
tokens, before dispatch and before dropping, and "dropped" counts this rank's own dropped
assignments, so summing both over the data-parallel group gives the one-process numbers;
"expert_rows" counts the rows this rank's expert GEMMs compute.

* `AllToAllDispatcher` (`parallel.moe_token_dispatcher: alltoall`, Megatron's alltoall; needs
  AlltoAll: CPU (emulated) and Ascend):
  - dropless, bucketed splits (CPU; Ascend with `parallel.ep_splits: bucketed`): sort by expert
    (hence by destination), exchange the per-expert counts `[ep, L]`, then the tokens in one
    all-to-all-v: destination j gets `C_j` rows from every source, its run padded to that
    (`pair_capacity`, sized by `moetrain.moe.capacity` from the counts, re-run on overflow; unset =
    the bound `T min(k, L)`, exact for any routing). The receiver sorts what it got by local expert
    (rows layout: only the received rows are computed; capacity layout: `[L, C_e, H]`), runs the
    experts, and the reverse all-to-all-v returns the rows.
  - dropless, exact splits (the Ascend path with Ascend's AlltoAllV, `dispatch_splits`): the counts
    `[ep, L]` first, then `comm.all_to_all_v_dynamic` (AlltoAllV with Tensor split sizes computed
    on the device from them) moves exactly the routed rows; the receiver's grouped matmul computes
    exactly them (`group_list` = the received counts per local expert), the reverse exchange
    returns them. Nothing to size on the host (`capacity_fields()` empty): no re-runs, no graph per
    capacity set. Shapes are dynamic: run through the contract in PyNative only; UNVERIFIED on
    Ascend hardware (docs/parallel_engine.md, "Exact splits on Ascend").
  - capacity (`capacity_factor > 0`, GShard): each rank fills its own `[E, C, H]` buffer, dropping
    exactly as one process would with its micro-batch, then one fixed-size all-to-all of
    `[ep, L C, H]` each way.
* `AllGatherDispatcher` (`allgather`; only AllGather and ReduceScatter, which GPU has): all-gather
  the tokens and their routing, run the local experts on the assignments routed to them (rows
  layout: exactly those; capacity layout: `[L, C_e, H]`), reduce-scatter the partial outputs.

Byte counters ("ep" row of `comm.CommLedger`): every exchange books the buffer it really moves,
padding included (`sum_j C_j` rows sent per bucketed all-to-all-v; exactly the routed rows with
exact splits).
"""
from __future__ import annotations

from typing import Tuple

import mindspore as ms
from mindspore import nn, ops

from moetrain.moe.capacity import DroplessSizing
from moetrain.moe.dispatcher import check_layout, expert_counts, kept_rows, rows_layout
from moetrain.moe.native_ops import MoEOps
from moetrain.moe.permutation import (assignment_rows, capacity_layout, capacity_rows, expert_capacity,
                                      permute, sort_by_expert, unpermute)
from moetrain.distributed import comm
from moetrain.distributed.topology import Group

_logged_gpu_fallback = []
SPLITS = ("exact", "bucketed")


def _check_layout(name: str, num_experts: int, group: Group) -> int:
    if num_experts % group.size:
        raise ValueError(f"{name}: num_experts={num_experts} is not divisible by the {group.size} ranks of the "
                         f"{group.kind} group {group.ranks}; choose parallel.expert_parallel dividing "
                         f"model.moe.num_experts")
    return num_experts // group.size


def _rows_or_zero(rows, index):
    """`rows[index]`, with index `len(rows)` giving a zero row."""
    zero = ops.zeros((1, rows.shape[1]), rows.dtype)
    return ops.gather(ops.concat([rows, zero], 0), index, 0)


class _EPDispatcher(nn.Cell, DroplessSizing):
    """What both expert-parallel dispatchers share: the group, the capacities, and the receiver's
    local layout of the rows routed to this rank's experts."""

    def __init__(self, name: str, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                 layout: str):
        super().__init__()
        self.num_local = _check_layout(name, num_experts, group)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = float(capacity_factor)
        self.group, self.n, self.rank = group, group.size, group.rank_in_group
        self.layout = check_layout(layout)
        self.ops = MoEOps()
        self.expert_capacity = 0    # rows per local expert in the capacity layout (0: the bound)

    def _to_local(self, rows, ids, bound: int, state):
        """Candidate rows `rows [M, H]`, `ids [M, k]` local expert of each assignment (L: not for
        this rank) -> (the experts' input, `state`): rows layout (exactly the assignments for this
        rank, sorted by local expert, the others after them) or capacity layout `[L, C_e, H]`.
        Graph mode passes dicts by value: the caller uses the returned `state`."""
        num_local, top_k = self.num_local, ids.shape[1]
        if self.layout == "rows":
            sorted_rows, slot = self.ops.permute(rows, ids, num_local + 1)
            sizes = ops.split(expert_counts(ids, num_local + 1), [num_local, 1])[0]
            row_expert, expert_rows = rows_layout(sizes, sorted_rows.shape[0])
            state["local_slot"] = slot
            state["group_sizes"] = sizes
            state["row_expert"] = row_expert
            state["expert_rows"] = state["computed_rows"] = expert_rows
            return sorted_rows, state
        capacity = min(self.expert_capacity or bound, bound)
        state["computed_rows"] = kept_rows(ops.split(expert_counts(ids, num_local + 1), [num_local, 1])[0], capacity)
        order, slot_row = capacity_layout(ids.reshape(-1), num_local, capacity)
        state["local_row"] = assignment_rows(order, slot_row)
        state["expert_rows"] = ops.full((), num_local * capacity, dtype=ms.float32)
        expert_input = permute(rows, order, slot_row, top_k, num_local * capacity)
        return expert_input.reshape(num_local, capacity, rows.shape[1]), state

    def _from_local(self, expert_output, state, probs=None):
        """The experts' output back in candidate order: `[M k, H]` rows without `probs`, else
        `[M, H]` with each candidate's assignments weighted by `probs [M, k]` and summed."""
        if "local_slot" in state:
            return self.ops.unpermute(expert_output, state["local_slot"], probs)
        rows = expert_output.reshape(-1, expert_output.shape[-1])
        if probs is None:
            return _rows_or_zero(rows, state["local_row"])
        return unpermute(rows, state["local_row"], probs)


# ---------------------------------------------------------------------------------------------
# AllToAll
# ---------------------------------------------------------------------------------------------
class AllToAllDispatcher(_EPDispatcher):
    """Tokens to the ranks of their experts and back by all-to-all in the `ep` group (see module
    docstring). `splits`: "bucketed" (host-sized static buffers) or "exact" (device-side split
    sizes; rows layout only). `pair_capacity` (bucketed): per destination rank, the rows every
    source sends it in the dropless exchange (`()`: the bound `T min(k, L)` for all)."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                 layout: str = "rows", splits: str = "bucketed"):
        super().__init__("AllToAllDispatcher", num_experts, top_k, capacity_factor, group, layout)
        if splits not in SPLITS:
            raise ValueError(f"AllToAllDispatcher: splits {splits!r} is not one of {SPLITS}")
        if splits == "exact" and self.layout != "rows":
            raise ValueError("AllToAllDispatcher: exact splits need the rows layout (grouped matmul experts); "
                             f"this one computes a {self.layout} layout")
        self.splits = splits
        self.sizes_pairs = splits == "bucketed"      # exact splits size nothing on the host
        self.pair_capacity: Tuple[int, ...] = ()

    def _pair_capacities(self, num_tokens: int) -> Tuple[int, ...]:
        """Rows each destination gets from every source, at most the bound and at least 1 (static)."""
        bound = num_tokens * min(self.top_k, self.num_local)     # a token picks k distinct experts
        chosen = self.pair_capacity or (bound,) * self.n
        return tuple(max(1, min(int(c), bound)) for c in chosen)

    def dispatch(self, x, topk_idx, topk_weight):
        counts = expert_counts(topk_idx, self.num_experts)
        state = {"tokens_per_expert": counts.astype(topk_weight.dtype), "topk_weight": topk_weight}
        if self.capacity_factor > 0:
            return self._dispatch_capacity(x, topk_idx, state)
        if self.splits == "exact":
            return self._dispatch_exact(x, topk_idx, counts, state)
        return self._dispatch_dropless(x, topk_idx, counts, state)

    def combine(self, expert_output, state):
        if self.capacity_factor > 0:
            return self._combine_capacity(expert_output, state)
        if self.splits == "exact":
            return self._combine_exact(expert_output, state)
        return self._combine_dropless(expert_output, state)

    # ---- dropless, exact splits (Ascend) ----------------------------------------------------
    def _dispatch_exact(self, x, topk_idx, counts, state):
        n, num_local = self.n, self.num_local
        sorted_rows, slot = self.ops.permute(x, topk_idx, self.num_experts)       # [T k, H] by expert
        per_expert = counts.reshape(n, num_local)                                 # [destination, L]
        # counts first (one fp32 per local expert to each rank; no backward), then exactly the rows
        recv_counts = comm.all_to_all(ops.stop_gradient(per_expert.astype(ms.float32)), self.group)   # [source, L]
        send_rows = per_expert.sum(1).astype(ms.int64)
        recv_rows = recv_counts.sum(1).astype(ms.int64)
        spare = ops.zeros((1, x.shape[1]), sorted_rows.dtype)           # keeps both buffers non-empty
        send = ops.depend(ops.concat([sorted_rows, spare]), recv_counts)
        recv = comm.all_to_all_v_dynamic(send, send_rows, recv_rows, self.group)  # [R + 1, H], spare last
        # received rows come by source, then by local expert: row r is in segment #(segment ends <= r)
        ends = ops.cumsum(recv_counts.astype(ms.int32).reshape(-1), 0)            # [n L]
        row = ops.cumsum(ops.ones_like(recv[:, 0], dtype=ms.int32), 0) - 1        # shape-polymorphic arange
        segment = (row.reshape(-1, 1) >= ends.reshape(1, -1)).astype(ms.int32).sum(1)
        local = ops.where(segment < n * num_local, segment % num_local, ops.full_like(segment, num_local))
        state["slot"] = slot
        state["send_rows"], state["recv_rows"] = send_rows, recv_rows
        state["dropped"] = ops.zeros((), ms.float32)
        return self._to_local(recv, local.reshape(-1, 1), 0, state)          # rows layout: no bound needed

    def _combine_exact(self, expert_output, state):
        returned = self._from_local(expert_output, state)                        # [R + 1, H], received order
        back = comm.all_to_all_v_dynamic(returned, state["recv_rows"], state["send_rows"], self.group)
        rows = back[:-1]                                                          # [T k, H] by expert
        return self.ops.unpermute(rows, state["slot"], state["topk_weight"])

    # ---- dropless ---------------------------------------------------------------------------
    def _dispatch_dropless(self, x, topk_idx, counts, state):
        num_tokens, hidden = x.shape
        n, num_local, top_k = self.n, self.num_local, self.top_k
        caps = self._pair_capacities(num_tokens)
        mine, total, num_sorted = caps[self.rank], sum(caps), num_tokens * top_k
        # sender: sorted by expert, so each destination's rows are one run; destination j's run is
        # padded to caps[j] rows at a fixed place of the send buffer
        sorted_rows, slot = self.ops.permute(x, topk_idx, self.num_experts)
        per_destination = counts.reshape(n, num_local).sum(1)
        run_end = ops.cumsum(per_destination, 0)
        run_start = run_end - per_destination
        capacity = ops.concat([ops.full((1,), c, dtype=ms.int32) for c in caps])
        place = ops.cumsum(capacity, 0) - capacity                       # first send row of each destination
        row_destination = ops.concat([ops.full((c,), j, dtype=ms.int32) for j, c in enumerate(caps)])
        column = ops.arange(total, dtype=ms.int32) - ops.gather(place, row_destination, 0)
        send_index = ops.where(column < ops.gather(per_destination, row_destination, 0),
                               ops.gather(run_start, row_destination, 0) + column,
                               ops.full((total,), num_sorted, dtype=ms.int32))
        send = _rows_or_zero(sorted_rows, send_index)                                        # [sum caps, H]
        # where each sorted row comes back (rows past a run's capacity were not sent: an overflow,
        # which the host detects from the counts and re-runs)
        sorted_row = ops.arange(num_sorted, dtype=ms.int32)
        destination = (sorted_row.reshape(-1, 1) >= run_end.reshape(1, n)).astype(ms.int32).sum(1)
        offset = sorted_row - ops.gather(run_start, destination, 0)
        back_index = ops.where(offset < ops.gather(capacity, destination, 0),
                               ops.gather(place, destination, 0) + offset, ops.full_like(offset, total))

        # counts first (one fp32 per local expert to each other rank; no backward), then the tokens
        recv_counts = comm.all_to_all(ops.stop_gradient(counts.reshape(n, num_local).astype(ms.float32)),
                                      self.group)                                             # [source, L]
        # the two exchanges do not depend on each other through data: order them (same on every rank)
        send = ops.depend(send, recv_counts)
        recv = comm.all_to_all_v(send, caps, (mine,) * n, self.group, max(caps))             # [source * mine, H]

        # receiver: row c from a source belongs to local expert #(segment ends <= c); L = padding
        segment_end = ops.minimum(ops.cumsum(recv_counts.astype(ms.int32), 1), mine)
        column = ops.arange(mine, dtype=ms.int32).reshape(1, mine, 1)
        local = (column >= segment_end.reshape(n, 1, num_local)).astype(ms.int32).sum(-1)
        state["slot"] = slot
        state["back_index"] = back_index
        state["dropped"] = ops.zeros((), ms.float32)
        return self._to_local(recv, local.reshape(-1, 1), n * min(num_tokens, mine), state)

    def _combine_dropless(self, expert_output, state):
        caps = self._pair_capacities(state["topk_weight"].shape[0])
        returned = self._from_local(expert_output, state)                                   # [source * mine, H]
        back = comm.all_to_all_v(returned, (caps[self.rank],) * self.n, caps, self.group, max(caps))
        sorted_rows = _rows_or_zero(back, state["back_index"])
        return self.ops.unpermute(sorted_rows, state["slot"], state["topk_weight"])

    # ---- capacity ---------------------------------------------------------------------------
    def _dispatch_capacity(self, x, topk_idx, state):
        num_tokens, hidden = x.shape
        n, num_local = self.n, self.num_local
        capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
        order, slot_expert, slot_rank, counts = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
        slot_row, dropped = capacity_rows(slot_expert, slot_rank, capacity, self.num_experts)
        state["dropped"] = dropped
        send = permute(x, order, slot_row, self.top_k, self.num_experts * capacity)
        # the exchange has a fixed size, so every kept row arrives: counted on the sender
        state["computed_rows"] = kept_rows(counts, capacity)
        recv = comm.all_to_all(send.reshape(n, num_local * capacity, hidden), self.group)   # [source, L C, H]
        expert_input = recv.reshape(n, num_local, capacity, hidden).transpose(1, 0, 2, 3)
        state["send_row"] = assignment_rows(order, slot_row)
        state["expert_rows"] = ops.full((), num_local * n * capacity, dtype=ms.float32)
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
class AllGatherDispatcher(_EPDispatcher):
    """Every rank of the `ep` group sees every token: all-gather `x` and its routing, compute the
    local experts' share of each token's output, reduce-scatter the partial outputs. Moves
    `(ep - 1) T H` per gather against `(ep - 1)/ep T k H` per all-to-all (no more for k >= ep),
    needs no counts, and uses only AllGather / ReduceScatter (GPU has them; not AlltoAll).
    Capacity mode drops on the source rank, as one process would, then packs `[L, ep C, H]`."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                 layout: str = "rows"):
        super().__init__("AllGatherDispatcher", num_experts, top_k, capacity_factor, group, layout)

    def dispatch(self, x, topk_idx, topk_weight):
        num_tokens, hidden = x.shape
        n, num_local, top_k = self.n, self.num_local, self.top_k
        counts = expert_counts(topk_idx, self.num_experts)
        state = {"tokens_per_expert": counts.astype(topk_weight.dtype)}
        # one gather for the routing: weights (differentiable), expert ids and, with a capacity,
        # each assignment's slot in its expert's buffer on the source (-1: dropped there)
        routing = [topk_weight.astype(ms.float32), ops.stop_gradient(topk_idx.astype(ms.float32))]
        if self.capacity_factor > 0:
            capacity = expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)
            order, _, slot_rank, _ = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
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
        local_expert = pieces[1].astype(ms.int32) - self.rank * num_local
        is_local = ops.logical_and(local_expert >= 0, local_expert < num_local)

        if self.capacity_factor > 0:   # buffer [L, n C]: local expert, then source rank, then slot
            slot = pieces[2].astype(ms.int32).reshape(-1)
            local_expert = local_expert.reshape(-1)
            source = ops.arange(slot.shape[0], dtype=ms.int32) // (num_tokens * top_k)
            groups, group_rows = num_local, n * capacity
            mine = ops.logical_and(is_local.reshape(-1), slot >= 0)
            slot_row = ops.where(mine, local_expert * group_rows + source * capacity + slot,
                                 ops.full_like(slot, groups * group_rows))
            state["local_row"] = slot_row                     # slot i holds assignment i
            state["computed_rows"] = mine.astype(ms.float32).sum()
            state["expert_rows"] = ops.full((), groups * group_rows, dtype=ms.float32)
            expert_input = permute(all_tokens, ops.arange(slot.shape[0], dtype=ms.int32), slot_row, top_k,
                                   groups * group_rows)
            return expert_input.reshape(groups, group_rows, hidden), state
        local_expert = ops.where(is_local, local_expert, ops.full_like(local_expert, num_local))
        return self._to_local(all_tokens, local_expert, n * num_tokens, state)

    def combine(self, expert_output, state):
        partial = self._from_local(expert_output, state, state["topk_weight"])          # [n T, H]
        return comm.reduce_scatter(partial, self.group)


def dispatch_splits(path: str, forced: str = "auto") -> str:
    """How the dropless alltoall dispatcher sizes its exchange on code path `path`: "exact" (counts
    on the device, AlltoAllV with Tensor split sizes) on the Ascend path when comm runs Ascend's
    AlltoAllV (native, or its contract), "bucketed" (host-sized static capacities) elsewhere.
    `forced` (`parallel.ep_splits`: exact | bucketed) overrides (e.g. bucketed on Ascend for static shapes)."""
    if forced not in ("auto", *SPLITS):
        raise ValueError(f"parallel.ep_splits={forced!r}: use auto, {', '.join(SPLITS)}")
    has_alltoallv = comm.backend_name() != "emulated" and comm.native_target() == "Ascend"
    if forced == "exact" and not (path == "ascend" and has_alltoallv):
        raise ValueError(f"parallel.ep_splits=exact needs the Ascend MoE path with Ascend's AlltoAllV (this process: "
                         f"MoE path {path!r}, comm backend {comm.backend_name()!r} for {comm.native_target()}); "
                         f"set it to auto or bucketed")
    if forced != "auto":
        return forced
    return "exact" if path == "ascend" and has_alltoallv else "bucketed"


def build_ep_dispatcher(name: str, num_experts: int, top_k: int, capacity_factor: float, group: Group,
                        layout: str = "rows", path: str = "cpu", splits: str = "auto") -> nn.Cell:
    """The expert-parallel dispatcher named by `parallel.moe_token_dispatcher` on code path `path`
    (`native_ops.platform()`): GPU has no AlltoAll in MindSpore 2.10, so "alltoall" runs the
    allgather dispatcher there (said once in the log); on Ascend the dropless alltoall exchange
    uses exact split sizes (`dispatch_splits`; `splits`: `parallel.ep_splits`)."""
    if name not in ("alltoall", "allgather"):
        raise ValueError(f"parallel.moe_token_dispatcher: {name!r} is not one of 'alltoall', 'allgather'")
    if name == "alltoall" and path == "gpu":
        if not _logged_gpu_fallback and group.global_rank(group.rank_in_group) == 0:
            _logged_gpu_fallback.append(True)
            print("moetrain: parallel.moe_token_dispatcher=alltoall needs AlltoAll, which MindSpore 2.10 has on "
                  "Ascend only; this GPU job dispatches with allgather (AllGather + local experts + ReduceScatter)",
                  flush=True)
        name = "allgather"
    if name == "alltoall":
        splits = dispatch_splits(path, splits) if capacity_factor == 0 else "bucketed"
        return AllToAllDispatcher(num_experts, top_k, capacity_factor, group, layout, splits)
    return AllGatherDispatcher(num_experts, top_k, capacity_factor, group, layout)
