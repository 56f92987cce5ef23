"""Pipeline schedules as data: every stage's instruction list (`Op`s of forward, backward, weight
and exchange over (model chunk, micro-batch)), checked and measured without running a model.
Pure Python (the planner imports it); moetrain/parallel/pipeline.py runs the lists.

    build_schedules(kind, P, M, chunks)    every stage's list (cached)
    compute_order / pair_exchanges         the passes' order; the exchanges placed by a lock-step run
    peak_in_flight(ops)                    the most micro-batch inputs a stage holds
    schedule_bubble(kind, P, M, chunks)    the idle fraction at given pass costs
    run_schedule(kind, P, M, chunks, cost) makespan and busy time at per-stage pass costs
    virtual_stage / stage_of               where the model chunks sit (round robin, or ZB-V's V)
    sends_per_micro_batch                  the tensors a stage sends its neighbours per micro-batch

The schedules and their sources are described in moetrain/parallel/pipeline.py.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from moetrain.layout import SCHEDULES

SPLIT_BACKWARD = ("zero_bubble_h1", "zero_bubble_v")   # backward as B (input gradient) + W (weight gradient)
FORWARD, BACKWARD, WEIGHT, EXCHANGE = "forward", "backward", "weight", "exchange"
ACTIVATION, GRADIENT = "activation", "gradient"


class PipelineError(RuntimeError):
    """A schedule that does not pair its exchanges, deadlocks or leaves work behind (a bug, not a
    layout: layouts are checked by moetrain.layout)."""


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------
class Msg(NamedTuple):
    """A tensor crossing between virtual stages: the activation INTO virtual stage `vstage`, or the
    gradient of `vstage`'s output, of micro-batch `micro`."""

    kind: str
    vstage: int
    micro: int


@dataclass(frozen=True)
class Op:
    """One instruction. forward / backward / weight: `micro` on the stage's model chunk `chunk`
    (weight: the weight-gradient pass of a split backward). exchange with stage `peer`: `send` goes
    out, `recv` comes in (either may be None)."""

    kind: str
    micro: int = -1
    chunk: int = 0
    peer: int = -1
    send: Optional[Msg] = None
    recv: Optional[Msg] = None


def chunks_per_stage(kind: str, interleave: int = 1) -> int:
    """Model chunks on every stage: two for ZB-V, `interleave` (parallel.pp_interleave_num) else."""
    return 2 if kind == "zero_bubble_v" else interleave


def virtual_stage(kind: str, num_stages: int, stage: int, chunk: int) -> int:
    """The virtual stage of `chunk` on `stage`: round robin (chunk c of stage s is c*P + s), or for
    ZB-V the V: stage s holds s and 2P-1-s (the last stage's two chunks are adjacent, the loss is on
    stage 0)."""
    if kind == "zero_bubble_v" and chunk == 1:
        return 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_of(kind: str, num_stages: int, vstage: int) -> Tuple[int, int]:
    """`(stage, chunk)` holding virtual stage `vstage`."""
    if kind == "zero_bubble_v" and vstage >= num_stages:
        return 2 * num_stages - 1 - vstage, 1
    return vstage % num_stages, vstage // num_stages


def sends_per_micro_batch(kind: str, num_stages: int, stage: int, chunks: int = 1) -> int:
    """Tensors `stage` sends to other stages per micro-batch: for each of its chunks, the
    activation into the next virtual stage and the gradient into the previous one, where that
    virtual stage sits on another stage (ZB-V's turn stays on its stage)."""
    V, sends = num_stages * chunks, 0
    for c in range(chunks):
        u = virtual_stage(kind, num_stages, stage, c)
        sends += sum(0 <= w < V and stage_of(kind, num_stages, w)[0] != stage for w in (u + 1, u - 1))
    return sends


def build_schedule(kind: str, num_stages: int, stage: int, num_micro: int, chunks: int = 1) -> List[Op]:
    """The instruction list of `stage` (see the module notes)."""
    return list(build_schedules(kind, num_stages, num_micro, chunks)[stage])


@functools.lru_cache(maxsize=64)
def build_schedules(kind: str, num_stages: int, num_micro: int, chunks: int = 1) -> Tuple[Tuple[Op, ...], ...]:
    """Every stage's instruction list. 1F1B and GPipe: Megatron's order with its merged two-way
    exchanges. Interleaved 1F1B: each stage's compute order (`compute_order`), the zero-bubble
    schedules: backward first; the exchanges placed by `pair_exchanges`."""
    if kind not in SCHEDULES:
        raise PipelineError(f"parallel.pipeline_schedule={kind!r} is not one of {SCHEDULES}")
    if num_micro < num_stages:
        raise PipelineError(f"{num_micro} micro-batches cannot fill {num_stages} pipeline stages")
    if chunks != chunks_per_stage(kind, chunks) or (chunks > 1) != (kind in ("interleaved_1f1b", "zero_bubble_v")):
        raise PipelineError(f"{kind} cannot run {chunks} model chunks per stage")
    if kind == "interleaved_1f1b" and num_micro % num_stages:
        raise PipelineError(f"interleaved 1F1B needs micro-batches ({num_micro}) in multiples of the stages "
                            f"({num_stages})")
    if kind in ("1f1b", "gpipe"):
        return tuple(tuple(_megatron_schedule(kind, num_stages, s, num_micro)) for s in range(num_stages))
    orders = None if kind in SPLIT_BACKWARD else [
        compute_order(kind, num_stages, s, num_micro, chunks) for s in range(num_stages)]
    return tuple(tuple(ops) for ops in pair_exchanges(kind, num_stages, num_micro, chunks, orders))


def _megatron_schedule(kind: str, num_stages: int, stage: int, num_micro: int) -> List[Op]:
    first, last = stage == 0, stage == num_stages - 1
    ops: List[Op] = []

    def exchange(up: bool, send=None, recv=None):
        """`up`: with stage + 1 (sends activations, receives gradients); else with stage - 1."""
        if (up and last) or (not up and first):
            return
        if up:
            out, back = stage + 1, stage
            ops.append(Op(EXCHANGE, peer=stage + 1, send=None if send is None else Msg(ACTIVATION, out, send),
                          recv=None if recv is None else Msg(GRADIENT, back, recv)))
        else:
            ops.append(Op(EXCHANGE, peer=stage - 1, send=None if send is None else Msg(GRADIENT, stage - 1, send),
                          recv=None if recv is None else Msg(ACTIVATION, stage, recv)))

    if kind == "gpipe":
        for m in range(num_micro):
            exchange(False, recv=m)
            ops.append(Op(FORWARD, m))
            exchange(True, send=m)
        for m in range(num_micro):
            exchange(True, recv=m)
            ops.append(Op(BACKWARD, m))
            exchange(False, send=m)
        return ops

    warmup = min(num_stages - stage - 1, num_micro)
    steady = num_micro - warmup
    for m in range(warmup):
        exchange(False, recv=m)
        ops.append(Op(FORWARD, m))
        exchange(True, send=m)
    if steady:
        exchange(False, recv=warmup)
    for i in range(steady):
        forward_micro, backward_micro = warmup + i, i
        ops.append(Op(FORWARD, forward_micro))
        exchange(True, send=forward_micro, recv=backward_micro)           # send_forward_recv_backward
        ops.append(Op(BACKWARD, backward_micro))
        if i == steady - 1:
            exchange(False, send=backward_micro)                          # send_backward
        else:
            exchange(False, send=backward_micro, recv=forward_micro + 1)  # send_backward_recv_forward
    for m in range(steady, num_micro):
        exchange(True, recv=m)
        ops.append(Op(BACKWARD, m))
        exchange(False, send=m)
    return ops


def compute_order(kind: str, num_stages: int, stage: int, num_micro: int, chunks: int) -> List[Op]:
    """The forward / backward / weight passes of `stage` in order, without exchanges.

    interleaved_1f1b: Megatron-Core's `forward_backward_pipelining_with_interleaving`: virtual
        micro-batch k runs chunk (k mod P·v) // P (backward: the chunks in reverse) on micro-batch
        (k // P·v)·P + k mod P; (P - s - 1)·2 + (v - 1)·P warm-up forwards, then one forward and one
        backward, then the remaining backwards.
    The zero-bubble schedules have no fixed order: `pair_exchanges` runs each stage's ready passes
    backward first (see there).
    """
    if kind != "interleaved_1f1b":
        raise PipelineError(f"{kind} has no fixed compute order")
    P, M, s, v = num_stages, num_micro, stage, chunks
    total = M * v
    warmup = total if M == P else min((P - s - 1) * 2 + (v - 1) * P, total)

    def op(k_index: int, forward: bool) -> Op:
        in_group = k_index % (P * v)
        chunk = in_group // P
        micro = (k_index // (P * v)) * P + in_group % P
        return Op(FORWARD if forward else BACKWARD, micro, chunk if forward else v - 1 - chunk)

    order = [op(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(k + warmup, True), op(k, False)]
    return order + [op(k, False) for k in range(total - warmup, total)]


def pair_exchanges(kind: str, num_stages: int, num_micro: int, chunks: int,
                   orders: Optional[Sequence[Sequence[Op]]] = None) -> List[List[Op]]:
    """Every stage's compute passes with the exchanges placed so that both ends of every pair of
    stages make the same exchanges in the same order, without deadlock.

    A simulation in unit time steps at the nominal costs (forward 1, input gradient 1, weight
    gradient 1, an unsplit backward 2): at each time, the passes ending then hand their outputs
    over, every pair of stages with tensors to pass, both between passes, makes one exchange per
    tensor (in a fixed order of pairs; each end sends its oldest waiting tensor for the other, or
    nothing), then every idle
    stage starts its next pass whose input has arrived: the next of `orders[s]`, or with no orders
    (the zero-bubble schedules) the first ready of: the next backward (ZB-V: of the V's second leg
    first), the next forward (second leg first) while fewer than P - s micro-batches (ZB-H1, 1F1B's
    memory) or 2P chunk inputs (ZB-V, the same bytes) are held, the oldest deferred weight pass.
    ZB-H1 is Qi et al. 2023, section 3; ZB-V places its chunks as in section 6 (torchtitan's
    ScheduleZBVZeroBubble) but runs backward first rather than the paper's fixed order (F B W per
    chunk in turn): here a weight pass recomputes the chunk's forward and costs about as much as
    a forward and an input gradient together, and the fixed order put a W and an F ahead of the
    input gradient the V's first leg waits for (measured: docs/parallel_engine.md). Every stage lists its
    exchanges in the same global (time, pair) order, so the lowest unfinished exchange always has
    both ends able to reach it: no deadlock. A tensor between two chunks of one stage (ZB-V's turn)
    is handed over without an exchange. Raises if the orders can never finish."""
    P, V = num_stages, num_stages * chunks
    split = kind in SPLIT_BACKWARD
    duration = {FORWARD: 1, BACKWARD: 1 if split else 2, WEIGHT: 1}
    lists: List[List[Op]] = [[] for _ in range(P)]
    position = [0] * P
    arrived: List[set] = [set() for _ in range(P)]
    done: List[set] = [set() for _ in range(P)]
    outbox: List[Dict[int, List[Msg]]] = [{} for _ in range(P)]
    running: List[Optional[Op]] = [None] * P
    ends = [0] * P
    per_stage = num_micro * chunks * (3 if split else 2)

    def ready(s: int, op: Op) -> bool:
        u = virtual_stage(kind, P, s, op.chunk)
        if op.kind == FORWARD:
            return u == 0 or Msg(ACTIVATION, u, op.micro) in arrived[s]
        if op.kind == BACKWARD:
            return (FORWARD, op.chunk, op.micro) in done[s] and (
                u == V - 1 or Msg(GRADIENT, u, op.micro) in arrived[s])
        return (BACKWARD, op.chunk, op.micro) in done[s]

    def greedy(s: int) -> Optional[Op]:
        """The zero-bubble schedules' next pass (see above)."""
        started = [op for op in lists[s] if op.kind != EXCHANGE]
        tally = collections.Counter((op.kind, op.chunk) for op in started)
        count = {(k, c): tally[(k, c)] for k in (FORWARD, BACKWARD, WEIGHT) for c in range(chunks)}
        held = sum(count[(FORWARD, c)] - count[(WEIGHT, c)] for c in range(chunks))
        bound = P - s if chunks == 1 else 2 * P
        candidates = [Op(BACKWARD, count[(BACKWARD, c)], c) for c in reversed(range(chunks))
                      if count[(BACKWARD, c)] < count[(FORWARD, c)]]
        candidates += [Op(FORWARD, count[(FORWARD, c)], c) for c in reversed(range(chunks))
                       if count[(FORWARD, c)] < num_micro and held < bound]
        begun = {(op.kind, op.chunk, op.micro) for op in started}
        candidates += [Op(WEIGHT, op.micro, op.chunk) for op in started            # the oldest deferred one
                       if op.kind == BACKWARD and (WEIGHT, op.chunk, op.micro) not in begun][:1]
        return next((op for op in candidates if ready(s, op)), None)

    time_step = 0
    while True:
        for s in range(P):   # passes ending now hand their outputs over
            op = running[s]
            if op is None or ends[s] > time_step:
                continue
            running[s] = None
            done[s].add((op.kind, op.chunk, op.micro))
            u = virtual_stage(kind, P, s, op.chunk)
            out = (Msg(ACTIVATION, u + 1, op.micro) if op.kind == FORWARD and u < V - 1 else
                   Msg(GRADIENT, u - 1, op.micro) if op.kind == BACKWARD and u > 0 else None)
            if out is not None:
                dest = stage_of(kind, P, out.vstage)[0]
                if dest == s:
                    arrived[s].add(out)
                else:
                    outbox[s].setdefault(dest, []).append(out)
        for a in range(P):
            for b in range(a + 1, P):
                if running[a] is not None or running[b] is not None:
                    continue                 # an exchange waits until both ends are between passes
                while outbox[a].get(b) or outbox[b].get(a):
                    up = outbox[a][b].pop(0) if outbox[a].get(b) else None
                    down = outbox[b][a].pop(0) if outbox[b].get(a) else None
                    lists[a].append(Op(EXCHANGE, peer=b, send=up, recv=down))
                    lists[b].append(Op(EXCHANGE, peer=a, send=down, recv=up))
                    arrived[b].add(up)
                    arrived[a].add(down)
        if all(len(done[s]) == per_stage and not any(outbox[s].values()) for s in range(P)):
            return lists
        for s in range(P):   # idle stages start their next pass
            if running[s] is not None:
                continue
            if orders is None:
                op = greedy(s)
            else:
                op = orders[s][position[s]] if position[s] < len(orders[s]) else None
                op = op if op is not None and ready(s, op) else None
            if op is not None:
                position[s] += 1
                lists[s].append(op)
                running[s], ends[s] = op, time_step + duration[op.kind]
        if all(running[s] is None for s in range(P)) and not any(any(box.values()) for box in outbox):
            stuck = {s: orders[s][position[s]] if orders else None for s in range(P) if len(done[s]) < per_stage}
            raise PipelineError(f"{kind}: the compute orders cannot finish; stages wait at {stuck}")
        time_step += 1


def peak_in_flight(ops: Sequence[Op]) -> int:
    """Most micro-batch inputs held at any point of `ops`: from a chunk's forward to its backward, or
    to its weight pass when the backward is split (W recomputes the forward from the same input)."""
    release = WEIGHT if any(op.kind == WEIGHT for op in ops) else BACKWARD
    held = peak = 0
    for op in ops:
        held += (op.kind == FORWARD) - (op.kind == release)
        peak = max(peak, held)
    return peak


@functools.lru_cache(maxsize=256)
def schedule_bubble(kind: str, num_stages: int, num_micro: int, chunks: int = 1,
                    costs: Tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The idle fraction of the schedule when a forward, input-gradient and weight-gradient pass
    of a whole stage take `costs` (F, B, W; a chunk's pass: over the chunks) and exchanges take no
    time, found by running every stage's list: 1 - busy / (stages x makespan). An unsplit backward
    costs B + W. 1F1B gives the textbook (P - 1) / (M + P - 1)."""
    f, b, w = (c / chunks for c in costs)
    split = kind in SPLIT_BACKWARD
    cost = {FORWARD: f, BACKWARD: b if split else b + w, WEIGHT: w}
    makespan, busy = run_schedule(kind, num_stages, num_micro, chunks, lambda stage, op: cost[op.kind])
    return 1.0 - sum(busy) / (num_stages * makespan)


def run_schedule(kind: str, num_stages: int, num_micro: int, chunks: int, cost) -> Tuple[float, List[float]]:
    """`(makespan, busy time of each stage)` of every stage's list when pass `op` of `stage` takes
    `cost(stage, op)` and exchanges take no time (both ends leave an exchange together)."""
    ops = build_schedules(kind, num_stages, num_micro, chunks)
    clock, position, busy = [0.0] * num_stages, [0] * num_stages, [0.0] * num_stages
    while any(position[s] < len(ops[s]) for s in range(num_stages)):
        moved = False
        for s in range(num_stages):
            while position[s] < len(ops[s]):
                op = ops[s][position[s]]
                if op.kind != EXCHANGE:
                    seconds = cost(s, op)
                    clock[s] += seconds
                    busy[s] += seconds
                    position[s] += 1
                    moved = True
                    continue
                peer = op.peer
                if position[peer] == len(ops[peer]) or ops[peer][position[peer]].kind != EXCHANGE \
                        or ops[peer][position[peer]].peer != s:
                    break                                  # the other end is not there yet
                clock[s] = clock[peer] = max(clock[s], clock[peer])
                position[s] += 1
                position[peer] += 1
                moved = True
        if not moved:
            raise PipelineError(f"{kind}: the schedule deadlocks")
    return max(clock), busy
