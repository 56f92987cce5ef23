"""The pipeline schedule walks of the cost model: which layers each model chunk holds, the most a
stage holds while it runs its instruction list (`pipeline_peak`), and the idle fraction at this
runtime's pass costs (`pipeline_bubble`). The schedules themselves are data in
moetrain/parallel/schedules.py (pure Python), the same lists the pipeline runs."""
from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple

from moetrain.layout import Layout
from moetrain.parallel import schedules
from moetrain.planner.arch import Arch


def chunk_layer_lists(arch: Arch, layout: Layout, stage: int) -> List[List[int]]:
    """The layers of each model chunk of `stage`: chunk c runs virtual stage
    `schedules.virtual_stage(stage, c)`; the MTP blocks run after the stack, with the head."""
    virtual = layout.pp * layout.chunks
    sizes = layout.pipeline_layers or [arch.layers // virtual] * virtual
    bounds = list(itertools.accumulate(sizes, initial=0))
    chunks = []
    for c in range(layout.chunks):
        u = schedules.virtual_stage(layout.schedule, layout.pp, stage, c) if layout.pp > 1 else 0
        chunks.append(list(range(bounds[u], bounds[u + 1])) + (list(arch.mtp_layers) if u == virtual - 1 else []))
    return chunks


def last_stage(layout: Layout) -> int:
    """The stage holding the head and loss: the last (ZB-V: the first, the V's end)."""
    return schedules.stage_of(layout.schedule, layout.pp, layout.pp * layout.chunks - 1)[0] if layout.pp > 1 else 0


def pipeline_in_flight(layout: Layout, stage: int) -> int:
    """The most micro-batch inputs `stage` holds (model chunks' inputs; 1 without pipeline)."""
    if layout.pp == 1:
        return 1
    return schedules.peak_in_flight(schedules.build_schedule(layout.schedule, layout.pp, stage,
                                                             layout.num_micro_batches, layout.chunks))


def pipeline_peak(layout: Layout, stage: int, inputs: Sequence[float], working: Sequence[float], hidden: float,
                  grads: float, buffers: float, alongside: float = 0.0) -> float:
    """The most `stage` holds above the step's start while it runs its schedule's instruction list,
    as moetrain/parallel/pipeline.py's `PipelineExecutor` keeps tensors (found with the dry run's
    pool record, pass by pass): each chunk input from its forward to its backward (or W);
    `hidden` for every hidden state or gradient received and not yet used, handed over and not yet
    sent, an output gradient kept from B to W, the last chunk's input gradient kept from its
    forward to its B; inside a pass, chunk c's working set `working[c]` (its layers' activations,
    recomputed from the input) and, in a pass that takes parameter gradients (unsplit backward, W,
    the last chunk's forward), the per-parameter gradients `grads` and their packed copy `buffers`
    at its end; between passes, the running gradient sum, with the old sum and the micro-batch's
    packed gradients while they are added. `alongside`: what a gradient pass holds beside its working
    set (ZeRO-2's bucketed packing: one unit's gradients and one bucket, while the activations
    are live). Every schedule is counted by this one walk."""
    kind, P = layout.schedule, layout.pp
    V, split = P * layout.chunks, kind in schedules.SPLIT_BACKWARD
    held = peak = 0.0
    summed = False       # the running gradient sum exists (after the first gradient pass)

    def gradient_pass(c: int) -> None:
        nonlocal peak, summed
        total = buffers if summed else 0.0
        peak = max(peak, held + total + max(working[c] + alongside, grads + buffers))
        if summed:               # old sum + micro-batch + new sum
            peak = max(peak, held + 3 * buffers)
        summed = True

    for op in schedules.build_schedule(kind, P, stage, layout.num_micro_batches, layout.chunks):
        if op.kind == schedules.EXCHANGE:
            held += hidden * ((op.recv is not None) - (op.send is not None))
            continue
        c = op.chunk
        u = schedules.virtual_stage(kind, P, stage, c)
        first, last = u == 0, u == V - 1
        if op.kind == schedules.FORWARD:
            held += inputs[c] - (0.0 if first else hidden)    # the received activation becomes the input
            if last:
                gradient_pass(c)                            # its whole backward runs in its forward
            held += hidden                                  # output handed over, or the last's input gradient
        elif op.kind == schedules.BACKWARD:
            if last:
                held -= 0.0 if split else inputs[c]
            elif split:                                     # B: the output gradient stays for W
                if not first:
                    peak = max(peak, held + (buffers if summed else 0.0) + working[c] + hidden)
                    held += hidden
            else:
                gradient_pass(c)
                held += (0.0 if first else hidden) - inputs[c] - hidden
        else:                                               # W
            if not last:
                gradient_pass(c)
                held -= hidden
            held -= inputs[c]
    return peak


def pipeline_bubble(layout: Layout, pass_costs: Sequence[Sequence[Tuple[float, float, float]]]) -> float:
    """The idle fraction of the busiest stage when every stage runs its schedule's instruction list
    with its own pass costs (`pass_costs[stage][chunk]`: F, B, W seconds) and exchanges take no
    time: 1 - busiest stage's work / makespan. At equal costs on every stage this is
    `schedules.schedule_bubble`; here the costs are this runtime's (the last virtual stage takes its
    gradients in its forward, a split backward recomputes the forward in B and in W)."""
    index = {schedules.FORWARD: 0, schedules.BACKWARD: 1, schedules.WEIGHT: 2}
    makespan, busy = schedules.run_schedule(layout.schedule, layout.pp, layout.num_micro_batches, layout.chunks,
                                            lambda stage, op: pass_costs[stage][op.chunk][index[op.kind]])
    return 1.0 - max(busy) / makespan
