"""Data parallelism and optimizer sharding (ZeRO) over flat gradient buffers.

`OptimizerStep` owns everything between "this rank's gradients" and "updated parameters". Like
Megatron-Core's distributed optimizer it works on a few contiguous buffers instead of one tensor
per parameter: the parameters are ordered buffer by buffer, and each buffer holds the gradients
of parameters that are reduced over the same group (dp, or edp for expert weights), count the
same number of times in the global norm and share a weight-decay flag.

    grad step    (jit)  flatten(grads): per buffer one concat;  ZeRO-2: packed and reduce-scattered
                        bucket by bucket in backward order, so only this rank's shard lives between
                        micro-batches and a bucket's per-parameter gradients are freed as the
                        backward goes (`_bucketed_rows`)
    accumulate   (jit)  buffer += buffer
    prepare      (jit)  sequence-parallel grads summed over tp; all-reduce (level 0) or
                        reduce-scatter (level 1) over the group; unscale; global norm over the world
                        (finite check); clip
    apply        (jit)  level 0: the optimizer on the parameters (views of the buffer)
                        level 1/2: the optimizer on this rank's fp32 master rows, then all-gather
                        the rows into the parameters

Where moetrain's CPU kernels run and the optimizer is fp32 AdamW / Adam (`optimizer.fused: off`
turns it off), prepare and apply touch the buffers only twice:
`SumOfSquares` per buffer for the norm (summed in float64 up to the world total, so the norm does
not depend on how the layout cuts the gradients), then `FusedAdamW` per buffer, which takes unscale x clip as
one gradient multiplier and updates the parameters (or the ZeRO master row) and both moments in
place. No scaled, clipped or per-parameter copy of the gradients is made (the plain path makes
three); the moments stay the optimizer's per-parameter Parameters, so checkpoints are the same.

Buffer layout. At level 0 a buffer is the parameters' gradients flattened and concatenated. With
ZeRO over a group of G ranks each parameter of n elements is padded to G * ceil(n / G) and the
buffer is a [G, S] matrix, S = sum of ceil(n / G): row r is rank r's shard of every parameter, so
a reduce-scatter along rows gives each rank its row, and the checkpoint's per-parameter ZeRO
ranges are the same at every level.

Why buffers: compile time. Inside `ms.jit`, MindSpore 2.10 analyses Python loops, list updates
and many-way `ops.split` as nested calls, superlinear in the number of parameters (a 12-layer GPT
hit "Exceed function call depth limit 1000"). Per-parameter work here goes through `ops.HyperMap`,
which stays linear; everything else runs once per buffer.

Gradients are SUMMED over replicas here; the trainer's `inv_scale` divides by dp (and by
micro-batches and the loss scale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, ops

from moetrain import kernels
from moetrain.kernels.ops import FusedAdamW, SumOfSquares
from moetrain.optim import build_optimizer, decays
from moetrain.distributed import comm
from moetrain.distributed.sharding import MASTER_PREFIX, param_role, reduction_group_kind, shard_spec, tp_copies

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}

# Slices below are `x[a:b]` (StridedSlice), never `ops.slice`: MindSpore 2.10's CPU Slice kernel refuses
# an input over 2**31 - 1 bytes (the 671B head and embedding, 3.7 GB: docs/parallel_engine.md).
# ---- per-parameter pieces of the graph (ops.HyperMap applies them over tuples, linearly) ----------
_FLATTEN = ops.MultitypeFuncGraph("flatten")
_AS_ROWS = ops.MultitypeFuncGraph("as_rows")
_TAKE = ops.MultitypeFuncGraph("take")
_ASSIGN_COLUMNS = ops.MultitypeFuncGraph("assign_columns")


@_FLATTEN.register("Tensor")
def _flatten(grad):
    return grad.reshape(-1)


@_AS_ROWS.register("Tensor", "Number", "Number")
def _as_rows(grad, pad, rows):
    """[n] padded with `pad` zeros, as [rows, (n + pad) / rows]: row r is rank r's shard."""
    flat = grad.reshape(-1)
    if pad:
        flat = ops.concat((flat, ops.zeros((pad,), flat.dtype)))
    return flat.reshape(rows, -1)


@_TAKE.register("Tensor", "Number", "Number", "Tuple")
def _take(flat, offset, size, shape):
    return flat[offset:offset + size].reshape(shape)


@_ASSIGN_COLUMNS.register("Tensor", "Number", "Number", "Number", "Tensor")
def _assign_columns(matrix, offset, shard, numel, param):
    """param <- the first `numel` elements of columns [offset, offset + shard) of `matrix`, row-major."""
    rows = matrix.shape[0]
    if matrix.shape[1] == shard and rows * shard == numel and matrix.dtype == param.dtype:
        return ops.assign(param, matrix.reshape(param.shape))     # the whole matrix: no sliced copy
    full = matrix[:, offset:offset + shard].reshape(-1)
    if rows * shard != numel:
        full = full[:numel]
    return ops.assign(param, full.reshape(param.shape).astype(param.dtype))


@dataclass
class FlatBuffer:
    """Parameters `[start, end)` of `OptimizerStep.params`, reduced and updated as one tensor."""

    kind: str                        # reduction group kind: "dp" or "edp"
    group: object                    # its Group
    start: int
    end: int
    shapes: Tuple[Tuple[int, ...], ...]
    numels: Tuple[int, ...]
    shards: Tuple[int, ...]          # elements per row: n (level 0) or ceil(n / G) (ZeRO)
    offsets: Tuple[int, ...]         # where each parameter's shard starts in a row
    rows: int                        # 1 (level 0) or G (ZeRO)
    norm_weight: float               # 1 / copies of each gradient element over the world
    decay: bool
    summed_over: Tuple[str, ...]     # group kinds whose ranks' gradients are added first: "tp" for
                                     # sequence-parallel norms, the tied group for tied weights
    pieces: Tuple[int, ...] = ()     # level 0: the all-reduce's piece lengths (`piece_sizes`)
    buckets: Tuple[Tuple[int, int], ...] = ()   # ZeRO with G > 1: [start, end) parameter ranges of the
                                     # buffer (relative), each reduce-scattered (level 2) and
                                     # all-gathered (levels 1, 2) on its own

    @property
    def row(self) -> int:
        return sum(self.shards)

    @property
    def pads(self) -> Tuple[int, ...]:
        return tuple(self.rows * s - n for s, n in zip(self.shards, self.numels))


def piece_sizes(n: int, bucket_bytes: int) -> Tuple[int, ...]:
    """Lengths of the pieces a buffer of `n` elements is all-reduced in: at most `bucket_bytes` of
    fp32 each (at most 64 pieces), as equal as they can be.

    Computed here, in Python, never inside `ms.jit`: MindSpore 2.10's graph compiler evaluates
    integer `//` and `%` through float32 (measured: `16777219 // 2` gives 8388610, `16777219 % 2`
    gives -1, also for literals and shapes), which is wrong once the buffer has more than 2^24
    elements: worked out in the graph, the sizes of 176,160,768 elements in 27 pieces summed to
    176,160,771 and `ops.split` refused them (DeepSeek-V3-671B, docs/parallel_engine.md)."""
    pieces = max(1, min(64, math.ceil(n * 4 / bucket_bytes)))
    return tuple(n // pieces + (1 if i < n % pieces else 0) for i in range(pieces))


def bucket_ranges(sizes: Sequence[int], bucket_bytes: int) -> Tuple[Tuple[int, int], ...]:
    """Consecutive [start, end) ranges of items of `sizes` bytes, each at most `bucket_bytes`
    unless one item alone is larger."""
    ranges, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > bucket_bytes:
            ranges.append((start, i))
            start, total = i, 0
        total += size
    if sizes:
        ranges.append((start, len(sizes)))
    return tuple(ranges)


def _copies_over_world(param, pctx, group, sharded: bool) -> int:
    """How many ranks hold an identical copy of this rank's gradient of `param` once reduced."""
    copies = (1 if sharded else group.size) * tp_copies(shard_spec(param), reduction_group_kind(param), pctx)
    tied = param_role(param).tied_group
    if tied:                                   # e.g. the embedding on the first and last stage
        copies *= pctx.group(tied).size
    return copies


class OptimizerStep:
    """Gradient synchronisation + unscale/clip + optimizer (+ ZeRO) for one optimizer step.

    `params` (in buffer order: build the gradient function over THIS order) and `buffers`
    describe the layout; the trainer calls `flatten` inside its jitted grad step, `accumulate` (module
    function) between micro-batches and `__call__` once per step."""

    def __init__(self, params: Sequence[Parameter], optimizer_cfg, parallel_cfg, pctx, clip: float, jit: bool,
                 fused: bool = None):
        self.pctx = pctx
        self.level = parallel_cfg.optimizer_shard
        self.clip = clip
        self.reduce_dtype = _DTYPES[parallel_cfg.grad_reduce_dtype]
        # the CPU's AllReduce has no bf16: reduce fp32 tensors holding bf16 values (docs/precision.md)
        self.emulated_bf16 = self.reduce_dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU"
        self.bucket_bytes = max(1, int(parallel_cfg.grad_bucket_mb * 2 ** 20))
        self.world = pctx.group("world")
        self.params, self.buffers = self._layout(list(params))
        self.bucket_order = self._bucket_order(list(params))
        # per buffer, where its buckets' reduced pieces sit in `bucket_order`, in buffer order
        self._bucket_slots = tuple(tuple(j for _, j in sorted((start, j) for j, (k, start, _, _, _) in
                                                               enumerate(self.bucket_order) if k == i))
                                   for i in range(len(self.buffers)))
        self.hyper = ops.HyperMap()
        if self.level == 0:
            self.optimizer = build_optimizer(self.params, optimizer_cfg)
        else:
            self.param_tuples = [ParameterTuple(self.params[b.start:b.end]) for b in self.buffers]
            self.masters = [Parameter(Tensor(self._own_row(b)), name=f"{MASTER_PREFIX}buffer{i}")
                            for i, b in enumerate(self.buffers)]
            self.optimizer = build_optimizer(self.masters, optimizer_cfg, decay_flags=[b.decay for b in self.buffers])
            self._gather_buckets = [self._gather_layout(b) for b in self.buffers]
        # fused: None reads optimizer.fused (auto / on: wherever the kernels serve the optimizer;
        # off: the plain path); tests pass False / True
        if fused is None:
            fused = (optimizer_cfg.fused != "off"
                     and _fused_optimizer_runs(optimizer_cfg, self.optimizer.params))
        self.fused = fused
        if self.fused:
            self._bind_fused_kernels(optimizer_cfg)
        # The fused path is a few kernel calls per buffer, so it runs in PyNative: compiled, its graphs
        # would keep their last inputs, the step's flat gradient buffers, alive through the next step's
        # backward (measured on benchmarks/bench.py's MoE model: peak RSS 1,228-1,243 -> 1,068-1,072 MB, the
        # step time unchanged, paired ratio 1.003 over 24 alternating steps).
        wrap = ms.jit if jit and not self.fused else (lambda fn: fn)
        self._prepare = wrap(self._prepare_fused_impl if self.fused else self._prepare_impl)
        self._apply = wrap(self._apply_fused_impl if self.fused else self._apply_impl)

    def _bind_fused_kernels(self, optimizer_cfg) -> None:
        """One FusedAdamW per buffer over the tensors the optimizer updates for it: the buffer's
        parameters (level 0) or its master row (ZeRO), with the optimizer's own moments."""
        opt = self.optimizer
        self.sum_of_squares = SumOfSquares()
        self.fused_groups = []
        for i, b in enumerate(self.buffers):
            start, end = (b.start, b.end) if self.level == 0 else (i, i + 1)
            kernel = FusedAdamW(optimizer_cfg.beta1, optimizer_cfg.beta2, optimizer_cfg.eps,
                                decoupled=optimizer_cfg.name == "adamw", tensors=end - start)
            size = sum(int(np.prod(p.shape)) for p in opt.params[start:end])
            decay = optimizer_cfg.weight_decay if b.decay else 0.0
            self.fused_groups.append((kernel, tuple(opt.params[start:end]), tuple(opt.exp_avg[start:end]),
                                      tuple(opt.exp_avg_sq[start:end]), Tensor(np.array([size], np.int64)),
                                      Tensor(np.array([decay], np.float32))))

    # ---- layout ---------------------------------------------------------------------------
    def _layout(self, params: List[Parameter]) -> Tuple[List[Parameter], List[FlatBuffer]]:
        sharded = self.level > 0
        keyed: Dict[tuple, List[Parameter]] = {}
        for p in params:
            kind = reduction_group_kind(p)
            group = self.pctx.group(kind)
            role = param_role(p)
            summed_over = tuple(k for k, on in (("tp", role.sequence_parallel), (role.tied_group, role.tied_group))
                                if on and self.pctx.group(k).size > 1)
            key = (kind, _copies_over_world(p, self.pctx, group, sharded), decays(p), summed_over)
            keyed.setdefault(key, []).append(p)
        ordered, buffers = [], []
        for (kind, copies, decay, summed_over), members in keyed.items():
            group = self.pctx.group(kind)
            rows = group.size if sharded else 1
            numels = tuple(int(np.prod(p.shape)) for p in members)
            shards = tuple(math.ceil(n / rows) for n in numels)
            offsets = tuple(int(o) for o in np.cumsum((0,) + shards[:-1]))
            buckets = bucket_ranges([rows * s * 4 for s in shards], self.bucket_bytes) if rows > 1 else ()
            buffers.append(FlatBuffer(kind, group, len(ordered), len(ordered) + len(members),
                                      tuple(tuple(int(d) for d in p.shape) for p in members), numels, shards,
                                      offsets, rows, 1.0 / copies, decay, summed_over,
                                      () if sharded else piece_sizes(sum(numels), self.bucket_bytes), buckets))
            ordered += members
        return ordered, buffers

    def _bucket_order(self, given: List[Parameter]) -> Tuple[tuple, ...]:
        """ZeRO-2's buckets as (buffer, start, end, pads, columns) in the order the backward completes
        them: by descending position of their first parameter in `given` (the model's order, which
        its backward runs in reverse), the LM head's first (`ParamRole.lm_head`: its gradient is the
        backward's first, though DeepSeek's MTP blocks come after it; ordered by place it waited
        for theirs, 3.45 GiB held through the MTP block's backward on the 671B last stage). The
        same on every rank of a group, so are its collectives.

        `columns`: the first and the last bucket, when one parameter over `grad_bucket_mb` (the last
        stage's LM head, the first stage's embedding), are reduce-scattered a few columns of their
        [G, s] matrix at a time, (first, count) ranges computed here, not in the graph
        (`piece_sizes`): the collective's output is then a piece, not the parameter's size (the CPU's
        reduce-scatter is an all-reduce and a slice). Only those two: MindSpore runs a chain of such
        pieces behind the backward's pending work, so chunking a bucket in the middle held the
        gradients of the layers around it longer (measured: 12 layers chunked in 4 peaked at 35.7 MB
        against 13.4 MB); a head of 32 MiB chunked before 12 layers of 4 MiB peaked 3.5 MiB (about a
        layer) above it unchunked, with the solo stand-in whose reduce-scatter holds no full output."""
        # the LM head's gradient is complete first (DeepSeek's MTP blocks follow it in the model's order)
        position = {id(p): len(given) if param_role(p).lm_head else i for i, p in enumerate(given)}
        found = []
        for i, b in enumerate(self.buffers):
            for start, end in b.buckets:
                found.append((position[id(self.params[b.start + start])], i, start, end, b.pads[start:end], ()))
        found = [entry[1:] for entry in sorted(found, key=lambda f: -f[0])]
        for k in sorted({0, len(found) - 1}) if found else ():
            i, start, end, pads, _ = found[k]
            b = self.buffers[i]
            if end - start == 1 and b.rows * b.shards[start] * 4 > self.bucket_bytes:
                widths = piece_sizes(b.shards[start], max(4, self.bucket_bytes // b.rows))   # at most 64
                found[k] = (i, start, end, pads, tuple(zip(np.cumsum((0,) + widths[:-1]).tolist(), widths)))
        return tuple(found)

    def _gather_layout(self, b: FlatBuffer):
        """Per bucket of `b` (the whole buffer where it has none): (first column, columns, each
        parameter's column offset in it, shards, numels, its ParameterTuple or None for all)."""
        if not b.buckets:
            return [(0, b.row, b.offsets, b.shards, b.numels, None)]
        out = []
        for start, end in b.buckets:
            lo = b.offsets[start]
            width = b.offsets[end - 1] + b.shards[end - 1] - lo
            whole = start == 0 and end == b.end - b.start
            out.append((lo, width, tuple(o - lo for o in b.offsets[start:end]), b.shards[start:end],
                        b.numels[start:end], None if whole else ParameterTuple(self.params[b.start + start:b.start + end])))
        return out

    def _own_row(self, b: FlatBuffer) -> np.ndarray:
        """This rank's row of buffer `b`'s [G, S] matrix, from the parameters' current values."""
        r = b.group.rank_in_group
        pieces = []
        for p, n, s in zip(self.params[b.start:b.end], b.numels, b.shards):
            flat = np.zeros(b.rows * s, np.float32)
            flat[:n] = p.asnumpy().reshape(-1)
            pieces.append(flat[r * s:(r + 1) * s])
        return np.concatenate(pieces)

    # ---- inside the grad step (jit) --------------------------------------------------------
    def flatten(self, grads):
        """Per-parameter gradients (in `params` order) -> one tensor per buffer. ZeRO-2 reduce-
        scatters here, once per micro-batch, so only this rank's row is accumulated, and does so
        bucket by bucket in backward order (`_bucketed_rows`)."""
        if self.level == 2 and self.bucket_order:
            return self._bucketed_rows(grads)
        out = ()
        for b in self.buffers:
            part = grads[b.start:b.end]
            if b.rows == 1:
                flat = ops.concat(self.hyper(_FLATTEN, part))
            else:
                flat = ops.concat(self.hyper(_AS_ROWS, part, b.pads, (b.rows,) * len(part)), axis=1).reshape(-1)
            if self.level == 2:
                flat = self._reduce(flat, b, "reduce_scatter", out)
            out += (flat,)
        return out

    def _bucketed_rows(self, grads):
        """ZeRO-2: each bucket (at most `grad_bucket_mb` of its [G, s] rows, or one parameter) packed
        and reduce-scattered on its own, in the order the backward completes them, then this rank's
        pieces concatenated into its row of each buffer (the same values as packing the buffer whole:
        every element takes the same ops). Megatron-Core's distributed optimizer reduces bucket by
        bucket during the backward; here the jitted grad step holds the collectives, and MindSpore's
        graph runs each pack as soon as its gradients exist, so a bucket's per-parameter gradients are
        freed before the backward of the layers below (measured: the pool's peak falls from every
        gradient plus the buffer to about one layer's, tests/test_optimizer_step.py). The chain of
        `depend`s keeps every rank's collectives in one order."""
        reduced = ()
        for i, start, end, pads, columns in self.bucket_order:
            b = self.buffers[i]
            part = grads[b.start + start:b.start + end]
            if columns:     # the first or last bucket, one large parameter: its [G, s] matrix a few columns at a time
                matrix = _as_rows(part[0], pads[0], b.rows)
                pieces = ()
                for first, count in columns:
                    previous = pieces if pieces else reduced
                    flat = matrix[:, first:first + count].reshape(-1)
                    pieces += (self._reduce(flat, b, "reduce_scatter", previous),)
                reduced += (ops.concat(pieces),)
                continue
            if len(part) == 1 and not pads[0]:     # one parameter: its gradient is the bucket (no copy)
                flat = part[0].reshape(-1)
            else:
                flat = ops.concat(self.hyper(_AS_ROWS, part, pads, (b.rows,) * len(part)), axis=1).reshape(-1)
            reduced += (self._reduce(flat, b, "reduce_scatter", reduced),)
        out = ()
        for i, b in enumerate(self.buffers):
            if not b.buckets:       # a group of one rank: the buffer is its row
                out += (ops.concat(self.hyper(_FLATTEN, grads[b.start:b.end])),)
                continue
            pieces = ()
            for j in self._bucket_slots[i]:
                pieces += (reduced[j],)
            out += (pieces[0] if len(pieces) == 1 else ops.concat(pieces),)
        return out

    def _reduce(self, flat, b: FlatBuffer, op: str, previous):
        """`op` ("all_reduce" or "reduce_scatter") over the buffer's group in the reduce dtype, after
        the previous buffers' ones. `op` is a string because a string comparison is folded when the
        graph is compiled: `collective is comm.all_reduce` (a function passed in) was not, so ms.jit
        compiled the all-reduce branch at ZeRO-1/2 too and failed on it (docs/parallel_engine.md)."""
        if b.group.size == 1:
            return flat
        if previous:   # independent collectives: keep every rank's order the same
            flat = ops.depend(flat, previous[-1])
        if self.emulated_bf16:
            flat = flat.astype(ms.bfloat16).astype(ms.float32)
        elif self.reduce_dtype != ms.float32:
            flat = flat.astype(self.reduce_dtype)
        if op == "all_reduce":
            flat = self._chunked_all_reduce(flat, b.group, b.pieces)
        else:
            flat = comm.reduce_scatter(flat, b.group)
        if self.emulated_bf16:   # the sum as a bf16 collective delivers it
            return flat.astype(ms.bfloat16).astype(ms.float32)
        return flat.astype(ms.float32)

    def _chunked_all_reduce(self, flat, group, sizes):
        """All-reduce in the pieces `sizes` (`piece_sizes`: few, large collectives)."""
        if len(sizes) == 1:
            return comm.all_reduce(flat, group)
        done = []
        for chunk in ops.split(flat, sizes):
            if done:
                chunk = ops.depend(chunk, done[-1])
            done.append(comm.all_reduce(chunk, group))
        return ops.concat(done)

    # ---- the step -------------------------------------------------------------------------
    def _reduced(self, flats):
        """The buffers summed over their groups (level 0) or reduce-scattered (level 1)."""
        out = ()
        for b, flat in zip(self.buffers, flats):
            for kind in b.summed_over:
                if out:
                    flat = ops.depend(flat, out[-1])
                flat = comm.all_reduce(flat, self.pctx.group(kind))
            if self.level == 0:
                flat = self._reduce(flat, b, "all_reduce", out)
            elif self.level == 1:
                flat = self._reduce(flat, b, "reduce_scatter", out)
            out += (flat,)
        return out

    def _global_norm(self, local_sq, out):
        """(norm, finite, clip factor or None) from this rank's weighted squared norm."""
        if self.world.size > 1:
            local_sq = comm.all_reduce(ops.depend(local_sq, out[-1]).reshape(1), self.world)[0]
        # An inf or nan anywhere makes the sum of squares non-finite (so does a sum past fp32 range,
        # which clipping would turn into a zero update anyway): no separate all_finite pass.
        finite = ops.isfinite(local_sq)
        norm = ops.sqrt(local_sq)
        factor = ops.minimum(self.clip / (norm + 1e-6), 1.0) if self.clip > 0 else None
        return norm, finite, factor

    def _prepare_impl(self, flats, inv_scale):
        out = tuple(flat * inv_scale for flat in self._reduced(flats))
        # squared norm of what this rank holds, each copy weighted by 1/copies, summed over the world
        local_sq = ops.zeros((), ms.float32)
        for b, flat in zip(self.buffers, out):
            local_sq = local_sq + (flat * flat).sum() * b.norm_weight
        norm, finite, factor = self._global_norm(local_sq, out)
        if factor is not None:
            out = tuple(flat * factor for flat in out)
        return out, norm, finite

    def _prepare_fused_impl(self, flats, inv_scale):
        """As `_prepare_impl`, but the buffers stay as reduced: the unscale and the clip factor come
        back as one multiplier `[1]` for FusedAdamW, and the norm is taken of the unscaled sums in
        float64 (`_world_sum_of_squares`), so the same gradients give the same float32 norm, and
        clip factor, on every layout."""
        out = self._reduced(flats)
        total = self._world_sum_of_squares(out) * float(inv_scale.asnumpy()) ** 2
        finite = bool(np.isfinite(np.float32(total)))   # as before: a float32 sum past its range is not finite
        norm = Tensor(np.float32(np.sqrt(total)) if finite else np.float32(np.inf), ms.float32)
        factor = ops.minimum(self.clip / (norm + 1e-6), 1.0) if self.clip > 0 else None
        scale = inv_scale if factor is None else inv_scale * factor
        return out, norm, Tensor(finite), scale.reshape(1)

    def _world_sum_of_squares(self, out) -> float:
        """The weighted sum of squares of every gradient over the world, in float64 from the kernel's
        per-buffer (hi, lo) sums to the ranks' total (one AllGather of each rank's (hi, lo)). In
        float32 it depended on how the layout cut the model into buffers and ranks: a pipeline's
        norm was an ulp off the same gradients' norm on its dp control, and through the clip factor
        so was every update (issue 30's pp2.dp2.ep2 row)."""
        local = 0.0
        for b, flat in zip(self.buffers, out):
            hi, lo = self.sum_of_squares(flat).asnumpy().astype(np.float64)
            local += (hi + lo) * b.norm_weight
        if self.world.size == 1:
            return local
        hi = np.float32(local)
        lo = np.float32(local - np.float64(hi)) if np.isfinite(hi) else np.float32(0.0)
        parts = comm.all_gather(Tensor(np.array([hi, lo], np.float32)), self.world).asnumpy()
        return float(np.sum(parts.astype(np.float64)))

    def _apply_impl(self, flats, lr, step):
        if self.level == 0:
            grads = ()
            for b, flat in zip(self.buffers, flats):
                grads += self.hyper(ops.partial(_TAKE, flat), b.offsets, b.numels, b.shapes)
            self.optimizer(grads, lr, step)
            return lr
        self.optimizer(flats, lr, step)
        self._gather_masters()
        return lr

    def _apply_fused_impl(self, flats, lr, step, grad_scale):
        for (kernel, params, exp_avgs, exp_avg_sqs, ends, decay), flat in zip(self.fused_groups, flats):
            kernel(params, exp_avgs, exp_avg_sqs, flat, lr, step, grad_scale, ends, decay)   # in place
        if self.level:
            self._gather_masters()
        return lr

    def _gather_masters(self):
        """ZeRO: all-gather every buffer's updated master rows into the parameters, bucket by bucket
        (the buckets of `flatten`): a bucket's [G, s] is the most that is gathered at once, never a
        whole buffer (the 671B first stage's dense buffer is 10 GiB)."""
        gathered = None
        for b, master, params, buckets in zip(self.buffers, self.masters, self.param_tuples, self._gather_buckets):
            for lo, width, offsets, shards, numels, members in buckets:
                row = master if width == b.row else master[lo:lo + width]
                row = row if gathered is None else ops.depend(row, gathered)
                gathered = comm.all_gather(row, b.group) if b.group.size > 1 else row
                matrix = gathered.reshape(b.rows, width)
                self.hyper(ops.partial(_ASSIGN_COLUMNS, matrix), offsets, shards, numels,
                           params if members is None else members)

    def __call__(self, flats, lr: float, step: int, inv_scale: float):
        """Returns (grad_norm, finite); the optimizer runs only when every gradient is finite."""
        prepared = self._prepare(ms.mutable(tuple(flats)), Tensor(inv_scale, ms.float32))
        flats, norm, finite = prepared[:3]
        finite = bool(finite)
        if finite and self.fused:
            self._apply(ms.mutable(flats), Tensor([lr], ms.float32), Tensor([float(step)], ms.float32), prepared[3])
        elif finite:
            self._apply(ms.mutable(flats), Tensor(lr, ms.float32), Tensor(step, ms.int32))
        return float(norm), finite

    # ---- state ----------------------------------------------------------------------------
    def state_parameters(self) -> List[Parameter]:
        """Optimizer state held by this rank (ZeRO: the shards, with the fp32 masters)."""
        return self.optimizer.state_parameters() + (list(self.masters) if self.level else [])

    def optimizer_state_bytes(self) -> int:
        return sum(int(np.prod(p.shape)) * p.itemsize for p in self.optimizer.state_parameters())

    def checkpoint_pieces(self):
        """`(key, param, buffer, index, flat_range, state)` of every optimizer tensor this rank
        holds, per parameter, with layout-independent keys: `<state prefix>.<parameter name>` for
        moments, `zero_master.<parameter name>` for ZeRO masters. `state` is the Parameter holding
        the values (at ZeRO: a flat row; `flat_range` is the parameter's [start, stop) in it)."""
        pieces = []
        if self.level == 0:
            by_name = {p.name: p for p in self.params}
            for state in self.optimizer.state_parameters():
                pieces.append((state.name, by_name[state.name.split(".", 1)[1]], None, None, None, state))
            return pieces
        for state in self.state_parameters():
            prefix, _, buffer_name = state.name.rpartition(MASTER_PREFIX)
            i = int(buffer_name[len("buffer"):])
            b = self.buffers[i]
            for j, param in enumerate(self.params[b.start:b.end]):
                key = f"{prefix}{param.name}" if prefix else f"{MASTER_PREFIX}{param.name}"
                pieces.append((key, param, b, j, (b.offsets[j], b.offsets[j] + b.shards[j]), state))
        return pieces


def _fused_optimizer_runs(optimizer_cfg, params) -> bool:
    """Whether FusedAdamW serves this step: AdamW or Adam on fp32 tensors, with the kernels here."""
    if optimizer_cfg.name not in ("adamw", "adam") or any(p.dtype != ms.float32 for p in params):
        return False
    return kernels.available()


def accumulate(acc, flats):
    """Gradient accumulation over micro-batches: buffer-wise sums (jit it; few buffers)."""
    return tuple(a + f for a, f in zip(acc, flats))


def reduce_host_values(values: Dict[str, object], pctx, summed: Sequence[str]) -> Dict[str, object]:
    """Sum (keys in `summed`) or average numpy values over the data-parallel group (dp x cp ranks: a
    context-parallel rank's loss is the mean over its equal share of the tokens, moetrain/distributed/topology.py)."""
    keys = list(values)
    arrays = [np.asarray(values[k], np.float64) for k in keys]
    flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32)
    total = comm.all_reduce(Tensor(flat), pctx.group("dp")).asnumpy().astype(np.float64)
    out, offset = {}, 0
    for key, array in zip(keys, arrays):
        part = total[offset:offset + array.size].reshape(array.shape)
        offset += array.size
        out[key] = part if key in summed else part / pctx.dp_cp
    return out
