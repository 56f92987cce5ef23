"""Pipeline parallelism: the model cut into stages by layers, run with a 1F1B or GPipe schedule.

    stage 0: embed + layers[0:a]    stage s: layers[a:b]    stage P-1: layers[..:L] + final norm, head, loss

Every rank of a pipeline stage builds the whole model with the same seed (so the split model
starts exactly where a one-process run starts, tied embeddings included) and keeps only its
stage's cells (`PipelineStage`, parameter names unchanged); the rest is freed.

Schedules (`build_schedule`) are per-stage instruction lists of forward, backward and link
exchanges, Megatron's order. 1F1B: stage s runs `min(P - s - 1, M)` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most
`P - s` micro-batches in flight (GPipe: all M). `PipelineExecutor.peak_in_flight` counts them.

Links. On CPU the only collective in a sub-group is AllReduce, so a point-to-point message is a
SUM AllReduce on the 2-rank group of neighbours (`pp_next` / `pp_prev`) to which the receiver
contributes zeros. Both ranks must make the same calls in the same order, and a rank that sends
an activation while its neighbour sends a gradient must not call two different AllReduces: like
Megatron's `send_forward_recv_backward`, such a pair is ONE exchange of a `[2, *shape]` buffer,
slot 0 the lower stage's activation, slot 1 the upper stage's gradient. The schedules are built
so that the exchanges of both ends of every link pair up one to one; `drive_in_process` runs all
stages in one process with the same pairing and checks it (tests: every schedule, no deadlock).

Backward by recomputation. MindSpore cannot keep an autodiff graph alive between two jitted
calls, so a stage keeps only its INPUT per micro-batch in flight (token ids on the first stage)
and its backward is `value_and_grad` of `sum(stage(x) * dout) + scale * aux(x)` with respect to
its parameters and `x`: one extra stage forward per micro-batch on every stage but the last,
whose forward and backward are one call (`value_and_grad` of its loss) because 1F1B runs them
back to back anyway.

Loss and metrics. The model's loss is `lm_loss + sum over MoE layers of the weighted aux
losses`, so stage s contributes its layers' weighted aux terms and the last stage adds lm_loss.
Each stage reduces its stats over micro-batches into a vector laid out for the WHOLE model
(loss part, lm_loss, aux terms, counts, expert_load rows of every MoE layer, zeros outside its
own), and one AllReduce over the `pp` group gives every rank, rank 0 included, the same metrics a
one-process run reports.

Tied embeddings: first and last stage both hold `embed.weight`; it is broadcast from the first
stage at start and marked `tied_group="embedding"`, so the optimizer sums its gradient over that
group every step and counts it as two copies in the global gradient norm.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import ReduceOp

from moetrain.moe.layer import update_expert_bias as balancing_step
from moetrain.parallel import comm
from moetrain.parallel.sharding import mark_role

SCHEDULES = ("1f1b", "gpipe")
FORWARD, BACKWARD, EXCHANGE = "forward", "backward", "exchange"
NEXT, PREV = "next", "prev"


class PipelineError(ValueError):
    """A pipeline layout that cannot run; the message says what, where, and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Splitting the layers
# ---------------------------------------------------------------------------------------------
def split_layers(num_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]] = None
                 ) -> List[Tuple[int, int]]:
    """`[(start, end), ...]`: the layer range of every stage (even split, or `layers_per_stage`)."""
    if num_stages < 1:
        raise PipelineError(f"parallel.pipeline_stage must be >= 1, got {num_stages}")
    if layers_per_stage:
        sizes = [int(n) for n in layers_per_stage]
        if len(sizes) != num_stages or min(sizes) < 1 or sum(sizes) != num_layers:
            raise PipelineError(
                f"parallel.pipeline_layers={list(layers_per_stage)} must give {num_stages} stages "
                f"(parallel.pipeline_stage) of >= 1 layers summing to model.num_layers={num_layers}; "
                f"it has {len(sizes)} entries summing to {sum(sizes)}")
    else:
        if num_layers % num_stages:
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise PipelineError(
                f"model.num_layers={num_layers} cannot be split evenly into parallel.pipeline_stage="
                f"{num_stages} stages: choose pipeline_stage in {divisors} or list the layers of each "
                f"stage in parallel.pipeline_layers")
        sizes = [num_layers // num_stages] * num_stages
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def validate_pipeline_config(cfg) -> List[Tuple[int, int]]:
    """Check a config with `parallel.pipeline_stage > 1` before anything is built; returns the split."""
    p = cfg.parallel
    ranges = split_layers(getattr(cfg.model, "num_layers", 0), p.pipeline_stage, p.pipeline_layers)
    if cfg.num_micro_batches < p.pipeline_stage:
        raise PipelineError(
            f"{cfg.num_micro_batches} micro-batch(es) per step (train.global_batch_size="
            f"{cfg.train.global_batch_size} / (data_parallel={cfg.dp} x micro_batch_size="
            f"{cfg.micro_batch_size})) cannot fill {p.pipeline_stage} pipeline stages: need at least "
            f"{p.pipeline_stage}; lower train.micro_batch_size, set parallel.micro_batch_num or raise "
            f"train.global_batch_size")
    return ranges


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
def _stat_keys(model) -> Tuple[str, ...]:
    """Per-layer MoE stats summed over layers (the model's own contract, see models/moe_gpt.py)."""
    if not getattr(model, "moe_layer_indices", ()):
        return ()
    from models.moe_gpt import AUX_TERMS, COUNT_TERMS

    return tuple(AUX_TERMS + COUNT_TERMS)


def _check_splittable(model) -> None:
    needed = ("embed", "layers", "final_norm", "cross_entropy", "compute_dtype", "tie_embeddings", "max_positions")
    missing = [name for name in needed if not hasattr(model, name)]
    if missing:
        raise PipelineError(
            f"parallel.pipeline_stage > 1 needs a model made of embed / layers / final_norm / lm_head "
            f"(the GPT family: gpt, moe_gpt); {type(model).__name__} lacks {missing}: set "
            f"parallel.pipeline_stage=1")


class PipelineStage(nn.Cell):
    """Layers `[start, end)` of a GPT-family model, plus the embedding on the first stage and
    final norm, LM head and loss on the last. `construct(x, labels)` -> `(out, stats)`: `out`
    is the hidden state `[B, S, H]`, or on the last stage its loss part; `stats["loss"]` is
    this stage's part of the model's loss (weighted MoE aux terms, + lm_loss on the last),
    the MoE terms are summed over its layers and `expert_load` stacks its layers' rows.
    Parameter names are the whole model's (`layers.{i}....`)."""

    def __init__(self, model, start: int, end: int, num_stages: int, stage: int):
        super().__init__(auto_prefix=False)   # keep the model's parameter names
        self.start, self.end, self.stage, self.num_stages = start, end, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.tie_embeddings = bool(model.tie_embeddings)
        self.max_positions = model.max_positions
        self.embed = model.embed if self.is_first or (self.is_last and self.tie_embeddings) else None
        self.layers = nn.CellList([model.layers[i] for i in range(start, end)], auto_prefix=False)
        moe_layers = tuple(getattr(model, "moe_layer_indices", ()))
        self.moe_positions = tuple(i - start for i in moe_layers if start <= i < end)
        self.moe_rows = tuple(moe_layers.index(i + start) for i in self.moe_positions)  # rows of expert_load
        self.num_moe_layers = len(moe_layers)
        self.stat_keys = _stat_keys(model)
        self.compute_dtype = model.compute_dtype
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last and not self.tie_embeddings else None
        self.cross_entropy = model.cross_entropy if self.is_last else None
        self.tied_head_matmul = ops.MatMul(transpose_b=True)

    def output_logits(self, h):
        """The model's `output_logits` (models/gpt.py), on the last stage."""
        h = self.final_norm(h)
        if self.tie_embeddings:
            batch, seq_len = h.shape[0], h.shape[1]
            weight = self.embed.weight
            if self.compute_dtype != ms.float32:
                h = h.astype(self.compute_dtype)
                weight = weight.astype(self.compute_dtype)
            logits = self.tied_head_matmul(h.reshape(batch * seq_len, -1), weight).reshape(batch, seq_len, -1)
        else:
            logits = self.lm_head(h)
        return logits.astype(ms.float32)

    def construct(self, x, labels=None):
        if self.is_first:
            if x.shape[-1] > self.max_positions:
                raise ValueError(f"input has {x.shape[-1]} tokens per sequence but the model was built "
                                 f"for at most model.seq_length={self.max_positions}")
            h = self.embed(x)
        else:
            h = x
        zero = ops.zeros((), ms.float32)
        stats = {key: zero for key in self.stat_keys}
        weighted_aux = zero
        loads = []
        for index in range(len(self.layers)):
            if index in self.moe_positions:
                h, layer_stats = self.layers[index](h)
                for key in self.stat_keys:
                    stats[key] = stats[key] + layer_stats[key].astype(ms.float32)
                weighted_aux = weighted_aux + self.layers[index].moe.weighted_aux(layer_stats)
                loads.append(layer_stats["expert_load"].astype(ms.float32))
            else:
                h = self.layers[index](h)
        if loads:
            stats["expert_load"] = ops.stack(loads)
        if self.is_last:
            lm_loss = self.cross_entropy(self.output_logits(h), labels)
            stats["lm_loss"] = lm_loss
            stats["loss"] = lm_loss + weighted_aux
            return stats["loss"], stats
        stats["loss"] = weighted_aux
        return h, stats

    def update_expert_bias(self, expert_load: np.ndarray) -> None:
        """Aux-loss-free balancing for this stage's MoE layers from the whole model's
        `expert_load [num_moe_layers, E]` (the same rule as the model's own method). In place with
        `ops.assign`: after `set_data` a graph compiled earlier (the stage's jitted forward and
        backward) keeps reading the old bias (MindSpore 2.10, measured)."""
        expert_load = np.asarray(expert_load)
        if expert_load.shape[0] != self.num_moe_layers:
            raise ValueError(f"expert_load has {expert_load.shape[0]} rows, the model has "
                             f"{self.num_moe_layers} MoE layers")
        for position, row in zip(self.moe_positions, self.moe_rows):
            moe = self.layers[position].moe
            new_bias = balancing_step(moe.expert_bias.asnumpy(), expert_load[row], moe.cfg.bias_update_rate)
            ops.assign(moe.expert_bias, ms.Tensor(new_bias, ms.float32))   # not set_data: see below


def build_stages(model, ranges: Sequence[Tuple[int, int]], stages: Optional[Iterable[int]] = None) -> Dict:
    """`{stage: PipelineStage}` for `stages` (default all) of `model`; the cells are shared with it."""
    _check_splittable(model)
    if ranges[-1][1] != len(model.layers):
        raise PipelineError(f"the stages cover {ranges[-1][1]} layers but the model has {len(model.layers)}")
    chosen = range(len(ranges)) if stages is None else stages
    return {s: PipelineStage(model, *ranges[s], len(ranges), s) for s in chosen}


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
        def forward(x, labels):
            out, stats = stage(x, labels)
            return out, tuple(stats.keys()), tuple(stats.values())

        def loss_of(x, labels, scale):            # last stage: its loss part, scaled
            loss, stats = stage(x, labels)
            return loss * scale, stats

        def objective(x, dout, scale):            # other stages: <out, dout> + scale * aux
            out, stats = stage(x, None)
            return (out * dout).sum() + stats["loss"] * scale

        input_position = None if first else 0    # the first stage's input is token ids
        loss_grad = ms.value_and_grad(loss_of, input_position, self.params, has_aux=True)
        objective_grad = ms.value_and_grad(objective, input_position, self.params)

        def forward_backward(x, labels, scale):
            (_, stats), grads = loss_grad(x, labels, scale)
            param_grads, dx = _split_grads(grads, first)
            return tuple(stats.keys()), tuple(stats.values()), pack(param_grads), dx

        def backward(x, dout, scale):
            _, grads = objective_grad(x, dout, scale)
            param_grads, dx = _split_grads(grads, first)
            return pack(param_grads), dx

        def accumulate(acc, grads):
            return tuple(a + g for a, g in zip(acc, grads))

        jitted_forward, jitted_forward_backward = wrap(forward), wrap(forward_backward)

        def forward_with_dict(x, labels):
            out, keys, values = jitted_forward(x, labels)
            return out, dict(zip(keys, values))

        def forward_backward_with_dict(x, labels, scale):
            keys, values, grads, dx = jitted_forward_backward(x, labels, scale)
            return dict(zip(keys, values)), grads, dx

        self._forward, self._forward_backward = forward_with_dict, forward_backward_with_dict
        self._backward, self._accumulate = wrap(backward), wrap(accumulate)

    def steps(self, batches: Sequence[Tuple], scale, activation_shape: Tuple[int, ...]):
        """Generator over this stage's schedule; yields `Exchange`s, returns `(grads, stats)` with
        grads summed over micro-batches and `stats[m]` the stage's stats of micro-batch m.
        `batches[m]` = (input_ids, labels) Tensors (only the first / last stage reads them)."""
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
            if op.kind == FORWARD:
                x = batches[m][0] if stage.is_first else received[PREV].pop(m)
                if stage.is_last:
                    stats[m], micro_grads, dx = self._forward_backward(x, batches[m][1], scale)
                    add(micro_grads)
                    held[m] = dx
                else:
                    outgoing[NEXT][m], stats[m] = self._forward(x, None)
                    held[m] = x
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            else:
                kept = held.pop(m)
                self.in_flight -= 1
                if stage.is_last:
                    dx = kept
                else:
                    micro_grads, dx = self._backward(kept, received[NEXT].pop(m), scale)
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
        out, stats = self._forward(x, batch[1] if stage.is_last else None)
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
class PairLink:
    """The 2-rank group with one neighbour; every exchange is one SUM AllReduce on it. Slot 0 of a
    two-way buffer carries the lower stage's activation, slot 1 the upper stage's gradient."""

    def __init__(self, group, lower: bool):
        self.group = group
        self.slot = 0 if lower else 1
        self.sum = ops.AllReduce(ReduceOp.SUM, group.name)
        self.bytes_sent = 0

    def exchange(self, request: Exchange):
        nbytes = int(np.prod(request.shape)) * 4
        if request.payload is not None and request.recv is not None:
            zeros = ops.zeros(request.shape, ms.float32)
            pair = (request.payload, zeros) if self.slot == 0 else (zeros, request.payload)
            total = self.sum(ops.stack(pair))
            self.bytes_sent += nbytes
            return total[1 - self.slot]
        if request.payload is not None:
            self.sum(request.payload)
            self.bytes_sent += nbytes
            return None
        return self.sum(ops.zeros(request.shape, ms.float32))


def run_with_links(run, links: Dict[str, PairLink]):
    """Drive one stage's generator on a real rank: each exchange is an AllReduce on its link."""
    reply = None
    while True:
        try:
            request = run.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = links[request.link].exchange(request)


# ---------------------------------------------------------------------------------------------
# What the trainer uses
# ---------------------------------------------------------------------------------------------
CPU_COLLECTIVE_TIMEOUT_S = 600


def allow_slow_neighbours() -> None:
    """Raise the CPU collectives' timeout (30 s by default) to CPU_COLLECTIVE_TIMEOUT_S unless the
    user set MS_CPU_COMM_OP_TIMEOUT. During the first step every stage compiles its own graphs,
    and a stage waits in a link exchange until its neighbour has compiled: under load that took
    more than 30 s here. MindSpore reads the variable when a collective first runs: call this
    before any. (A crashed rank is still caught at once by the launcher's watchdog.)"""
    os.environ.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(CPU_COLLECTIVE_TIMEOUT_S))


def build_pipeline_stage(model, cfg, pctx) -> PipelineStage:
    """This rank's stage of `model` (built whole with the run's seed, already tensor / expert
    parallelized). Once the caller drops `model`, the other stages' cells are freed."""
    ranges = validate_pipeline_config(cfg)
    stage = build_stages(model, ranges, [pctx.pp_rank])[pctx.pp_rank]
    if stage.tie_embeddings and (stage.is_first or stage.is_last) and pctx.group("embedding").size > 1:
        weight = stage.embed.weight
        weight.set_data(comm.broadcast(ms.Tensor(weight.asnumpy()), 0, pctx.group("embedding")))   # the first's
        # both ends hold it: the optimizer sums its gradient over them and counts it once in the norm
        mark_role(weight, tied_group="embedding")
    return stage


class Pipeline:
    """One rank's share of the pipeline: its stage's schedule, the links to its neighbours, the
    tied-embedding group and the reduction of metrics over the stages."""

    def __init__(self, stage: PipelineStage, opt_step, cfg, pctx, seq_length: int):
        self.stage, self.pctx, self.cfg = stage, pctx, cfg
        # the activation crossing a stage boundary: [B, S, H], its sequence slice under sequence parallel
        sequence_parallel = cfg.parallel.use_seq_parallel and pctx.tp > 1
        self.seq_length = seq_length // pctx.tp if sequence_parallel else seq_length
        self.hidden_size = cfg.model.hidden_size
        self.executor = PipelineExecutor(stage, opt_step.params, cfg.parallel.pipeline_schedule,
                                         cfg.num_micro_batches, cfg.train.jit, opt_step.flatten)
        self.links = {}
        if not stage.is_last:
            self.links[NEXT] = PairLink(pctx.group("pp_next"), lower=True)
        if not stage.is_first:
            self.links[PREV] = PairLink(pctx.group("pp_prev"), lower=False)
        self.stat_keys = ("loss", "lm_loss") + tuple(stage.stat_keys)
        self.step_bytes_sent = 0
        self.load_shape = (stage.num_moe_layers, cfg.model.moe.num_experts) if stage.num_moe_layers else None

    @property
    def peak_in_flight(self) -> int:
        return self.executor.peak_in_flight

    @property
    def bytes_sent(self) -> int:
        """Bytes of activations and gradients this rank has sent to its neighbours (point-to-point
        volume; the CPU emulation all-reduces one such buffer per exchange and direction)."""
        return sum(link.bytes_sent for link in self.links.values())

    def activation_shape(self, batch_size: int) -> Tuple[int, int, int]:
        return (batch_size, self.seq_length, self.hidden_size)

    # ---- training --------------------------------------------------------------------------
    def train_step(self, batches: Sequence[Tuple], scale, summed: Sequence[str]):
        """All micro-batches of one step through the schedule. Returns `(grads, values)`: this
        stage's gradients summed over micro-batches (tied embedding already all-reduced) and the
        step's metrics for the whole model (micro-batch mean or sum), the same on every stage."""
        shape = self.activation_shape(self.cfg.micro_batch_size)
        sent_before = self.bytes_sent
        grads, stats = run_with_links(self.executor.steps(batches, scale, shape), self.links)
        self.step_bytes_sent = self.bytes_sent - sent_before
        return grads, self.combine_stats(stats, summed)

    def combine_stats(self, stats: Sequence[Dict], summed: Sequence[str]) -> Dict[str, object]:
        """Micro-batch mean (sum for `summed` keys) of this stage's stats, written into the
        whole-model layout and summed over the stages."""
        parts = []
        for key in self.stat_keys:
            arrays = [float(s[key].asnumpy()) if key in s else 0.0 for s in stats]
            parts.append(np.sum(arrays) if key in summed else np.mean(arrays))
        vector = np.array(parts, np.float64)
        if self.load_shape is not None:
            loads = np.zeros(self.load_shape, np.float64)
            if self.stage.moe_rows:
                own = np.sum([s["expert_load"].asnumpy() for s in stats], 0)
                loads[list(self.stage.moe_rows)] = own
            vector = np.concatenate([vector, loads.reshape(-1)])
        total = comm.all_reduce(ms.Tensor(vector.astype(np.float32)), self.pctx.group("pp")).asnumpy()
        total = total.astype(np.float64)
        values = {key: total[i] for i, key in enumerate(self.stat_keys)}
        if self.load_shape is not None:
            values["expert_load"] = total[len(self.stat_keys):].reshape(self.load_shape)
        return values

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate_batch(self, batch) -> float:
        """The model's loss on one batch (every stage gets it)."""
        shape = self.activation_shape(int(batch[0].shape[0]))
        stats = run_with_links(self.executor.forward_only(batch, shape), self.links)
        part = np.array([float(stats["loss"].asnumpy())], np.float32)
        return float(comm.all_reduce(ms.Tensor(part), self.pctx.group("pp")).asnumpy()[0])
