"""How each model family is parallelized: tensor-parallel plans and recompute policies, in one place.

Model code stays single-device. `parallelize_model(model, cfg, pctx)` (called by the trainer right
after `build_model`) looks up the plan of `model.registered_name`, checks the sizes, slices the
model over the tp group (`tensor_parallel.parallelize_module`) and marks the cells to recompute.
A model family from a user module registers its own with `register_plans`.

Recompute (`parallel.recompute`, MindSpore's `cell.recompute()` on the cells a policy names): "full"
recomputes every transformer block in the backward (only block inputs are kept; a MoE block is
recomputed piecewise: norms, attention, router, experts, shared experts, not the dispatch, see
`recompute_boundaries`); "selective" the attention core softmax(QK^T)V (its [B, heads, S, S]
probabilities) and the routed experts (their tokens x top_k x ffn activations). Loss, stats and
gradients are unchanged. Measured on CPU (docs/parallel_engine.md, "Recompute"): PyNative peaks
drop; under ms.jit MindSpore 2.10 does not lower the CPU peak.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

from moetrain.moe.layer import MoELayer
from moetrain.parallel.tensor_parallel import (ColwiseParallel, RegionInput, RegionOutput, RowwiseParallel,
                                               SequenceParallel, VocabParallel, WholeSequence,
                                               modules_matching, parallelize_module)

# Llama-style GPT: attention and MLP are tensor-parallel regions between sequence-parallel norms.
GPT_TP_PLAN = {
    "embed": VocabParallel(),
    "layers.*.attention_norm": SequenceParallel(),
    "layers.*.attention": RegionInput(),
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.ffn_norm": SequenceParallel(),
    "layers.*.mlp": RegionInput(),
    "layers.*.mlp.w_gate": ColwiseParallel(),
    "layers.*.mlp.w_up": ColwiseParallel(),
    "layers.*.mlp.w_down": RowwiseParallel(),
    "final_norm": (SequenceParallel(), RegionOutput()),
    "lm_head": ColwiseParallel(),
    "cross_entropy": VocabParallel(),
}

# MoE layers are replicated over tp (router and experts on every tp rank, on the whole sequence, so
# routing, capacity and aux losses equal one process); the shared experts are split inside them.
MOE_GPT_TP_PLAN = {
    **GPT_TP_PLAN,
    "layers.*.moe": WholeSequence(),
    "layers.*.moe.shared_experts": RegionInput(sequence=False),
    "layers.*.moe.shared_experts.w_gate": ColwiseParallel(),
    "layers.*.moe.shared_experts.w_up": ColwiseParallel(),
    "layers.*.moe.shared_experts.w_down": RowwiseParallel(sequence=False),
}

# Cells to recompute per policy (module path patterns).
GPT_RECOMPUTE = {"full": ("layers.*",), "selective": ("layers.*.attention.core",)}
MOE_GPT_RECOMPUTE = {"full": ("layers.*",), "selective": ("layers.*.attention.core", "layers.*.moe.experts")}

TP_PLANS: Dict[str, Mapping] = {"gpt": GPT_TP_PLAN, "moe_gpt": MOE_GPT_TP_PLAN}
RECOMPUTE_PLANS: Dict[str, Mapping[str, Sequence[str]]] = {"gpt": GPT_RECOMPUTE, "moe_gpt": MOE_GPT_RECOMPUTE}


def register_plans(model_name: str, tp_plan: Mapping = None, recompute: Mapping[str, Sequence[str]] = None) -> None:
    """Declare how a (user) model family is parallelized; see GPT_TP_PLAN for the format."""
    if tp_plan is not None:
        TP_PLANS[model_name] = tp_plan
    if recompute is not None:
        RECOMPUTE_PLANS[model_name] = recompute


def recompute_boundaries(cell) -> List:
    """The cells to call `recompute()` on so that `cell` is recomputed in the backward.

    Normally `[cell]`. A cell holding a MoE layer is split into its children instead, and the MoE
    layer into its router, experts and shared experts (its dispatcher and statistics are kept):
    under `ms.jit`, MindSpore 2.10 mishandles a recomputed cell whose outputs include values off
    the gradient path (the MoE layer's `stats`: expert loads, aux and z losses). With one MoE layer
    the jitted step returned the FIRST call's stats on every later call (stale expert loads and aux
    terms in the loss); with two it failed to compile ("The id found is out of value tuple
    index"). PyNative was right either way. Tested: tests/test_tensor_parallel.py."""
    if not any(isinstance(c, MoELayer) for _, c in cell.cells_and_names()):
        return [cell]
    if isinstance(cell, MoELayer):
        return [c for c in (cell.router, cell.experts, cell.shared_experts) if c is not None]
    return [piece for child in cell.name_cells().values() for piece in recompute_boundaries(child)]


def apply_recompute(model, patterns: Sequence[str]) -> int:
    """`cell.recompute()` on every cell matching one of `patterns` (MoE-holding cells piecewise, see
    `recompute_boundaries`); returns how many cells were marked."""
    marked = []
    for pattern in patterns:
        for _, cell in modules_matching(model, pattern):
            for piece in recompute_boundaries(cell):
                if all(piece is not m for m in marked):
                    piece.recompute()
                    marked.append(piece)
    return len(marked)


def parallelize_model(model, cfg, pctx):
    """Tensor/sequence parallelism (tp > 1) and recompute for the built single-device `model`, in place."""
    name = getattr(model, "registered_name", type(model).__name__)
    p = cfg.parallel
    if pctx.tp > 1:
        if name not in TP_PLANS:
            raise ValueError(f"model {name!r} has no tensor-parallel plan (known: {sorted(TP_PLANS)}); set "
                             f"parallel.model_parallel=1 or declare one with moetrain.parallel.plans.register_plans")
        parallelize_module(model, TP_PLANS[name], pctx.group("tp"), p.use_seq_parallel)
    if p.recompute != "none":
        if p.recompute not in RECOMPUTE_PLANS.get(name, {}):
            raise ValueError(f"parallel.recompute={p.recompute!r}: model {name!r} declares no such policy "
                             f"(known: {sorted(RECOMPUTE_PLANS.get(name, {}))}); set parallel.recompute=none")
        apply_recompute(model, RECOMPUTE_PLANS[name][p.recompute])
    return model
