"""What a model family exposes, so that one trainer, pipeline / tensor / expert parallelism and the
planner work on it without copying model code.

Every model:
    construct(*batch) -> (loss, stats)      stats: a dict of fp32 tensors
    stat_specs() -> {name: StatSpec}        how each stat combines over layers, micro-batches and
                                            data-parallel ranks (a stat left out averages)

A layered language model, for pipeline parallelism, adds the pieces its `construct` is made of:
    embed_tokens(input_ids) -> h            the first stage's part
    run_layers(h, context) -> (h, stats, aux)   the blocks this model (or pipeline stage) holds; aux:
                                            the weighted auxiliary losses they add to the loss
    head_loss(h, labels, context) -> (loss, stats)   the last stage's part: final norm, head, loss (+ MTP)
    EMBEDDING_CELLS, HEAD_CELLS             the attribute names of the first / last stage's cells
                                            (built only if `builds_embedding` / `builds_head`, else None)
    needs_embedding_in_head                 the head reads the embedding (tied head, MTP)
    head_stat_rows                          per-layer stat rows the head adds (MTP's MoE blocks)
A block of `layers` returns `h`, or `(h, stats)` when it sets `returns_stats` (then it also has
`weighted_aux(stats)` and its stats follow the model's `stat_specs`).

Packed documents (`data.reset_attention_mask` / `data.reset_position_ids`): the batch is then
`(input_ids, labels, document_ids, position_ids)` and `construct` takes the last two (None
otherwise). `attention_context` makes them the attention context, None or the tuple
`(document_ids, position_ids)` of int32 `[B, S]` tensors, which `run_layers` / `run_blocks` pass to
every block as `block(h, context)` and each block to its attention (`moetrain.layers.CausalAttention`);
blocks see it only when it is not None, so a block without the argument runs unpacked batches. It is
one argument held per call, not state: one compiled graph serves every batch, and a pipeline stage
receives its micro-batch's context beside its input. Tensor parallelism is declared
per family in `moetrain.parallel.plans` by module paths; expert parallelism finds the `MoELayer`s.
`moetrain.parallel.pipeline` builds each stage's chunk alone (`building_part`: its blocks; the
embedding and head cells only where `builds_embedding` / `builds_head` say), cuts what a model built
beyond that with `keep_stage`, and calls the pieces.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mindspore as ms
from mindspore import nn, ops

from moetrain.layout import LayoutError

SUM, MEAN = "sum", "mean"


@dataclass(frozen=True)
class StatSpec:
    """`reduce`: over micro-batches and data-parallel ranks (SUM for counts, MEAN for losses).
    Produced by several layers, a stat is summed over them, or, `per_layer`, stacked: one row of
    shape `row` per producing layer, in layer order."""

    reduce: str = MEAN
    per_layer: bool = False
    row: Tuple[int, ...] = ()


def stat_specs_of(model) -> Dict[str, StatSpec]:
    return model.stat_specs() if hasattr(model, "stat_specs") else {}


def summed_stats(specs: Dict[str, StatSpec]) -> Tuple[str, ...]:
    """The stats that add up over micro-batches and data-parallel ranks (the others average)."""
    return tuple(name for name, spec in specs.items() if spec.reduce == SUM)


def reused_block(init):
    """Decorate a block's `__init__`: MindSpore compiles ONE graph per block class and init
    arguments and reuses it for every layer (`ms.lazy_inline` with the "front" policy: the reused
    sub-graph is inlined in the frontend, after autodiff, so CPU and GPU run it as well as Ascend;
    the default policy fails on CPU with "Input[0] must be a Primitive ValueNode"). The first step's
    compile then grows far slower than the depth (docs/performance.md, "Compile time at depth");
    results are bitwise the same. `train.cell_reuse: false` turns it off (A/B measurements;
    `set_cell_reuse`, read when a block is built)."""
    reused = ms.lazy_inline(init, policy="front")

    @functools.wraps(init)
    def build(self, *args, **kwargs):
        return (reused if CELL_REUSE[0] else init)(self, *args, **kwargs)

    return build


CELL_REUSE = [True]   # train.cell_reuse of the model being built (moetrain.build.build_model sets it)


def set_cell_reuse(on: bool) -> None:
    """Whether blocks built from now on compile one graph reused by every layer (`reused_block`)."""
    CELL_REUSE[0] = bool(on)


def split_specs(specs: Dict[str, StatSpec]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """`(summed over layers, stacked per layer)` stat names: the graph-safe form of `specs`."""
    return (tuple(sorted(n for n, s in specs.items() if not s.per_layer)),
            tuple(sorted(n for n, s in specs.items() if s.per_layer)))


def attention_context(document_ids=None, position_ids=None):
    """The attention context of a batch (see the module notes): None for plain causal attention,
    else `(document_ids, position_ids)` as int32. The dataset yields both or neither."""
    if document_ids is None and position_ids is None:
        return None
    if document_ids is None or position_ids is None:
        raise ValueError("packed documents need both document_ids and position_ids (the LM dataset yields both "
                         "with data.reset_attention_mask or data.reset_position_ids)")
    return document_ids.astype(ms.int32), position_ids.astype(ms.int32)


def run_blocks(blocks, h, summed: Tuple[str, ...], stacked: Tuple[str, ...], context=None):
    """Run `blocks` in order: `(h, stats, aux)`. Stats of the blocks that return them are summed
    over blocks (`stacked` ones: one row per block); `aux` is the sum of their `weighted_aux`.
    `context` (None, or packed documents: `attention_context`) goes to every block.
    Graph-safe: names and `returns_stats` are Python constants, the loop unrolls over the blocks."""
    zero = ops.zeros((), ms.float32)
    totals = {name: zero for name in summed}
    rows = {name: [] for name in stacked}
    aux = zero
    for block in blocks:
        args = (h,) if context is None else (h, context)
        if block.returns_stats:
            h, stats = block(*args)
            for name in summed:
                totals[name] = totals[name] + stats[name].astype(ms.float32)
            for name in stacked:
                rows[name].append(stats[name].astype(ms.float32))
            aux = aux + block.weighted_aux(stats)
        else:
            h = block(*args)
    for name in stacked:
        if rows[name]:
            totals[name] = ops.stack(rows[name])
    return h, totals, aux


def merge_stats(stats, more, stacked: Tuple[str, ...]):
    """`stats` with `more` added in: summed, the `stacked` ones' rows appended after `stats`' rows."""
    for name in more:
        if name not in stats:
            stats[name] = more[name]
        elif name in stacked:
            stats[name] = ops.cat((stats[name], more[name]), 0)
        else:
            stats[name] = stats[name] + more[name]
    return stats


def stat_rows(blocks) -> int:
    """Per-layer stat rows `blocks` produce (one per block that returns stats)."""
    return sum(1 for block in blocks if getattr(block, "returns_stats", False))


# ---------------------------------------------------------------------------------------------
# Building a part of a model: the layers of one pipeline chunk, not the whole stack
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuiltPart:
    """What a model constructed inside `building_part` builds: blocks `[start, end)`; `first` / `last`:
    its chunk is the first / last virtual stage; `embedding_from_chunk`: another chunk of this rank
    holds the first virtual stage and lends its embedding to this one's head (ZB-V's stage 0)."""
    start: int
    end: int
    first: bool = True
    last: bool = True
    embedding_from_chunk: bool = False


_BUILDING: List[Optional[BuiltPart]] = [None]


@contextlib.contextmanager
def building_part(part: BuiltPart):
    """Models constructed inside the block build only one pipeline chunk (`moetrain.build.build_model`
    with a parallel context): their blocks `[part.start, part.end)`, named as in the whole model, the
    embedding cells only where `builds_embedding` says, the head cells only where `builds_head` says.
    So a stage is cut before it is constructed; `keep_stage` then drops only what a model that
    ignores these (a user's family) built anyway."""
    saved, _BUILDING[0] = _BUILDING[0], part
    try:
        yield
    finally:
        _BUILDING[0] = saved


def builds_embedding(head_reads_it: bool) -> bool:
    """Whether the model being constructed builds its `EMBEDDING_CELLS`: always, except inside
    `building_part` of a chunk that is not the first virtual stage and whose head does not read the
    embedding (`head_reads_it`: `needs_embedding_in_head`), or reads one lent by another chunk."""
    part = _BUILDING[0]
    return part is None or part.first or (part.last and head_reads_it and not part.embedding_from_chunk)


def builds_head() -> bool:
    """Whether the model being constructed builds its `HEAD_CELLS`: except inside `building_part` of a
    chunk that is not the last virtual stage."""
    return _BUILDING[0] is None or _BUILDING[0].last


def build_layers(model, build_block, num_layers: int) -> None:
    """Set `model.layers` to the blocks `build_block(i)` of the layer range being built (all
    `num_layers`, or `building_part`'s range), each named `layers.{i}.` as in the whole model, and
    `model.built_range` to that range."""
    part = _BUILDING[0]
    start, end = (part.start, part.end) if part is not None else (0, num_layers)
    if not 0 <= start < end <= num_layers:
        raise LayoutError(f"layers [{start}, {end}) are not within the model's {num_layers} layers")
    blocks = []
    for i in range(start, end):
        block = build_block(i)
        block.update_parameters_name(f"layers.{i}.")
        blocks.append(block)
    auto_prefix = model._auto_prefix   # the blocks are named already: no renaming by position
    model._auto_prefix = False
    try:
        model.layers = nn.CellList(blocks, auto_prefix=False)
    finally:
        model._auto_prefix = auto_prefix
    model.built_range = (start, end)


def layer_stat_rows(model, start: int, end: int) -> int:
    """Per-layer stat rows of the whole model's blocks `[start, end)`, built here or not (the model's
    `block_returns_stats`; without it, the blocks it holds)."""
    if hasattr(model, "block_returns_stats"):
        return sum(1 for i in range(start, end) if model.block_returns_stats(i))
    built = getattr(model, "built_range", (0, len(model.layers)))
    return stat_rows(model.layers[i - built[0]] for i in range(start, end))


def keep_stage(model, start: int, end: int, first: bool, last: bool) -> None:
    """Cut `model` down, in place, to one pipeline stage: its blocks `[start, end)`, the embedding on
    the first stage (and on the last when the head reads it), the head cells on the last. Parameter
    names stay the whole model's (`layers.{i}...`), so checkpoints and optimizers see no difference;
    the other cells are dropped and freed with the caller's last reference."""
    missing = [name for name in ("layers", "embed_tokens", "run_layers", "head_loss", "EMBEDDING_CELLS",
                                 "HEAD_CELLS") if not hasattr(model, name)]
    if missing:
        raise LayoutError(f"parallel.pipeline_stage > 1 needs a layered model (moetrain/modeling.py: layers, "
                          f"embed_tokens, run_layers, head_loss, EMBEDDING_CELLS, HEAD_CELLS); "
                          f"{type(model).__name__} lacks {missing}: set parallel.pipeline_stage=1")
    built = getattr(model, "built_range", (0, len(model.layers)))
    if not built[0] <= start < end <= built[1]:
        raise LayoutError(f"a pipeline stage of layers [{start}, {end}) cut from a model built with layers {built}")
    kept = [model.layers[i - built[0]] for i in range(start, end)]
    auto_prefix = model._auto_prefix   # no renaming: the kept blocks keep their global names
    model._auto_prefix = False
    try:
        model.layers = nn.CellList(kept, auto_prefix=False)
        keep_embedding = first or (last and model.needs_embedding_in_head)
        for name in (() if keep_embedding else model.EMBEDDING_CELLS) + (() if last else model.HEAD_CELLS):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
    finally:
        model._auto_prefix = auto_prefix
    model.stage_range = model.built_range = (start, end)
