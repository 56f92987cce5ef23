"""Expert parallelism: split every MoE layer's experts over the `ep` group (and each expert's FFN
over the `etp` group), and wire the expert-parallel dispatcher, the token slices and the aux loss's
token set.

    model = build_model(cfg, pctx)                 # this rank's part, parameters deferred
    parallelize_moe(model, cfg.parallel, pctx)     # record this rank's E/ep experts, swap dispatchers

Rank `ep_rank` keeps global experts `[ep_rank L, (ep_rank + 1) L)`, `L = E / ep`, of
`experts.w_gate/w_up/w_down` (sliced along axis 0 and marked with `mark_shard(..., "ep")` so
checkpoints can reassemble them). Deferred expert tensors are only marked, then generated as that
slice of the one-process values (moetrain/param_init.py), so an expert-parallel job starts from
exactly the one-process model without any rank building the other experts.

MoE parallel folding (`parallel.expert_tensor_parallel`, ep spanning tp ranks; the layout is in
moetrain/distributed/topology.py): with etp > 1 each local expert keeps FFN columns `[etp_rank F/etp, ..)`
of `w_gate/w_up` (axis 2) and the same rows of `w_down` (axis 1), Megatron's column/row split; the
MoE layer brings the dispatched rows into the etp region and sums the partial outputs over it. When
folded, the tp ranks of a dp rank (which hold the same tokens) each dispatch one slice of them
(the `tp_tokens` group; `MoELayer.set_expert_groups`), so no token is computed twice.

Gradients: expert parameters (marked `expert` at creation) are summed over the `edp` group (the
replicas of the same experts: when folded it spans tp ranks too, never the etp ranks, which hold
other columns), everything else over `dp` (`data_parallel.OptimizerStep`). The expert gradients on
a rank already hold the contributions of every token of its `ep` group (the dispatcher's backward
brings them back), so the two reductions together count every token once.
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor

from moetrain.moe.ep_dispatcher import build_ep_dispatcher
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.layer import moe_layers
from moetrain.distributed.sharding import mark_further_shard, mark_shard, shard_spec
from moetrain.param_init import is_deferred


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
        whole = tuple(int(d) for d in param.shape)
        if not is_deferred(param):   # built whole: keep the slice (deferred: only the slice is ever made)
            param.set_data(Tensor(np.ascontiguousarray(np.split(param.asnumpy(), ep, axis=0)[ep_rank])))
        mark_shard(param, whole, axis=0, index=ep_rank, count=ep, group_kind="ep")
    experts.num_local_experts = num_experts // ep


def split_expert_ffn(experts: GroupedExperts, etp_rank: int, etp: int) -> None:
    """Keep FFN slice `etp_rank` of `etp` of every local expert, in place: columns of `w_gate/w_up`
    `[E, H, F]` (axis 2), rows of `w_down` `[E, F, H]` (axis 1)."""
    for param, axis in ((experts.w_gate, 2), (experts.w_up, 2), (experts.w_down, 1)):
        width = param.shape[axis]
        if width % etp:
            raise ValueError(f"{param.name}: the expert FFN width {width} cannot be split over "
                             f"parallel.expert_tensor_parallel={etp} ranks; choose etp dividing "
                             f"model.moe.ffn_hidden_size")
        spec = shard_spec(param)
        if not is_deferred(param):
            param.set_data(Tensor(np.ascontiguousarray(np.split(param.asnumpy(), etp, axis=axis)[etp_rank])))
        if spec.slicings():
            mark_further_shard(param, axis, etp_rank, etp, "etp")
        else:
            mark_shard(param, tuple(int(d) for d in spec.global_shape), axis, etp_rank, etp, "etp")


def parallelize_moe(model, parallel_cfg, pctx) -> int:
    """Apply `parallel.expert_parallel`, `parallel.moe_token_dispatcher` and
    `parallel.moe_aux_loss_scope` to every MoE layer of `model`; returns the number of MoE layers.
    Models without MoE layers are left alone (and must keep the defaults); a pipeline stage
    without MoE layers of a model that has them (DeepSeek-V3's first, dense layers) is left alone
    too. Call it before the optimizer collects the parameters."""
    layers = moe_layers(model)
    scope = parallel_cfg.moe_aux_loss_scope
    if not layers:
        model_has_moe = bool(getattr(getattr(model, "cfg", None), "moe_layers", None))
        if (pctx.ep > 1 or scope != "micro_batch") and not model_has_moe:
            raise ValueError(f"parallel.expert_parallel={pctx.ep} / parallel.moe_aux_loss_scope={scope!r} apply to "
                             f"MoE layers, and model {type(model).__name__} has none: set them back to 1 / "
                             f"'micro_batch' or use a MoE model (one with MoE layers)")
        return 0
    ep_group = pctx.group("ep")
    for layer in layers:
        if pctx.ep > 1:
            shard_experts(layer.experts, pctx.ep_rank, pctx.ep)
            layer.dispatcher = build_ep_dispatcher(parallel_cfg.moe_token_dispatcher, layer.num_experts,
                                                   layer.top_k, layer.cfg.capacity_factor, ep_group,
                                                   layer.experts.layout, layer.experts.ops.path,
                                                   parallel_cfg.ep_splits)
        if pctx.etp > 1:
            split_expert_ffn(layer.experts, pctx.etp_rank, pctx.etp)
        layer.set_expert_groups(pctx.group("tp_tokens"), pctx.group("etp"))
        layer.set_aux_loss_scope(scope, pctx.group("dp"))
    return len(layers)
