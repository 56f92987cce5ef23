"""Expert parallelism: split every MoE layer's experts over the `ep` group and wire the
expert-parallel dispatcher and the aux loss's token set.

    model = build_model(cfg)                       # every rank, same seed: identical full model
    parallelize_moe(model, cfg.parallel, pctx)     # keep this rank's E/ep experts, swap dispatchers

Rank `ep_rank` keeps global experts `[ep_rank L, (ep_rank + 1) L)`, `L = E / ep`, of
`experts.w_gate/w_up/w_down` (sliced along axis 0 and marked with `mark_shard(..., "ep")` so
checkpoints can reassemble them). Because every rank slices the same full initialisation, an
expert-parallel job starts from exactly the one-process model.

Gradients: expert parameters (`.experts.` in the name) are summed over the `edp` group (the
replicas of the same experts), everything else over `dp` (`data_parallel.OptimizerStep`). The
expert gradients on a rank already hold the contributions of every token of its `ep` group (the
dispatcher's backward brings them back), so the two reductions together count every token once.
"""
from __future__ import annotations

from typing import List

import numpy as np
from mindspore import Tensor

from moetrain.moe.ep_dispatcher import build_ep_dispatcher
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.layer import MoELayer
from moetrain.dist.sharding import mark_shard, shard_spec


def moe_layers(model) -> List[MoELayer]:
    """Every `MoELayer` cell of the model, in definition order."""
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoELayer)]


def shard_experts(experts: GroupedExperts, ep_rank: int, ep: int) -> None:
    """Keep local experts `[ep_rank L, (ep_rank + 1) L)` of the stacked expert tensors, in place."""
    num_experts = experts.w_gate.shape[0]
    if num_experts % ep:
        raise ValueError(f"{experts.w_gate.name}: {num_experts} experts cannot be split evenly over "
                         f"parallel.expert_parallel={ep} ranks; choose ep dividing model.moe.num_experts")
    for param in (experts.w_gate, experts.w_up, experts.w_down):
        if shard_spec(param).axis is not None:
            raise ValueError(f"{param.name} is already sharded ({shard_spec(param)}); parallelize_moe must run "
                             f"once, on the freshly built model")
        full = param.asnumpy()
        param.set_data(Tensor(np.ascontiguousarray(np.split(full, ep, axis=0)[ep_rank])))
        mark_shard(param, full.shape, axis=0, index=ep_rank, count=ep, group_kind="ep")
    experts.num_local_experts = num_experts // ep


def parallelize_moe(model, parallel_cfg, pctx) -> int:
    """Apply `parallel.expert_parallel`, `parallel.moe_token_dispatcher` and
    `parallel.moe_aux_loss_scope` to every MoE layer of `model`; returns the number of MoE layers.
    Models without MoE layers are left alone (and must keep the defaults). Call it before the
    optimizer collects the parameters."""
    layers = moe_layers(model)
    scope = parallel_cfg.moe_aux_loss_scope
    if not layers:
        if pctx.ep > 1 or scope != "micro_batch":
            raise ValueError(f"parallel.expert_parallel={pctx.ep} / parallel.moe_aux_loss_scope={scope!r} apply to "
                             f"MoE layers, and model {type(model).__name__} has none: set them back to 1 / "
                             f"'micro_batch' or use a MoE model (e.g. model.name: moe_gpt)")
        return 0
    ep_group = pctx.group("ep")
    for layer in layers:
        if pctx.ep > 1:
            shard_experts(layer.experts, pctx.ep_rank, pctx.ep)
            layer.dispatcher = build_ep_dispatcher(parallel_cfg.moe_token_dispatcher, layer.num_experts,
                                                   layer.top_k, layer.cfg.capacity_factor, ep_group,
                                                   layer.experts.layout, layer.experts.ops.path)
        layer.set_aux_loss_scope(scope, pctx.group("dp"))
    return len(layers)
