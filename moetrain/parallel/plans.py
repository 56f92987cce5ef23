"""Applies a model family's tensor-parallel plan and recompute policy (both declared in the family's
`moetrain.family.Family`, in its folder under `models/`).

Model code stays single-device. `parallelize_model(model, cfg, pctx)` (called right after the model
is built) reads the family of `model.registered_name`, slices the model over the tp group
(`tensor_parallel.parallelize_module`) and marks the cells to recompute.

Recompute (`parallel.recompute`, MindSpore's `cell.recompute()` on the cells a policy names): "full"
recomputes every transformer block in the backward, MoE blocks included (only block inputs and
outputs are kept); "selective" the attention core softmax(QK^T)V (its [B, heads, S, S]
probabilities) and the routed experts (their tokens x top_k x ffn activations; the planner reads
the plan's patterns, `Arch.selective_experts`). Loss, stats and gradients are unchanged. Measured
on CPU (docs/parallel_engine.md, "Recompute"): the jitted step's memory-pool peak (what the dry
run measures) drops, moe_tiny at 16 layers: full 0.27x, selective 0.69x of none; PyNative peaks
drop too.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from moetrain.family import family_of
from moetrain.parallel.tensor_parallel import modules_matching, parallelize_module
from moetrain.registry import get_model, registered_models, replace_family


class _FamilyPlans(Mapping):
    """{family name: its plan} read from the registered families (`field`: "tp_plan" or "recompute");
    families that declare none are left out."""

    def __init__(self, field: str):
        self.field = field

    def _plans(self):
        return {name: getattr(entry.family, self.field) for name, entry in registered_models().items()
                if getattr(entry.family, self.field)}

    def __getitem__(self, name: str):
        return self._plans()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plans())

    def __len__(self) -> int:
        return len(self._plans())


TP_PLANS = _FamilyPlans("tp_plan")           # read-only views for tools and tests
RECOMPUTE_PLANS = _FamilyPlans("recompute")


def register_plans(model_name: str, tp_plan: Mapping = None, recompute: Mapping[str, Sequence[str]] = None) -> None:
    """Give a registered family a tensor-parallel plan and/or recompute policies (a family declares
    them in its `moetrain.family.Family`; this is for one registered with `register_model`)."""
    changes = {key: value for key, value in (("tp_plan", tp_plan), ("recompute", recompute)) if value is not None}
    if changes:
        replace_family(model_name, **changes)


def apply_recompute(model, patterns: Sequence[str]) -> int:
    """`cell.recompute()` on every cell matching one of `patterns`, whole (a MoE block too: its
    statistics are outputs of the recomputed cell and come out right under `ms.jit`, see
    docs/parallel_engine.md, "Recompute"); a cell inside one already marked is left alone (MindSpore
    takes one recompute mark per subtree). Returns how many cells were marked."""
    marked = []
    for pattern in patterns:
        for _, cell in modules_matching(model, pattern):
            if not any(cell is m or _contains(m, cell) for m in marked):
                cell.recompute()
                marked.append(cell)
    return len(marked)


def _contains(parent, cell) -> bool:
    return any(c is cell for _, c in parent.cells_and_names())


def parallelize_model(model, cfg, pctx):
    """Tensor/sequence parallelism (tp > 1) and recompute for the built single-device `model`, in place,
    following its family's plans (`moetrain.family.Family.tp_plan`, `.recompute`)."""
    name = getattr(model, "registered_name", type(model).__name__)
    family = family_of(model) or (get_model(name).family if name in registered_models() else None)
    tp_plan = family.tp_plan if family is not None else None
    recompute = family.recompute if family is not None else {}
    p = cfg.parallel
    if pctx.tp > 1:
        if tp_plan is None:
            raise ValueError(f"model {name!r} has no tensor-parallel plan (known: {sorted(TP_PLANS)}); set "
                             f"parallel.model_parallel=1 or declare one (Family.tp_plan, moetrain/family.py)")
        parallelize_module(model, tp_plan, pctx.group("tp"), p.use_seq_parallel)
    if p.recompute != "none":
        if p.recompute not in recompute:
            raise ValueError(f"parallel.recompute={p.recompute!r}: model {name!r} declares no such policy "
                             f"(known: {sorted(recompute)}); set parallel.recompute=none")
        apply_recompute(model, recompute[p.recompute])
    return model
