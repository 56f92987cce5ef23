"""Pipeline parallelism: the model cut into stages by layers, run with a 1F1B, GPipe, interleaved
1F1B or zero-bubble (ZB-H1, ZB-V) schedule.

    stage 0: embed + layers[0:a]    stage s: layers[a:b]    stage P-1: layers[..:L] + head and loss

Every rank constructs only its stage: each of its model chunks once, with that chunk's layers (named
as in the whole model) and the embedding and head cells only where its virtual stage keeps them
(`moetrain.build.build_model(cfg, pctx, chunk)`, `chunk_parts`); `keep_stage` (moetrain/modeling.py)
then drops only what a family that ignores `building_part` built anyway. The kept parameters are
generated as the one-process values (`moetrain.param_init`), so the split model starts exactly where
a one-process run starts, tied embeddings included. The
stage runs the model's own pieces (`embed_tokens`, `run_layers`, `head_loss`): no model code here.

Model chunks. Interleaved 1F1B (`parallel.pp_interleave_num: v`) and ZB-V (always 2) put several
chunks on a stage: the layers are split into P·v virtual stages (`parallel.pipeline_layers` lists
them, in virtual-stage order) and chunk c of stage s runs virtual stage c·P + s (ZB-V: s and
2P-1-s, a V whose turn is on stage P-1 and whose loss is on stage 0). Each chunk is a model built
once with that chunk's layers only (`more_models(c)`); ZB-V's first and last chunk share one tied
embedding.

Schedules (`build_schedules`) are per-stage instruction lists (`Op`) of forward, backward, weight
and exchange instructions over (chunk, micro-batch). 1F1B and GPipe: Megatron's order with its
merged two-way exchanges; 1F1B stage s runs `min(P - s - 1, M)` warm-up forwards, then alternates
one forward and one backward, then drains the backwards, holding at most `P - s` micro-batches.
Interleaved 1F1B: Megatron-Core's order (`compute_order`); ZB-H1 and ZB-V: each stage runs its
ready passes backward first and fills its waits with deferred weight passes, within 1F1B's memory
(`pair_exchanges`; ZB-V's chunks in the paper's V). For those, `pair_exchanges` places the exchanges by a lock-step run at nominal
costs, so that both ends of every pair make the same exchanges in the same global order (no
deadlock). `peak_in_flight` counts the inputs held; `schedule_bubble` the idle fraction at given
pass costs. `drive_in_process` runs all stages in one process and checks the pairing.

Links (`comm.PairLink`): native Send/Receive on Ascend/GPU; on CPU one SUM all-reduce on the
2-rank group of the two stages (neighbours; interleaving over more than two stages also links the
last stage back to the first, over their `embedding` pair group). Both ranks make the same calls in
the same order; a rank that sends while its peer sends makes ONE two-way exchange (Megatron's
`send_forward_recv_backward`). Each rank times its exchanges: `pipeline_bubble` in the step's
metrics is the fraction of the step spent waiting for a neighbour, `pipeline_comm` the fraction
spent moving the data (the step's fastest exchange, one whose peer was already there, times the
number of exchanges), both averaged over the stages.

Backward by recomputation. MindSpore cannot keep an autodiff graph alive between two jitted
calls, so a chunk keeps only its INPUT per micro-batch in flight (token ids on the first virtual
stage) and its backward is `value_and_grad` of `sum(chunk(x) * dout) + scale * aux(x)`: with
respect to its parameters and `x` (one pass), or, split for the zero-bubble schedules, B with
respect to `x` only and W with respect to the parameters only, two compiled functions that each
recompute the chunk's forward (a split backward costs one more forward than an unsplit one; the
input and output gradient stay held until W). The last virtual stage's forward computes its loss
and all its gradients in one call (nothing after it to wait for), whatever the schedule: its
backward only sends the input gradient, its W is empty.

Loss and metrics. The model's loss is the head's loss plus the weighted auxiliary losses of the
layers, so each chunk contributes its layers' part and the last one adds the head's. Each stage
reduces its chunks' stats over micro-batches into a vector laid out for the WHOLE model (every stat
the model declares in `stat_specs`; per-layer stats such as `expert_load` at the rows of the
chunk's layers, zeros elsewhere) and one AllReduce over the `pp` group gives every rank the metrics
a one-process run reports.

MoE dispatch capacities. Dropless expert-parallel buffers are sized from the routing
(`parallel.moe_capacity: adaptive`) per STEP, not per micro-batch: a micro-batch's passes are spread
over the stages and every backward recomputes its forward, so its capacities may not change inside
the step. After the schedule every rank (a dense stage too) all-gathers its largest need per
destination (`moetrain.moe.capacity.StepCapacities`); an overflow anywhere grows them and every rank
runs the step again (each capacity set compiles its own passes); shrinks wait for the step's end.
Evaluation runs at the bound (its counts are not checked).

Tied embeddings: first and last virtual stage both hold `embed.weight`; on two ranks it is
broadcast from the first stage at start and marked `tied_group="embedding"`, so the optimizer sums
its gradient over that group every step and counts it as two copies in the global gradient norm.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn

from moetrain.distributed import comm
from moetrain.distributed.comm import PairLink
from moetrain.distributed.sharding import mark_role
from moetrain.layout import split_layers
from moetrain.modeling import (BuiltPart, StatSpec, attention_context, keep_stage, layer_stat_rows, merge_stats,
                               split_specs)
from moetrain.moe.capacity import StepCapacities, world_gather
from moetrain.moe.layer import moe_layers
from moetrain.param_init import materialize
from moetrain.parallel.runner import as_tensors
# the schedules are data (pure Python, moetrain/parallel/schedules.py); re-exported: the pipeline's vocabulary
from moetrain.parallel.schedules import (  # noqa: F401
    ACTIVATION, BACKWARD, EXCHANGE, FORWARD, GRADIENT, SCHEDULES, SPLIT_BACKWARD, WEIGHT, Msg, Op, PipelineError,
    build_schedule, build_schedules, chunks_per_stage, compute_order, pair_exchanges, peak_in_flight,
    schedule_bubble, stage_of, virtual_stage)

@dataclass
class Exchange:
    """What a stage asks of its link to stage `peer`: `payload` goes out (None: nothing), a tensor of
    `shape` comes in when `recv` is not None. `send`/`recv` name the tensors (checked in process)."""

    peer: int
    send: Optional[Msg]
    recv: Optional[Msg]
    payload: object
    shape: Tuple[int, ...]


def drive_in_process(runs: Sequence) -> List:
    """Run every stage's generator (see `PipelineExecutor.steps`) in one process: an exchange
    completes when both ends have reached theirs, as with the pair-group AllReduce. Raises if the
    two ends disagree on what crosses, or if no stage can move (deadlock). Returns each generator's
    return value."""
    n = len(runs)
    pending: List[Optional[Exchange]] = [None] * n
    results: List = [None] * n
    done = [False] * n

    def advance(s, reply):
        try:
            pending[s] = runs[s].send(reply)
        except StopIteration as stop:
            done[s], pending[s], results[s] = True, None, stop.value

    for s in range(n):
        advance(s, None)
    while not all(done):
        moved = False
        for low in range(n):
            a = pending[low]
            if a is None or not low < a.peer < n:
                continue
            high = a.peer
            b = pending[high]
            if b is None or b.peer != low:
                continue
            if (a.send, a.recv) != (b.recv, b.send):
                raise PipelineError(f"link {low}-{high}: stage {low} sends {a.send} and expects {a.recv}, stage "
                                    f"{high} sends {b.send} and expects {b.recv}")
            advance(low, b.payload)
            advance(high, a.payload)
            moved = True
        if not moved:
            waiting = {s: (pending[s].peer, pending[s].send, pending[s].recv) for s in range(n) if not done[s]}
            raise PipelineError(f"pipeline deadlock: stages wait on (peer, send, recv) {waiting}")
    return results


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
class PipelineStage(nn.Cell):
    """One model chunk of a rank (the rank's whole stage with one chunk): `keep_stage`
    (moetrain/modeling.py) cut the model down to layers `[start, end)`, the embedding on the first
    virtual stage and the head on the last; `construct` calls the model's pieces.
    `construct(x, labels, *side)` -> `(out, stats)`: `out` is the hidden state `[B, S, H]`, or on the
    last virtual stage its loss part; `stats["loss"]` is this chunk's part of the model's loss (its
    layers' weighted aux terms, + the head's loss on the last). `side`: the batch's fields after
    `(input_ids, labels)` (packed documents: document_ids, position_ids), which every chunk's
    attention reads. `stage` / `num_stages`: the rank's pipeline stage; `vstage` / `num_vstages`:
    this chunk's virtual stage (the same with one chunk a stage)."""

    def __init__(self, model, start: int, end: int, num_stages: int, stage: int,
                 vstage: Optional[int] = None, num_vstages: Optional[int] = None):
        super().__init__(auto_prefix=False)   # the model's parameter names stay
        self.start, self.end, self.stage, self.num_stages = start, end, stage, num_stages
        self.vstage = stage if vstage is None else vstage
        self.num_vstages = num_stages if num_vstages is None else num_vstages
        self.is_first, self.is_last = self.vstage == 0, self.vstage == self.num_vstages - 1
        self.stacked = split_specs(model.stat_specs())[1]
        keep_stage(model, start, end, self.is_first, self.is_last)
        self.model = model

    def construct(self, x, labels=None, *side):
        context = attention_context(*side)
        h = self.model.embed_tokens(x) if self.is_first else x
        h, stats, aux = self.model.run_layers(h, context)
        if self.is_last:
            loss, head_stats = self.model.head_loss(h, labels, context)
            stats = merge_stats(stats, head_stats, self.stacked)
            stats["loss"] = loss + aux
            return stats["loss"], stats
        stats["loss"] = aux
        return h, stats


class StageChunks(nn.Cell):
    """A rank's model chunks (interleaved 1F1B, ZB-V): `chunks[c]` is a `PipelineStage` of its own
    copy of the model; parameter names stay the whole model's."""

    def __init__(self, chunks: Sequence[PipelineStage]):
        super().__init__(auto_prefix=False)
        self.chunks = nn.CellList(list(chunks), auto_prefix=False)
        self.stage, self.num_stages = chunks[0].stage, chunks[0].num_stages
        self.layer_ranges = [(c.start, c.end) for c in chunks]


def build_chunks(models: Sequence, kind: str, num_stages: int, stage: int,
                 ranges: Sequence[Tuple[int, int]]) -> List[PipelineStage]:
    """`stage`'s chunks, one per whole model of `models` (identical copies), each cut to the layer
    range of its virtual stage (`ranges`: every virtual stage's). Where the first and the last
    virtual stage share a rank (ZB-V) and the head reads the embedding, both use one embedding."""
    chunks = [PipelineStage(model, *ranges[virtual_stage(kind, num_stages, stage, c)], num_stages, stage,
                            virtual_stage(kind, num_stages, stage, c), len(ranges)) for c, model in enumerate(models)]
    first = next((c for c in chunks if c.is_first), None)
    last = next((c for c in chunks if c.is_last), None)
    if first is not None and last is not None and first is not last and last.model.needs_embedding_in_head:
        auto_prefix = last.model._auto_prefix   # no renaming: the shared cells keep their names
        last.model._auto_prefix = False
        try:
            for name in last.model.EMBEDDING_CELLS:
                setattr(last.model, name, getattr(first.model, name))
        finally:
            last.model._auto_prefix = auto_prefix
    return chunks


def build_stages(model_factory, ranges: Sequence[Tuple[int, int]], stages: Optional[Sequence[int]] = None,
                 kind: str = "1f1b", chunks: int = 1) -> Dict:
    """`{stage: PipelineStage}` (one chunk) or `{stage: [chunks]}` for `stages` (default all): each
    chunk from its own `model_factory()` (the same seed: identical whole models), cut to its
    virtual stage's range of `ranges`. For tests that drive every stage in one process."""
    num_stages = len(ranges) // chunks
    chosen = range(num_stages) if stages is None else stages
    built = {s: build_chunks([model_factory() for _ in range(chunks)], kind, num_stages, s, ranges) for s in chosen}
    return {s: c[0] if chunks == 1 else c for s, c in built.items()}


@dataclass(frozen=True)
class StatLayout:
    """Where each chunk's stats go in the whole-model vector that is summed over the stages."""

    scalars: Tuple[str, ...]                       # "loss" and every summed-over-layers stat
    stacked: Dict[str, Tuple[int, ...]]            # per-layer stat -> row shape
    rows: int                                      # per-layer rows of the whole model
    offsets: Tuple[int, ...]                       # each chunk's first row
    reduce: Dict[str, str]

    @classmethod
    def of(cls, model, specs: Dict[str, StatSpec], starts: Sequence[int], num_layers: int) -> "StatLayout":
        """`starts`: the first layer of each of the rank's chunks in the whole model of `num_layers`
        layers (`model` may hold one chunk's blocks only)."""
        summed, stacked = split_specs(specs)
        rows = layer_stat_rows(model, 0, num_layers) + model.head_stat_rows
        return cls(("loss",) + summed, {name: specs[name].row for name in stacked}, rows,
                   tuple(layer_stat_rows(model, 0, start) for start in starts),
                   {k: s.reduce for k, s in specs.items()})


# ---------------------------------------------------------------------------------------------
# Running a stage
# ---------------------------------------------------------------------------------------------
class ChunkPasses:
    """The compiled passes of one chunk (jitted functions return tuples, never dicts: stats leave as
    (keys, values)). Every backward recomputes the chunk's forward from its input (MindSpore keeps
    no autodiff graph between two jitted calls). Gradients are taken for all of the rank's
    parameters `params` (the optimizer's order; those of other chunks come out zero) and packed
    by `pack`. `side`: the micro-batch's fields after (input_ids, labels).

        forward(x, labels, *side)                  -> out, stats
        loss_full(x, labels, scale, *side)         -> stats, grads, dx     last chunk: forward and backward
        backward(x, dout, scale, *side)            -> grads, dx            unsplit backward
        backward_input(x, dout, scale, *side)      -> dx                   B
        backward_weight(x, dout, scale, *side)     -> grads                W
    """

    def __init__(self, chunk: PipelineStage, params: Sequence, jit: bool, pack):
        wrap = ms.jit if jit else (lambda fn: fn)
        first = chunk.is_first
        input_position = None if first else 0     # the first chunk's input is token ids

        def forward(x, labels, *side):
            out, stats = chunk(x, labels, *side)
            return out, tuple(stats.keys()), tuple(stats.values())

        def loss_of(x, labels, scale, *side):     # last chunk: its loss part, scaled
            loss, stats = chunk(x, labels, *side)
            return loss * scale, stats

        def objective(x, dout, scale, *side):     # other chunks: <out, dout> + scale * aux
            out, stats = chunk(x, None, *side)
            return (out * dout).sum() + stats["loss"] * scale

        loss_full_grad = ms.value_and_grad(loss_of, input_position, params, has_aux=True)
        full_grad = ms.value_and_grad(objective, input_position, params)
        weight_grad = ms.value_and_grad(objective, None, params)
        input_grad = ms.value_and_grad(objective, 0, None) if not first else None

        def loss_full(x, labels, scale, *side):
            (_, stats), grads = loss_full_grad(x, labels, scale, *side)
            param_grads, dx = _split_grads(grads, first)
            return tuple(stats.keys()), tuple(stats.values()), pack(param_grads), dx

        def backward(x, dout, scale, *side):
            _, grads = full_grad(x, dout, scale, *side)
            param_grads, dx = _split_grads(grads, first)
            return pack(param_grads), dx

        def backward_input(x, dout, scale, *side):
            return input_grad(x, dout, scale, *side)[1]

        def backward_weight(x, dout, scale, *side):
            return pack(tuple(weight_grad(x, dout, scale, *side)[1]))

        jitted = {name: wrap(fn) for name, fn in (("forward", forward), ("loss_full", loss_full))}
        self.backward, self.backward_input, self.backward_weight = wrap(backward), wrap(backward_input), wrap(
            backward_weight)

        def forward_with_dict(x, labels, *side):
            out, keys, values = jitted["forward"](x, labels, *side)
            return out, dict(zip(keys, values))

        def loss_full_with_dict(x, labels, scale, *side):
            keys, values, grads, dx = jitted["loss_full"](x, labels, scale, *side)
            return dict(zip(keys, values)), grads, dx

        self.forward, self.loss_full = forward_with_dict, loss_full_with_dict


class PipelineExecutor:
    """Runs one stage's schedule for one optimizer step: compute in (optionally jitted) functions,
    each exchange yielded to a driver (`Pipeline` on real ranks, `drive_in_process` in tests)."""

    def __init__(self, stage, params: Sequence, schedule: str, num_micro: int, jit: bool, flatten=None):
        """`stage`: a `PipelineStage`, a `StageChunks` or a list of a rank's chunks. `params`: the
        order of the gradients; `flatten` (e.g. `OptimizerStep.flatten`) packs each pass's
        gradients into the optimizer's buffers before they are accumulated."""
        chunks = list(stage.chunks) if isinstance(stage, StageChunks) else (
            list(stage) if isinstance(stage, (list, tuple)) else [stage])
        self.chunks, self.params, self.kind = chunks, list(params), schedule
        self.num_stages, self.stage_index = chunks[0].num_stages, chunks[0].stage
        self.ops = build_schedule(schedule, self.num_stages, self.stage_index, num_micro, len(chunks))
        self.split = schedule in SPLIT_BACKWARD
        self.num_micro = num_micro
        self.in_flight = self.peak_in_flight = 0
        self.jit, self.pack = jit, (flatten if flatten is not None else tuple)
        self.passes = [ChunkPasses(chunk, self.params, jit, self.pack) for chunk in chunks]
        self.compiled: Dict[Tuple, List[ChunkPasses]] = {}     # MoE capacity set -> its passes

    def use_capacities(self, key: Tuple, max_sets: int = 8) -> None:
        """Run the next passes with the MoE dispatch capacities now set on the dispatchers (`key`
        names the set): the capacities are Python ints baked in when a graph is compiled, so each
        set has its own compiled passes (built at its first use; at most `max_sets` kept)."""
        if key not in self.compiled:
            if not self.compiled:          # the passes built at construction compile the first set
                self.compiled[key] = self.passes
            else:
                self.compiled[key] = [ChunkPasses(chunk, self.params, self.jit, self.pack) for chunk in self.chunks]
                if len(self.compiled) > max_sets:
                    self.compiled.pop(next(iter(self.compiled)))
        self.passes = self.compiled.pop(key)
        self.compiled[key] = self.passes   # most recently used last

    @staticmethod
    def _accumulate(acc, grads):
        """`acc + grads` per buffer, in PyNative: a compiled graph keeps its last call's inputs alive
        until its next call (measured), so a jitted sum held the previous sum and the micro-batch's
        gradients (two gradient-sized buffers) through the passes that followed."""
        return tuple(a + g for a, g in zip(acc, grads))

    def peers(self) -> List[int]:
        """The stages this one exchanges with (training and evaluation)."""
        vstages = [c.vstage for c in self.chunks]
        around = {u + d for u in vstages for d in (-1, 1) if 0 <= u + d < self.chunks[0].num_vstages}
        return sorted({stage_of(self.kind, self.num_stages, u)[0] for u in around} - {self.stage_index})

    def _is_mine(self, msg: Msg) -> bool:
        return stage_of(self.kind, self.num_stages, msg.vstage)[0] == self.stage_index

    def steps(self, batches: Sequence[Tuple], scale, activation_shape: Tuple[int, ...]):
        """Generator over this stage's schedule; yields `Exchange`s, returns `(grads, stats)` with
        grads summed over micro-batches and passes and `stats[c][m]` chunk c's stats of micro-batch
        m. `batches[m]` = (input_ids, labels, *side) Tensors (only the first / last virtual stage
        reads input_ids / labels; every chunk reads `side`)."""
        held: Dict[Tuple[int, int], object] = {}     # (chunk, micro) -> input kept for the backward passes
        douts: Dict[Tuple[int, int], object] = {}    # split backward: output gradient kept for W
        dxs: Dict[Tuple[int, int], object] = {}      # last chunk: input gradient from its forward
        inbox: Dict[Msg, object] = {}
        outbox: Dict[Msg, object] = {}
        stats: List[List] = [[None] * self.num_micro for _ in self.chunks]
        grads = None
        self.in_flight = self.peak_in_flight = 0

        def add(micro_grads):
            nonlocal grads
            grads = micro_grads if grads is None else self._accumulate(grads, micro_grads)

        def hand_over(msg: Msg, tensor) -> None:
            (inbox if self._is_mine(msg) else outbox)[msg] = tensor

        def release(key):
            held.pop(key)
            self.in_flight -= 1

        for op in self.ops:
            if op.kind == EXCHANGE:
                payload = outbox.pop(op.send) if op.send is not None else None
                reply = yield Exchange(op.peer, op.send, op.recv, payload, activation_shape)
                if op.recv is not None:
                    inbox[op.recv] = reply
                continue
            c, m = op.chunk, op.micro
            chunk, passes, key = self.chunks[c], self.passes[c], (op.chunk, op.micro)
            u, side = chunk.vstage, tuple(batches[m][2:])
            if op.kind == FORWARD:
                x = batches[m][0] if chunk.is_first else inbox.pop(Msg(ACTIVATION, u, m))
                if chunk.is_last:   # its whole backward now: the loss's gradient needs nothing from later
                    stats[c][m], micro_grads, dxs[key] = passes.loss_full(x, batches[m][1], scale, *side)
                    add(micro_grads)
                    del micro_grads     # not held through the next pass
                else:
                    out, stats[c][m] = passes.forward(x, None, *side)
                    hand_over(Msg(ACTIVATION, u + 1, m), out)
                held[key] = x
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            elif op.kind == BACKWARD:
                if chunk.is_last:
                    dx = dxs.pop(key)
                else:
                    dout = inbox.pop(Msg(GRADIENT, u, m))
                    if self.split:
                        dx = None if chunk.is_first else passes.backward_input(held[key], dout, scale, *side)
                        douts[key] = dout
                    else:
                        micro_grads, dx = passes.backward(held[key], dout, scale, *side)
                        add(micro_grads)
                        del micro_grads
                if not self.split:
                    release(key)
                if not chunk.is_first:
                    hand_over(Msg(GRADIENT, u - 1, m), dx)
            else:
                if not chunk.is_last:    # the last chunk's weight gradient came with its forward
                    add(passes.backward_weight(held[key], douts.pop(key), scale, *side))
                release(key)
        leftovers = [*held, *douts, *dxs, *inbox, *outbox]
        if leftovers:
            raise PipelineError(f"stage {self.stage_index}: the schedule left {leftovers} behind")
        return grads, stats

    def forward_only(self, batch, activation_shape):
        """Generator: one evaluation batch through this stage's chunks in virtual-stage order (each
        exchange links virtual stages u and u + 1 only: no deadlock); returns `{"loss": this stage's
        part of the loss, "lm_loss": the next-token loss (the last stage; 0 elsewhere)}`."""
        loss, lm_loss, x = 0.0, 0.0, None
        for chunk, passes in sorted(zip(self.chunks, self.passes), key=lambda pair: pair[0].vstage):
            u = chunk.vstage
            if chunk.is_first:
                x = batch[0]
            elif not self._is_mine(Msg(ACTIVATION, u - 1, 0)):
                x = yield Exchange(stage_of(self.kind, self.num_stages, u - 1)[0], None, Msg(ACTIVATION, u, 0),
                                   None, activation_shape)
            x, stats = passes.forward(x, batch[1] if chunk.is_last else None, *batch[2:])
            loss = loss + float(stats["loss"].asnumpy())
            if chunk.is_last and "lm_loss" in stats:
                lm_loss = float(stats["lm_loss"].asnumpy())
            if not chunk.is_last and not self._is_mine(Msg(ACTIVATION, u + 1, 0)):
                yield Exchange(stage_of(self.kind, self.num_stages, u + 1)[0], Msg(ACTIVATION, u + 1, 0), None, x,
                               activation_shape)
        return {"loss": loss, "lm_loss": lm_loss}


def _split_grads(grads, first: bool):
    """value_and_grad returns param grads alone (first stage) or (input grad, param grads)."""
    if first:
        return tuple(grads), None
    dx, param_grads = grads
    return tuple(param_grads), dx


# ---------------------------------------------------------------------------------------------
# Links between ranks
# ---------------------------------------------------------------------------------------------
def run_with_links(run, links: Dict[int, PairLink], clock: Optional[Dict[str, float]] = None):
    """Drive one stage's generator on a real rank: each exchange goes over the link to its peer.
    `clock["wait"]` gains the seconds spent in exchanges (waiting for the neighbour, and the transfer),
    `clock["count"]` their number and `clock["fastest"]` the shortest one."""
    reply = None
    while True:
        try:
            request = run.send(reply)
        except StopIteration as stop:
            return stop.value
        start = time.perf_counter()
        reply = links[request.peer].exchange(request.payload, request.shape if request.recv is not None else None)
        if clock is not None:
            seconds = time.perf_counter() - start
            clock["wait"] = clock.get("wait", 0.0) + seconds
            clock["count"] = clock.get("count", 0) + 1
            clock["fastest"] = min(clock.get("fastest", seconds), seconds)


# ---------------------------------------------------------------------------------------------
# The runner the trainer uses
# ---------------------------------------------------------------------------------------------
CPU_COLLECTIVE_TIMEOUT_S = 600


def allow_slow_neighbours() -> None:
    """Raise the CPU collectives' timeout to CPU_COLLECTIVE_TIMEOUT_S unless it is set already:
    during the first step every stage compiles its own graphs while its neighbour waits in a link
    exchange. MindSpore reads the variable when a collective first runs: call this before any."""
    os.environ.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(CPU_COLLECTIVE_TIMEOUT_S))


def chunk_layer_ranges(cfg, pp: int, pp_rank: int) -> List[Tuple[int, int]]:
    """The layers `[start, end)` of each model chunk of pipeline stage `pp_rank` (one chunk, or
    several for interleaved 1F1B and ZB-V), in chunk order."""
    kind = cfg.parallel.pipeline_schedule
    chunks = chunks_per_stage(kind, cfg.parallel.pp_interleave_num)
    ranges = split_layers(cfg.model.num_layers, pp * chunks, cfg.parallel.pipeline_layers, chunks=chunks)
    return [ranges[virtual_stage(kind, pp, pp_rank, c)] for c in range(chunks)]


def chunk_parts(cfg, pp: int, pp_rank: int) -> List[BuiltPart]:
    """What each model chunk of stage `pp_rank` constructs (`moetrain.modeling.building_part`): its
    layers, whether it is the first / last virtual stage, and whether its head borrows the embedding
    of another chunk on this rank (ZB-V: stage 0 holds both ends)."""
    kind = cfg.parallel.pipeline_schedule
    chunks = chunks_per_stage(kind, cfg.parallel.pp_interleave_num)
    vstages = [virtual_stage(kind, pp, pp_rank, c) for c in range(chunks)]
    last = pp * chunks - 1
    return [BuiltPart(start, end, v == 0, v == last, v == last and 0 in vstages)
            for (start, end), v in zip(chunk_layer_ranges(cfg, pp, pp_rank), vstages)]


def build_pipeline_stage(model, cfg, pctx, more_models=None):
    """This rank's stage of `model` (already tensor / expert parallelized; built whole, or built as
    chunk 0 of this stage only: `moetrain.build.build_model` with a parallel context): a
    `PipelineStage`, or with several chunks a `StageChunks` whose chunk c is cut from
    `more_models(c)` for c >= 1. The cut comes first, then the deferred parameters of what is kept
    are materialized (`moetrain.param_init`): no other stage's parameter gets memory."""
    kind, P = cfg.parallel.pipeline_schedule, pctx.pp
    chunks = chunks_per_stage(kind, cfg.parallel.pp_interleave_num)
    ranges = split_layers(cfg.model.num_layers, P * chunks, cfg.parallel.pipeline_layers, chunks=chunks)
    if chunks > 1 and more_models is None:
        raise PipelineError(f"{kind} puts {chunks} model chunks on a stage: pass more_models")
    parts = build_chunks([model] + [more_models(c) for c in range(1, chunks)], kind, P, pctx.pp_rank, ranges)
    materialize(parts, cfg.train.seed)
    holder = next((c.model for c in parts if c.is_first or (c.is_last and c.model.needs_embedding_in_head)), None)
    embed = getattr(holder, "embed", None)
    # the head on stage P - 1 reads the embedding of stage 0 (not with ZB-V: both on stage 0)
    across = stage_of(kind, P, P * chunks - 1)[0] != 0
    if embed is not None and model.needs_embedding_in_head and across and pctx.group("embedding").size > 1:
        weight = embed.weight
        weight.set_data(comm.broadcast(ms.Tensor(weight.asnumpy()), 0, pctx.group("embedding")))   # the first's
        # both ends hold it: the optimizer sums its gradient over them and counts it once in the norm
        mark_role(weight, tied_group="embedding")
    return parts[0] if chunks == 1 else StageChunks(parts)


class Pipeline:
    """The pipeline's step runner (the interface of `moetrain.parallel.runner`): this rank's stage,
    its schedule, the links to its neighbours and the reduction of metrics over the stages."""

    def __init__(self, model, specs: Dict[str, StatSpec], cfg, pctx, seq_length: int, more_models=None):
        """Cuts `model` (already tensor / expert parallelized) down to this rank's stage
        (`more_models`: see `build_pipeline_stage`); `bind` then attaches the optimizer step built
        over the stage's parameters."""
        kind, P = cfg.parallel.pipeline_schedule, pctx.pp
        chunks = chunks_per_stage(kind, cfg.parallel.pp_interleave_num)
        starts = [start for start, _ in chunk_layer_ranges(cfg, P, pctx.pp_rank)]
        self.stats = StatLayout.of(model, specs, starts, cfg.model.num_layers)
        self.stage = build_pipeline_stage(model, cfg, pctx, more_models)
        self.chunks = list(self.stage.chunks) if chunks > 1 else [self.stage]
        self.model = self.stage
        self.pctx, self.cfg = pctx, cfg
        # the activation crossing a stage boundary: [B, S, H], its sequence slice under sequence parallel
        sequence_parallel = cfg.parallel.use_seq_parallel and pctx.tp > 1
        self.seq_length = seq_length // pctx.tp if sequence_parallel else seq_length
        self.hidden_size = cfg.model.hidden_size
        self.executor = None
        self.capacities = None      # StepCapacities when dropless expert-parallel buffers are sized (bind)
        self.links: Dict[int, PairLink] = {}
        self.step_bytes_sent = 0
        self.step_wait_s = self.step_comm_s = self.step_seconds = 0.0

    def _link(self, peer: int) -> PairLink:
        """The pair link to stage `peer`: a neighbour, or (interleaving over more than two stages)
        between the last and the first stage, over their `embedding` pair group."""
        s, P = self.pctx.pp_rank, self.pctx.pp
        if peer == s + 1:
            return PairLink(self.pctx.group("pp_next"), lower=True)
        if peer == s - 1:
            return PairLink(self.pctx.group("pp_prev"), lower=False)
        if {s, peer} == {0, P - 1}:
            return PairLink(self.pctx.group("embedding"), lower=s == 0)
        raise PipelineError(f"stage {s} has no link to stage {peer}")

    def bind(self, opt_step) -> "Pipeline":
        """Attach the optimizer step built over this stage's parameters (its gradient order and buffers)."""
        self.executor = PipelineExecutor(self.chunks, opt_step.params, self.cfg.parallel.pipeline_schedule,
                                         self.cfg.num_micro_batches, self.cfg.train.jit, opt_step.flatten)
        self.links = {peer: self._link(peer) for peer in self.executor.peers()}
        moe = getattr(self.cfg.model, "moe", None)
        p = self.cfg.parallel
        # decided from the config alone, so that every rank (a dense stage too) joins the gather
        if (moe is not None and p.moe_capacity == "adaptive" and self.pctx.ep > 1
                and not getattr(moe, "capacity_factor", 0) > 0):
            dispatchers = [layer.dispatcher for chunk in self.chunks for layer in moe_layers(chunk)]
            self.capacities = StepCapacities(dispatchers, self.pctx.ep, moe.num_experts, moe.top_k,
                                             world_gather(self.pctx), p.moe_capacity_prior)
        return self

    @property
    def peak_in_flight(self) -> int:
        return self.executor.peak_in_flight

    def activation_shape(self, batch_size: int) -> Tuple[int, int, int]:
        return (batch_size, self.seq_length, self.hidden_size)

    # ---- training --------------------------------------------------------------------------
    def train_step(self, batches, scale):
        """All micro-batches of one step through the schedule: this stage's gradient buffers summed
        over micro-batches, and the step's values for the whole model (the same on every stage),
        with `pipeline_bubble`: the fraction of the step the stages spent waiting for their
        neighbours, and `pipeline_comm`: the fraction spent moving the data, both averaged over the
        stages. An exchange takes the time its peer keeps it waiting plus the transfer; the transfer
        is taken as the step's fastest exchange (one whose peer was already there; the payloads are
        the same hidden-state shape), so the bubble is the time in exchanges beyond that."""
        batches = [as_tensors(batch) for batch in batches]
        shape = self.activation_shape(int(batches[0][0].shape[0]))
        capacities = self.capacities
        if capacities is not None:
            capacities.prime(int(np.prod(batches[0][0].shape)))
        while True:
            if capacities is not None:
                self.executor.use_capacities(capacities.key())
            clock = {"wait": 0.0}
            start = time.perf_counter()
            with comm.CommLedger() as ledger:
                grads, stats = run_with_links(self.executor.steps(batches, scale, shape), self.links, clock)
            if capacities is None or not self._resized(stats):
                break
            # a buffer overflowed somewhere: every rank runs the step again with the grown capacities
            # (the discarded gradients dropped first, not held through the re-run)
            del grads, stats
        self.step_seconds = time.perf_counter() - start
        self.step_comm_s = clock.get("count", 0) * clock.get("fastest", 0.0)
        self.step_wait_s = clock["wait"] - self.step_comm_s
        self.step_bytes_sent = ledger.bytes_by_group(backward=False).get("pp", 0)
        step = max(self.step_seconds, 1e-12)
        return grads, self.combine_stats(stats, self.step_wait_s / step, self.step_comm_s / step)

    def _resized(self, stats: Sequence[Sequence[Dict]]) -> bool:
        """After a step: the dispatch capacities checked against every rank's routing counts (its
        chunks' `dispatch_load` of every micro-batch) and resized; True when the step must be re-run."""
        capacities = self.capacities
        loads = [s["dispatch_load"].asnumpy() for chunk_stats in stats for s in chunk_stats
                 if s is not None and "dispatch_load" in s]
        rerun = capacities.update(capacities.local_need(loads))
        capacities.steps += 1
        capacities.reruns += int(rerun)
        if capacities.changes:
            if self.pctx.rank == 0:   # stderr: stdout carries what a command prints for machines
                print("moetrain: MoE dispatch capacities (pipeline): " + "; ".join(capacities.changes)
                      + ("; re-running the step" if rerun else ""), file=sys.stderr, flush=True)
            capacities.changes.clear()
        return rerun

    def combine_stats(self, stats: Sequence[Sequence[Dict]], bubble: float = 0.0,
                      transfer: float = 0.0) -> Dict[str, object]:
        """Micro-batch mean (or sum) of each chunk's stats (`stats[c][m]`), written into the
        whole-model layout, and this stage's `bubble` and `transfer` fractions over the stage count,
        summed over the stages."""
        layout = self.stats
        parts = np.zeros(len(layout.scalars) + 2, np.float64)
        rows = {key: np.zeros((layout.rows,) + tuple(row), np.float64) for key, row in layout.stacked.items()}
        for chunk_stats, offset in zip(stats, layout.offsets):
            for i, key in enumerate(layout.scalars):
                arrays = [float(s[key].asnumpy()) if key in s else 0.0 for s in chunk_stats]
                parts[i] += np.sum(arrays) if layout.reduce.get(key) == "sum" else np.mean(arrays)
            for key in layout.stacked:
                if key in chunk_stats[0]:
                    own = np.asarray([s[key].asnumpy() for s in chunk_stats], np.float64)
                    own = own.sum(0) if layout.reduce.get(key) == "sum" else own.mean(0)
                    rows[key][offset:offset + own.shape[0]] = own
        parts[-2:] = bubble / self.pctx.pp, transfer / self.pctx.pp
        flat = np.concatenate([parts] + [r.reshape(-1) for r in rows.values()]).astype(np.float32)
        total = comm.all_reduce(ms.Tensor(flat), self.pctx.group("pp")).asnumpy().astype(np.float64)
        values = {key: total[i] for i, key in enumerate(layout.scalars)}
        values["pipeline_bubble"], values["pipeline_comm"] = total[len(layout.scalars):len(layout.scalars) + 2]
        offset = len(layout.scalars) + 2
        for key, row in layout.stacked.items():
            size = layout.rows * int(np.prod(row))
            values[key] = total[offset:offset + size].reshape((layout.rows,) + tuple(row))
            offset += size
        return values

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, batch):
        """The model's loss on one batch and `{"lm_loss"}` (every stage gets both)."""
        batch = as_tensors(batch)
        shape = self.activation_shape(int(batch[0].shape[0]))
        if self.capacities is not None:
            # the bound: an evaluation batch is not checked for overflow (its stats stay on the stage)
            held = self.capacities.key()
            for dispatcher in self.capacities.dispatchers:
                dispatcher.pair_capacity = ()
            self.executor.use_capacities(())
            try:
                stats = run_with_links(self.executor.forward_only(batch, shape), self.links)
            finally:
                for dispatcher in self.capacities.dispatchers:
                    dispatcher.pair_capacity = held
        else:
            stats = run_with_links(self.executor.forward_only(batch, shape), self.links)
        part = np.array([stats["loss"], stats["lm_loss"]], np.float32)
        loss, lm_loss = comm.all_reduce(ms.Tensor(part), self.pctx.group("pp")).asnumpy()
        return float(loss), {"lm_loss": np.float32(lm_loss)}

    def capacity_state(self):
        """The MoE dispatch capacities and their sizing history (None when nothing sizes them:
        `moetrain.moe.capacity.StepCapacities`)."""
        return None if self.capacities is None else self.capacities.state()

    def capacities_in_force(self):
        """The capacities the last step ran with (None: the bound)."""
        key = None if self.capacities is None else self.capacities.key()
        return {"pair_capacity": list(key)} if key else None

    def capacities_largest(self):
        """Element-wise the largest capacities any step ran with (None: the bound)."""
        largest = None if self.capacities is None else self.capacities.largest
        return {"pair_capacity": list(largest)} if largest else None

    def load_capacity_state(self, state) -> None:
        if self.capacities is not None and state:
            self.capacities.load_state(state)

    def update_expert_bias(self, expert_load) -> None:
        """Aux-loss-free balancing for this stage's MoE layers, from its chunks' rows of the whole
        model's load."""
        for chunk, offset in zip(self.chunks, self.stats.offsets):
            model = chunk.model
            if hasattr(model, "update_expert_bias"):
                rows = len(model.moe_modules())
                model.update_expert_bias(np.asarray(expert_load)[offset:offset + rows])
