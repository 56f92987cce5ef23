"""Context parallelism (`parallel.context_parallel: cp`): every sequence split over the cp ranks.

    chunk_order(seq_len, cp, rank)          the global token positions rank `rank` holds
    local_batch(batch, cp, rank)            a batch's local tokens, labels and global position ids
    blockwise_attention(q, k, v, rank, cp)  causal attention of the local queries against the
                                            gathered K/V, chunk by chunk, merged by log-sum-exp
    TiledAttention                          that in one cell, its backward recomputing P
    ContextParallelAttention                that, with the K/V all-gathered over the cp group (comm)
                                            or passed around it (ring); or Ulysses' all-to-alls
                                            around the layer's own attention
    parallelize_context(model, cfg, pctx)   switches every `CausalAttention` and the MoE statistics
    ContextParallelRunner                   a step runner handing each micro-batch's local tokens

Load-balanced causal split (Megatron-Core's and torchtitan's): a sequence of S tokens is cut into
2·cp chunks of c = S / (2·cp); rank i holds chunks i and 2·cp−1−i, in that order. Under a causal
mask a query chunk k attends to k + 1 key chunks, so every rank's two chunks together see 2·cp + 1
key chunks: the same work on every rank. The local tokens keep increasing global positions (chunk i
comes before chunk 2·cp−1−i), so inside a rank's own block the mask is the ordinary lower triangle.

Everything but attention works on the local tokens unchanged: embedding, norms, MLP / MoE and the
loss. Each rank's loss is the mean over its S/cp tokens of each sequence, the same count on every
rank, so the mean over the cp ranks (the trainer averages step values and sums gradients over the
`dp` group, which spans dp x cp ranks: moetrain/distributed/topology.py) is the mean over all tokens of
the global batch, exactly as on one process; `ContextParallelRunner` checks that count every step
(`TokenCountError`). MoE statistics that mix tokens of one micro-batch (the Switch aux loss's
per-expert sums, the sequence-wise aux loss) are all-reduced over the cp group first
(`parallelize_context`), so they are those of the whole sequences.

Attention (`cp_comm_type: all_gather`, Megatron-Core's name): K and V (after RoPE at the global
positions) are all-gathered over the cp group (`comm.all_gather`: native AllGather on a device,
derived from AllReduce on the CPU; its backward reduce-scatters dK, dV back to their owners). The
local queries then attend to them in one `TiledAttention` cell: each local chunk (i = r, then
2·cp−1−r) against the key chunks 0..i, the last (its own) causal, in tiles of rows (as many as fit a
bound on one step's transient, `tiling.tile_rows`) against one key chunk at a time, the steps' partial results combined by their log-sum-exp:

    lse = log(e^lse1 + e^lse2),   out = out1 · e^(lse1 − lse) + out2 · e^(lse2 − lse)

(kept as running sums, the per-row terms in fp64). Every rank sees 2·cp + 1 key chunks in all, so
every rank runs the same number of equal steps. The cell's hand-written backward keeps only q, the
gathered k and v, the merged output and its log-sum-exp, and recomputes each step's probabilities
from them (FlashAttention style; exact): a layer keeps O(S/cp·dv) for the backward, no query-key
pairs and no per-block outputs. Where the CPU kernels run (fp32), each step is one call of the block
kernel each way (`kernels.ops.BlockAttention`: the step's (out, lse) merged into the running one inside
it); `FUSED = False` or `MOETRAIN_DISABLE_KERNELS=1` runs the plain ops.
Ring attention (`cp_comm_type: p2p`, `RingAttention`, as Megatron-Core runs it) passes the blocks
around the ring instead, inside one cell: each step sends the block in hand to the next rank and
receives the previous rank's (an all-to-all-v with one row each way: Ascend's AlltoAllV moves just
that row; on the CPU comm derives it from AllReduce, so there `all_gather` moves fewer bytes), and
the same steps run against each block as it arrives. Its backward keeps only the local K|V and
passes the blocks round again, each block's dK|dV summed by the ranks in turn and handed back to
its owner, so a layer holds no other rank's K|V for the backward. MLA's ring passes its compressed
latent and RoPE key round (`gather_keys`), expands them and runs the all_gather form's cell.

Attention (`cp_comm_type: a2a`, DeepSpeed Ulysses): an all-to-all over the cp group per q, k, v trades
the sequence split for a head split (each rank: the whole sequence, 1/cp of the query and K/V heads),
the sequence is put back in order, the layer's own attention runs (the fused kernel or the plain path,
as on one process), and one all-to-all trades back. Needs num_heads divisible by cp, and num_kv_heads
divisible by cp or dividing it: with fewer K/V heads than ranks each is replicated before the
all-to-all (`replicate_kv_heads`), so every rank gets the one its query heads read.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from moetrain import kernels
from moetrain.kernels.ops import BlockAttention, block_meta, shared
from moetrain.distributed import comm
from moetrain.layers import CausalAttention
from moetrain.layout import LayoutError
from moetrain.parallel.expert_parallel import moe_layers
from moetrain.parallel.tiling import tile_rows

_BMM, _BMM_NT, _BMM_TN = ops.BatchMatMul(), ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_a=True)
_MASKED = -1e9          # additive mask: finite, so a masked score can never make a NaN


class TokenCountError(ValueError):
    """The tokens the loss is averaged over differ from the global batch's (context parallelism): the
    step would train on a wrongly weighted loss, so it stops before any work (`moetrain train`: one
    line, exit code 2)."""


# ---------------------------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------------------------
def chunk_order(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """The global positions (int64 `[seq_len / cp]`) rank `rank` of `cp` holds: chunk `rank`, then
    chunk `2·cp − 1 − rank`, of 2·cp equal chunks."""
    if seq_len % (2 * cp):
        raise LayoutError(f"a sequence of {seq_len} tokens cannot be cut into 2 x parallel.context_parallel = "
                          f"{2 * cp} equal chunks; use a sequence length that is a multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return np.concatenate([np.arange(first * c, (first + 1) * c), np.arange(second * c, (second + 1) * c)])


def local_batch(batch: Sequence[np.ndarray], cp: int, rank: int, lookahead: int = 0) -> Tuple[np.ndarray, ...]:
    """This rank's part of an LM batch `(input_ids, labels[, document_ids, position_ids])` `[B, S]`:
    the local tokens and labels `[B, S / cp]` and the attention context the model then needs,
    `(document_ids, position_ids)`: the batch's own, sliced alike (packed documents: docs/data.md), or
    one document per row and the global positions, which RoPE rotates at. `lookahead` D > 0 (a head
    that reads labels ahead, DeepSeek-V3's MTP: `model.label_lookahead`): the labels become
    `[B, 1 + D, S / cp]`, row j the labels j positions after the local ones (0 past the sequence's
    end, where the model counts nothing): the runner holds the whole batch, so nothing is exchanged."""
    if len(batch) not in (2, 4):
        raise LayoutError(f"parallel.context_parallel > 1 splits LM batches (input_ids, labels[, document_ids, "
                          f"position_ids]); this batch has {len(batch)} arrays")
    arrays = [np.asarray(a) for a in batch]
    input_ids = arrays[0]
    if input_ids.ndim != 2 or any(a.shape != input_ids.shape for a in arrays):
        raise LayoutError(f"parallel.context_parallel > 1 needs [batch, seq] arrays of one shape, got "
                          f"{[a.shape for a in arrays]}")
    order = chunk_order(input_ids.shape[1], cp, rank)
    if len(arrays) == 2:
        positions = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int32), input_ids.shape)
        arrays += [np.zeros(input_ids.shape, np.int32), positions]
    local = [np.ascontiguousarray(a[:, order]) for a in arrays]
    if lookahead:
        seq_len, labels = input_ids.shape[1], arrays[1]
        ahead = [np.where(order + j < seq_len, labels[:, np.minimum(order + j, seq_len - 1)], 0)
                 for j in range(lookahead + 1)]
        local[1] = np.ascontiguousarray(np.stack(ahead, 1).astype(labels.dtype))
    return tuple(local)


def main_labels(labels: np.ndarray) -> np.ndarray:
    """The labels of the local positions themselves (`local_batch`: `[B, L]`, or row 0 of `[B, 1 + D, L]`)."""
    return labels[:, 0] if labels.ndim == 3 else labels


# ---------------------------------------------------------------------------------------------
# The attention math
# ---------------------------------------------------------------------------------------------
def _softmax_dtype(x):
    """fp32 for the softmax and the merge (the project's rule), fp64 for fp64 inputs (exactness tests)."""
    return ms.float64 if x.dtype == ms.float64 else ms.float32


TILE_ROWS = None        # query rows attended at a time: None, by `tiling.tile_rows`; a number fixes it (tests)
FUSED = None            # the steps on the fused CPU kernel: None, where `kernels.available()`; False: plain ops


def use_fused() -> bool:
    """Whether new `TiledAttention` / `RingAttention` cells run their fp32 steps on the fused kernel
    (`kernels/block_attention.cc`): `FUSED` when set, else `kernels.available()`
    (`MOETRAIN_DISABLE_KERNELS=1` turns it off)."""
    return kernels.available() if FUSED is None else bool(FUSED)


class TiledAttention(nn.Cell):
    """Softmax attention of query row ranges against key ranges, all in one cell whose backward keeps
    only what it was given (q, k, v, the document ids) and returned (the output and its log-sum-exp)
    and recomputes the probabilities FlashAttention-style, so a layer keeps O(rows·dv) for the
    backward: no scores, probabilities, per-block outputs or merge terms (docs/context_parallel.md,
    "Measured").

    `plan`: `((q0, q1, ((k0, k1, causal), ...)), ...)`: query rows [q0, q1) attend to the union of
    their key ranges; a `causal` range is aligned with the query range (key k0 + i is query q0 + i's
    position), so query i sees its keys <= i. Ranges of one query range are disjoint; the ranges of
    different query ranges are equal or disjoint. `construct(q, k, v, query_docs, key_docs)`: q
    `[B, h, g, R, d]` (pre-scaled; the g query heads sharing one of the h K/V heads), k `[B, h, K, d]`,
    v `[B, h, K, dv]`; with `documents` the fp32 document ids `[B, R]` / `[B, K]` (a query sees only
    keys of its own document; otherwise placeholders) -> `(out [B, h, g, R, dv], lse [B, h, g, R, 1])`,
    out fp32 (fp64 for fp64 inputs), lse fp64. Every query must see at least one key.

    Steps: the rows of a query range in tiles of `rows` (`tiling.tile_rows`), each tile against each of its key
    ranges in turn (each step after the one before, so one step's `[rows, keys]` transient lives at a
    time; a causal range skips the keys after the tile's rows). A step keeps its row maximum m, the
    sum l of e = exp(S − m) and e·V; the tile's lse = log Σ e^(m + log l) and out = Σ (e·V) e^(m − lse),
    the per-row terms in fp64. Backward per step, P = e · e^(m − lse) (e recomputed with the forward's
    very ops, the per-row factor in fp64: MindSpore's fp32 exp on the CPU is 5e-6 off, so P as
    exp(S − lse) in fp32 would not be the forward's P): dV += Pᵀ dO, dP = dO Vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), dQ += dS K, dK += dSᵀ Q: exact.

    Every step is one tile of rows against one key range: with the load-balanced split's plan
    (`balanced_plan`) every rank runs the same number of equal steps (the balance of
    benchmarks/bench_cp_balance.py).

    `fused`: fp32 steps run on the fused CPU kernel (`kernels.ops.BlockAttention`: one op a step each
    way, the merge by log-sum-exp inside it, the mask from the step's offsets and the document ids, no
    slice of q, k or v; then lse is fp32); fp64 inputs and `fused=False` run the plain ops above."""

    def __init__(self, plan, documents: bool, rows: int, fused: bool = False):
        super().__init__()
        self.plan, self.documents, self.rows = plan, documents, rows
        slots = sorted({(k0, k1) for _, _, ranges in plan for k0, k1, _ in ranges})
        for (a0, a1), (b0, b1) in zip(slots, slots[1:]):
            if b0 < a1:
                raise ValueError(f"TiledAttention: key ranges [{a0}, {a1}) and [{b0}, {b1}) overlap")
        self.slots = tuple(slots)
        # per query range, per key range: the slot its dK / dV accumulate into
        slot_of = [[slots.index((k0, k1)) for k0, k1, _ in ranges] for _, _, ranges in plan]
        # `((r0, r1, offset, ((k0, k1, causal, slot), ...)), ...)`: every row tile in order (r0, r1 absolute
        # rows of q, offset = r0 − q0), its key ranges and the slot each one's dK / dV accumulate into;
        # fixed here: the graph compiler reads constants, it cannot run the loops
        tiles = []
        for (q0, q1, ranges), slot_row in zip(plan, slot_of):
            steps = tuple((k0, k1, causal, slot) for (k0, k1, causal), slot in zip(ranges, slot_row))
            for r0 in range(q0, q1, rows):
                tiles.append((r0, min(r0 + rows, q1), r0 - q0, steps))
        self.tiles = tuple(tiles)
        self.kernel = None
        if fused:
            self.kernel = shared(BlockAttention)
            # per tile, per step: the kernel's step description (query rows, key range, mask, merge)
            self.metas = tuple(tuple(self.meta(r0, offset, step, prior=i > 0) for i, step in enumerate(steps))
                               for r0, _, offset, steps in self.tiles)

    def meta(self, r0, offset, step, prior: bool):
        """The fused kernel's description of a step (`kernels.ops.block_meta`): tile rows from r0, the
        key range of `step`, causal at the tile's `offset` within its query range."""
        k0, k1, causal, _ = step
        return block_meta(r0, k0, k1 - k0, causal, offset, self.documents, prior)

    def fused_on(self, q, k, v):
        """Whether this call runs on the fused kernel: the cell has it and q, k, v are fp32."""
        return self.kernel is not None and q.dtype == ms.float32 and k.dtype == ms.float32 and \
            v.dtype == ms.float32

    def fused_forward(self, q, k, v, query_docs, key_docs):
        """`construct` on the fused kernel: per tile, one kernel call a step, each merged into the last."""
        batch, heads, group = q.shape[0], q.shape[1], q.shape[2]
        outs, lses = [], []
        for index in range(len(self.tiles)):                  # (no enumerate: ms.jit cannot unroll it here)
            r0, r1, _, steps = self.tiles[index]
            shape = (batch, heads, group, r1 - r0)
            out, lse = ops.zeros(shape + (v.shape[3],), ms.float32), ops.zeros(shape + (1,), ms.float32)
            for i in range(len(steps)):
                out, lse = self.kernel(q, k, v, query_docs, key_docs, out, lse, self.metas[index][i])
            outs.append(out)
            lses.append(lse)
        return _joined(outs), _joined(lses)

    def fused_backward(self, q, k, v, query_docs, key_docs, out, dout):
        """`bprop` on the fused kernel: per step one call adding its dq to the tile's and its dk, dv to
        the key range's (from the merged output and lse, FlashAttention's)."""
        batch, heads, group, _, dim = q.shape
        dq_tiles, dks, dvs = [], (None,) * len(self.slots), (None,) * len(self.slots)
        for index in range(len(self.tiles)):
            r0, r1, _, steps = self.tiles[index]
            dq = ops.zeros((batch, heads, group, r1 - r0, dim), ms.float32)
            for i in range(len(steps)):
                k0, k1, _, slot = steps[i]
                dk = _or_zeros(dks[slot], (batch, heads, k1 - k0, dim))
                dv = _or_zeros(dvs[slot], (batch, heads, k1 - k0, v.shape[3]))
                dq, dk, dv = self.kernel.backward(q, k, v, query_docs, key_docs, out[0], out[1], dout[0], dout[1],
                                                  dq, dk, dv, self.metas[index][i])
                dks, dvs = _replaced(dks, slot, dk), _replaced(dvs, slot, dv)
            dq_tiles.append(dq)
        dq = _joined(dq_tiles)
        dk, dv = self.whole_keys(dks, k.shape, ms.float32), self.whole_keys(dvs, v.shape, ms.float32)
        return dq, dk, dv, ops.zeros_like(query_docs), ops.zeros_like(key_docs)

    def exponentials(self, q_tile, k, query_docs, key_docs, r0, offset, step, dtype):
        """`(e [B, h, g·t, kc], row max m [B, h, g, t, 1], kc)` of one step: the masked fp32 (fp64)
        scores S of the tile's rows against the keys of range `step` they may see, e = exp(S − m)."""
        k0, k1, causal, _ = step
        batch, heads, group, rows, dim = q_tile.shape
        keys = offset + rows if causal else k1 - k0
        # every slice after the tile's turn (`_after`): else the graph may take every step's at once
        scores = _BMM_NT(q_tile.reshape(batch, heads, group * rows, dim), _after(k, q_tile)[:, :, k0:k0 + keys])
        if scores.dtype != dtype:
            scores = scores.astype(dtype)
        scores = scores.reshape(batch, heads, group, rows, keys)
        if causal and offset + rows > 1:
            query = ops.arange(offset, offset + rows, dtype=ms.int32).reshape(-1, 1)
            hidden = ops.arange(0, keys, dtype=ms.int32).reshape(1, -1) > query
            scores = scores + hidden.astype(dtype) * _MASKED
        if self.documents:
            other = _after(query_docs, q_tile)[:, r0:r0 + rows].reshape(batch, 1, 1, rows, 1) != \
                _after(key_docs, q_tile)[:, k0:k0 + keys].reshape(batch, 1, 1, 1, keys)
            scores = scores + other.astype(dtype) * _MASKED
        top = scores.max(axis=-1, keepdims=True)
        weights = ops.exp(scores - top)
        return weights.reshape(batch, heads, group * rows, keys), top, keys

    def step_grads(self, q_tile, q_rows, do_rows, delta, lse_tile, k, k_c, v_c, query_docs, key_docs, r0, offset,
                   step, dtype):
        """One step's backward from its recomputed probabilities (FlashAttention's): `(dq [B, h, g, t, d],
        dk [B, h, k1 − k0, d], dv [B, h, k1 − k0, dv])`; `q_rows`, `do_rows`, `delta` (rowsum(dO ∘ O) −
        dlse) and `lse_tile` are the tile's rows, `k_c`, `v_c` the keys and values in `dtype`."""
        k0, k1 = step[0], step[1]
        batch, heads, group, rows, dim = q_tile.shape
        e, top, keys = self.exponentials(q_tile, k, query_docs, key_docs, r0, offset, step, dtype)
        scale = ops.exp(top.astype(ms.float64) - lse_tile).astype(dtype).reshape(batch, heads, group * rows, 1)
        probs = e * scale                                                    # [B, h, g·t, kc]
        # after P: else the graph may compute every step's dP first, all their transients at once
        d_probs = _BMM_NT(ops.depend(do_rows, probs), _after(v_c, probs)[:, :, k0:k0 + keys])
        d_scores = probs * (d_probs - delta)
        dq = _BMM(d_scores, _after(k_c, d_scores)[:, :, k0:k0 + keys]).reshape(batch, heads, group, rows, dim)
        dk = _BMM_TN(d_scores, q_rows)                                       # [B, h, kc, d]
        dv = _BMM_TN(probs, do_rows)                                         # [B, h, kc, dv]
        if keys < k1 - k0:                                                   # a causal tile: keys [k0, k0 + kc)
            dk = ops.pad(dk, (0, 0, 0, k1 - k0 - keys))
            dv = ops.pad(dv, (0, 0, 0, k1 - k0 - keys))
        return dq, dk, dv

    def step_forward(self, q_tile, k, v, query_docs, key_docs, r0, offset, step, dtype):
        """One step's `(e·V [B, h, g, t, dv], m, l)`, m and l (the sum of e) `[B, h, g, t, 1]` fp64."""
        batch, heads, group, rows, _ = q_tile.shape
        e, top, keys = self.exponentials(q_tile, k, query_docs, key_docs, r0, offset, step, dtype)
        total = e.sum(axis=-1).reshape(top.shape).astype(ms.float64)
        value = _BMM(e.astype(v.dtype), _after(v, e)[:, :, step[0]:step[0] + keys]).astype(dtype)
        return value.reshape(batch, heads, group, rows, v.shape[-1]), top.astype(ms.float64), total

    def construct(self, q, k, v, query_docs, key_docs):
        if self.fused_on(q, k, v):
            return self.fused_forward(q, k, v, query_docs, key_docs)
        dtype = _softmax_dtype(q)
        outs, lses = [], []
        for r0, r1, offset, steps in self.tiles:
            q_tile = q[:, :, :, r0:r1]
            if outs:                                              # one step after another: one transient at a time
                q_tile = ops.depend(q_tile, outs[-1])
            acc, peak, norm = self.step_forward(q_tile, k, v, query_docs, key_docs, r0, offset, steps[0], dtype)
            for step in steps[1:]:                                # running sums, rescaled to the new maximum (fp64)
                value, top, total = self.step_forward(ops.depend(q_tile, acc), k, v, query_docs, key_docs, r0,
                                                      offset, step, dtype)
                new_peak = ops.maximum(peak, top)
                old_w, new_w = ops.exp(peak - new_peak), ops.exp(top - new_peak)
                acc = acc * old_w.astype(dtype) + value * new_w.astype(dtype)
                norm = norm * old_w + total * new_w
                peak = new_peak
            outs.append(acc / norm.astype(dtype))
            lses.append(peak + ops.log(norm))
        return _joined(outs), _joined(lses)

    def bprop(self, q, k, v, query_docs, key_docs, out, dout):
        if self.fused_on(q, k, v):
            return self.fused_backward(q, k, v, query_docs, key_docs, out, dout)
        dtype = _softmax_dtype(q)
        o, lse, d_out, d_lse = out[0], out[1], dout[0], dout[1]
        batch, heads, group, _, dim = q.shape
        k_c, v_c = k.astype(dtype), v.astype(dtype)
        dq_tiles, dks, dvs = [], (None,) * len(self.slots), (None,) * len(self.slots)
        for r0, r1, offset, steps in self.tiles:
            t = r1 - r0
            q_tile = q[:, :, :, r0:r1]
            if dq_tiles:
                q_tile = ops.depend(q_tile, dq_tiles[-1])
            do_tile = _after(d_out, q_tile)[:, :, :, r0:r1].astype(dtype)
            delta = (do_tile * _after(o, q_tile)[:, :, :, r0:r1].astype(dtype)).sum(axis=-1, keepdims=True) \
                - _after(d_lse, q_tile)[:, :, :, r0:r1].astype(dtype)
            delta = delta.reshape(batch, heads, group * t, 1)
            do_rows = do_tile.reshape(batch, heads, group * t, -1)
            lse_tile = _after(lse, q_tile)[:, :, :, r0:r1].astype(ms.float64)
            q_rows = q_tile.reshape(batch, heads, group * t, dim).astype(dtype)
            dq = None
            for step in steps:
                slot = step[3]
                q_step = q_tile if dq is None else ops.depend(q_tile, dq)
                dq_part, dk_part, dv_part = self.step_grads(q_step, q_rows, do_rows, delta, lse_tile, k, k_c, v_c,
                                                            query_docs, key_docs, r0, offset, step, dtype)
                dq = dq_part if dq is None else dq + dq_part
                dks = _accumulate(dks, slot, dk_part)
                dvs = _accumulate(dvs, slot, dv_part)
            dq_tiles.append(dq)
        dq = _joined(dq_tiles)
        dk, dv = self.whole_keys(dks, k.shape, dtype), self.whole_keys(dvs, v.shape, dtype)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), ops.zeros_like(query_docs),
                ops.zeros_like(key_docs))

    def whole_keys(self, parts, shape, dtype, slots=None):
        """The per-slot gradients -> one `[B, h, K, ·]` tensor, zeros where no query looked (`slots`:
        the key ranges `parts` belong to; this cell's by default)."""
        pieces, at = [], 0
        for (k0, k1), part in zip(self.slots if slots is None else slots, parts):
            if k0 > at:
                pieces.append(ops.zeros((shape[0], shape[1], k0 - at, shape[3]), dtype))
            pieces.append(part)
            at = k1
        if shape[2] > at:
            pieces.append(ops.zeros((shape[0], shape[1], shape[2] - at, shape[3]), dtype))
        return pieces[0] if len(pieces) == 1 else ops.concat(pieces, 2)


class _RingShift(nn.Cell):
    """One ring step over `group` (`comm.all_to_all_v_raw`, one row each way), in a cell of its own
    without a bprop: what `RingAttention`'s forward and hand-written backward call (under ms.jit a
    bprop can call neither comm's differentiable ops nor, measured, comm's functions directly)."""

    def __init__(self, group, send_counts, recv_counts):
        super().__init__()
        self.group, self.send_counts, self.recv_counts = group, send_counts, recv_counts

    def construct(self, block):
        shape = block.shape
        moved = comm.all_to_all_v_raw(block.reshape(1, -1), self.send_counts, self.recv_counts, self.group, None)
        return moved.reshape(shape)


class RingAttention(TiledAttention):
    """Ring attention (`cp_comm_type: p2p`) in one cell, as Megatron-Core runs it: the local queries
    against every rank's K|V, the blocks passed round the cp group inside the cell, and a backward that
    keeps only the local K|V (besides q, the output and its log-sum-exp) and passes the blocks round
    again, each block's dK|dV summed by the ranks in turn and handed back to its owner. A layer keeps
    O(S/cp) for the backward: no other rank's K|V (docs/context_parallel.md, "Ring").

    `plan`: the rank's `balanced_plan` against keys in rank order (rank j's at [j·L, (j+1)·L)), its
    steps (`TiledAttention`) grouped by the block they read: ring step t holds rank (r − t)'s block,
    step 0 the rank's own (every tile's causal step is there, so in the forward it starts every tile's
    running sums).
    Forward: cp − 1 shifts of K and of V, each after the steps on the block before (two blocks live
    at most). Backward: the other ranks' blocks first (steps 1 .. cp − 1, the same shifts); from step
    2 on, the dK and dV sums of the block arriving come from the previous rank (the ranks before added
    theirs), this rank adds its part and passes them on; after step cp − 1 the sums go one hop more,
    to their owners, and only then does a rank form its own block's part, added to the sum that
    arrived (no dK|dV of its own held while the ring runs): cp − 1 shifts of K|V and cp − 1 of dK|dV,
    Megatron's backward traffic. K, V and the sums travel as separate tensors: a concatenation and
    its slices would be copies, live beside the blocks (the dry run: 4.0 MiB more at cp 2, 2.0 at cp 4).

    `construct(q, k, v, query_docs, key_docs)`: q `[B, h, g, L, d]` pre-scaled, this rank's k
    `[B, h, L, d]` and v `[B, h, L, dv]`; with `documents` the fp32 document ids of the local queries
    `[B, L]` and of every rank's keys `[B, cp·L]` in rank order (one value a token: kept whole) ->
    `(out [B, h, g, L, dv], lse [B, h, g, L, 1])` as `TiledAttention`. `shift`: one ring step, `block`
    to the next rank of `group`, the previous rank's back (`_RingShift`: one row each way)."""

    def __init__(self, plan, documents: bool, rows: int, group, block: int, fused: bool = False):
        super().__init__(plan, documents, rows, fused)
        self.group, self.cp, self.rank, self.block = group, group.size, group.rank_in_group, block
        nxt, prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        self.send_counts = tuple(1 if r == nxt else 0 for r in range(self.cp))
        self.recv_counts = tuple(1 if r == prev else 0 for r in range(self.cp))
        # per ring step t: the block's rank, its key ranges (block-local), and the steps reading it:
        # `(tile, (k0, k1, causal, slot))`, k0 / k1 block-local, slot: the range's index in the block
        owners, block_slots, block_steps = [], [], []
        for t in range(self.cp):
            owner = (self.rank - t) % self.cp
            lo, hi = owner * block, (owner + 1) * block
            mine = sorted({(k0 - lo, k1 - lo) for k0, k1 in self.slots if lo <= k0 < hi})
            steps = []
            for tile, (_, _, _, tile_steps) in enumerate(self.tiles):
                for k0, k1, causal, _ in tile_steps:
                    if lo <= k0 < hi:
                        steps.append((tile, (k0 - lo, k1 - lo, causal, mine.index((k0 - lo, k1 - lo)))))
            owners.append(owner)
            block_slots.append(tuple(mine))
            block_steps.append(tuple(steps))
        if not all(tile in {tile for tile, _ in block_steps[0]} for tile in range(len(self.tiles))):
            raise ValueError("RingAttention: every query tile must read its own block (its causal keys)")
        self.owners, self.block_slots, self.block_steps = tuple(owners), tuple(block_slots), tuple(block_steps)
        self.shifter = _RingShift(group, self.send_counts, self.recv_counts)
        if fused:   # per ring step, per step on its block: the kernel's description (a tile's first merges nothing)
            started, metas = set(), []
            for steps in self.block_steps:
                row = []
                for tile, step in steps:
                    row.append(self.meta(self.tiles[tile][0], self.tiles[tile][2], step, prior=tile in started))
                    started.add(tile)
                metas.append(tuple(row))
            self.ring_metas = tuple(metas)

    def shift(self, block):
        """One ring step: `block` to the next rank, the previous rank's back (its backward: the other way)."""
        return self.shifter(block)

    def next_block(self, t: int, k_b, v_b, key_docs, last):
        """Ring step t's keys, values and their document ids: from step 1 on, the block before passed
        on (k after `last`, the steps on the block before; then v)."""
        if t:
            k_b = self.shift(_after(k_b, last))
            v_b = self.shift(_after(v_b, k_b))
        return k_b, v_b, self.block_docs(key_docs, t)

    def block_docs(self, key_docs, t: int):
        """The document ids of ring step t's keys (placeholders without documents)."""
        if not self.documents:
            return key_docs
        at = self.owners[t] * self.block
        return key_docs[:, at:at + self.block]

    def construct(self, q, k, v, query_docs, key_docs):
        if self.fused_on(q, k, v):
            return self.fused_ring_forward(q, k, v, query_docs, key_docs)
        dtype = _softmax_dtype(q)
        states = (None,) * len(self.tiles)            # per tile: its running (e·V, max, sum)
        k_b, v_b, last = k, v, q
        for t in range(self.cp):
            k_b, v_b, docs = self.next_block(t, k_b, v_b, key_docs, last)
            for tile, step in self.block_steps[t]:
                r0, r1, offset, _ = self.tiles[tile]
                q_tile = _after(_after(q[:, :, :, r0:r1], last), v_b)
                value, top, total = self.step_forward(q_tile, k_b, v_b, query_docs, docs, r0, offset, step, dtype)
                state = states[tile]
                if state is not None:                  # running sums, rescaled to the new maximum (fp64)
                    peak = ops.maximum(state[1], top)
                    old_w, new_w = ops.exp(state[1] - peak), ops.exp(top - peak)
                    value = state[0] * old_w.astype(dtype) + value * new_w.astype(dtype)
                    total = state[2] * old_w + total * new_w
                    top = peak
                states = _replaced(states, tile, (value, top, total))
                last = value
        outs = [acc / norm.astype(dtype) for acc, _, norm in states]
        lses = [peak + ops.log(norm) for _, peak, norm in states]
        return _joined(outs), _joined(lses)

    def fused_ring_forward(self, q, k, v, query_docs, key_docs):
        """`construct` on the fused kernel: each step one call, merged into its tile's running (out, lse)."""
        batch, heads, group = q.shape[0], q.shape[1], q.shape[2]
        states = (None,) * len(self.tiles)            # per tile: its running (out, lse)
        k_b, v_b, last = k, v, q
        for t in range(self.cp):
            k_b, v_b, docs = self.next_block(t, k_b, v_b, key_docs, last)
            for i in range(len(self.block_steps[t])):
                tile = self.block_steps[t][i][0]
                r0, r1, _, _ = self.tiles[tile]
                state = states[tile]
                if state is None:                     # the kernel does not read these (its meta: no prior)
                    shape = (batch, heads, group, r1 - r0)
                    state = (ops.zeros(shape + (v.shape[3],), ms.float32), ops.zeros(shape + (1,), ms.float32))
                state = self.kernel(_after(q, v_b), k_b, v_b, query_docs, docs, state[0], state[1],
                                    self.ring_metas[t][i])
                states = _replaced(states, tile, state)
                last = state[0]
        outs, lses = [state[0] for state in states], [state[1] for state in states]
        return _joined(outs), _joined(lses)

    def fused_block_grads(self, t, q, k_b, v_b, query_docs, key_docs, out, dout, dq_tiles, last):
        """`block_grads` on the fused kernel: one call a step, adding to its tile's dQ and its range's dK, dV."""
        batch, heads, group, _, dim = q.shape
        docs = self.block_docs(key_docs, t)
        dks = dvs = (None,) * len(self.block_slots[t])
        for i in range(len(self.block_steps[t])):
            tile, (k0, k1, _, slot) = self.block_steps[t][i]
            r0, r1, _, _ = self.tiles[tile]
            dq = _or_zeros(dq_tiles[tile], (batch, heads, group, r1 - r0, dim))
            dk = _or_zeros(dks[slot], (batch, heads, k1 - k0, dim))
            dv = _or_zeros(dvs[slot], (batch, heads, k1 - k0, v_b.shape[3]))
            dq, dk, dv = self.kernel.backward(_after(q, last), k_b, v_b, query_docs, docs, out[0], out[1], dout[0],
                                              dout[1], dq, dk, dv, self.ring_metas[t][i])
            dq_tiles = _replaced(dq_tiles, tile, dq)
            dks, dvs = _replaced(dks, slot, dk), _replaced(dvs, slot, dv)
            last = dv
        shape = (batch, heads, self.block, dim)
        dk = self.whole_keys(dks, shape, ms.float32, self.block_slots[t])
        dv = self.whole_keys(dvs, shape[:3] + (v_b.shape[3],), ms.float32, self.block_slots[t])
        return dq_tiles, dk, dv

    def block_grads(self, t, q, k_b, v_b, query_docs, key_docs, out, dout, delta_all, dq_tiles, last):
        """Ring step t of the backward: dQ of every tile reading block r − t added to `dq_tiles`, and
        this rank's part of that block's dK and dV `[B, h, L, ·]` (fp32 / fp64); each step after
        `last` and the one before."""
        dtype = _softmax_dtype(q)
        lse, d_out = out[1], dout[0]
        batch, heads, group, _, dim = q.shape
        k_c, v_c = k_b.astype(dtype), v_b.astype(dtype)
        docs = self.block_docs(key_docs, t)
        dks = dvs = (None,) * len(self.block_slots[t])
        for tile, step in self.block_steps[t]:
            r0, r1, offset, _ = self.tiles[tile]
            slot = step[3]
            rows = r1 - r0
            q_tile = _after(q[:, :, :, r0:r1], last)
            do_rows = _after(d_out, q_tile)[:, :, :, r0:r1].astype(dtype).reshape(batch, heads, group * rows, -1)
            delta = _after(delta_all, q_tile)[:, :, :, r0:r1].reshape(batch, heads, group * rows, 1)
            lse_tile = _after(lse, q_tile)[:, :, :, r0:r1].astype(ms.float64)
            q_rows = q_tile.reshape(batch, heads, group * rows, dim).astype(dtype)
            dq_part, dk_part, dv_part = self.step_grads(q_tile, q_rows, do_rows, delta, lse_tile, k_b, k_c, v_c,
                                                        query_docs, docs, r0, offset, step, dtype)
            dq_tiles = _accumulate(dq_tiles, tile, dq_part)
            dks = _accumulate(dks, slot, dk_part)
            dvs = _accumulate(dvs, slot, dv_part)
            last = ops.depend(dvs[slot], ops.depend(dks[slot], dq_tiles[tile]))
        shape = (batch, heads, self.block, dim)
        dk = self.whole_keys(dks, shape, dtype, self.block_slots[t])
        dv = self.whole_keys(dvs, shape[:3] + (v_b.shape[3],), dtype, self.block_slots[t])
        return dq_tiles, dk, dv

    def grads_of_block(self, fused, t, q, k_b, v_b, query_docs, key_docs, out, dout, delta_all, dq_tiles, last):
        """Ring step t's `block_grads`, on the fused kernel when `fused` (which forms its own rowsums)."""
        if fused:
            return self.fused_block_grads(t, q, k_b, v_b, query_docs, key_docs, out, dout, dq_tiles, last)
        return self.block_grads(t, q, k_b, v_b, query_docs, key_docs, out, dout, delta_all, dq_tiles, last)

    def bprop(self, q, k, v, query_docs, key_docs, out, dout):
        dtype = _softmax_dtype(q)
        fused = self.fused_on(q, k, v)
        # rowsum(dO ∘ O) − dlse of every local row: [B, h, g, L, 1], small (the fused kernel forms its own)
        delta_all = dout[0]
        if not fused:
            delta_all = (dout[0].astype(dtype) * out[0].astype(dtype)).sum(axis=-1, keepdims=True) \
                - dout[1].astype(dtype)
        dq_tiles = (None,) * len(self.tiles)
        k_b, v_b, dk_sum, dv_sum, last = k, v, None, None, delta_all
        for t in range(1, self.cp):                   # the other ranks' blocks; this rank's own last
            k_b = self.shift(_after(k_b, last))
            v_b = self.shift(_after(v_b, k_b))
            if t > 1:                                 # the sums of block r − t from rank r − 1
                dk_sum = self.shift(_after(dk_sum, v_b))
                dv_sum = self.shift(_after(dv_sum, dk_sum))
            dq_tiles, dk, dv = self.grads_of_block(fused, t, q, k_b, v_b, query_docs, key_docs, out, dout, delta_all,
                                                   dq_tiles, v_b if t == 1 else dv_sum)
            dk_sum = dk if t == 1 else dk_sum + dk
            dv_sum = dv if t == 1 else dv_sum + dv
            last = dv_sum
        # the sums' last hop, to their owners (this rank gets its own block's), then this rank's part of it
        dk_sum = self.shift(_after(dk_sum, last))
        dv_sum = self.shift(_after(dv_sum, dk_sum))
        dq_tiles, dk, dv = self.grads_of_block(fused, 0, q, k, v, query_docs, key_docs, out, dout, delta_all,
                                               dq_tiles, dv_sum)
        dk, dv = dk_sum + dk, dv_sum + dv
        dq = _joined(dq_tiles)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), ops.zeros_like(query_docs),
                ops.zeros_like(key_docs))


def _joined(tiles):
    """The per-tile results along the rows (axis 3): one tile as it is."""
    return tiles[0] if len(tiles) == 1 else ops.concat(tiles, 3)


def _after(x, event):
    """`x`, read only once `event` is computed (ops.depend: no copy)."""
    return ops.depend(x, event)


def _replaced(parts, slot: int, value):
    """`parts` (a tuple) with `value` at `slot` (a tuple rebuilt: no list item assignment under ms.jit)."""
    return parts[:slot] + (value,) + parts[slot + 1:]


def _accumulate(parts, slot: int, value):
    """`parts` with `value` added at `slot` (set there if it holds None)."""
    return _replaced(parts, slot, value if parts[slot] is None else parts[slot] + value)


def _or_zeros(part, shape):
    """`part`, or fp32 zeros of `shape` where it is None (a fused kernel's accumulator not started yet)."""
    return ops.zeros(shape, ms.float32) if part is None else part


def chunk_plan(held: Sequence[int], key_offset, chunk: int):
    """`TiledAttention`'s plan for causal attention of a rank holding the chunks `held` (their
    indices in the sequence, in local order, `chunk` tokens each) against the keys of every chunk up
    to each: query chunk i sees key chunks 0..i, the last causal. `key_offset(j)`: where chunk j's
    keys start in k."""
    plan = []
    for local, index in enumerate(held):
        ranges = tuple((key_offset(j), key_offset(j) + chunk, j == index) for j in range(index + 1))
        plan.append((local * chunk, (local + 1) * chunk, ranges))
    return tuple(plan)


def balanced_plan(rows: int, rank: int, cp: int):
    """The plan of rank `rank`'s L = `rows` local queries (chunks rank and 2·cp−1−rank) against k in
    rank order (rank j's local keys at [j·L, (j+1)·L): chunk j, then chunk 2·cp−1−j, as the all-gather
    leaves them). Every rank: (2·cp + 1) key chunks in all, so the same steps."""
    chunk = rows // 2

    def key_offset(j):
        return j * rows if j < cp else (2 * cp - 1 - j) * rows + chunk
    return chunk_plan((rank, 2 * cp - 1 - rank), key_offset, chunk)


# one instance per plan, shared by every layer (MindSpore parses and infers the backward once)
_CELLS = {}
_NO_DOCS = Tensor(np.zeros((1, 1), np.float32))


def plan_tile_rows(plan, lanes: float) -> int:
    """The tile rows for `plan` with `lanes` = batch x query heads: `TILE_ROWS` when set, else
    `tiling.tile_rows` of its longest query range (a chunk: every range of a balanced plan is one)."""
    if TILE_ROWS:
        return TILE_ROWS
    return tile_rows(max(q1 - q0 for q0, q1, _ in plan), lanes)


def tiled_cell(plan, documents: bool, lanes: float = 1) -> TiledAttention:
    """The shared `TiledAttention` of `plan` for `lanes` = batch x query heads (its tile size; made
    here, in Python: ms.jit cannot make a cell)."""
    rows, fused = plan_tile_rows(plan, lanes), use_fused()
    key = (plan, documents, rows, fused)
    if key not in _CELLS:
        _CELLS[key] = TiledAttention(plan, documents, rows, fused)
    return _CELLS[key]


def ring_cell(plan, documents: bool, lanes: float, group, block: int) -> RingAttention:
    """The shared `RingAttention` of `plan` on `group` (`block`: the local rows, one rank's keys)."""
    rows, fused = plan_tile_rows(plan, lanes), use_fused()
    key = ("ring", plan, documents, rows, group, block, fused)
    if key not in _CELLS:
        _CELLS[key] = RingAttention(plan, documents, rows, group, block, fused)
    return _CELLS[key]


def run_tiled(cell, q, k, v, documents=None):
    """`cell(q, k, v, ...)` -> `(out, lse)`; `documents` None or `(query_docs, key_docs)` fp32 ids."""
    if documents is None:
        return cell(q, k, v, _NO_DOCS, _NO_DOCS)
    return cell(q, k, v, documents[0], documents[1])


def tiled_attention(plan, q, k, v, documents=None):
    """`TiledAttention(plan)`'s `(out, lse)` (PyNative: the cell is looked up or made here; its tile
    size from q's batch x heads)."""
    lanes = q.shape[0] * q.shape[1] * q.shape[2]
    return run_tiled(tiled_cell(plan, documents is not None, lanes), q, k, v, documents)


def block_attention(q, k, v, causal: bool = False, documents=None):
    """One block's `(out, lse)`: q `[B, h, g, Sq, d]` pre-scaled against all of k `[B, h, Sk, d]`,
    v `[B, h, Sk, dv]`; `causal` (Sq == Sk) for a diagonal block; `documents` None or `(query_docs
    [B, Sq], key_docs [B, Sk])` fp32 ids."""
    plan = ((0, q.shape[3], ((0, k.shape[2], causal),)),)
    return tiled_attention(plan, q, k, v, documents)


def blockwise_attention(q, k_all, v_all, rank: int, cp: int, documents=None):
    """Causal attention of rank `rank`'s local queries against every rank's keys, one `TiledAttention`
    cell (`balanced_plan`). q `[B, h, g, L, d]` pre-scaled, the local L = S / cp tokens (chunk `rank`,
    then chunk 2·cp−1−rank); k_all `[B, h, cp·L, d]`, v_all `[B, h, cp·L, dv]`: rank j's local keys at
    `[j·L, (j+1)·L)` (what an all-gather over the cp group gives, or the ring's blocks put in rank
    order); `documents`: None, or `(query_docs [B, L], key_docs [B, cp·L])` (packed documents)
    -> `[B, h, g, L, dv]` fp32 (fp64 for fp64)."""
    return tiled_attention(balanced_plan(q.shape[3], rank, cp), q, k_all, v_all, documents)[0]


def replicate_kv_heads(x, cp: int):
    """Ulysses with fewer K/V heads than cp ranks (GQA; Megatron-Core's and DeepSpeed-Ulysses' way):
    `[B, L, n_kv, d]` -> `[B, L, cp, d]`, K/V head j repeated cp / n_kv times in a row, so that the
    all-to-all over the heads gives rank r K/V head r // (cp / n_kv), the one its n/cp query heads read
    (all inside one group of n/n_kv). The backward (the broadcast's) sums the replicas' gradients into
    their head. With n_kv >= cp (n_kv divisible by cp, the layout rule) `x` itself."""
    batch, rows, heads, dim = x.shape
    if heads >= cp:
        return x
    if cp % heads:       # ValueError: a graph may raise only Python's own exception types
        raise ValueError(f"context parallel a2a: {heads} K/V heads on this rank cannot be replicated over "
                         f"{cp} ranks (cp must be a multiple of them, or divide them)")
    copies = cp // heads
    whole = ops.broadcast_to(x.reshape(batch, rows, heads, 1, dim), (batch, rows, heads, copies, dim))
    return whole.reshape(batch, rows, cp, dim)


def heads_major_queries(q, num_kv_heads: int):
    """`[B, L, n, d]` -> `[B, n_kv, g, L, d]`: query head h uses K/V head h // g (HF repeat_kv)."""
    batch, rows, heads, dim = q.shape
    return q.reshape(batch, rows, num_kv_heads, heads // num_kv_heads, dim).transpose(0, 2, 3, 1, 4)


def tokens_major_output(out):
    """`[B, n_kv, g, L, dv]` -> `[B, L, n * dv]` (inverse of `heads_major_queries`)."""
    batch, kv_heads, group, rows, dim = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, rows, kv_heads * group * dim)


# ---------------------------------------------------------------------------------------------
# The cell the attention layers hand their core to
# ---------------------------------------------------------------------------------------------
class ContextParallelAttention(nn.Cell):
    """What a `CausalAttention` whose sequence is split over `group` (the cp group) runs instead of its
    own attention over the whole sequence (`CausalAttention.attend` dispatches on `splits_heads`):

    * all_gather: `attend(q, k, v, scale, rope, context)`, the signature of `CausalAttention.attend`, on
      the local tokens; `context` is `(document_ids, position_ids)` of the local tokens (`local_batch`)
      and RoPE rotates at those global positions; K and V travel as one tensor, one all-gather a layer.
      p2p: the same signature; the ring runs inside `RingAttention` (`attend_ring`), whose backward
      passes K|V round again instead of keeping them.
    * a2a (DeepSpeed Ulysses): `to_heads(q, k, v)` trades the sequence split for a head split, one
      all-to-all per tensor over the group, and puts the whole sequence back in order, so the layer's
      own attention (fused kernel or plain path, RoPE at positions 0..S-1) runs on 1/cp of the heads;
      `from_heads(out)` trades back. Query head h still reads K/V head h // g: rank r holds query heads
      [r·n/cp, (r+1)·n/cp) and K/V heads [r·n_kv/cp, (r+1)·n_kv/cp), or with n_kv < cp the one K/V
      head r // (cp/n_kv), replicated (`replicate_kv_heads`). `seq_length`: the whole sequence;
      `lanes`: micro-batch x query heads on this rank, which size the tiles (`tiling.tile_rows`)."""

    def __init__(self, group, seq_length: int, comm_type: str = "all_gather", packed: bool = False,
                 lanes: float = 1):
        super().__init__()
        self.packed = packed          # packed documents: document masks cross the split, positions restart
        if comm_type not in ("all_gather", "p2p", "a2a"):
            raise LayoutError(f"parallel.cp_comm_type={comm_type!r} is not one of all_gather, p2p, a2a")
        self.group = group
        self.cp, self.rank = group.size, group.rank_in_group
        self.splits_heads = comm_type == "a2a"
        self.ring = comm_type == "p2p"
        # all_gather, p2p: the keys cross the split whole (all-gathered or round the ring), so a layer may
        # send a smaller form of them and expand it after (MLA: its compressed latent and shared RoPE key;
        # `gather_keys`)
        self.gathers_keys = comm_type in ("all_gather", "p2p")
        # p2p: each ring step sends this rank's current block to the next rank and receives the previous
        # rank's (rows of one block; an all-to-all-v with one non-zero count each way)
        nxt, prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        self.send_counts = tuple(1 if r == nxt else 0 for r in range(self.cp))
        self.recv_counts = tuple(1 if r == prev else 0 for r in range(self.cp))
        self.seq_length = seq_length
        # all_gather / p2p: the local queries against the keys in rank order, one cell (made here, not under ms.jit)
        self.rows = seq_length // self.cp
        self.tiled = None if self.splits_heads else tiled_cell(balanced_plan(self.rows, self.rank, self.cp), packed,
                                                               lanes)
        # p2p: the ring in one cell (K|V passed round inside it, again in its backward); MLA's ring passes its
        # compressed keys through `gather_keys` and `tiled` instead
        self.ring_attention = ring_cell(balanced_plan(self.rows, self.rank, self.cp), packed, lanes, group,
                                        self.rows) if self.ring else None
        # a2a: the gathered sequence arrives in rank order of the local chunks; these put it in order and back
        ranks_order = np.concatenate([chunk_order(seq_length, self.cp, r) for r in range(self.cp)])
        self.to_natural = Tensor(np.argsort(ranks_order).astype(np.int32))
        self.to_ranks = Tensor(ranks_order.astype(np.int32))

    def to_heads(self, q, k, v, after=None):
        """Ulysses: local tokens of every head `[B, S/cp, heads, d]` -> the whole sequence, in order, of
        this rank's 1/cp of the heads `[B, S, heads/cp, d]`, for q, k and v (in that order on every rank,
        after the tensor `after` when given)."""
        out = ()
        for x in (q, replicate_kv_heads(k, self.cp), replicate_kv_heads(v, self.cp)):
            if out:
                x = ops.depend(x, out[-1])
            elif after is not None:
                x = ops.depend(x, after)
            whole = comm.all_to_all(x, self.group, 2, 1)                   # rank order of the chunks
            if whole.shape[1] != self.seq_length:
                raise ValueError(f"context parallel a2a: a sequence of {whole.shape[1]} tokens, the layer was set "
                                 f"up for {self.seq_length}")
            out += (ops.gather(whole, self.to_natural, 1),)
        return out

    def from_heads(self, out, value_dim: int):
        """Ulysses: `[B, S, heads/cp * dv]` in order -> this rank's tokens of every head `[B, S/cp, heads * dv]`."""
        batch, seq_len = out.shape[0], out.shape[1]
        out = ops.gather(out.reshape(batch, seq_len, -1, value_dim), self.to_ranks, 1)
        out = comm.all_to_all(out, self.group, 1, 2)                        # [B, S/cp, heads, dv]
        return out.reshape(batch, seq_len // self.cp, -1)

    def attend(self, q, k, v, scale: float, rope=None, context=None):
        if context is None:   # ValueError: a graph may raise only Python's own exception types
            raise ValueError("context parallel attention needs the local tokens' global positions: the batch must "
                             "come from ContextParallelRunner (moetrain/parallel/context_parallel.py)")
        position_ids = context[1]
        if rope is not None:
            q, k = rope(q, position_ids), rope(k, position_ids)
        if self.ring:
            return self.attend_ring(q, k, v, scale, context)
        # K and V as one tensor, all-gathered into every rank's, in rank order
        kv, key_docs = self.gather_keys(ops.concat((k, v), -1), context)      # [B, cp * L, n_kv, d + dv]
        k_all, v_all = ops.split(kv, [k.shape[3], v.shape[-1]], -1)
        return self.attend_gathered(q, k_all, v_all, scale, context, key_docs)

    def attend_ring(self, q, k, v, scale: float, context):
        """p2p: the local queries `q [B, L, n, d]` (RoPE applied) against every rank's K|V, passed round
        the ring inside `RingAttention` (its backward keeps only this rank's k and v) -> `[B, L, n·dv]`.
        Packed documents: the keys' document ids go round first (`ring_gather`; one value a token)."""
        q = q * scale
        queries = heads_major_queries(q, k.shape[2])
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        docs = _NO_DOCS
        if self.packed:                                      # before K|V: one order of the ring steps everywhere
            docs = context[0].astype(ms.float32)
            key_docs = self.ring_gather(docs)
            k = ops.depend(k, key_docs)
        else:
            key_docs = _NO_DOCS
        if queries.shape[3] != self.rows:   # ValueError: a graph may raise only Python's own exception types
            raise ValueError(f"context parallel attention: {queries.shape[3]} local tokens, the layer was set up "
                             f"for {self.rows} (seq_length {self.seq_length} / cp {self.cp})")
        out = self.ring_attention(queries, k, v, docs, key_docs)[0]
        return tokens_major_output(out.astype(q.dtype))

    def ring_gather(self, x, after=None):
        """Every rank's `x [B, L, ...]` in rank order `[B, cp·L, ...]` by cp − 1 ring steps (block t is
        rank r − t's), each after the one before (and the first after `after`)."""
        blocks = [x if after is None else ops.depend(x, after)]
        for _ in range(1, self.cp):
            blocks.append(self.ring_shift(blocks[-1]))
        return ops.concat([blocks[(self.rank - j) % self.cp] for j in range(self.cp)], 1)

    def gather_keys(self, x, context):
        """all_gather and p2p: a per-token tensor of the local keys `[B, L, ...]` (K|V, or MLA's
        compressed latent and RoPE key) -> every rank's `[B, cp·L, ...]` in rank order, and the keys'
        document ids `[B, cp·L]` fp32 with packed documents (None otherwise). all_gather: comm.all_gather
        (its backward reduce-scatters the gradient to the owners); p2p: cp − 1 ring steps (`ring_shift`,
        block t is rank r − t's), the blocks put in rank order (the backward sends each block's
        gradient back round the ring)."""
        docs = context[0].astype(ms.float32) if self.packed else None       # ids < 2^24: exact in fp32
        if not self.ring:
            whole = comm.all_gather(x, self.group, 1)
            key_docs = None
            if docs is not None:                                            # after the keys: one order everywhere
                key_docs = comm.all_gather(ops.depend(docs, whole), self.group, 1)
            return whole, key_docs
        blocks, doc_blocks = [x], [docs]
        for _ in range(1, self.cp):                                         # rank r - t's block at step t
            blocks.append(self.ring_shift(blocks[-1]))
            if docs is not None:                                            # after the block: one order everywhere
                doc_blocks.append(self.ring_shift(ops.depend(doc_blocks[-1], blocks[-1])))
        by_rank = [(self.rank - j) % self.cp for j in range(self.cp)]
        whole = ops.concat([blocks[t] for t in by_rank], 1)
        key_docs = None if docs is None else ops.concat([doc_blocks[t] for t in by_rank], 1)
        return whole, key_docs

    def attend_gathered(self, q, k_all, v_all, scale: float, context, key_docs=None):
        """all_gather: the local queries `q [B, L, n, d]` (RoPE applied) against every rank's keys and
        values `k_all [B, cp·L, n_kv, d]`, `v_all [B, cp·L, n_kv, dv]` (`gather_keys`' order), blockwise,
        merged by log-sum-exp -> `[B, L, n·dv]`."""
        q = q * scale
        queries = heads_major_queries(q, k_all.shape[2])
        documents = None if key_docs is None else (context[0].astype(ms.float32), key_docs)
        out = self.blockwise(queries, k_all.transpose(0, 2, 1, 3), v_all.transpose(0, 2, 1, 3), documents)
        return tokens_major_output(out.astype(q.dtype))

    def blockwise(self, queries, k_all, v_all, documents):
        """`blockwise_attention` through this layer's cell: queries `[B, h, g, L, d]`, keys and values
        `[B, h, cp·L, ·]` in rank order -> `[B, h, g, L, dv]`."""
        if queries.shape[3] != self.rows:   # ValueError: a graph may raise only Python's own exception types
            raise ValueError(f"context parallel attention: {queries.shape[3]} local tokens, the layer was set up "
                             f"for {self.rows} (seq_length {self.seq_length} / cp {self.cp})")
        return run_tiled(self.tiled, queries, k_all, v_all, documents)[0]

    def whole_context(self, context):
        """Ulysses: the attention context of the whole sequence, in order (packed documents: document
        ids and positions all-gathered over the group; otherwise None: one document, positions 0..S−1)."""
        if not self.packed:
            return None
        local = ops.stack((context[0], context[1]), -1).astype(ms.float32)  # ids and positions < 2^24: exact
        whole = ops.gather(comm.all_gather(local, self.group, 1), self.to_natural, 1).astype(ms.int32)
        return whole[:, :, 0], whole[:, :, 1]

    def ring_shift(self, block):
        """One ring step: `block` to the next rank of the cp group, the previous rank's block back
        (`comm.all_to_all_v` with one row each way: Ascend's AlltoAllV sends only that row; elsewhere
        comm derives it, on the CPU from AllReduce). Backward: the gradient goes the other way round."""
        shape = block.shape
        moved = comm.all_to_all_v(block.reshape(1, -1), self.send_counts, self.recv_counts, self.group)
        return moved.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Applying it to a model, and the step runner
# ---------------------------------------------------------------------------------------------
def attention_cells(model) -> List[nn.Cell]:
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, CausalAttention)]


def parallelize_context(model, cfg, pctx) -> int:
    """Split `model`'s sequences over the cp group: every `CausalAttention` gets a
    `ContextParallelAttention`, and every MoE layer reduces its per-micro-batch and per-sequence
    routing statistics over the cp group. Returns the number of attention layers switched (0 and
    nothing changed when cp = 1). Call after `parallelize_moe` (it sets the aux-loss scope)."""
    if pctx.cp == 1:
        return 0
    group = pctx.group("cp")
    cells = attention_cells(model)
    if not cells:
        raise LayoutError(f"parallel.context_parallel={pctx.cp}: model {type(model).__name__} has no causal attention "
                          f"layer (moetrain.layers.CausalAttention) to split the sequence for; set it to 1")
    seq_length = cfg.data.seq_length or cfg.model.seq_length
    packed = cfg.data.reset_attention_mask or cfg.data.reset_position_ids
    # the tiles' size: micro-batch x this rank's query heads (the same on every cp rank: equal steps)
    lanes = max(1, cfg.micro_batch_size) * getattr(cfg.model, "num_heads", 1) / pctx.tp
    for cell in cells:
        cell.context_parallel = ContextParallelAttention(group, seq_length, cfg.parallel.cp_comm_type, packed, lanes)
    if getattr(model, "label_lookahead", 0):   # a head reading labels ahead (MTP): which positions it counts
        model.hold_positions(chunk_order(seq_length, pctx.cp, pctx.cp_rank), seq_length)
    for layer in moe_layers(model):
        if layer.aux_loss_scope == "micro_batch":   # the micro-batch's tokens are those of the whole cp group
            layer.set_aux_loss_scope("global", group)
        layer.set_sequence_group(group)
    return len(cells)


class ContextParallelRunner:
    """A step runner (the interface of `runner.MicroBatchRunner`) that gives `inner` this rank's part
    of every micro-batch (`local_batch`) and checks, every step, that the tokens the loss is averaged
    over add up to the global batch's (`TokenCountError` otherwise). Anything else is `inner`'s.
    `lookahead`: the model's `label_lookahead` (`local_batch`)."""

    def __init__(self, inner, pctx, global_tokens: int, lookahead: int = 0):
        self.inner, self.pctx, self.global_tokens, self.lookahead = inner, pctx, global_tokens, lookahead

    def local(self, batch):
        return local_batch(batch, self.pctx.cp, self.pctx.cp_rank, self.lookahead)

    def train_step(self, batches, scale):
        local = [self.local(b) for b in batches]
        check_token_count([np.asarray(b[1]).size for b in batches], [main_labels(b[1]).size for b in local],
                          self.pctx.cp, self.pctx.dp, self.global_tokens)
        return self.inner.train_step(local, scale)

    def evaluate(self, batch):
        return self.inner.evaluate(self.local(batch))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def check_token_count(global_counts: Sequence[int], local_counts: Sequence[int], cp: int, dp: int,
                      global_tokens: int) -> None:
    """The loss of each micro-batch is the mean over its local labels; the trainer averages them over
    micro-batches and the dp x cp ranks with equal weights. That is the mean over the global batch's
    tokens only if every rank holds 1/cp of each micro-batch's labels and the micro-batches of all dp
    ranks hold the global batch: raise `TokenCountError` (naming the counts) otherwise."""
    for i, (whole, mine) in enumerate(zip(global_counts, local_counts)):
        if mine * cp != whole:
            raise TokenCountError(f"context parallel: micro-batch {i} has {whole} label tokens but this rank's loss "
                                  f"averages over {mine}, not 1/{cp} of them: the ranks' losses would be weighted "
                                  f"unequally (moetrain/parallel/context_parallel.py)")
    averaged = sum(local_counts) * cp * dp
    if averaged != global_tokens:
        raise TokenCountError(f"context parallel: the loss is averaged over {averaged} tokens "
                              f"(local {sum(local_counts)} "
                              f"x cp {cp} x dp {dp}), but the global batch holds {global_tokens} "
                              f"(train.global_batch_size x seq_length); check data.seq_length against model.seq_length")
