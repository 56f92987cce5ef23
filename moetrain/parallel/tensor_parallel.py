"""Tensor parallelism (Megatron-LM) and sequence parallelism, applied to a BUILT single-device model.

`parallelize_module(model, plan, group, sequence_parallel)` slices a model in place following a plan
of styles keyed by module path (each model family declares its plan, `moetrain/family.py`). A model
from `build_model(cfg, pctx)` has deferred parameters (moetrain/param_init.py): they are only
marked, and `parallelize` later generates each as exactly its slice of the one-process values; a
model built whole and materialized is sliced in place:

    layer                       tp rank r of n keeps               communication (Megatron f / g)
    ColumnParallelLinear        weight rows [r·out/n, (r+1)·out/n)  input enters the region: copy_to_region
                                (output split on the last axis)     (bwd all-reduce) or, with SP,
                                                                    gather_from_sequence (bwd reduce-scatter)
    RowParallelLinear           weight cols [r·in/n, (r+1)·in/n)    partial outputs summed: reduce_from_region
                                                                    or, with SP, reduce_scatter_to_sequence
    VocabParallelEmbedding      rows [r·V/n, (r+1)·V/n)             ids outside the shard read zeros; the
                                                                    partial rows are summed like a row output
    VocabParallelCrossEntropy   (local logits [.., V/n])            max, sum-exp and target logit reduced
                                                                    over tp: no rank ever holds [.., V]

Attention needs nothing of its own: wq/wk/wv are column-parallel (whole heads: rank r holds query
heads [r·h/n, ..) and kv-heads [r·kv/n, ..), so GQA groups stay on one rank), wo is row-parallel, and
`Attention` reads its local head counts from the weight shapes. A module left whole inside the
region whose output feeds only this rank's heads (MLA's down-projections and latent norms, Qwen3's
per-head q/k norms) gets `HeadShared`: each rank computes its parameters' gradient from its own
heads only, so those gradients are summed over tp.

Modules are converted in place, as FSDP2's `fully_shard` does: the Parameter objects (so their
names, and everything holding them) stay, their data is sliced, and the module's class is switched
to a parallel subclass whose `construct` adds the communication. `mark_shard` records each slice so
checkpoints can reassemble it and the gradient norm counts it once.

Conventions. The loss is replicated over tp (every rank computes the same value); the gradients
each rank computes are those of that one loss. Activations are `[B, S, H]`.

Sequence parallelism (Korthikanti et al., 2022): between tensor-parallel regions the residual
stream is split along S over the tp ranks, so norms and residual adds run on 1/n of the tokens.
Parameters used there see only part of the sequence: `mark_sequence_parallel` flags them and
`OptimizerStep` sums their gradients over tp.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Sequence, Tuple, Union

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from moetrain.family import (ColwiseParallel, HeadShared, RegionInput, RegionOutput, RowwiseParallel,  # noqa: F401
                             SequenceParallel, Style, VocabParallel, WholeSequence)
from moetrain.layers import CrossEntropy, Embedding, Linear
from moetrain.distributed import comm
from moetrain.distributed.sharding import mark_role, mark_shard, param_role, shard_spec
from moetrain.distributed.topology import Group
from moetrain.param_init import is_deferred

SEQUENCE_AXIS = 1        # activations are [B, S, H]
ENTRY_MODES = ("copy", "sequence", "none")    # how an input enters a column-parallel region
EXIT_MODES = ("reduce", "sequence", "none")   # how a row-parallel region's partial sums leave it


# ---------------------------------------------------------------------------------------------
# Region boundaries (graph-safe: the mode is a Python constant, so jit folds the branches)
# ---------------------------------------------------------------------------------------------
def enter_region(x, group: Group, mode: str):
    """Megatron f: replicated input -> copy_to_region; sequence-split input -> gather_from_sequence."""
    if mode == "copy":
        return comm.copy_to_region(x, group)
    if mode == "sequence":
        return comm.gather_from_sequence(x, group, SEQUENCE_AXIS)
    return x


def exit_region(y, group: Group, mode: str):
    """Megatron g: partial sums -> all-reduced, or reduce-scattered along the sequence (SP)."""
    if mode == "reduce":
        return comm.reduce_from_region(y, group)
    if mode == "sequence":
        return comm.reduce_scatter_to_sequence(y, group, SEQUENCE_AXIS)
    return y


def _check_mode(what: str, mode: str, allowed: Sequence[str]) -> None:
    if mode not in allowed:
        raise ValueError(f"{what}: mode {mode!r} is not one of {tuple(allowed)}")


# ---------------------------------------------------------------------------------------------
# Parameter slicing and flags
# ---------------------------------------------------------------------------------------------
def shard_parameter(param, axis: int, group: Group) -> None:
    """Keep this rank's 1/n slice of `param` along `axis` (in place) and record it with `mark_shard`;
    a deferred `param` (`moetrain.param_init`) is only marked, and materializes as that slice."""
    global_shape = tuple(int(d) for d in param.shape)
    if shard_spec(param).group_kind == "tp":
        raise ValueError(f"{param.name} is already split over tensor parallel; parallelize a model only once")
    if global_shape[axis] % group.size:
        divisors = [d for d in range(1, global_shape[axis] + 1) if global_shape[axis] % d == 0]
        raise ValueError(f"tensor parallel: {param.name} has shape {global_shape}, and its dimension {axis} "
                         f"({global_shape[axis]}) is not divisible by tp={group.size}; choose "
                         f"parallel.model_parallel in {divisors} or resize the model")
    if not is_deferred(param):   # built whole: keep the slice (deferred: only the slice is ever made)
        local = np.split(param.asnumpy(), group.size, axis=axis)[group.rank_in_group]
        param.set_data(Tensor(np.ascontiguousarray(local)))
    mark_shard(param, global_shape, axis, group.rank_in_group, group.size, "tp")


def mark_sequence_parallel(param) -> None:
    """This rank's gradient of `param` is a partial sum over tp (`param` is used on this rank's
    sequence chunk only, or feeds only this rank's heads): `OptimizerStep` sums it over tp."""
    mark_role(param, sequence_parallel=True)


def is_sequence_parallel(param) -> bool:
    return param_role(param).sequence_parallel


_DERIVED_CLASSES: Dict[Tuple[type, type], type] = {}


def switch_class(module: nn.Cell, mixin: type, **attributes) -> nn.Cell:
    """Give `module` the class `mixin + type(module)` (in place, as FSDP2's `fully_shard` does) and
    set the mixin's attributes. Parameters, names and attributes stay; `isinstance` still holds.

    The mixin's construct calls `self.base_construct(...)`: `super()` inside construct does not
    resolve under ms.jit for such classes in MindSpore 2.10, so the base construct is stored."""
    base = type(module)
    if hasattr(base, "base_construct"):   # a second mixin would make base_construct call itself
        raise ValueError(f"a {base.__name__} was already given a parallel style; one per module, and "
                         f"parallelize a model only once")
    key = (mixin, base)
    if key not in _DERIVED_CLASSES:
        _DERIVED_CLASSES[key] = type(f"{mixin.__name__.lstrip('_')}{base.__name__}", (mixin, base),
                                     {"base_construct": base.construct})
    module.__class__ = _DERIVED_CLASSES[key]
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def _require_exact_type(module, expected: type, what: str) -> None:
    if type(module) is not expected:
        raise TypeError(f"{what} converts a {expected.__name__}, got {type(module).__name__} (a subclass would "
                        f"lose its own construct); give that module its own style in the plan")


# ---------------------------------------------------------------------------------------------
# Parallel layers (converted in place from the single-device layers)
# ---------------------------------------------------------------------------------------------
class ColumnParallelLinear(Linear):
    """`Linear` with the output features split over tp: weight `[out/n, in]`, output `[..., out/n]`.

    `entry`: "copy" (input replicated over tp), "sequence" (input sequence-split: all-gather it),
    or "none" (the caller already brought the input into the region, e.g. once for wq/wk/wv).
    `gather_output`: all-gather the output features (backward keeps this rank's slice)."""

    @classmethod
    def from_linear(cls, linear: Linear, group: Group, entry: str = "copy", gather_output: bool = False):
        _require_exact_type(linear, Linear, "ColumnParallelLinear.from_linear")
        _check_mode("ColumnParallelLinear entry", entry, ENTRY_MODES)
        shard_parameter(linear.weight, 0, group)
        linear.__class__ = cls
        linear.tp_group, linear.entry, linear.gather_output = group, entry, gather_output
        return linear

    def construct(self, x):
        y = Linear.construct(self, enter_region(x, self.tp_group, self.entry))
        if self.gather_output:
            return comm.gather_from_region(y, self.tp_group, -1)
        return y

    @property
    def plain(self) -> bool:
        return self.entry == "none" and not self.gather_output


class RowParallelLinear(Linear):
    """`Linear` with the input features split over tp: weight `[out, in/n]`, input `[..., in/n]`.

    `exit`: "reduce" (all-reduce the partial outputs), "sequence" (reduce-scatter them along the
    sequence: SP) or "none" (return partial sums). `input_is_parallel=False` slices a replicated input."""

    @classmethod
    def from_linear(cls, linear: Linear, group: Group, exit: str = "reduce", input_is_parallel: bool = True):
        _require_exact_type(linear, Linear, "RowParallelLinear.from_linear")
        _check_mode("RowParallelLinear exit", exit, EXIT_MODES)
        shard_parameter(linear.weight, 1, group)
        linear.__class__ = cls
        linear.tp_group, linear.exit, linear.input_is_parallel = group, exit, input_is_parallel
        return linear

    def construct(self, x):
        if not self.input_is_parallel:
            x = comm.scatter_to_region(x, self.tp_group, -1)
        return exit_region(Linear.construct(self, x), self.tp_group, self.exit)

    @property
    def plain(self) -> bool:
        return False


class VocabParallelEmbedding(Embedding):
    """`Embedding` with the vocabulary split over tp: rank r holds rows `[r·V/n, (r+1)·V/n)`.

    Ids outside the shard read zeros, so the ranks' outputs sum to the full lookup: `exit` "reduce"
    (all-reduce) or "sequence" (reduce-scatter along the sequence: SP)."""

    @classmethod
    def from_embedding(cls, embedding: Embedding, group: Group, exit: str = "reduce"):
        _require_exact_type(embedding, Embedding, "VocabParallelEmbedding.from_embedding")
        _check_mode("VocabParallelEmbedding exit", exit, ("reduce", "sequence"))
        shard_parameter(embedding.weight, 0, group)
        embedding.__class__ = cls
        embedding.tp_group, embedding.exit = group, exit
        return embedding

    def construct(self, input_ids):
        rows = self.weight.shape[0]
        local_ids = input_ids - self.tp_group.rank_in_group * rows
        inside = ops.logical_and(local_ids >= 0, local_ids < rows)
        vectors = self.gather(self.weight, local_ids * inside.astype(local_ids.dtype), 0)
        vectors = vectors * ops.expand_dims(inside.astype(vectors.dtype), -1)
        return exit_region(vectors, self.tp_group, self.exit)


class VocabParallelCrossEntropy(CrossEntropy):
    """Mean cross-entropy of vocabulary-split fp32 logits `[..., V/n]` against global labels `[...]`.

    With `m` the max over the whole vocabulary (all-gathered per-rank maxima; no gradient: any
    common shift gives the same loss), `loss = log Σ_r Σ exp(z - m) - (z_label - m)`, the two sums
    all-reduced in one call. `reduce_from_region` (backward identity) matches the replicated-loss
    convention: d loss / d local logits = softmax - one_hot on this rank's vocabulary slice."""

    def __init__(self, group: Group):
        super().__init__()
        self.tp_group = group

    @classmethod
    def from_cross_entropy(cls, loss: CrossEntropy, group: Group):
        _require_exact_type(loss, CrossEntropy, "VocabParallelCrossEntropy.from_cross_entropy")
        loss.__class__ = cls
        loss.tp_group = group
        return loss

    def construct(self, logits, labels):
        vocab_local = logits.shape[-1]
        logits = logits.reshape(-1, vocab_local).astype(ms.float32)
        labels = labels.reshape(-1).astype(ms.int32)
        local_max = ops.stop_gradient(ops.amax(logits, -1))
        shift = ops.stop_gradient(ops.amax(comm.all_gather(local_max.reshape(1, -1), self.tp_group, 0), 0))
        shifted = logits - shift.reshape(-1, 1)
        local_labels = labels - self.tp_group.rank_in_group * vocab_local
        inside = ops.logical_and(local_labels >= 0, local_labels < vocab_local)
        picked = ops.gather_elements(shifted, 1, (local_labels * inside.astype(ms.int32)).reshape(-1, 1))
        target = picked.reshape(-1) * inside.astype(ms.float32)
        sum_exp = ops.exp(shifted).sum(-1)
        totals = comm.reduce_from_region(ops.concat((target.reshape(1, -1), sum_exp.reshape(1, -1))), self.tp_group)
        return (ops.log(totals[1]) - totals[0]).mean()


# ---------------------------------------------------------------------------------------------
# Module mixins (switched in by the styles below)
# ---------------------------------------------------------------------------------------------
class _RegionInput:
    """The module's input enters the tp region once, for all its column-parallel projections; other
    arguments (an attention's packed-document context: whole-sequence ids) pass unchanged."""

    def construct(self, x, *args):
        return self.base_construct(enter_region(x, self.tp_group, self.tp_entry), *args)


class _RegionOutput:
    """The module's output enters the tp region (the final norm feeding the vocabulary-parallel
    head, tied to the embedding or not)."""

    def construct(self, x):
        return enter_region(self.base_construct(x), self.tp_group, self.tp_entry)


class _WholeSequence:
    """A module replicated over tp inside the sequence-parallel stream: it sees the whole sequence
    (gather; backward keeps this rank's chunk) and each rank keeps its chunk of the output (backward
    all-gathers). Every rank computes the same thing, so its parameters need no gradient sum."""

    def construct(self, x):
        out = self.base_construct(comm.gather_from_region(x, self.tp_group, SEQUENCE_AXIS))
        if isinstance(out, tuple):   # (y, stats) of the MoE layer
            return (comm.scatter_to_region(out[0], self.tp_group, SEQUENCE_AXIS),) + out[1:]
        return comm.scatter_to_region(out, self.tp_group, SEQUENCE_AXIS)


# ---------------------------------------------------------------------------------------------
# Styles: what a plan entry does to the module it names (torchtitan's ParallelStyle)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanContext:
    group: Group
    sequence_parallel: bool


def _colwise(style: ColwiseParallel, module, ctx: PlanContext) -> None:
    ColumnParallelLinear.from_linear(module, ctx.group, entry="none")


def _rowwise(style: RowwiseParallel, module, ctx: PlanContext) -> None:
    exit = "sequence" if ctx.sequence_parallel and style.sequence else "reduce"
    RowParallelLinear.from_linear(module, ctx.group, exit=exit)


def _vocab(style: VocabParallel, module, ctx: PlanContext) -> None:
    if isinstance(module, CrossEntropy):
        VocabParallelCrossEntropy.from_cross_entropy(module, ctx.group)
    else:
        VocabParallelEmbedding.from_embedding(module, ctx.group, "sequence" if ctx.sequence_parallel else "reduce")


def _region_input(style: RegionInput, module, ctx: PlanContext) -> None:
    entry = "sequence" if ctx.sequence_parallel and style.sequence else "copy"
    switch_class(module, _RegionInput, tp_group=ctx.group, tp_entry=entry)


def _region_output(style: RegionOutput, module, ctx: PlanContext) -> None:
    entry = "sequence" if ctx.sequence_parallel else "copy"
    switch_class(module, _RegionOutput, tp_group=ctx.group, tp_entry=entry)


def _sequence(style: SequenceParallel, module, ctx: PlanContext) -> None:
    if ctx.sequence_parallel:
        for param in module.get_parameters():
            mark_sequence_parallel(param)


def _head_shared(style: HeadShared, module, ctx: PlanContext) -> None:
    """Every rank computes the module on the same input, but its parameters' gradient on a rank comes
    from that rank's heads only, so it is summed over tp (the input's gradient is summed by the
    region's entry, as for every projection)."""
    for param in module.get_parameters():
        mark_sequence_parallel(param)


def _whole_sequence(style: WholeSequence, module, ctx: PlanContext) -> None:
    if ctx.sequence_parallel:
        switch_class(module, _WholeSequence, tp_group=ctx.group)


# what each style (declared in moetrain/family.py, so that model families can name them) does
APPLY = {ColwiseParallel: _colwise, RowwiseParallel: _rowwise, VocabParallel: _vocab, RegionInput: _region_input,
         RegionOutput: _region_output, SequenceParallel: _sequence, HeadShared: _head_shared,
         WholeSequence: _whole_sequence}


def apply_style(style: Style, module, ctx: PlanContext) -> None:
    """Apply one plan entry's style to `module`."""
    if type(style) not in APPLY:
        raise ValueError(f"{style!r} is not a tensor-parallel style (moetrain.family: {sorted(c.__name__ for c in APPLY)})")
    APPLY[type(style)](style, module, ctx)


# ---------------------------------------------------------------------------------------------
# Applying a plan
# ---------------------------------------------------------------------------------------------
def modules_matching(model: nn.Cell, pattern: str) -> Iterator[Tuple[str, nn.Cell]]:
    """(name, cell) of every sub-cell whose dotted path matches `pattern`; `*` stands for one path
    component (`layers.*.attention` matches `layers.0.attention`, `layers.1.attention`, ...)."""
    regex = re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern)))
    for name, cell in model.cells_and_names():
        if name and regex.fullmatch(name):
            yield name, cell


def parallelize_module(model: nn.Cell, plan: Mapping[str, Union[Style, Tuple[Style, ...]]], group: Group,
                       sequence_parallel: bool = False) -> nn.Cell:
    """Apply `plan` ({module path pattern: style or tuple of styles}) to `model` in place.

    A pattern matching no module is skipped (e.g. `lm_head` of a model with tied embeddings, shared
    experts of a MoE without them). On a tp group of one rank nothing changes."""
    if group.size == 1:
        return model
    already = [p.name for p in model.get_parameters() if shard_spec(p).group_kind == "tp"]
    if already:
        raise ValueError(f"the model is already split over tensor parallel ({already[0]}, ...); "
                         f"parallelize a freshly built model only once")
    ctx = PlanContext(group, sequence_parallel)
    matches = [(cell, styles if isinstance(styles, tuple) else (styles,))
               for pattern, styles in plan.items() for _, cell in modules_matching(model, pattern)]
    for cell, styles in matches:      # resolved first: styles change classes, not the module tree
        for style in styles:
            apply_style(style, cell, ctx)
    return model
