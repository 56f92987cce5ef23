"""Pipeline parallelism: the model cut into stages by layers, run with a 1F1B or GPipe schedule.

    stage 0: embed + layers[0:a]    stage s: layers[a:b]    stage P-1: layers[..:L] + head and loss

Every rank of a pipeline stage builds the whole model with the same seed (so the split model
starts exactly where a one-process run starts, tied embeddings included), then `keep_stage`
(moetrain/modeling.py) cuts it down to its stage; parameter names stay the whole model's. The
stage runs the model's own pieces (`embed_tokens`, `run_layers`, `head_loss`): no model code here.

Schedules (`build_schedule`) are per-stage instruction lists of forward, backward and link
exchanges, Megatron's order. 1F1B: stage s runs `min(P - s - 1, M)` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most
`P - s` micro-batches in flight (GPipe: all M). `PipelineExecutor.peak_in_flight` counts them.

Links (`comm.PairLink`): native Send/Receive on Ascend/GPU; on CPU one SUM all-reduce on the
2-rank group of neighbours. Both ranks make the same calls in the same order; a rank that sends
an activation while its neighbour sends a gradient makes ONE two-way exchange (Megatron's
`send_forward_recv_backward`). The schedules pair the exchanges of both ends of every link one to
one; `drive_in_process` runs all stages in one process with the same pairing and checks it.

Backward by recomputation. MindSpore cannot keep an autodiff graph alive between two jitted
calls, so a stage keeps only its INPUT per micro-batch in flight (token ids on the first stage)
and its backward is `value_and_grad` of `sum(stage(x) * dout) + scale * aux(x)` with respect to
its parameters and `x`: one extra stage forward per micro-batch on every stage but the last,
whose forward and backward are one call (`value_and_grad` of its loss).

Loss and metrics. The model's loss is the head's loss plus the weighted auxiliary losses of the
layers, so stage s contributes its layers' part and the last stage adds the head's. Each stage
reduces its stats over micro-batches into a vector laid out for the WHOLE model (every stat the
model declares in `stat_specs`; per-layer stats such as `expert_load` at the rows of the stage's
layers, zeros elsewhere) and one AllReduce over the `pp` group gives every rank the metrics a
one-process run reports.

Tied embeddings: first and last stage both hold `embed.weight`; it is broadcast from the first
stage at start and marked `tied_group="embedding"`, so the optimizer sums its gradient over that
group every step and counts it as two copies in the global gradient norm.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn

from moetrain.dist import comm
from moetrain.dist.comm import PairLink
from moetrain.dist.sharding import mark_role
from moetrain.layout import split_layers
from moetrain.modeling import StatSpec, attention_context, keep_stage, merge_stats, split_specs, stat_rows
from moetrain.parallel.runner import as_tensors

SCHEDULES = ("1f1b", "gpipe")
FORWARD, BACKWARD, EXCHANGE = "forward", "backward", "exchange"
NEXT, PREV = "next", "prev"


class PipelineError(RuntimeError):
    """A schedule that does not pair its exchanges, deadlocks or leaves work behind (a bug, not a
    layout: layouts are checked by moetrain.layout)."""


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One instruction. forward/backward: `micro`. exchange on `link` (next: toward stage s+1,
    prev: toward s-1): `send` is the micro-batch whose tensor goes out (activation on next,
    gradient on prev), `recv` the one whose tensor comes in (gradient on next, activation on prev)."""

    kind: str
    micro: int = -1
    link: str = ""
    send: Optional[int] = None
    recv: Optional[int] = None


def build_schedule(kind: str, num_stages: int, stage: int, num_micro: int) -> List[Op]:
    """The instruction list of `stage` (Megatron order; see the module notes)."""
    if kind not in SCHEDULES:
        raise PipelineError(f"parallel.pipeline_schedule={kind!r} is not one of {SCHEDULES}")
    if num_micro < num_stages:
        raise PipelineError(f"{num_micro} micro-batches cannot fill {num_stages} pipeline stages")
    first, last = stage == 0, stage == num_stages - 1
    ops: List[Op] = []

    def exchange(link, send=None, recv=None):
        if (link == PREV and not first) or (link == NEXT and not last):
            ops.append(Op(EXCHANGE, link=link, send=send, recv=recv))

    if kind == "gpipe":
        for m in range(num_micro):
            exchange(PREV, recv=m)
            ops.append(Op(FORWARD, m))
            exchange(NEXT, send=m)
        for m in range(num_micro):
            exchange(NEXT, recv=m)
            ops.append(Op(BACKWARD, m))
            exchange(PREV, send=m)
        return ops

    warmup = min(num_stages - stage - 1, num_micro)
    steady = num_micro - warmup
    for m in range(warmup):
        exchange(PREV, recv=m)
        ops.append(Op(FORWARD, m))
        exchange(NEXT, send=m)
    if steady:
        exchange(PREV, recv=warmup)
    for i in range(steady):
        forward_micro, backward_micro = warmup + i, i
        ops.append(Op(FORWARD, forward_micro))
        exchange(NEXT, send=forward_micro, recv=backward_micro)          # send_forward_recv_backward
        ops.append(Op(BACKWARD, backward_micro))
        if i == steady - 1:
            exchange(PREV, send=backward_micro)                          # send_backward
        else:
            exchange(PREV, send=backward_micro, recv=forward_micro + 1)  # send_backward_recv_forward
    for m in range(steady, num_micro):
        exchange(NEXT, recv=m)
        ops.append(Op(BACKWARD, m))
        exchange(PREV, send=m)
    return ops


def peak_in_flight(ops: Sequence[Op]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of `ops`."""
    held = peak = 0
    for op in ops:
        held += (op.kind == FORWARD) - (op.kind == BACKWARD)
        peak = max(peak, held)
    return peak


@dataclass
class Exchange:
    """What a stage asks of one link: `payload` goes out (None: nothing), a tensor of `shape` comes
    in when `recv` is not None. `send`/`recv` name the micro-batches (checked in process)."""

    link: str
    send: Optional[int]
    recv: Optional[int]
    payload: object
    shape: Tuple[int, ...]


def drive_in_process(runs: Sequence) -> List:
    """Run every stage's generator (see `PipelineExecutor.steps`) in one process: an exchange
    completes when both ends of its link have reached theirs, as with the pair-group AllReduce.
    Raises if the two ends disagree on what crosses the link, or if no stage can move (deadlock).
    Returns each generator's return value."""
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
        for low in range(n - 1):   # the link between stages low and low + 1
            a, b = pending[low], pending[low + 1]
            if a is None or b is None or a.link != NEXT or b.link != PREV:
                continue
            if (a.send, a.recv) != (b.recv, b.send):
                raise PipelineError(f"link {low}-{low + 1}: stage {low} sends activation {a.send} and expects "
                                    f"gradient {a.recv}, stage {low + 1} expects activation {b.recv} and "
                                    f"sends gradient {b.send}")
            advance(low, b.payload)
            advance(low + 1, a.payload)
            moved = True
        if not moved:
            waiting = {s: (pending[s].link, pending[s].send, pending[s].recv) for s in range(n) if not done[s]}
            raise PipelineError(f"pipeline deadlock: stages wait on (link, send, recv) {waiting}")
    return results


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
class PipelineStage(nn.Cell):
    """This rank's part of a layered model (moetrain/modeling.py): `keep_stage` cut the model down to
    layers `[start, end)`, the embedding on the first stage and the head on the last; `construct`
    calls the model's pieces. `construct(x, labels, *side)` -> `(out, stats)`: `out` is the hidden
    state `[B, S, H]`, or on the last stage its loss part; `stats["loss"]` is this stage's part of the
    model's loss (its layers' weighted aux terms, + the head's loss on the last). `side`: the batch's
    fields after `(input_ids, labels)` (packed documents: document_ids, position_ids), which every
    stage's attention reads."""

    def __init__(self, model, start: int, end: int, num_stages: int, stage: int):
        super().__init__(auto_prefix=False)   # the model's parameter names stay
        self.start, self.end, self.stage, self.num_stages = start, end, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
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


def build_stages(model_factory, ranges: Sequence[Tuple[int, int]], stages: Optional[Sequence[int]] = None) -> Dict:
    """`{stage: PipelineStage}` for `stages` (default all): each from its own `model_factory()`
    (the same seed: identical whole models), cut to its range. For tests that drive every stage in
    one process."""
    chosen = range(len(ranges)) if stages is None else stages
    return {s: PipelineStage(model_factory(), *ranges[s], len(ranges), s) for s in chosen}


@dataclass(frozen=True)
class StatLayout:
    """Where each stage's stats go in the whole-model vector that is summed over the stages."""

    scalars: Tuple[str, ...]                       # "loss" and every summed-over-layers stat
    stacked: Dict[str, Tuple[int, ...]]            # per-layer stat -> row shape
    rows: int                                      # per-layer rows of the whole model
    offset: int                                    # this stage's first row
    reduce: Dict[str, str]

    @classmethod
    def of(cls, model, specs: Dict[str, StatSpec], start: int, last: bool) -> "StatLayout":
        summed, stacked = split_specs(specs)
        rows = stat_rows(model.layers) + model.head_stat_rows
        return cls(("loss",) + summed, {name: specs[name].row for name in stacked}, rows,
                   stat_rows(model.layers[i] for i in range(start)), {k: s.reduce for k, s in specs.items()})


# ---------------------------------------------------------------------------------------------
# Running a stage
# ---------------------------------------------------------------------------------------------
class PipelineExecutor:
    """Runs one stage's schedule for one optimizer step: compute in (optionally jitted) functions,
    each link exchange yielded to a driver (`Pipeline` on real ranks, `drive_in_process` in tests)."""

    def __init__(self, stage, params: Sequence, schedule: str, num_micro: int, jit: bool, flatten=None):
        """`params`: the order of the gradients; `flatten` (e.g. `OptimizerStep.flatten`) packs each
        micro-batch's gradients into the optimizer's buffers before they are accumulated."""
        self.stage, self.params = stage, list(params)
        self.ops = build_schedule(schedule, stage.num_stages, stage.stage, num_micro)
        self.num_micro = num_micro
        self.in_flight = self.peak_in_flight = 0
        wrap = ms.jit if jit else (lambda fn: fn)
        first = stage.is_first
        pack = flatten if flatten is not None else tuple

        # jitted functions return tuples, never dicts (see the trainer): stats leave as (keys, values)
        # `side`: the micro-batch's fields after (input_ids, labels), given to every stage
        def forward(x, labels, *side):
            out, stats = stage(x, labels, *side)
            return out, tuple(stats.keys()), tuple(stats.values())

        def loss_of(x, labels, scale, *side):     # last stage: its loss part, scaled
            loss, stats = stage(x, labels, *side)
            return loss * scale, stats

        def objective(x, dout, scale, *side):     # other stages: <out, dout> + scale * aux
            out, stats = stage(x, None, *side)
            return (out * dout).sum() + stats["loss"] * scale

        input_position = None if first else 0    # the first stage's input is token ids
        loss_grad = ms.value_and_grad(loss_of, input_position, self.params, has_aux=True)
        objective_grad = ms.value_and_grad(objective, input_position, self.params)

        def forward_backward(x, labels, scale, *side):
            (_, stats), grads = loss_grad(x, labels, scale, *side)
            param_grads, dx = _split_grads(grads, first)
            return tuple(stats.keys()), tuple(stats.values()), pack(param_grads), dx

        def backward(x, dout, scale, *side):
            _, grads = objective_grad(x, dout, scale, *side)
            param_grads, dx = _split_grads(grads, first)
            return pack(param_grads), dx

        def accumulate(acc, grads):
            return tuple(a + g for a, g in zip(acc, grads))

        jitted_forward, jitted_forward_backward = wrap(forward), wrap(forward_backward)

        def forward_with_dict(x, labels, *side):
            out, keys, values = jitted_forward(x, labels, *side)
            return out, dict(zip(keys, values))

        def forward_backward_with_dict(x, labels, scale, *side):
            keys, values, grads, dx = jitted_forward_backward(x, labels, scale, *side)
            return dict(zip(keys, values)), grads, dx

        self._forward, self._forward_backward = forward_with_dict, forward_backward_with_dict
        self._backward, self._accumulate = wrap(backward), wrap(accumulate)

    def steps(self, batches: Sequence[Tuple], scale, activation_shape: Tuple[int, ...]):
        """Generator over this stage's schedule; yields `Exchange`s, returns `(grads, stats)` with
        grads summed over micro-batches and `stats[m]` the stage's stats of micro-batch m.
        `batches[m]` = (input_ids, labels, *side) Tensors (only the first / last stage reads input_ids /
        labels; every stage reads `side`)."""
        stage = self.stage
        held: Dict[int, object] = {}       # micro -> stage input kept for the backward (last stage: its dx)
        received = {NEXT: {}, PREV: {}}     # link -> micro -> output gradient (next) / activation (prev)
        outgoing = {NEXT: {}, PREV: {}}     # link -> micro -> activation (next) / input gradient (prev)
        stats: List = [None] * self.num_micro
        grads = None
        self.in_flight = self.peak_in_flight = 0

        def add(micro_grads):
            nonlocal grads
            grads = micro_grads if grads is None else self._accumulate(ms.mutable(grads), ms.mutable(micro_grads))

        for op in self.ops:
            if op.kind == EXCHANGE:
                payload = outgoing[op.link].pop(op.send) if op.send is not None else None
                reply = yield Exchange(op.link, op.send, op.recv, payload, activation_shape)
                if op.recv is not None:
                    received[op.link][op.recv] = reply
                continue
            m = op.micro
            side = tuple(batches[m][2:])
            if op.kind == FORWARD:
                x = batches[m][0] if stage.is_first else received[PREV].pop(m)
                if stage.is_last:
                    stats[m], micro_grads, dx = self._forward_backward(x, batches[m][1], scale, *side)
                    add(micro_grads)
                    held[m] = dx
                else:
                    outgoing[NEXT][m], stats[m] = self._forward(x, None, *side)
                    held[m] = x
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            else:
                kept = held.pop(m)
                self.in_flight -= 1
                if stage.is_last:
                    dx = kept
                else:
                    micro_grads, dx = self._backward(kept, received[NEXT].pop(m), scale, *side)
                    add(micro_grads)
                if not stage.is_first:
                    outgoing[PREV][m] = dx
        leftovers = {**held, **received[NEXT], **received[PREV], **outgoing[NEXT], **outgoing[PREV]}
        if leftovers:
            raise PipelineError(f"stage {stage.stage}: the schedule left micro-batches {sorted(leftovers)} behind")
        return grads, stats

    def forward_only(self, batch, activation_shape):
        """Generator: one evaluation batch through this stage; returns the stage's stats."""
        stage = self.stage
        x = batch[0]
        if not stage.is_first:
            x = yield Exchange(PREV, None, 0, None, activation_shape)
        out, stats = self._forward(x, batch[1] if stage.is_last else None, *batch[2:])
        if not stage.is_last:
            yield Exchange(NEXT, 0, None, out, activation_shape)
        return stats


def _split_grads(grads, first: bool):
    """value_and_grad returns param grads alone (first stage) or (input grad, param grads)."""
    if first:
        return tuple(grads), None
    dx, param_grads = grads
    return tuple(param_grads), dx


# ---------------------------------------------------------------------------------------------
# Links between ranks
# ---------------------------------------------------------------------------------------------
def run_with_links(run, links: Dict[str, PairLink]):
    """Drive one stage's generator on a real rank: each exchange goes over its link."""
    reply = None
    while True:
        try:
            request = run.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = links[request.link].exchange(request.payload, request.shape if request.recv is not None else None)


# ---------------------------------------------------------------------------------------------
# The runner the trainer uses
# ---------------------------------------------------------------------------------------------
CPU_COLLECTIVE_TIMEOUT_S = 600


def allow_slow_neighbours() -> None:
    """Raise the CPU collectives' timeout to CPU_COLLECTIVE_TIMEOUT_S unless it is set already:
    during the first step every stage compiles its own graphs while its neighbour waits in a link
    exchange. MindSpore reads the variable when a collective first runs: call this before any."""
    os.environ.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(CPU_COLLECTIVE_TIMEOUT_S))


def build_pipeline_stage(model, cfg, pctx) -> PipelineStage:
    """This rank's stage of `model` (built whole with the run's seed, already tensor / expert
    parallelized). Once the caller drops `model`, the other stages' cells are freed."""
    ranges = split_layers(len(model.layers), pctx.pp, cfg.parallel.pipeline_layers)
    stage = PipelineStage(model, *ranges[pctx.pp_rank], pctx.pp, pctx.pp_rank)
    embed = getattr(model, "embed", None)
    if embed is not None and model.needs_embedding_in_head and pctx.group("embedding").size > 1:
        weight = embed.weight
        weight.set_data(comm.broadcast(ms.Tensor(weight.asnumpy()), 0, pctx.group("embedding")))   # the first's
        # both ends hold it: the optimizer sums its gradient over them and counts it once in the norm
        mark_role(weight, tied_group="embedding")
    return stage


class Pipeline:
    """The pipeline's step runner (the interface of `moetrain.parallel.runner`): this rank's stage,
    its schedule, the links to its neighbours and the reduction of metrics over the stages."""

    def __init__(self, model, specs: Dict[str, StatSpec], cfg, pctx, seq_length: int):
        """Cuts `model` (built whole, already tensor / expert parallelized) down to this rank's stage;
        `bind` then attaches the optimizer step built over the stage's parameters."""
        ranges = split_layers(len(model.layers), pctx.pp, cfg.parallel.pipeline_layers)
        start, end = ranges[pctx.pp_rank]
        self.stats = StatLayout.of(model, specs, start, pctx.pp_rank == pctx.pp - 1)
        self.stage = build_pipeline_stage(model, cfg, pctx)
        self.model = self.stage
        self.pctx, self.cfg = pctx, cfg
        # the activation crossing a stage boundary: [B, S, H], its sequence slice under sequence parallel
        sequence_parallel = cfg.parallel.use_seq_parallel and pctx.tp > 1
        self.seq_length = seq_length // pctx.tp if sequence_parallel else seq_length
        self.hidden_size = cfg.model.hidden_size
        self.executor = None
        self.links = {}
        if not self.stage.is_last:
            self.links[NEXT] = PairLink(pctx.group("pp_next"), lower=True)
        if not self.stage.is_first:
            self.links[PREV] = PairLink(pctx.group("pp_prev"), lower=False)
        self.step_bytes_sent = 0

    def bind(self, opt_step) -> "Pipeline":
        """Attach the optimizer step built over this stage's parameters (its gradient order and buffers)."""
        self.executor = PipelineExecutor(self.stage, opt_step.params, self.cfg.parallel.pipeline_schedule,
                                         self.cfg.num_micro_batches, self.cfg.train.jit, opt_step.flatten)
        return self

    @property
    def peak_in_flight(self) -> int:
        return self.executor.peak_in_flight

    def activation_shape(self, batch_size: int) -> Tuple[int, int, int]:
        return (batch_size, self.seq_length, self.hidden_size)

    # ---- training --------------------------------------------------------------------------
    def train_step(self, batches, scale):
        """All micro-batches of one step through the schedule: this stage's gradient buffers summed
        over micro-batches, and the step's values for the whole model (the same on every stage)."""
        batches = [as_tensors(batch) for batch in batches]
        shape = self.activation_shape(int(batches[0][0].shape[0]))
        with comm.CommLedger() as ledger:
            grads, stats = run_with_links(self.executor.steps(batches, scale, shape), self.links)
        self.step_bytes_sent = ledger.bytes_by_group(backward=False).get("pp", 0)
        return grads, self.combine_stats(stats)

    def combine_stats(self, stats: Sequence[Dict]) -> Dict[str, object]:
        """Micro-batch mean (or sum) of this stage's stats, written into the whole-model layout and
        summed over the stages."""
        layout = self.stats
        parts = []
        for key in layout.scalars:
            arrays = [float(s[key].asnumpy()) if key in s else 0.0 for s in stats]
            parts.append(np.sum(arrays) if layout.reduce.get(key) == "sum" else np.mean(arrays))
        vector = [np.array(parts, np.float64)]
        for key, row in layout.stacked.items():
            rows = np.zeros((layout.rows,) + tuple(row), np.float64)
            if key in stats[0]:
                own = np.asarray([s[key].asnumpy() for s in stats], np.float64)
                own = own.sum(0) if layout.reduce.get(key) == "sum" else own.mean(0)
                rows[layout.offset:layout.offset + own.shape[0]] = own
            vector.append(rows.reshape(-1))
        flat = np.concatenate(vector).astype(np.float32)
        total = comm.all_reduce(ms.Tensor(flat), self.pctx.group("pp")).asnumpy().astype(np.float64)
        values = {key: total[i] for i, key in enumerate(layout.scalars)}
        offset = len(layout.scalars)
        for key, row in layout.stacked.items():
            size = layout.rows * int(np.prod(row))
            values[key] = total[offset:offset + size].reshape((layout.rows,) + tuple(row))
            offset += size
        return values

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, batch):
        """The model's loss on one batch (every stage gets it)."""
        batch = as_tensors(batch)
        shape = self.activation_shape(int(batch[0].shape[0]))
        stats = run_with_links(self.executor.forward_only(batch, shape), self.links)
        part = np.array([float(stats["loss"].asnumpy())], np.float32)
        return float(comm.all_reduce(ms.Tensor(part), self.pctx.group("pp")).asnumpy()[0]), {}

    def update_expert_bias(self, expert_load) -> None:
        """Aux-loss-free balancing for this stage's MoE layers, from its rows of the whole model's load."""
        model = self.stage.model
        if hasattr(model, "update_expert_bias"):
            rows = len(model.moe_modules())
            model.update_expert_bias(np.asarray(expert_load)[self.stats.offset:self.stats.offset + rows])
